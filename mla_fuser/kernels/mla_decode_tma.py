"""Absorbed MLA decode with the latent tiles loaded by the Tensor Memory Accelerator (Hopper), transposed products.

The attention and the split scheme are :mod:`mla_fuser.kernels.mla_decode`'s (read its docstring first; stage 2,
the split choice and the launch plan are shared).  What differs is how a tile reaches the tensor cores:

* **TMA**.  The page pool, seen as rows ``[pages * page_size, D]``, is described once on the host (:mod:`tma`);
  each full tile (``BLOCK_N`` rows inside one page) comes in as value chunks of up to 256 columns (a box's limit) and
  the rope part, in bulk copies straight to shared memory.  Loaded from pointers, the 16-head tile holds its
  addresses and operands in registers: 255 per thread and 1144 bytes spilled for sm_90 (Triton 3.6).
* **Transposed products** (``S^T = K Q^T``, ``O^T = V^T P^T``, as ``MLADecodeConfig.swap_ab``): the MMA's M side is
  the token tile and the value columns, so Hopper's ``wgmma`` reads the tile from shared memory where TMA put it, and
  the accumulator per thread is small.  With both: 151 registers, no spill.
* **Tiles with rows outside the sequence** (the sequence's last tile; with left padding, its first) come in whole
  too, but a row past the sequence's end may hold anything its page held before (a NaN left by another call's
  broken sequence would turn ``0 * NaN`` into NaN in ``P V``): their scores are masked and their value rows zeroed
  in registers before ``P V`` (masked loads from pointers, as ``mla_decode`` reads, spilled more).  For sm_90
  (Triton 3.6, 16 heads, 64-token tiles): 255 registers, 8 stack bytes (184 with left padding).

A probe of this design (``benchmarks/probe_mla_decode_tma.py``: every tile full, no masking; an H100, CUDA-graph
replay, 16 heads, 512 + 64, page 64; ``mla_decode_tma_probe_h100.json``) against the pointer kernel: B=32 L=4k 68.9
against 70.5 us, 64x8k 218.9 against 225.3, 16x1k 14.1 against 15.6, 1x16k 11.8 against 13.4, 1x32k 20.8 against
25.3.  At 64 and 128 heads (64-head tiles) TMA was within 3% either way and the transposed form 13-24% slower, so
there ``mla_decode``'s kernel stays.  What this kernel itself gains is for ``bench_mla_decode_kernel.py --tma-ab``.

**Off, and no setting turns it on** (``ENABLED``: tests and ``bench_mla_decode_kernel.py --tma-ab`` set it for
their process).  Compiled on an H100 (Triton 3.6, 2026-12-07; ``mla_decode_tma_cases_h100.jsonl``, one case a
process) its full tiles are right (0 to 1e-3 from the pointer kernel: 1, 3 and 24 splits, 512 + 64, 256 + 32, NoPE,
5 heads) and its partial-tile block is wrong: a 150-token sequence comes out NaN when the rows past its end hold
NaN and off by 0.1 when they hold zeros, and a 65-token sequence, or left padding, stops the process with an illegal
memory access.  The interpreter runs the same cases right.  ``tests/test_kernel_mla_decode_tma.py``'s compiled test
(``MLA_FUSER_TEST_DECODE_TMA_GPU=1``) reproduces it.  Where it is on, :func:`usable` says which calls it takes: a
GPU with TMA (or the interpreter), a 16-bit contiguous pool with 16-byte rows, a value width of 256 or 512 (one or two
chunks), a rope part of 0 or a power of two from 16 to 256, tiles inside pages.  Everything else runs
``mla_decode``'s kernel.
"""

from __future__ import annotations

import weakref

import torch

from .dispatch import MAX_COMBINE, SUM_COMBINE, lazy_jit, tl
from .tma import MAX_BOX, tma_operand, tma_ready

__all__ = ["ENABLED", "launch_stage1", "usable"]

# this process's choice, off: wrong when compiled (see above); tests and a benchmark's A/B set it to run the kernel
ENABLED = False

KERNEL_DTYPES_BYTES = 2  # bf16 / fp16 pools only (fp32 inputs keep mla_decode's fp32 tiles)


def usable(q, kv_pages, v_dim: int, rope: int, per_row_pages: bool) -> bool:
    """Whether this kernel is on and can run the call: see the module docstring."""
    if not ENABLED:
        return False
    if per_row_pages or kv_pages.element_size() != KERNEL_DTYPES_BYTES or q.dtype != kv_pages.dtype:
        return False
    # (a rope part under 16 columns is too narrow for the score product's K side)
    if v_dim not in (MAX_BOX, 2 * MAX_BOX) or not (rope == 0 or (rope & (rope - 1) == 0 and 16 <= rope <= MAX_BOX)):
        return False
    # (a contiguous pool's strides are multiples of its row's: tma_ready of the pool is that of its rows)
    return kv_pages.is_contiguous() and tma_ready(q, kv_pages)


# id(pool) -> (a weak reference to the pool, what the descriptors were built for, value descriptor, rope descriptor)
_POOL_DESCRIPTORS: dict[int, tuple] = {}


