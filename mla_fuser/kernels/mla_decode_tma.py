"""Absorbed MLA decode with the latent tiles loaded by the Tensor Memory Accelerator (Hopper), transposed products.

The attention and the split scheme are :mod:`mla_fuser.kernels.mla_decode`'s (read its docstring first; stage 2,
the split choice and the launch plan are shared).  What differs is how a tile reaches the tensor cores:

* **TMA**.  The page pool, seen as tile slots ``[pages * page_size / BLOCK_N, BLOCK_N, D]`` (a slot: one tile's
  rows of one page), is described once on the host (:mod:`tma`); each tile comes in as value chunks of up to 256
  columns (a box's limit) and the rope part, in bulk copies straight to shared memory.  Loaded from pointers, the
  16-head tile holds its addresses and operands in registers: 255 per thread and 1144 bytes spilled for sm_90
  (Triton 3.6).
* **Transposed products** (``S^T = K Q^T``, ``O^T = V^T P^T``, as ``MLADecodeConfig.swap_ab``): the MMA's M side is
  the token tile and the value columns, so Hopper's ``wgmma`` reads the tile from shared memory where TMA put it, and
  the accumulator per thread is small.  With both: 151 registers, no spill (Triton 3.6; 241 on 3.9).
* **Tiles cut by the sequence** (its last tile; with left padding, its first) go through the same loop with their
  box shifted inside the slot: by ``rows - BLOCK_N`` (negative) for a last tile of ``rows`` rows, by the start's row
  for a first tile.  The rows outside the sequence then lie outside the slot, where TMA writes zeros, so ``P V``
  never multiplies what a page held before (a NaN there would make ``0 * NaN``); only the scores are masked.  A
  split whose one tile is cut at both ends (a left-padded sequence shorter than a tile) cannot be shifted so: it is
  read after the loop by masked loads from pointers, in ``mla_decode``'s orientation.  With left padding: 255
  registers and no spill (Triton 3.6), 255 and 168 stack bytes (3.9).

A probe of this design (``benchmarks/probe_mla_decode_tma.py``: every tile full, no masking; an H100, CUDA-graph
replay, 16 heads, 512 + 64, page 64; ``mla_decode_tma_probe_h100.json``) against the pointer kernel: B=32 L=4k 68.9
against 70.5 us, 64x8k 218.9 against 225.3, 16x1k 14.1 against 15.6, 1x16k 11.8 against 13.4, 1x32k 20.8 against
25.3.  At 64 and 128 heads (64-head tiles) TMA was within 3% either way and the transposed form 13-24% slower, so
there ``mla_decode``'s kernel stays.  What this kernel itself gains is for ``bench_mla_decode_kernel.py --tma-ab``.

**On by default**; ``MLA_FUSER_DECODE_TMA=0`` turns it off (``ENABLED``, when not None, overrides the setting in
a process: tests and ``bench_mla_decode_kernel.py --tma-ab``).  A first version read the cut tiles whole and zeroed
their value rows in registers after the loop; compiled on an H100 (Triton 3.6) it was wrong (NaN, 0.1 off, illegal
memory accesses) where the interpreter passed (``mla_decode_tma_cases_h100.jsonl``), and so was the both-ends tile
read from pointers in the transposed orientation.  This version is right on that GPU in every case
(``mla_decode_tma_cases_shifted_h100.jsonl``, ``mla_decode_tma_cases_both_ends_h100.jsonl``: 0.0 from the pointer
kernel), in its compiled test (``tests/test_kernel_mla_decode_tma.py``, on a Hopper GPU) and in
the GPU tests of both Transformers ends with it on; ``bench_mla_decode_kernel.py --tma-ab`` (16 heads, 512 + 64,
page 64, CUDA-graph replay; ``mla_decode_tma_ab_h100.json``) gives 24.6 against 25.5 us at B=1 L=32k, 15.8 / 17.5 at
1x16k, 9.3 / 9.6 at 1x4k, 16.9 / 17.7 at 4x4k, 18.5 / 19.3 at 16x1k, 68.6 / 70.3 at 32x4k, 220.3 / 225.6 at 64x8k.
A whole graphed step does not show it (``decode_tma_generate_h100.json``: within 1%).

Where it is on, :func:`usable` says which calls it takes: a Hopper GPU (compute capability 9.x: where it was tuned and
checked; newer GPUs have TMA too, but other tensor-core instructions) or the interpreter, a 16-bit contiguous
pool with 16-byte rows, a value width of 256 or 512 (one or two chunks), a rope part of 0 or a power of two from 16
to 256, tiles inside pages.  Everything else runs ``mla_decode``'s kernel.
"""

