"""Absorbed MLA decode over latent rows stored as two half rows, read in place through a slot list.

Why: Transformers' continuous-batching pool stores a token's row as a K half and a V half of equal width, in two
different pages of a block (the V page of a layer follows its K page, so a token's V half is a fixed number of
elements after its K half).  ``runtime.continuous_batching`` splits the latent ``[kv_c | k_pe]`` so that each half
is itself a kernel-friendly run: K half = ``[kv_c[:r/2] | k_pe[:p/2]]``, V half = ``[kv_c[r/2:] | k_pe[p/2:]]``.
This kernel reads those halves where they lie — no gather into a contiguous copy (which cost as much as the
attention itself) — with the same math as ``mla_decode``: per query row ``b`` the rows ``slots[t]`` for
``starts[b] <= t < seq_lens[b]``, scores ``q_nope . kv_c + q_pe . k_pe``, output ``softmax @ kv_c``; the two halves
of ``kv_c`` get one accumulator each.  Split-K partials are merged by ``mla_decode``'s second stage.

A prefill chunk's tokens all attend the same request's rows (each up to its own position).  One program per token
re-read those rows once per token (a 1000-token chunk read its context 1000 times: ~19% of a serving run's GPU
time); runs of ``GROUP`` tokens with one start are therefore served by a second launch whose programs hold ``GROUP``
tokens x H heads as rows (:func:`tokens_per_program`: 64 rows, the decode kernel's wide tile), each row masked to its
own range; the per-token launch skips those tokens.  Decode tokens (each another request's) stay one per program.

Requirements (else the caller joins the rows and uses ``mla_decode``): ``r/2`` a power of two >= 16, ``p`` even.
:func:`mla_decode_split_rows_ref` is the torch twin (it rebuilds the rows and calls ``mla_decode_ref``).
"""

from __future__ import annotations

import torch

from .dispatch import MAX_COMBINE, SUM_COMBINE, capability_major, cdiv, lazy_jit, next_pow2, tl, use_triton
from .mla_decode import (
    _LOG2E, MLADecodeConfig, _tile_n, default_config, dot_mode, launch_plan, merge_splits, mla_decode_ref,
    split_partials,
)

__all__ = ["split_rows_supported", "mla_decode_split_rows", "mla_decode_split_rows_ref", "join_split_rows", "row_slots"]


def split_rows_supported(rank: int, rope: int) -> bool:
    """Whether a latent of this layout can be read as two half rows by the kernel."""
    half = rank // 2
    return rank % 2 == 0 and rope % 2 == 0 and half >= 16 and half & (half - 1) == 0


def join_split_rows(k_rows: torch.Tensor, v_rows: torch.Tensor, rank: int) -> torch.Tensor:
    """``[n, rank + rope]`` latent rows ``[kv_c | k_pe]`` from their K and V half rows ``[n, (rank + rope) / 2]``."""
    h = rank // 2
    return torch.cat([k_rows[:, :h], v_rows[:, :h], k_rows[:, h:], v_rows[:, h:]], dim=-1)


