"""Absorbed MLA decode over latent rows stored as two half rows, read in place through a slot list.

Why: Transformers' continuous-batching pool stores a token's row as a K half and a V half of equal width, in two
different pages of a block (the V page of a layer follows its K page, so a token's V half is a fixed number of
elements after its K half).  ``runtime.continuous_batching`` splits the latent ``[kv_c | k_pe]`` so that each half
is itself a kernel-friendly run: K half = ``[kv_c[:r/2] | k_pe[:p/2]]``, V half = ``[kv_c[r/2:] | k_pe[p/2:]]``.
This kernel reads those halves where they lie — no gather into a contiguous copy (which cost as much as the
attention itself) — with the same math as ``mla_decode``: per query row ``b`` the rows ``slots[t]`` for
``starts[b] <= t < seq_lens[b]``, scores ``q_nope . kv_c + q_pe . k_pe``, output ``softmax @ kv_c``; the two halves
of ``kv_c`` get one accumulator each.  Split-K partials are merged by ``mla_decode``'s second stage.

Requirements (else the caller joins the rows and uses ``mla_decode``): ``r/2`` a power of two >= 16, ``p`` even.
:func:`mla_decode_split_rows_ref` is the torch twin (it rebuilds the rows and calls ``mla_decode_ref``).
"""

from __future__ import annotations

import torch

from .dispatch import MAX_COMBINE, SUM_COMBINE, LazyJit, cdiv, next_pow2, tl, use_triton
from .mla_decode import (
    _LOG2E, _tile_n, default_config, dot_mode, launch_plan, merge_splits, mla_decode_ref, split_partials,
)

__all__ = ["split_rows_supported", "mla_decode_split_rows", "mla_decode_split_rows_ref", "join_split_rows"]


def split_rows_supported(rank: int, rope: int) -> bool:
    """Whether a latent of this layout can be read as two half rows by the kernel."""
    half = rank // 2
    return rank % 2 == 0 and rope % 2 == 0 and half >= 16 and half & (half - 1) == 0


def join_split_rows(k_rows: torch.Tensor, v_rows: torch.Tensor, rank: int) -> torch.Tensor:
    """``[n, rank + rope]`` latent rows ``[kv_c | k_pe]`` from their K and V half rows ``[n, (rank + rope) / 2]``."""
    h = rank // 2
    return torch.cat([k_rows[:, :h], v_rows[:, :h], k_rows[:, h:], v_rows[:, h:]], dim=-1)


def mla_decode_split_rows_ref(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank):
    """Torch twin: the rows of ``slots`` joined, then ``mla_decode_ref`` over them as pages of one row."""
    n = slots.shape[-1]
    latent = join_split_rows(k_rows[slots[:n].long()], v_rows[slots[:n].long()], rank)
    table = torch.arange(n, device=q.device, dtype=torch.int32).expand(q.shape[0], -1)
    return mla_decode_ref(q, latent.unsqueeze(1), table, seq_lens, scale, rank, starts=starts)