from __future__ import annotations

import weakref

import torch

from .. import envs
from .dispatch import MAX_COMBINE, SUM_COMBINE, capability_major, cuda_index, lazy_jit, tl
from .tma import MAX_BOX, tma_operand, tma_ready

__all__ = ["ENABLED", "launch_stage1", "usable"]

# this process's choice where not None (tests, a benchmark's A/B); None follows MLA_FUSER_DECODE_TMA (on by default)
ENABLED: bool | None = None

KERNEL_DTYPES_BYTES = 2  # bf16 / fp16 pools only (fp32 inputs keep mla_decode's fp32 tiles)


def usable(q, kv_pages, v_dim: int, rope: int, per_row_pages: bool) -> bool:
    """Whether this kernel is on and can run the call: see the module docstring."""
    if not (envs.decode_tma() if ENABLED is None else ENABLED):
        return False
    if kv_pages.is_cuda and capability_major(cuda_index(kv_pages)) != 9:  # (tuned and checked on Hopper only)
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
    """The descriptors of ``kv_pages`` as tile slots ``[slots, block_n, D]`` (a slot: ``block_n`` rows of a page) in
    ``[1, block_n, chunk]`` and ``[1, block_n, rope]`` boxes, built once per pool.  Slots, not rows: a box shifted
    past its slot's edge reads zeros there (what the kernel's cut tiles need), where over rows it would read the next
    tile's.  Why once per pool: building them costs ~5 us of host time per call (two descriptors and a view), a third
    of an eager ``mla_decode`` call's wrapper, and a cache layer passes the same pool on every step.

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
    slots = torch.empty(0, dtype=kv_pages.dtype, device=kv_pages.device).set_(
        kv_pages.untyped_storage(), kv_pages.storage_offset(), (kv_pages.numel() // (block_n * width), block_n, width),
        (block_n * width, width, 1))
    kv_c = tma_operand(slots, [1, block_n, chunk], True)
    kv_r = tma_operand(slots, [1, block_n, rope], True) if rope else kv_c

    def forget(ref, key=key):
        if _POOL_DESCRIPTORS.get(key, (None,))[0] is ref:
            del _POOL_DESCRIPTORS[key]

    _POOL_DESCRIPTORS[key] = (weakref.ref(kv_pages, forget), signature, kv_c, kv_r)
    return kv_c, kv_r


@lazy_jit(do_not_specialize=("NUM_SPLITS", "stride_btb", "stride_lb", "stride_lh"))
def _mla_decode_tma_stage1(
    Q, QR, KV, KV_C, KV_R, BT, SEQ_LENS, STARTS, O_PART, LSE, OUT,
    qk_scale, H, NUM_SPLITS,
    stride_qb, stride_qh, stride_qrb, stride_qrh, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    V_CHUNKS: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    """Stage 1 (one head tile, one split, one sequence), transposed products.  ``KV_C`` / ``KV_R``: descriptors of the
    pool as tile slots ``[slots, BLOCK_N, D]`` in ``[1, BLOCK_N, CHUNK]`` / ``[1, BLOCK_N, ROPE]`` boxes; ``KV``: the
    pool itself (a split whose one tile is cut at both ends reads it from pointers)."""
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
    if HAS_STARTS:
        # The split is one tile with rows outside the sequence at both ends (a left-padded sequence shorter than a
        # tile): no shift of the box leaves only the sequence inside its slot, so that tile is read from pointers
        # after the loop, which then has nothing to do.
        both_ends = (t_start < start_tok) & (t_end - t_start < BLOCK_N) & (t_start < t_end)
        loop_end = tl.where(both_ends, t_start, t_end)
    else:
        loop_end = t_end

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

    # Every tile of the split, by TMA.  A tile cut by the sequence's end (or, with left padding, its start) is read
    # with its box shifted inside its slot so that the rows outside the sequence fall outside the slot, where TMA
    # writes zeros: the value rows P V reads there are 0, never what the page held before (0 * NaN is NaN), and
    # their scores are masked.  Full tiles take the same path with a shift of 0 and every row valid.
    for tok0 in range(t_start, loop_end, BLOCK_N):
        page = tl.load(bt_row + tok0 // PAGE_SIZE)
        slot = page * (PAGE_SIZE // BLOCK_N) + (tok0 % PAGE_SIZE) // BLOCK_N
        if HAS_STARTS:
            lo = tl.maximum(start_tok - tok0, 0)  # the sequence's rows of the slot: [lo, hi)
        else:
            lo = 0
        hi = tl.minimum(t_end - tok0, BLOCK_N)
        shift = tl.where(hi < BLOCK_N, hi - BLOCK_N, lo)  # (negative: the rows before the slot are the zeros)
        k0 = KV_C.load([slot, shift, 0]).reshape(BLOCK_N, CHUNK)
        k1 = k0
        if V_CHUNKS == 2:
            k1 = KV_C.load([slot, shift, CHUNK]).reshape(BLOCK_N, CHUNK)
        kr = k0
        if ROPE > 0:
            kr = KV_R.load([slot, shift, V_CHUNKS * CHUNK]).reshape(BLOCK_N, ROPE)
        if DOT_UPCAST:
            k0 = k0.to(tl.float32)
            k1 = k1.to(tl.float32)
            kr = kr.to(tl.float32)
        st = tl.dot(k0, tl.trans(q0), input_precision=DOT_PRECISION)
        if V_CHUNKS == 2:
            st = tl.dot(k1, tl.trans(q1), acc=st, input_precision=DOT_PRECISION)
        if ROPE > 0:
            st = tl.dot(kr, tl.trans(qr), acc=st, input_precision=DOT_PRECISION)
        in_seq = (offs_n + shift >= lo) & (offs_n + shift < hi)
        st = tl.where(in_seq[:, None], st * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(st, 0, MAX_COMBINE))  # finite: every tile holds one of the tokens
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

    if HAS_STARTS:
        if both_ends:  # the split's only tile, nothing accumulated before it: masked loads from pointers
            page = tl.load(bt_row + t_start // PAGE_SIZE)
            in_seq = (t_start + offs_n >= start_tok) & (t_start + offs_n < t_end)
            kv_row = KV + (page.to(tl.int64) * PAGE_SIZE + t_start % PAGE_SIZE + offs_n)[:, None] * (V_CHUNKS * CHUNK
                                                                                                   + ROPE)
            k0 = tl.load(kv_row + offs_c[None, :], mask=in_seq[:, None], other=0.0)
            k1 = k0
            if V_CHUNKS == 2:
                k1 = tl.load(kv_row + CHUNK + offs_c[None, :], mask=in_seq[:, None], other=0.0)
            kr = k0
            if ROPE > 0:
                kr = tl.load(kv_row + V_CHUNKS * CHUNK + offs_r[None, :], mask=in_seq[:, None], other=0.0)
            if DOT_UPCAST:
                k0 = k0.to(tl.float32)
                k1 = k1.to(tl.float32)
                kr = kr.to(tl.float32)
            # (in mla_decode's orientation, S = Q K^T and O = P V: a transposed product whose operand is a register
            # tile, V^T P^T, came out wrong compiled for sm_90 by Triton 3.6)
            s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
            if V_CHUNKS == 2:
                s = tl.dot(q1, tl.trans(k1), acc=s, input_precision=DOT_PRECISION)
            if ROPE > 0:
                s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=DOT_PRECISION)
            s = tl.where(in_seq[None, :], s * qk_scale, float("-inf"))
            m_i = tl.reduce(s, 1, MAX_COMBINE)
            p = tl.exp2(s - m_i[:, None])
            l_i = tl.reduce(p, 1, SUM_COMBINE)
            p = p.to(p_dtype)
            if DOT_UPCAST:
                p = p.to(tl.float32)
            acc0 = tl.trans(tl.dot(p, k0, input_precision=DOT_PRECISION))
            if V_CHUNKS == 2:
                acc1 = tl.trans(tl.dot(p, k1, input_precision=DOT_PRECISION))

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
        q, q_rope, kv_pages, kv_c, kv_r, block_table, seq_lens, starts if starts is not None else seq_lens,
        o_part, lse, out, qk_scale, H, num_splits,
        q_st[0], q_st[1], qr_st[0], qr_st[1], block_table.stride(0),
        *sp, *sl, out_st[0], out_st[1],
        PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk, V_CHUNKS=v_dim // chunk, ROPE=rope,
        BLOCK_R=max(rope, 16), DIRECT_OUT=num_splits == 1, DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast,
        HAS_STARTS=starts is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