def row_slots(slots, starts, seq_lens, page, page_bases):
    """The slot of every context position ``[0, max(seq_lens))`` from slots of whole pages (see
    :func:`mla_decode_split_rows`), each query's range filled from its own pages (host values: a twin's helper)."""
    n = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.zeros(n, dtype=torch.long, device=slots.device)
    for b, (start, end, base) in enumerate(zip(starts.tolist(), seq_lens.tolist(), page_bases.tolist())):
        local = torch.arange(end - start, device=slots.device)
        out[start:end] = slots[base + local // page].long() + local % page
    return out


def mla_decode_split_rows_ref(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, page=0, page_bases=None):
    """Torch twin: the rows of ``slots`` joined, then ``mla_decode_ref`` over them as pages of one row (slots of
    whole pages are first turned into one slot per row)."""
    if page:
        slots = row_slots(slots, starts, seq_lens, page, page_bases)
    n = slots.shape[-1]
    latent = join_split_rows(k_rows[slots[:n].long()], v_rows[slots[:n].long()], rank)
    table = torch.arange(n, device=q.device, dtype=torch.int32).expand(q.shape[0], -1)
    return mla_decode_ref(q, latent.unsqueeze(1), table, seq_lens, scale, rank, starts=starts)


@lazy_jit(do_not_specialize=("T", "NUM_SPLITS", "stride_lb", "stride_lh"))
def _split_rows_stage1(Q, QPE, KROWS, SLOTS, SEQ_LENS, STARTS, BASES, O_PART, LSE, OUT, qk_scale, T, H, RANK, RH,
                       NUM_SPLITS, V_SHIFT, stride_qb, stride_qh, stride_eb, stride_eh, stride_kr, stride_pb, stride_ph,
                       stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, TOKENS: tl.constexpr,
                       GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_VH: tl.constexpr, BLOCK_RH: tl.constexpr,
                       HAS_ROPE: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       DOT_UPCAST: tl.constexpr):
    # A program's rows are (token, head) pairs: TOKENS query tokens of H heads each, row r = token r // H, head r % H.
    # With GROUP > 1 the tokens come in aligned groups of GROUP: a group whose tokens share one start (one request's
    # prefill chunk) is served by the TOKENS == GROUP launch (its rows read each latent tile once), every other token
    # by the TOKENS == 1 launch; each launch leaves the other's rows alone.
    # PAGE > 0: SLOTS holds the slot of each page's first row, a program's rows are one request's (its tokens share
    # their start, the context's first row), and BASES[token] is where that request's pages begin in SLOTS.
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    g = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_r = g * TOKENS + offs_h // H
    head_r = offs_h % H
    mask_h = (offs_h < TOKENS * H) & (tok_r < T)
    if GROUP > 1:  # (vectors over the rows, all equal: a scalar condition in a mask trips Triton's interpreter)
        head_tok = (g * TOKENS // GROUP) * GROUP + offs_h * 0
        last_tok = tl.minimum(head_tok + GROUP - 1, T - 1)
        same = (head_tok + GROUP <= T) & (tl.load(STARTS + head_tok) == tl.load(STARTS + last_tok))
        if TOKENS == GROUP:
            mask_h = mask_h & same
        else:
            mask_h = mask_h & (same == 0)
    end_r = tl.load(SEQ_LENS + tok_r, mask=mask_h, other=0)
    start_r = tl.load(STARTS + tok_r, mask=mask_h, other=0)
    hi = tl.reduce(tl.where(mask_h, end_r, 0), 0, MAX_COMBINE)
    lo = tl.minimum(-tl.reduce(tl.where(mask_h, -start_r, -(1 << 30)), 0, MAX_COMBINE), hi)  # (the rows' min)
    if PAGE > 0:  # (every row of the program is one request's: one base)
        base = tl.reduce(tl.where(mask_h, tl.load(BASES + tok_r, mask=mask_h, other=0), 0), 0, MAX_COMBINE)
    first = (lo // BLOCK_N) * BLOCK_N
    n_tiles = (hi - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_start = first + pid_s * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_start + tiles_per_split * BLOCK_N, hi)

    tok64 = tok_r.to(tl.int64)
    offs_v = tl.arange(0, BLOCK_VH)
    offs_r = tl.arange(0, BLOCK_RH)
    offs_n = tl.arange(0, BLOCK_N)
    mask_r = offs_r < RH
    q_row = Q + tok64[:, None] * stride_qb + head_r[:, None] * stride_qh
    q_lo = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    q_hi = tl.load(q_row + BLOCK_VH + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    if HAS_ROPE:
        qe_row = QPE + tok64[:, None] * stride_eb + head_r[:, None] * stride_eh
        qp_lo = tl.load(qe_row + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        qp_hi = tl.load(qe_row + RH + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
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
        mask_n = (tok < t_end) & (tok >= lo)
        if PAGE > 0:
            local = tok - lo
            slot = tl.load(SLOTS + base + local // PAGE, mask=mask_n, other=0).to(tl.int64) + local % PAGE
        else:
            slot = tl.load(SLOTS + tok, mask=mask_n, other=0).to(tl.int64)
        k_ptr = KROWS + slot[:, None] * stride_kr
        lo_k = tl.load(k_ptr + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        hi_k = tl.load(k_ptr + V_SHIFT + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        p_dtype = lo_k.dtype
        if DOT_UPCAST:
            lo_k = lo_k.to(tl.float32)
            hi_k = hi_k.to(tl.float32)
        s = tl.dot(q_lo, tl.trans(lo_k), input_precision=DOT_PRECISION)
        s = tl.dot(q_hi, tl.trans(hi_k), acc=s, input_precision=DOT_PRECISION)
        if HAS_ROPE:
            pe_mask = mask_n[:, None] & mask_r[None, :]
            pe_lo = tl.load(k_ptr + BLOCK_VH + offs_r[None, :], mask=pe_mask, other=0.0)
            pe_hi = tl.load(k_ptr + V_SHIFT + BLOCK_VH + offs_r[None, :], mask=pe_mask, other=0.0)
            if DOT_UPCAST:
                pe_lo = pe_lo.to(tl.float32)
                pe_hi = pe_hi.to(tl.float32)
            s = tl.dot(qp_lo, tl.trans(pe_lo), acc=s, input_precision=DOT_PRECISION)
            s = tl.dot(qp_hi, tl.trans(pe_hi), acc=s, input_precision=DOT_PRECISION)
        # each row its own range (a tile can hold none of a row's tokens: its max is then -inf, taken as 0)
        keep = mask_n[None, :] & (tok[None, :] >= start_r[:, None]) & (tok[None, :] < end_r[:, None])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        p = p.to(p_dtype)
        if DOT_UPCAST:
            p = p.to(tl.float32)
        acc_lo = tl.dot(p, lo_k, acc=acc_lo, input_precision=DOT_PRECISION)
        acc_hi = tl.dot(p, hi_k, acc=acc_hi, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)
    store_mask = mask_h[:, None]
    if DIRECT_OUT:
        o_ptr = OUT + tok64[:, None] * stride_ob + head_r[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptr, (acc_lo * inv_l[:, None]).to(OUT.dtype.element_ty), mask=store_mask)
        tl.store(o_ptr + BLOCK_VH, (acc_hi * inv_l[:, None]).to(OUT.dtype.element_ty), mask=store_mask)
    else:
        o_ptr = O_PART + tok64[:, None] * stride_pb + head_r[:, None] * stride_ph + pid_s * stride_ps + offs_v[None, :]
        tl.store(o_ptr, acc_lo * inv_l[:, None], mask=store_mask)
        tl.store(o_ptr + BLOCK_VH, acc_hi * inv_l[:, None], mask=store_mask)
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + tok64 * stride_lb + head_r * stride_lh + pid_s, lse, mask=mask_h)


# Tokens per program for runs of one request's tokens when the caller gives none: None picks tokens_per_program(H),
# 1 turns grouping off (benchmarks set it for an A/B; never read from the environment).
GROUP_TOKENS: int | None = None


# The grouped launch's tiles on Hopper, from an H200 sweep (``bench_split_rows.py --sweep``, H=16, bf16,
# ``split_rows_sweep.json``): 64-token tiles, 8 warps, 3 stages were fastest on all three chunked shapes (1366 us for
# 4 x 2048-token prefills, 2059 us for a 2048-token chunk after 6k rows, 490 us mixed), 2-6% ahead of the decode
# kernel's 64-head default (2 stages); 16- or 32-token tiles and 4 warps were 1.3-4x slower.
GROUPED_CONFIG = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, swap_ab=False, ctas_per_sm=1)


def _hopper(device: torch.device) -> bool:
    """Whether :data:`GROUPED_CONFIG` (3 stages of 64-token tiles: Hopper's shared memory) fits this device (a
    tensor's: a CUDA one always has its index)."""
    return device.type == "cuda" and capability_major(device.index) >= 9


def tokens_per_program(heads: int) -> int:
    """Query tokens of one request's prefill chunk that one program serves together (``GROUP``): as many as make 64
    rows of (token, head), the decode kernel's wide tile (64 heads: two warpgroups).  Decode tokens, each of another
    request, stay one per program.  1 when the heads fill a wide tile by themselves."""
    group = 1
    while group * 2 * heads <= 64:
        group *= 2
    return group


def mla_decode_split_rows_triton(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits=None,
                                 q_rope=None, group=None, grouped_config=None, page=0, page_bases=None):
    """Triton path of :func:`mla_decode_split_rows` (no dispatch); ``grouped_config`` (an ``MLADecodeConfig``)
    overrides the grouped launch's tiles (sweeps)."""
    q_lat, q_pe = (q.narrow(-1, 0, rank), q.narrow(-1, rank, q.shape[-1] - rank)) if q_rope is None else (q, q_rope)
    T, H = q_lat.shape[:2]
    rope = q_pe.shape[-1]
    v_shift = (v_rows.data_ptr() - k_rows.data_ptr()) // k_rows.element_size()
    if (v_rows.data_ptr() - k_rows.data_ptr()) % k_rows.element_size() or v_rows.stride() != k_rows.stride():
        raise ValueError("mla_decode_split_rows: the V half rows must lie at a whole-element offset from the K half "
                         "rows, with the same strides")
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 or rope == 0 else q_pe.contiguous()
    out = torch.empty((T, H, rank), device=q_lat.device, dtype=q_lat.dtype)
    if T == 0 or H == 0:
        return out
    group = group or GROUP_TOKENS or tokens_per_program(H)
    group = group if T >= group else 1
    plans = []
    for tokens in ((1, group) if group > 1 else (1,)):
        # tiles and splits as mla_decode plans them for rows of `tokens` x H, the slot list read as pages of one
        # tile each; the grouped launch takes the first one's split count (one set of partials, one merge)
        config = None
        if tokens > 1:  # (fp32, or a GPU before Hopper: the decode kernel's defaults, sized for its shared memory)
            swept = q_lat.dtype != torch.float32 and _hopper(q_lat.device)
            config = grouped_config or (GROUPED_CONFIG if swept else None)
        block_n = _tile_n((config or default_config(tokens * H, q_lat.dtype)).block_n, 1)[0]
        rows = slots.shape[-1] * max(page, 1)  # (context rows the slot list can name: the split search's length)
        plans.append((tokens, launch_plan(q_lat, rank, block_n, cdiv(max(1, rows), block_n), config,
                                          num_splits, rope_apart=rope, rows=(cdiv(T, tokens), tokens * H))))
        num_splits = plans[0][1][7]
    o_part, lse, sp, sl = split_partials(out, num_splits, rank)
    dot_precision, dot_upcast = dot_mode(q_lat.dtype)
    rh = rope // 2
    qe_strides = (q_pe.stride(0), q_pe.stride(1)) if rope else (0, 0)
    for tokens, (cfg, block_h, block_n, _, _, _, head_tiles, _, block_s, block_vc) in plans:
        _split_rows_stage1[(head_tiles, num_splits, cdiv(T, tokens))](
            q_lat, q_pe if rope else q_lat, k_rows, slots, seq_lens, starts, page_bases if page else starts, o_part,
            lse, out, float(scale) * _LOG2E, T, H, rank, rh, num_splits, v_shift, q_lat.stride(0), q_lat.stride(1),
            *qe_strides, k_rows.stride(0), *sp, *sl, out.stride(0), out.stride(1), TOKENS=tokens, GROUP=group,
            PAGE=page,
            BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_VH=rank // 2, BLOCK_RH=max(16, next_pow2(max(rh, 1))),
            HAS_ROPE=rope > 0, DIRECT_OUT=num_splits == 1, DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    merge_splits(o_part, lse, out, rank, num_splits, sp, sl, block_s, block_vc)
    return out


def mla_decode_split_rows(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits=None, q_rope=None,
                          group=None, page=0, page_bases=None):
    """``[B, H, rank]``: absorbed MLA decode of ``q [B, H, rank + rope]`` over latent rows kept as K / V half rows.

    ``k_rows`` / ``v_rows``: ``[slots, (rank + rope) / 2]`` views of one layer's K and V half rows (same strides);
    ``slots``: int ``[n]`` the row of each context position; query ``b`` attends positions ``starts[b] <=
    t < seq_lens[b]`` (int32 ``[B]`` each).  ``q_rope [B, H, rope]``: the query's rope part where it lies (``q`` is
    then the latent part ``[B, H, rank]``; no joined copy).  ``group``: tokens per program for runs of queries with
    one start (default :func:`tokens_per_program`).  No host read: the launch can be captured in a CUDA graph.

    ``page > 0`` (slots of whole pages): ``slots`` names one slot per page of ``page`` rows (the page's first row;
    its rows follow it), each query's positions count from ``starts[b]`` (its request's first row: the queries of
    one start are one request's), and ``page_bases`` (int32 ``[B]``) says where query ``b``'s pages begin in
    ``slots``: position ``t`` lies in slot ``slots[page_bases[b] + (t - starts[b]) // page] + (t - starts[b]) %
    page``.  Continuous batching lists a context's pages this way instead of its every row (the engine's host work
    per step then grows with pages, not tokens)."""
    if page and (page_bases is None or page_bases.shape != starts.shape):
        raise ValueError("mla_decode_split_rows: slots of whole pages need page_bases, one per query")
    width = q.shape[-1] + (0 if q_rope is None else q_rope.shape[-1])
    if q_rope is not None and (q.shape[-1] != rank or q_rope.shape[:2] != q.shape[:2] or q_rope.dtype != q.dtype):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} does not go with a latent query {tuple(q.shape)} "
                         f"of rank {rank}")
    if not split_rows_supported(rank, width - rank) or k_rows.shape[-1] * 2 != width:
        raise ValueError(f"mla_decode_split_rows: half rows of {k_rows.shape[-1]} do not hold a latent of rank "
                         f"{rank} + rope {width - rank} split in two")
    if use_triton(q) and k_rows.stride(-1) == 1:
        return mla_decode_split_rows_triton(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, num_splits,
                                            q_rope, group, page=page, page_bases=page_bases)
    if q_rope is not None:
        q = torch.cat([q, q_rope], dim=-1)
    return mla_decode_split_rows_ref(q, k_rows, v_rows, slots, seq_lens, starts, scale, rank, page, page_bases)