@LazyJit
def _split_rows_stage1(Q, KROWS, SLOTS, SEQ_LENS, STARTS, O_PART, LSE, OUT, qk_scale, H, RANK, RH, NUM_SPLITS,
                       V_SHIFT, stride_qb, stride_qh, stride_kr, stride_pb, stride_ph, stride_ps, stride_lb,
                       stride_lh, stride_ob, stride_oh, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_VH: tl.constexpr, BLOCK_RH: tl.constexpr, HAS_ROPE: tl.constexpr,
                       DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start_tok = tl.load(STARTS + b)
    first = (start_tok // BLOCK_N) * BLOCK_N
    n_tiles = (seq_len - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_start = first + pid_s * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, seq_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_v = tl.arange(0, BLOCK_VH)
    offs_r = tl.arange(0, BLOCK_RH)
    offs_n = tl.arange(0, BLOCK_N)
    mask_r = offs_r < RH
    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q_lo = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    q_hi = tl.load(q_row + BLOCK_VH + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    if HAS_ROPE:
        qp_lo = tl.load(q_row + RANK + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        qp_hi = tl.load(q_row + RANK + RH + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        if DOT_UPCAST:
            qp_lo = qp_lo.to(tl.float32)
            qp_hi = qp_hi.to(tl.float32)
    if DOT_UPCAST:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc_lo = tl.full([BLOCK_H, BLOCK_VH], 0.0, dtype=tl.float32)
    acc_hi = tl.full([BLOCK_H, BLOCK_VH], 0.0, dtype=tl.float32)
    for start in range(t_start, t_end, BLOCK_N):
        tok = start + offs_n
        mask_n = (tok < t_end) & (tok >= start_tok)
        slot = tl.load(SLOTS + tok, mask=mask_n, other=0).to(tl.int64)
        k_ptr = KROWS + slot[:, None] * stride_kr
        lo = tl.load(k_ptr + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        hi = tl.load(k_ptr + V_SHIFT + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        p_dtype = lo.dtype
        if DOT_UPCAST:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        s = tl.dot(q_lo, tl.trans(lo), input_precision=DOT_PRECISION)
        s = tl.dot(q_hi, tl.trans(hi), acc=s, input_precision=DOT_PRECISION)
        if HAS_ROPE:
            pe_mask = mask_n[:, None] & mask_r[None, :]
            pe_lo = tl.load(k_ptr + BLOCK_VH + offs_r[None, :], mask=pe_mask, other=0.0)
            pe_hi = tl.load(k_ptr + V_SHIFT + BLOCK_VH + offs_r[None, :], mask=pe_mask, other=0.0)
            if DOT_UPCAST:
                pe_lo = pe_lo.to(tl.float32)
                pe_hi = pe_hi.to(tl.float32)
            s = tl.dot(qp_lo, tl.trans(pe_lo), acc=s, input_precision=DOT_PRECISION)
            s = tl.dot(qp_hi, tl.trans(pe_hi), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        p = p.to(p_dtype)
        if DOT_UPCAST:
            p = p.to(tl.float32)
        acc_lo = tl.dot(p, lo, acc=acc_lo, input_precision=DOT_PRECISION)
        acc_hi = tl.dot(p, hi, acc=acc_hi, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)
    store_mask = mask_h[:, None]
    if DIRECT_OUT:
        o_ptr = OUT + b * stride_ob + offs_h[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptr, (acc_lo * inv_l[:, None]).to(OUT.dtype.element_ty), mask=store_mask)
        tl.store(o_ptr + BLOCK_VH, (acc_hi * inv_l[:, None]).to(OUT.dtype.element_ty), mask=store_mask)
    else:
        o_ptr = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps + offs_v[None, :]
        tl.store(o_ptr, acc_lo * inv_l[:, None], mask=store_mask)
        tl.store(o_ptr + BLOCK_VH, acc_hi * inv_l[:, None], mask=store_mask)
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


def mla_decode_split_rows_triton(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits=None):
    """Triton path of :func:`mla_decode_split_rows` (no dispatch)."""
    B, H, D = q.shape
    rope = D - rank
    v_shift = (v_rows.data_ptr() - k_rows.data_ptr()) // k_rows.element_size()
    if (v_rows.data_ptr() - k_rows.data_ptr()) % k_rows.element_size() or v_rows.stride() != k_rows.stride():
        raise ValueError("mla_decode_split_rows: the V half rows must lie at a whole-element offset from the K half "
                         "rows, with the same strides")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((B, H, rank), device=q.device, dtype=q.dtype)
    if B == 0 or H == 0:
        return out
    # tiles and splits as mla_decode plans them, the slot list read as pages of one tile each
    block_n = _tile_n(default_config(H, q.dtype).block_n, 1)[0]
    cfg, block_h, block_n, _, _, _, head_tiles, num_splits, block_s, block_vc = launch_plan(
        q, rank, block_n, cdiv(max(1, slots.shape[-1]), block_n), None, num_splits)
    direct = num_splits == 1
    o_part, lse, sp, sl = split_partials(out, num_splits, rank)
    dot_precision, dot_upcast = dot_mode(q.dtype)
    rh = rope // 2
    _split_rows_stage1[(head_tiles, num_splits, B)](
        q, k_rows, slots, seq_lens, starts, o_part, lse, out, float(scale) * _LOG2E, H, rank, rh, num_splits,
        v_shift, q.stride(0), q.stride(1), k_rows.stride(0), *sp, *sl, out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_VH=rank // 2, BLOCK_RH=max(16, next_pow2(max(rh, 1))),
        HAS_ROPE=rope > 0, DIRECT_OUT=direct, DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    merge_splits(o_part, lse, out, rank, num_splits, sp, sl, block_s, block_vc)
    return out


def mla_decode_split_rows(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits=None):
    """``[B, H, rank]``: absorbed MLA decode of ``q [B, H, rank + rope]`` over latent rows kept as K / V half rows.

    ``k_rows`` / ``v_rows``: ``[slots, (rank + rope) / 2]`` views of one layer's K and V half rows (same strides);
    ``slots``: int ``[n]`` the row of each context position; query ``b`` attends positions ``starts[b] <=
    t < seq_lens[b]`` (int32 ``[B]`` each).  No host read: the launch can be captured in a CUDA graph."""
    if not split_rows_supported(rank, q.shape[-1] - rank) or k_rows.shape[-1] * 2 != q.shape[-1]:
        raise ValueError(f"mla_decode_split_rows: half rows of {k_rows.shape[-1]} do not hold a latent of rank "
                         f"{rank} + rope {q.shape[-1] - rank} split in two")
    if use_triton(q) and k_rows.stride(-1) == 1:
        return mla_decode_split_rows_triton(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits)
    return mla_decode_split_rows_ref(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank)