def pool_descriptors(kv_pages: torch.Tensor, block_n: int, chunk: int, rope: int):
    """The descriptors of ``kv_pages``' rows in ``[block_n, chunk]`` and ``[block_n, rope]`` boxes, built once per
    pool.  Why: building them costs ~5 us of host time per call (two descriptors and a view), a third of an eager
    ``mla_decode`` call's wrapper, and a cache layer passes the same pool on every step.

    Each entry is rebuilt when the pool's address, shape or the boxes differ, and is dropped with the pool: the
    descriptors are built over an alias of the pool's storage (``set_``, not a view: a view would keep the pool's
    Python object alive through its base, and with it this entry), so the weak reference's callback runs when the
    caller lets the pool go, and the alias, the last holder of the storage here, goes with the entry."""
    key = id(kv_pages)
    signature = (kv_pages.data_ptr(), kv_pages.shape, block_n, chunk, rope)
    entry = _POOL_DESCRIPTORS.get(key)
    if entry is not None and entry[0]() is kv_pages and entry[1] == signature:
        return entry[2], entry[3]
    width = kv_pages.shape[-1]
    rows = torch.empty(0, dtype=kv_pages.dtype, device=kv_pages.device).set_(
        kv_pages.untyped_storage(), kv_pages.storage_offset(), (kv_pages.numel() // width, width), (width, 1))
    kv_c = tma_operand(rows, [block_n, chunk], True)
    kv_r = tma_operand(rows, [block_n, rope], True) if rope else kv_c

    def forget(ref, key=key):
        if _POOL_DESCRIPTORS.get(key, (None,))[0] is ref:
            del _POOL_DESCRIPTORS[key]

    _POOL_DESCRIPTORS[key] = (weakref.ref(kv_pages, forget), signature, kv_c, kv_r)
    return kv_c, kv_r


@lazy_jit(do_not_specialize=("NUM_SPLITS", "stride_btb", "stride_lb", "stride_lh"))
def _mla_decode_tma_stage1(
    Q, QR, KV_C, KV_R, BT, SEQ_LENS, STARTS, O_PART, LSE, OUT,
    qk_scale, H, NUM_SPLITS,
    stride_qb, stride_qh, stride_qrb, stride_qrh, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    V_CHUNKS: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    """Stage 1 (one head tile, one split, one sequence), transposed products; ``KV_C`` / ``KV_R``: descriptors of the
    pool's rows in ``[BLOCK_N, CHUNK]`` / ``[BLOCK_N, ROPE]`` boxes."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(SEQ_LENS + b)
    if HAS_STARTS:
        start_tok = tl.load(STARTS + b)
        first = (start_tok // BLOCK_N) * BLOCK_N
    else:
        start_tok = 0
        first = 0
    n_tiles = (seq_len - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_start = first + pid_s * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, seq_len)
    # [lo, hi): the split's full tiles; a partial first tile (left padding) before, a partial last one after
    head_partial = t_start < start_tok
    lo = tl.where(head_partial, t_start + BLOCK_N, t_start)
    hi = lo + (tl.maximum(t_end - lo, 0) // BLOCK_N) * BLOCK_N

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, CHUNK)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q0 = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    q1 = q0
    if V_CHUNKS == 2:
        q1 = tl.load(q_row + CHUNK + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    qr = q0
    if ROPE > 0:
        qr = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :], mask=mask_h[:, None],
                     other=0.0)
    if DOT_UPCAST:
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc0 = tl.full([CHUNK, BLOCK_H], 0.0, dtype=tl.float32)
    acc1 = acc0
    bt_row = BT + b.to(tl.int64) * stride_btb
    p_dtype = Q.dtype.element_ty  # (the cache's dtype too)

    # Full tiles: every row is one of this sequence's tokens, no mask.  (The partial tiles below run the same step:
    # LazyJit kernels have no helper functions, see dispatch.LazyJit.)
    for start in range(lo, hi, BLOCK_N):
        page = tl.load(bt_row + start // PAGE_SIZE)
        row = page * PAGE_SIZE + start % PAGE_SIZE
        k0 = KV_C.load([row, 0])
        k1 = k0
        if V_CHUNKS == 2:
            k1 = KV_C.load([row, CHUNK])
        kr = k0
        if ROPE > 0:
            kr = KV_R.load([row, V_CHUNKS * CHUNK])
        if DOT_UPCAST:
            k0 = k0.to(tl.float32)
            k1 = k1.to(tl.float32)
            kr = kr.to(tl.float32)
        st = tl.dot(k0, tl.trans(q0), input_precision=DOT_PRECISION)
        if V_CHUNKS == 2:
            st = tl.dot(k1, tl.trans(q1), acc=st, input_precision=DOT_PRECISION)
        if ROPE > 0:
            st = tl.dot(kr, tl.trans(qr), acc=st, input_precision=DOT_PRECISION)
        st = st * qk_scale
        m_new = tl.maximum(m_i, tl.reduce(st, 0, MAX_COMBINE))
        alpha = tl.exp2(m_i - m_new)
        pt = tl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + tl.reduce(pt, 0, SUM_COMBINE)
        pt = pt.to(p_dtype)  # p rounded to the cache dtype, as mla_decode rounds it
        if DOT_UPCAST:
            pt = pt.to(tl.float32)
        acc0 = tl.dot(tl.trans(k0), pt, acc=acc0 * alpha[None, :], input_precision=DOT_PRECISION)
        if V_CHUNKS == 2:
            acc1 = tl.dot(tl.trans(k1), pt, acc=acc1 * alpha[None, :], input_precision=DOT_PRECISION)
        m_i = m_new

    # Tiles with rows outside [start_tok, t_end) (at most two: a first tile under left padding, the last one): the same
    # step with those rows' scores masked and their value rows zeroed before P V (p is 0 there, but 0 * NaN is not).
    # Written once for both, unrolled (a loop over them, or value rows loaded from pointers, spilled more registers).
    n_head = (head_partial & (t_start < t_end)).to(tl.int32)
    n_tail = (hi < t_end).to(tl.int32)
    for i in tl.static_range(2):  # (unrolled) a first tile under left padding, then the last tile
        if i == 0:
            start = t_start
            todo = n_head == 1
        else:
            start = hi
            todo = n_tail == 1
        if todo:
            tok = start + offs_n
            mask_n = (tok < t_end) & (tok >= start_tok)
            page = tl.load(bt_row + start // PAGE_SIZE)
            row = page * PAGE_SIZE + start % PAGE_SIZE
            k0 = KV_C.load([row, 0])
            k1 = k0
            if V_CHUNKS == 2:
                k1 = KV_C.load([row, CHUNK])
            kr = k0
            if ROPE > 0:
                kr = KV_R.load([row, V_CHUNKS * CHUNK])
            if DOT_UPCAST:
                k0 = k0.to(tl.float32)
                k1 = k1.to(tl.float32)
                kr = kr.to(tl.float32)
            st = tl.dot(k0, tl.trans(q0), input_precision=DOT_PRECISION)
            if V_CHUNKS == 2:
                st = tl.dot(k1, tl.trans(q1), acc=st, input_precision=DOT_PRECISION)
            if ROPE > 0:
                st = tl.dot(kr, tl.trans(qr), acc=st, input_precision=DOT_PRECISION)
            st = tl.where(mask_n[:, None], st * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(st, 0, MAX_COMBINE))  # finite: the tile holds a valid token
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.reduce(pt, 0, SUM_COMBINE)
            pt = pt.to(p_dtype)
            if DOT_UPCAST:
                pt = pt.to(tl.float32)
            v0 = tl.where(mask_n[:, None], k0, 0.0)
            acc0 = tl.dot(tl.trans(v0), pt, acc=acc0 * alpha[None, :], input_precision=DOT_PRECISION)
            if V_CHUNKS == 2:
                v1 = tl.where(mask_n[:, None], k1, 0.0)
                acc1 = tl.dot(tl.trans(v1), pt, acc=acc1 * alpha[None, :], input_precision=DOT_PRECISION)
            m_i = m_new

    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)  # empty split / sequence: exact zeros
    out0 = tl.trans(acc0) * inv_l[:, None]
    if DIRECT_OUT:
        o_row = OUT + b * stride_ob + offs_h[:, None] * stride_oh
        tl.store(o_row + offs_c[None, :], out0.to(OUT.dtype.element_ty), mask=mask_h[:, None])
        if V_CHUNKS == 2:
            out1 = tl.trans(acc1) * inv_l[:, None]
            tl.store(o_row + CHUNK + offs_c[None, :], out1.to(OUT.dtype.element_ty), mask=mask_h[:, None])
    else:
        o_row = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps
        tl.store(o_row + offs_c[None, :], out0, mask=mask_h[:, None])
        if V_CHUNKS == 2:
            tl.store(o_row + CHUNK + offs_c[None, :], tl.trans(acc1) * inv_l[:, None], mask=mask_h[:, None])
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


def launch_stage1(q, q_rope, kv_pages, block_table, seq_lens, starts, o_part, lse, out, qk_scale, H, v_dim, rope,
                  num_splits, sp, sl, page_size, block_h, block_n, head_tiles, cfg, dot_precision, dot_upcast):
    """Stage 1 on this kernel (after :func:`usable`); the arguments as ``mla_decode_triton`` has them."""
    chunk = min(v_dim, MAX_BOX)
    kv_c, kv_r = pool_descriptors(kv_pages, block_n, chunk, rope)
    q_st, qr_st, out_st = q.stride(), q_rope.stride(), out.stride()
    return _mla_decode_tma_stage1[(head_tiles, num_splits, q.shape[0])](
        q, q_rope, kv_c, kv_r, block_table, seq_lens, starts if starts is not None else seq_lens,
        o_part, lse, out, qk_scale, H, num_splits,
        q_st[0], q_st[1], qr_st[0], qr_st[1], block_table.stride(0),
        *sp, *sl, out_st[0], out_st[1],
        PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk, V_CHUNKS=v_dim // chunk, ROPE=rope,
        BLOCK_R=max(rope, 16), DIRECT_OUT=num_splits == 1, DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast,
        HAS_STARTS=starts is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
