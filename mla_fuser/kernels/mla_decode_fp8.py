"""Absorbed MLA decode over an FP8 paged latent cache (rows of :mod:`mla_fuser.kernels.latent_fp8`).

The same attention as :mod:`mla_fuser.kernels.mla_decode` (read its docstring first: tiles, splits, online softmax,
the split merge are shared); what differs is the row.  Each token's row holds e4m3 values and two fp32 scales, one for
``kv_c`` (the first ``v_dim`` columns, also the value) and one for ``k_pe``, so with ``s_c[t]``, ``s_pe[t]``::

    score[h, t] = scale * (s_c[t] * <q_nope[h], kv_c8[t]> + s_pe[t] * <q_pe[h], k_pe8[t]>)
    out[h]      = sum_t softmax(score)[h, t] * s_c[t] * kv_c8[t]

The kernel loads the e4m3 tile (half the bytes of bf16: the point, since decode is bound by reading the cache),
converts it to q's dtype in registers (exact: every e4m3 value is a bf16 / fp16 value), runs the two dots on bf16
tensor cores and applies the per-token scales to the scores' columns; the value's scale is folded into ``p`` before
``p @ V`` (``p * s_c`` is rounded to q's dtype where the bf16 kernel rounds ``p``).  Per-token scales cannot be
folded into the FP8 operands of an FP8 MMA without quantising ``q`` too, which would cost accuracy for no gain in a
memory-bound kernel.  Scales are read through an fp32 view of the same pages (``stride / 4``).

Stage 2 (the split merge), the launch configuration and the split choice are ``mla_decode``'s own, unchanged; the
bf16 kernel is not touched.  ``mla_decode_fp8_ref`` dequantises the rows the block table names and runs
``mla_decode_ref`` on them; CPU tensors run ``paged_cpu.mla_decode_cpu`` (which dequantises each sequence's rows).
"""

from __future__ import annotations

import torch

from .dispatch import (
    MAX_COMBINE, SUM_COMBINE, LazyJit, cdiv, kernel_op, tl, triton_interpreting, use_triton,
)
from .latent_fp8 import FP8_DTYPE, dequantise_rows, packed_width, scale_column
from .mla_decode import _LOG2E, LAST_LAUNCH, MLADecodeConfig, _mla_decode_stage2, launch_plan, mla_decode_ref
from .paged_cpu import mla_decode_cpu

__all__ = ["mla_decode_fp8", "mla_decode_fp8_ref", "mla_decode_fp8_triton"]


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


@LazyJit
def _mla_decode_fp8_stage1(
    Q, KV, KVS, BT, SEQ_LENS, STARTS, O_PART, LSE, OUT,
    qk_scale, H, V_DIM, ROPE_DIM, NUM_SPLITS, SCALE_COL,
    stride_qb, stride_qh, stride_kvp, stride_kvt, stride_sp, stride_st, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr,
    PER_ROW_PAGES: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HAS_STARTS: tl.constexpr,
):
    """``mla_decode._mla_decode_stage1`` (its non-swapped form) over packed e4m3 rows with per-token scales."""
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

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    if EVEN_V:
        mask_v = offs_v < BLOCK_V
    else:
        mask_v = offs_v < V_DIM
    if EVEN_R:
        mask_r = offs_r < BLOCK_R
    else:
        mask_r = offs_r < ROPE_DIM

    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    cdt = q_nope.dtype  # what the e4m3 tiles are converted to (exactly) for the dots
    if HAS_ROPE:
        q_pe = tl.load(q_row + V_DIM + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        if DOT_UPCAST:
            q_pe = q_pe.to(tl.float32)
    if DOT_UPCAST:
        q_nope = q_nope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_V], 0.0, dtype=tl.float32)

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
        kv_ptr = KV + rows[:, None]
        if EVEN_V:
            kv = tl.load(kv_ptr + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        else:
            kv = tl.load(kv_ptr + offs_v[None, :], mask=mask_n[:, None] & mask_v[None, :], other=0.0)
        s_c = tl.load(KVS + srows, mask=mask_n, other=0.0)
        kv = kv.to(cdt)
        if DOT_UPCAST:
            kv = kv.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION) * s_c[None, :]
        if HAS_ROPE:
            if EVEN_R:
                k_pe = tl.load(kv_ptr + V_DIM + offs_r[None, :], mask=mask_n[:, None], other=0.0)
            else:
                k_pe = tl.load(kv_ptr + V_DIM + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            s_pe = tl.load(KVS + srows + 1, mask=mask_n, other=0.0)
            k_pe = k_pe.to(cdt)
            if DOT_UPCAST:
                k_pe = k_pe.to(tl.float32)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION) * s_pe[None, :]
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        acc = acc * alpha[:, None]
        pv = (p * s_c[None, :]).to(cdt)  # the value's scale folded into p, rounded where the bf16 kernel rounds p
        if DOT_UPCAST:
            pv = pv.to(tl.float32)
        acc = tl.dot(pv, kv, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]
    store_mask = mask_h[:, None] & mask_v[None, :]
    if DIRECT_OUT:
        o_ptr = OUT + b * stride_ob + offs_h[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=store_mask)
    else:
        o_ptr = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps + offs_v[None, :]
        tl.store(o_ptr, out, mask=store_mask)
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


def mla_decode_fp8_triton(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None,
                          config: MLADecodeConfig | None = None, starts=None) -> torch.Tensor:
    """Triton path of :func:`mla_decode_fp8` (no dispatch).  ``config`` overrides the tile knobs (``swap_ab`` is
    ignored: this kernel has the non-swapped form only, the one the defaults pick)."""
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
        q, v_dim, page_size, block_table.shape[1], config, num_splits)
    direct = num_splits == 1
    if direct:
        o_part = lse = out
        sp, sl = (0, 0, 0), (0, 0)
    else:
        o_part = torch.empty((B, H, num_splits, v_dim), device=q.device, dtype=torch.float32)
        lse = torch.empty((B, H, num_splits), device=q.device, dtype=torch.float32)
        sp, sl = o_part.stride()[:3], lse.stride()[:2]
    # as in mla_decode: the interpreter's bf16 tl.dot is broken, so bf16 operands are upcast there only
    dot_upcast = triton_interpreting() and q.dtype == torch.bfloat16
    dot_precision = "ieee" if (q.dtype == torch.float32 or dot_upcast) else "tf32"
    scales = kv_pages.view(torch.float32)  # the same memory, fp32 elements: the scale columns
    k1 = _mla_decode_fp8_stage1[(head_tiles, num_splits, B)](
        q, kv_pages, scales, block_table, seq_lens, starts if starts is not None else seq_lens, o_part, lse, out,
        float(scale) * _LOG2E, H, v_dim, rope, num_splits, scale_column(D) // 4,
        q.stride(0), q.stride(1), kv_pages.stride(0), kv_pages.stride(1), scales.stride(0), scales.stride(1),
        block_table.stride(0), *sp, *sl, out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_R=block_r, HAS_ROPE=rope > 0,
        EVEN_V=block_v == v_dim, EVEN_R=block_r == rope, PER_ROW_PAGES=per_row, DIRECT_OUT=direct,
        DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast, HAS_STARTS=starts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(stage1=k1, num_splits=num_splits, block_h=block_h, block_n=block_n, per_row_pages=per_row)
    if not direct:
        _mla_decode_stage2[(cdiv(v_dim, block_vc), H, B)](
            o_part, lse, out, v_dim, num_splits, *sp, *sl, out.stride(0), out.stride(1),
            BLOCK_S=block_s, BLOCK_VC=block_vc, num_warps=4,
        )  # fmt: skip
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
