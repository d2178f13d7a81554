"""Absorbed MLA decode over an FP8 paged latent cache (rows of :mod:`mla_fuser.kernels.latent_fp8`).

The same attention as :mod:`mla_fuser.kernels.mla_decode` (read its docstring first: tiles, splits, online softmax,
the split merge are shared); what differs is the row.  Each token's row holds e4m3 values and two fp32 scales, one for
``kv_c`` (the first ``v_dim`` columns, also the value) and one for ``k_pe``, so with ``s_c[t]``, ``s_pe[t]``::

    score[h, t] = scale * (s_c[t] * <q_nope[h], kv_c8[t]> + s_pe[t] * <q_pe[h], k_pe8[t]>)
    out[h]      = sum_t softmax(score)[h, t] * s_c[t] * kv_c8[t]

The kernel loads the e4m3 tile (half the bytes of bf16: the point, since decode is bound by reading the cache),
converts it exactly to a 16-bit dtype, runs the two dots on tensor cores and applies the per-token scales to the
scores' columns; the value's scale is folded into ``p`` before ``p @ V``.  Per-token scales cannot be folded into the
FP8 operands of an FP8 MMA without quantising ``q`` and ``p`` too, which would cost accuracy.  Scales are read through
an fp32 view of the same pages (``stride / 4``).

Where and how the tile is converted decides the speed (the first version, on the bf16 kernel's tiles, ran at 0.4x
the bf16 kernel on an H200; the points below come from its compiled code and that of the variants, for sm_90a):

* Its own tiles (:func:`default_fp8_config`): a converted 64-token tile kept for both dots does not fit beside the
  accumulator (140+ registers spilled).  Smaller tiles alone were not the fix: at 32 tokens that code's tile load,
  feeding two dots in different layouts, stopped being pipelined (plain synchronous loads).  Every tile and variant
  here loads through ``cp.async`` pipelining, with no or few spills.
* fp16 dots (``f16_dots``): e4m3 -> fp16 is one instruction per two values, e4m3 -> bf16 adds one slow conversion
  per value.  To keep fp16 safe, each head's q is scaled by a power of two (exact) into [2**13, 2**14), and ``p @ V``
  runs on ``p * s_c[t] / s_max`` (``s_max``: the largest value scale seen so far, folded into the online softmax's
  rescale like a running max), so its operand stays in [0, 1].  Rounding: p gets 11 bits instead of bf16's 8.
* The PV dot's operand is converted in the tile's load layout, then transposed through shared memory as 16-bit
  values.  Left alone, Triton converts it inside that dot's operand loads, where the MMA's k (the tokens) lies rows
  apart: one-byte shared-memory reads.  An inline-asm conversion (or a no-op select) keeps it in place.
* Variants (``v_split``, ``shared_cvt``) trade registers, shared memory and conversions; see
  :class:`MLADecodeFP8Config`.

Stage 2 (the split merge), the launch configuration and the split choice are ``mla_decode``'s own, unchanged; the
bf16 kernel is not touched.  ``mla_decode_fp8_ref`` dequantises the rows the block table names and runs
``mla_decode_ref`` on them; CPU tensors run ``paged_cpu.mla_decode_cpu`` (which dequantises each sequence's rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .dispatch import (
    MAX_COMBINE, SUM_COMBINE, kernel_op, lazy_jit, tl, triton_interpreting, use_triton,
)
from .latent_fp8 import FP8_DTYPE, dequantise_rows, packed_width, scale_column
from .mla_decode import (
    _LOG2E, LAST_LAUNCH, MLADecodeConfig, default_config, dot_mode, launch_plan, merge_splits, mla_decode_ref,
    split_partials,
)
from .paged_cpu import mla_decode_cpu

# e4m3x2 -> f16x2 in one instruction (sm_89+); Triton's own conversion is the same one, but can be moved into a
# dot's operand layout, which the inline asm (not pure) prevents.
CVT_ASM = tl.constexpr("cvt.rn.f16x2.e4m3x2 $0, $1;") if tl is not None else None

__all__ = ["MLADecodeFP8Config", "default_fp8_config", "mla_decode_fp8", "mla_decode_fp8_ref", "mla_decode_fp8_triton"]


def mla_decode_fp8_ref(q, kv_pages, block_table, seq_lens, scale, v_dim, starts=None):
    """Torch reference: the pages of each block-table row dequantised (fp32) into a dense pool, then
    ``mla_decode_ref`` (same masking, same fp32 math)."""
    B, H, D = q.shape
    _check(q, kv_pages, v_dim)
    bt = block_table.to(device=q.device, dtype=torch.long)
    pages = dequantise_rows(kv_pages[bt.clamp(0, kv_pages.shape[0] - 1).view(-1)], v_dim, D)  # [B * W, P, D]
    table = torch.arange(bt.numel(), device=q.device, dtype=torch.int32).view(bt.shape)
    return mla_decode_ref(q.float(), pages, table, seq_lens, scale, v_dim, starts).to(q.dtype)


def _check(q, kv_pages, v_dim):
    if q.dim() != 3 or kv_pages.dim() != 3:
        raise ValueError(f"q must be [B, H, D] and kv_pages [P, page_size, W]; got {tuple(q.shape)}, "
                         f"{tuple(kv_pages.shape)}")
    if kv_pages.dtype != FP8_DTYPE:
        raise ValueError(f"mla_decode_fp8 reads a float8_e4m3fn cache, got {kv_pages.dtype} (use mla_decode)")
    if packed_width(q.shape[-1]) != kv_pages.shape[-1]:
        raise ValueError(f"q has D={q.shape[-1]}, whose packed FP8 rows are {packed_width(q.shape[-1])} bytes; the "
                         f"cache rows are {kv_pages.shape[-1]}")
    if not 0 < v_dim <= q.shape[-1]:
        raise ValueError(f"v_dim={v_dim} must be in (0, D={q.shape[-1]}]")


@lazy_jit(do_not_specialize=("NUM_SPLITS", "stride_btb", "stride_lb", "stride_lh"))
def _mla_decode_fp8_stage1(
    Q, KV, KVS, BT, SEQ_LENS, STARTS, O_PART, LSE, OUT,
    qk_scale, H, V_DIM, ROPE_DIM, NUM_SPLITS, SCALE_COL,
    stride_qb, stride_qh, stride_kvp, stride_kvt, stride_sp, stride_st, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr,
    PER_ROW_PAGES: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HAS_STARTS: tl.constexpr, V_SPLIT: tl.constexpr, SHARED_CVT: tl.constexpr, F16_DOTS: tl.constexpr,
    ASM_CVT: tl.constexpr,
):
    """``mla_decode._mla_decode_stage1`` (its non-swapped form) over packed e4m3 rows with per-token scales.  The
    variants (``V_SPLIT``, ``SHARED_CVT``, ``F16_DOTS``) are :class:`MLADecodeFP8Config`'s; ``ASM_CVT`` converts
    with inline PTX (compiled ``F16_DOTS`` only: the interpreter runs no PTX)."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(SEQ_LENS + b)
    if HAS_STARTS:
        start_tok = tl.load(STARTS + b)
        first = (start_tok // BLOCK_N) * BLOCK_N
    else:
        first = 0
    n_tiles = (seq_len - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_start = first + pid_s * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, seq_len)

    CHUNK: tl.constexpr = BLOCK_V // V_SPLIT
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, CHUNK)  # value columns of chunk 0; chunk 1 is CHUNK + offs_c
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    if EVEN_V:
        mask_c0 = offs_c < CHUNK  # all true, folded away
        mask_c1 = mask_c0
    else:
        mask_c0 = offs_c < V_DIM
        mask_c1 = CHUNK + offs_c < V_DIM
    if EVEN_R:
        mask_r = offs_r < BLOCK_R
    else:
        mask_r = offs_r < ROPE_DIM

    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q_c0 = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c0[None, :], other=0.0)
    if V_SPLIT == 2:
        q_c1 = tl.load(q_row + CHUNK + offs_c[None, :], mask=mask_h[:, None] & mask_c1[None, :], other=0.0)
    if HAS_ROPE:
        q_pe = tl.load(q_row + V_DIM + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    head_scale = tl.full([BLOCK_H], 1.0, dtype=tl.float32) * qk_scale  # the scores' scale, per head
    if F16_DOTS:
        # fp16 dots (``cdt``, the dtype e4m3 converts to exactly; p is rounded to it too).  Each head's q times the
        # power of two that puts its largest entry in [2**13, 2**14): exact and fp16-safe, undone in head_scale.
        # From the biased exponent e of the row max: 2**(13 - (e - 127)) as fp32 bits.
        cdt = tl.float16
        pdt = tl.float16
        q_max = tl.reduce(tl.abs(q_c0.to(tl.float32)), 1, MAX_COMBINE)
        if V_SPLIT == 2:
            q_max = tl.maximum(q_max, tl.reduce(tl.abs(q_c1.to(tl.float32)), 1, MAX_COMBINE))
        if HAS_ROPE:
            q_max = tl.maximum(q_max, tl.reduce(tl.abs(q_pe.to(tl.float32)), 1, MAX_COMBINE))
        q_exp = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
        q_mul = ((267 - tl.maximum(q_exp, 13)) << 23).to(tl.float32, bitcast=True)
        head_scale = head_scale / q_mul
        q_c0 = (q_c0.to(tl.float32) * q_mul[:, None]).to(cdt)
        if V_SPLIT == 2:
            q_c1 = (q_c1.to(tl.float32) * q_mul[:, None]).to(cdt)
        if HAS_ROPE:
            q_pe = (q_pe.to(tl.float32) * q_mul[:, None]).to(cdt)
    else:
        # q's own dtype, q straight from its load (as mla_decode: Hopper's wgmma then reads it from shared memory)
        pdt = Q.dtype.element_ty
        if DOT_UPCAST:
            cdt = tl.float32
        else:
            cdt = pdt
        q_c0 = q_c0.to(cdt)
        if V_SPLIT == 2:
            q_c1 = q_c1.to(cdt)
        if HAS_ROPE:
            q_pe = q_pe.to(cdt)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    # The largest value scale seen so far: acc holds sum_t p * (s_c[t] / s_max) * kv_c8[t], so the PV dot's p
    # operand stays in [0, 1] (fp16-safe) and the per-token scales cost a [BLOCK_N] vector, not a pass over a tile.
    s_max = tl.reduce(tl.full([BLOCK_N], 0.0, dtype=tl.float32), 0, MAX_COMBINE)
    acc0 = tl.full([BLOCK_H, CHUNK], 0.0, dtype=tl.float32)
    if V_SPLIT == 2:
        acc1 = tl.full([BLOCK_H, CHUNK], 0.0, dtype=tl.float32)

    bt_row = BT + b.to(tl.int64) * stride_btb
    for start in range(t_start, t_end, BLOCK_N):
        tok = start + offs_n
        mask_n = tok < t_end
        if HAS_STARTS:
            mask_n = mask_n & (tok >= start_tok)
        if PER_ROW_PAGES:
            page = tl.load(bt_row + tok // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            in_page = tok % PAGE_SIZE
        else:
            page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
            in_page = (start % PAGE_SIZE) + offs_n
        rows = page * stride_kvp + in_page * stride_kvt
        srows = page * stride_sp + in_page * stride_st + SCALE_COL
        c0_ptr = KV + rows[:, None] + offs_c[None, :]
        s_c = tl.load(KVS + srows, mask=mask_n, other=0.0)
        # (EVEN_V: the row mask only, so loads stay 16 B wide)
        kv0 = tl.load(c0_ptr, mask=mask_n[:, None] & mask_c0[None, :], other=0.0)
        # The value tile in cdt, the PV dot's operand, converted in the load's layout and never in that dot's operand
        # layout (tokens, that MMA's k, lie rows apart there: byte-wise shared-memory reads), which Triton would
        # otherwise choose: the inline asm (not pure) or a no-op select on the row mask keep the conversion here.
        if ASM_CVT:
            v0 = tl.inline_asm_elementwise(CVT_ASM, "=r,h", [kv0], dtype=cdt, is_pure=False, pack=2)
        else:
            v0 = tl.where(mask_n[:, None], kv0.to(cdt), 0.0)
        if V_SPLIT == 2:
            kv1 = tl.load(c0_ptr + CHUNK, mask=mask_n[:, None] & mask_c1[None, :], other=0.0)
            if ASM_CVT:
                v1 = tl.inline_asm_elementwise(CVT_ASM, "=r,h", [kv1], dtype=cdt, is_pure=False, pack=2)
            else:
                v1 = tl.where(mask_n[:, None], kv1.to(cdt), 0.0)
        # The key tile of the QK dot: that same conversion (SHARED_CVT), or a second one, which Triton places in
        # the QK dot's operand layout (tokens are its n: 16-byte runs of a row, no transpose).
        if SHARED_CVT:
            s = tl.dot(q_c0, tl.trans(v0), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q_c0, tl.trans(kv0.to(cdt)), input_precision=DOT_PRECISION)
        if V_SPLIT == 2:
            if SHARED_CVT:
                s = tl.dot(q_c1, tl.trans(v1), acc=s, input_precision=DOT_PRECISION)
            else:
                s = tl.dot(q_c1, tl.trans(kv1.to(cdt)), acc=s, input_precision=DOT_PRECISION)
        s = s * s_c[None, :]
        if HAS_ROPE:
            k_pe = tl.load(KV + rows[:, None] + V_DIM + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                           other=0.0)
            s_pe = tl.load(KVS + srows + 1, mask=mask_n, other=0.0)
            s += tl.dot(q_pe, tl.trans(k_pe.to(cdt)), input_precision=DOT_PRECISION) * s_pe[None, :]
        s = tl.where(mask_n[None, :], s * head_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        s_new = tl.maximum(s_max, tl.reduce(s_c, 0, MAX_COMBINE))  # > 0 for the same reason
        inv_s = 1.0 / s_new
        beta = (alpha * (s_max * inv_s))[:, None]  # acc's rescale: new row max, new value-scale unit
        # the value's scale folded into p, rounded to pdt where the bf16 kernel rounds p
        pv = (p * (s_c * inv_s)[None, :]).to(pdt).to(cdt)
        acc0 = tl.dot(pv, v0, acc=acc0 * beta, input_precision=DOT_PRECISION)
        if V_SPLIT == 2:
            acc1 = tl.dot(pv, v1, acc=acc1 * beta, input_precision=DOT_PRECISION)
        m_i = m_new
        s_max = s_new

    has_tok = l_i > 0.0
    out_scale = tl.where(has_tok, s_max / tl.where(has_tok, l_i, 1.0), 0.0)[:, None]  # empty: exact zeros
    if DIRECT_OUT:
        o_row = OUT + b * stride_ob + offs_h[:, None] * stride_oh
        out_ty = OUT.dtype.element_ty
    else:
        o_row = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps
        out_ty = tl.float32
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)
    tl.store(o_row + offs_c[None, :], (acc0 * out_scale).to(out_ty), mask=mask_h[:, None] & mask_c0[None, :])
    if V_SPLIT == 2:
        tl.store(o_row + CHUNK + offs_c[None, :], (acc1 * out_scale).to(out_ty),
                 mask=mask_h[:, None] & mask_c1[None, :])


@dataclass(frozen=True)
class MLADecodeFP8Config(MLADecodeConfig):
    """:class:`MLADecodeConfig` (the tiles; ``swap_ab`` is ignored: this kernel has no swapped form) plus the FP8
    kernel's variants.  Like the tiles, none changes the math beyond rounding; their defaults are the plainest form.

    * ``f16_dots``: run both dots in fp16 instead of q's dtype (bf16).  e4m3 -> fp16 is one instruction per two
      values; e4m3 -> bf16 goes through fp16 and then one slow conversion per value, which bounds the bf16 form.
      q is scaled per head by a power of two into fp16's range (exact), p is in [0, 1] (see the kernel), so fp16
      loses nothing here and rounds p to 11 bits instead of 8.  Ignored for fp32 q (fp32 dots).
    * ``shared_cvt``: convert each e4m3 tile once, for both dots (then both read it from shared memory), instead of
      a second conversion that Triton fuses into the QK dot's operand loads (e4m3 read from shared memory: half the
      bytes, twice the conversions).
    * ``v_split`` (1 or 2): the 512 value columns as two halves (two accumulators, two dots each for QK and PV),
      so a converted tile and its shared-memory copy are half as large: fewer registers, less shared memory.
    """

    v_split: int = 1
    shared_cvt: bool = False
    f16_dots: bool = False


# The default tiles (see default_fp8_config): (largest head count served, config).
_FP8_DEFAULTS = (
    (16, MLADecodeFP8Config(16, 32, 4, 5, ctas_per_sm=2, v_split=2, shared_cvt=True, f16_dots=True)),
    (32, MLADecodeFP8Config(32, 32, 8, 2, ctas_per_sm=1, v_split=2, shared_cvt=True, f16_dots=True)),
    (None, MLADecodeFP8Config(64, 32, 8, 5, ctas_per_sm=1, v_split=2, shared_cvt=True, f16_dots=True)),
)


@functools.lru_cache(maxsize=None)
def default_fp8_config(num_heads: int, dtype: torch.dtype) -> MLADecodeFP8Config:
    """The FP8 kernel's own tiles (``mla_decode.default_config`` is the bf16 kernel's; q's dtype ``dtype``).

    Why not the bf16 kernel's: its 64-token tiles, converted to bf16 in registers and kept for both dots, left no
    room (255 registers, 140+ spilled) and the e4m3 tile was read from shared memory byte by byte for the PV dot.
    Candidates chosen from ptxas register / spill counts and the main loop's instruction and shared-memory traffic
    (compiled offline for sm_90a, triton 3.6), then timed on an H200 (``bench_mla_decode_kernel.py --fp8-cache
    --sweep``, ``mla_decode_fp8_sweep.json``; 5 pipeline stages won at H=16 and H=128).  Still slower than the
    bf16 kernel over twice the bytes: 0.72x at H=16 B64x8k (0.41x before), 0.86x at B1x32k, 0.47x at H=128:

    * H <= 16: 32-token tiles, 4 warps, value halves, one fp16 conversion: 223 registers, no spills, 90 KB of
      shared memory at 5 stages, so 2 programs per SM.  64-token tiles spill with 4 warps and hold one program per SM with 8.
    * 16 < H <= 32: 32-head tiles need 8 warps at 32 tokens (4 warps spill).
    * H > 32: 64-head tiles, 8 warps (two warpgroups, wgmma) as in the bf16 kernel, but 32-token tiles: 64-token
      ones spill 2 KB.
    * fp32 q: the bf16 kernel's fp32 tiles, fp32 dots.
    """
    if torch.empty((), dtype=dtype).element_size() > 2:
        return MLADecodeFP8Config(**vars(default_config(num_heads, dtype)))
    for max_heads, cfg in _FP8_DEFAULTS:
        if max_heads is None or num_heads <= max_heads:
            return cfg
    raise AssertionError("unreachable")


def mla_decode_fp8_triton(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None,
                          config: MLADecodeConfig | None = None, starts=None) -> torch.Tensor:
    """Triton path of :func:`mla_decode_fp8` (no dispatch).  ``config`` (an :class:`MLADecodeFP8Config`, or a plain
    :class:`MLADecodeConfig` for the tiles alone) overrides :func:`default_fp8_config`."""
    _check(q, kv_pages, v_dim)
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError("block_table must be [B, max_pages] and seq_lens [B]")
    B, H, D = q.shape
    page_size = kv_pages.shape[1]
    rope = D - v_dim
    q = q if q.stride(-1) == 1 else q.contiguous()
    if kv_pages.stride(-1) != 1 or kv_pages.stride(0) % 4 or kv_pages.stride(1) % 4:
        raise ValueError("FP8 cache rows must be unit-stride and 4-byte aligned")
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    if starts is not None:
        if starts.shape != (B,):
            raise ValueError(f"starts must be [B] = [{B}], got {tuple(starts.shape)}")
        starts = starts if starts.dtype == torch.int32 else starts.to(torch.int32)

    out = torch.empty((B, H, v_dim), device=q.device, dtype=q.dtype)
    if B == 0 or H == 0:
        return out
    cfg, block_h, block_n, per_row, block_v, block_r, head_tiles, num_splits, block_s, block_vc = launch_plan(
        q, v_dim, page_size, block_table.shape[1], config or default_fp8_config(H, q.dtype), num_splits)
    v_split = 2 if getattr(cfg, "v_split", 1) == 2 and block_v >= 32 else 1  # (a dot's K: chunks of >= 16 columns)
    shared_cvt = bool(getattr(cfg, "shared_cvt", False))
    f16_dots = bool(getattr(cfg, "f16_dots", False)) and q.dtype != torch.float32
    asm_cvt = f16_dots and not triton_interpreting()
    direct = num_splits == 1
    o_part, lse, sp, sl = split_partials(out, num_splits, v_dim)
    dot_precision, dot_upcast = dot_mode(q.dtype)
    scales = kv_pages.view(torch.float32)  # the same memory, fp32 elements: the scale columns
    k1 = _mla_decode_fp8_stage1[(head_tiles, num_splits, B)](
        q, kv_pages, scales, block_table, seq_lens, starts if starts is not None else seq_lens, o_part, lse, out,
        float(scale) * _LOG2E, H, v_dim, rope, num_splits, scale_column(D) // 4,
        q.stride(0), q.stride(1), kv_pages.stride(0), kv_pages.stride(1), scales.stride(0), scales.stride(1),
        block_table.stride(0), *sp, *sl, out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_R=block_r, HAS_ROPE=rope > 0,
        EVEN_V=block_v == v_dim, EVEN_R=block_r == rope, PER_ROW_PAGES=per_row, DIRECT_OUT=direct,
        DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast, HAS_STARTS=starts is not None,
        V_SPLIT=v_split, SHARED_CVT=shared_cvt, F16_DOTS=f16_dots, ASM_CVT=asm_cvt,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(stage1=k1, num_splits=num_splits, block_h=block_h, block_n=block_n, per_row_pages=per_row,
                       v_split=v_split, shared_cvt=shared_cvt, f16_dots=f16_dots)
    merge_splits(o_part, lse, out, v_dim, num_splits, sp, sl, block_s, block_vc)
    return out


@kernel_op("mla_decode_fp8")
def _mla_decode_fp8_op(q: torch.Tensor, kv_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, v_dim: int, num_splits: int | None = None,
                       starts: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(q):
        return mla_decode_fp8_triton(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits, starts=starts)
    if q.is_cpu:  # each sequence's rows dequantised on their own (paged_cpu)
        _check(q, kv_pages, v_dim)
        return mla_decode_cpu(q, kv_pages, block_table, seq_lens, scale, v_dim, starts)
    return mla_decode_fp8_ref(q, kv_pages, block_table, seq_lens, scale, v_dim, starts)


@_mla_decode_fp8_op.register_fake
def _mla_decode_fp8_fake(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None, starts=None):
    return q.new_empty((q.shape[0], q.shape[1], v_dim))


def mla_decode_fp8(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None, starts=None) -> torch.Tensor:
    """:func:`mla_fuser.kernels.mla_decode.mla_decode` over an FP8 cache: ``q [B, H, D]`` (bf16/fp16/fp32, the
    dtype the result has and the e4m3 rows are converted to), ``kv_pages [P, page_size, packed_width(D)]``
    ``float8_e4m3fn`` rows of :mod:`latent_fp8`; every other argument as there.  Custom op
    ``mla_fuser::mla_decode_fp8`` under torch.compile."""
    return _mla_decode_fp8_op(q, kv_pages, block_table, seq_lens, float(scale), int(v_dim), num_splits, starts)
