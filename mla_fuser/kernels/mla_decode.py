"""Absorbed MLA decode attention over a paged latent KV cache.

MLA (DeepSeek-V2/V3) caches one latent row per token, ``[kv_c | k_pe]`` of width
``D = kv_lora_rank + rope_dim`` (512 + 64 = 576), shared by *all* heads.  With the up-projections
absorbed into the query (``q = [q_nope @ W_UK | q_pe]``) and into the output projection, decode
attention is multi-query attention with a wide head::

    score[b, h, t] = scale * <q[b, h], kv[b, t]>          (all D columns)
    out[b, h]      = softmax_t(score[b, h]) @ kv[b, :, :v_dim]   (the kv_c columns only)

so the value is the first ``v_dim`` columns of the key.  The cache is the only large operand: at
H=16 the kernel does ~30 FLOP per byte read (memory bound on any GPU), at H=128 ~240 FLOP/byte
(around the H200's ridge point).  The design therefore has one goal above all others: **read every
cache byte exactly once per (sequence, KV split) and keep enough of those reads in flight**.

Triton design (``_mla_decode_stage1`` + ``_mla_decode_stage2``)
---------------------------------------------------------------
* One program = (tile of ``BLOCK_H`` heads, one KV split, one sequence).  Every head of the tile
  uses each latent tile that is loaded, so with ``BLOCK_H >= H`` the cache is streamed once; the
  head-tile index is grid axis 0 (fastest varying), so programs that share a (sequence, split) run
  together and a second head tile (H=128, ``BLOCK_H=64``) mostly re-reads from L2, not HBM.
  ``tl.dot`` needs M >= 16, so fewer heads than 16 are padded to a 16-row tile (masked rows).
* The program walks its split in ``BLOCK_N``-token tiles.  When ``BLOCK_N`` divides ``page_size`` a
  tile lies inside one page: one block-table lookup per tile and ``BLOCK_N * D`` contiguous
  elements, which gives wide coalesced loads.  Otherwise (pages smaller than the tile, odd page
  sizes such as 1) each token row looks its page up on its own (``PER_ROW_PAGES``): rows are still
  contiguous D-wide runs, at the cost of a ``[BLOCK_N]`` index load per tile (not timed on a GPU).
* D = 576 is not a power of two.  Instead of padding to 1024 columns (78% wasted loads and MMA
  work) the dot is split: the ``v_dim`` part (512, power of two, which is also the value) and the
  rope part (64).  Other dims are padded to powers of two and masked (``EVEN_V``/``EVEN_R``
  constexprs keep the masks out of the real 512+64 case); ``rope_dim == 0`` drops the second dot.
* Online softmax in base 2 (``scale * log2(e)`` folded into the scores), fp32 statistics and
  accumulator; ``p`` is cast to the cache dtype for the ``p @ V`` tensor-core dot (the usual flash
  attention trade-off).  fp32 inputs use ``input_precision="ieee"`` so they stay exact(ish) instead
  of tf32.
* Split-KV for occupancy: decode batches are small, so ``B * ceil(H / BLOCK_H)`` programs do not
  fill 132 SMs.  Each sequence's tiles are divided evenly into ``num_splits`` chunks; stage 1 writes
  a normalised partial output ``[B, H, S, v_dim]`` and its log-sum-exp ``[B, H, S]`` (fp32, base 2),
  stage 2 merges them.  Splits that get no tokens (short sequences in a ragged batch, or
  ``seq_len == 0``) write ``lse = -inf`` and a zero partial, so they weigh nothing and never make
  NaN.  With one split, stage 1 writes the final output directly and stage 2 is skipped.
* ``num_splits=None`` (:func:`choose_num_splits`) picks the smallest split count whose programs
  fill the GPU's resident slots (SMs x programs per SM of the config) at >= 90% wave efficiency,
  never more splits than pages of the longest possible sequence (``block_table.shape[1]``) and
  never fewer than ``MIN_TILES_PER_SPLIT`` tiles per split (one: short contexts at small batch want every
  tile in its own program, ``benchmarks/results/mla_decode_splits.json``).  On an H200 its picks are within
  ~2 us of the best of a split-count sweep on every case of that sweep (H=16 and 128; B=1 at 512 to 32k
  tokens, B=4/16 at 1k, 16x4k, 64x8k), where four tiles per split ran B=1 L=512 in 13.5 us against 8 us.
  It uses only host-side
  shapes, so it needs no device sync and is CUDA-graph safe (the grid does not depend on
  ``seq_lens`` values).
* Kernels use only core Triton builtins plus ``tl.reduce`` (see ``dispatch.LazyJit``) so they run under
  ``TRITON_INTERPRET=1`` whatever the import order; bf16 dots are upcast under the interpreter
  only (its bf16 ``tl.dot`` is broken in triton 3.9).

What it reaches is measured by ``benchmarks/bench_mla_decode_kernel.py`` against the copy bandwidth of the same
run; the figures live in ``benchmarks/results/mla_decode_kernel.json`` (and the README), not here, where they would
go stale.  Known short of its targets: B=1 at long context (two launches plus the split merge are a large share
of a ~20 us step) and H=128 (the two warpgroups split the 64-token QK^T tile; the softmax is not overlapped with
the MMAs).

The op is also registered as ``torch.ops.mla_fuser.mla_decode`` (a ``torch.library`` custom op with
a fake implementation) so torch.compile treats it as one opaque node; the Triton launches are
CUDA-graph capturable (the benchmark times graph replays).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import decode_tiles, mla_decode_tma
from .dispatch import (
    MAX_COMBINE, SUM_COMBINE, cdiv, cuda_index, kernel_op, lazy_jit, next_pow2, tl, triton_interpreting, use_triton,
)
from .paged_cpu import mla_decode_cpu

__all__ = [
    "MLADecodeConfig",
    "default_config",
    "choose_num_splits",
    "mla_decode",
    "mla_decode_ref",
    "mla_decode_triton",
]

_LOG2E = 1.4426950408889634

# Tiles per split at least.  Four (so that a split's software pipeline fills and its q load and partial store
# amortise) measured slower than one wherever the split count is capped by the tiles: at B=1-16 and short
# contexts every tile in its own program wins (B=1 L=512: 8 us against 13.5; L=2048: 9 against 14.4; B=4 L=1k:
# 9 against 16), and where more programs than slots would result, the wave-efficiency rule stops earlier anyway.
MIN_TILES_PER_SPLIT = 1


# ---- Torch reference ----


def mla_decode_ref(q, kv_pages, block_table, seq_lens, scale, v_dim, starts=None):
    """Torch reference (and the CPU path): gathers the pages densely and computes in fp32.

    ``starts`` (int ``[B]`` or None): tokens before ``starts[b]`` are not attended (left padding).

    Vectorised over the batch (padded to the longest possible sequence, ``block_table.shape[1]``
    pages) so it needs no host sync; block-table entries past a sequence's last page are replaced
    by page 0 before indexing, so garbage there (e.g. -1) is never dereferenced, and their tokens are
    masked out.  Sequences of length 0 give zeros.
    """
    B, H, D = q.shape
    page_size = kv_pages.shape[1]
    max_pages = block_table.shape[1]
    if B == 0 or max_pages == 0:
        return q.new_zeros(B, H, v_dim)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.long)
    bt = block_table.to(device=q.device, dtype=torch.long)
    n_pages = (seq_lens + page_size - 1) // page_size
    page_idx = torch.arange(max_pages, device=q.device)
    bt = torch.where(page_idx[None, :] < n_pages[:, None], bt, torch.zeros_like(bt))
    kv = kv_pages[bt].reshape(B, max_pages * page_size, D).float()  # [B, Lmax, D]
    tok = torch.arange(max_pages * page_size, device=q.device)
    valid = tok[None, :] < seq_lens[:, None]  # [B, Lmax]
    if starts is not None:
        valid &= tok[None, :] >= starts.to(device=q.device, dtype=torch.long)[:, None]
    kv = kv.masked_fill(~valid[..., None], 0.0)  # garbage rows (maybe NaN) must not reach p @ V
    s = torch.einsum("bhd,btd->bht", q.float(), kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # exp(-inf) = 0 for masked tokens
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bht,btv->bhv", p, kv[..., :v_dim])
    out = torch.where(denom > 0, out / denom.clamp_min(1e-30), torch.zeros_like(out))
    return out.to(q.dtype)


# ---- Triton kernels ----


@lazy_jit(do_not_specialize=("NUM_SPLITS", "stride_btb", "stride_lb", "stride_lh"))
def _mla_decode_stage1(
    Q, QR,  # QR: the query's rope part (Q + V_DIM for a joined query, or a tensor of its own)
    KV, BT, SEQ_LENS, STARTS, O_PART, LSE, OUT,
    qk_scale,  # scale * log2(e)
    H, V_DIM, ROPE_DIM, NUM_SPLITS,
    stride_qb, stride_qh, stride_qrb, stride_qrh, stride_kvp, stride_kvt, stride_btb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr, EVEN_V: tl.constexpr, EVEN_R: tl.constexpr,
    PER_ROW_PAGES: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SWAP_AB: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(SEQ_LENS + b)
    if HAS_STARTS:
        # left padding: tokens before start_tok are not attended.  The splits cover the tiles from the one
        # holding start_tok (tiles stay BLOCK_N-aligned, so a tile still lies inside one page); only that first
        # tile has masked tokens, and it always holds start_tok itself, so every tile has a valid token.
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
        mask_v = offs_v < BLOCK_V  # all true, folded away
    else:
        mask_v = offs_v < V_DIM
    if EVEN_R:
        mask_r = offs_r < BLOCK_R
    else:
        mask_r = offs_r < ROPE_DIM

    q_row = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    if HAS_ROPE:
        q_pe = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                       mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        if DOT_UPCAST:
            q_pe = q_pe.to(tl.float32)
    if DOT_UPCAST:
        q_nope = q_nope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    if SWAP_AB:
        # Transposed problem: S^T = KV @ Q^T ([BLOCK_N, BLOCK_H]) and O^T = KV^T @ P^T
        # ([BLOCK_V, BLOCK_H]).  The MMA's M dimension is then BLOCK_N (64) resp. v_dim (512)
        # instead of the head tile (16), which suits Hopper's wgmma (M = 64 per warpgroup) and
        # keeps the fp32 accumulator small per thread; q^T is a loop-invariant B operand.
        q_nope_t = tl.trans(q_nope)
        if HAS_ROPE:
            q_pe_t = tl.trans(q_pe)
        acc_t = tl.full([BLOCK_V, BLOCK_H], 0.0, dtype=tl.float32)
    else:
        acc = tl.full([BLOCK_H, BLOCK_V], 0.0, dtype=tl.float32)

    bt_row = BT + b.to(tl.int64) * stride_btb
    for start in range(t_start, t_end, BLOCK_N):
        tok = start + offs_n
        mask_n = tok < t_end
        if HAS_STARTS:
            mask_n = mask_n & (tok >= start_tok)
        if PER_ROW_PAGES:
            page = tl.load(bt_row + tok // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
            rows = page * stride_kvp + (tok % PAGE_SIZE) * stride_kvt
        else:
            # BLOCK_N divides PAGE_SIZE: the whole tile is one contiguous run inside one page.
            page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
            rows = page * stride_kvp + ((start % PAGE_SIZE) + offs_n) * stride_kvt
        kv_ptr = KV + rows[:, None]
        if EVEN_V:  # row mask only: constant along the contiguous columns, so loads stay 16 B wide
            kv = tl.load(kv_ptr + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        else:
            kv = tl.load(kv_ptr + offs_v[None, :], mask=mask_n[:, None] & mask_v[None, :], other=0.0)
        p_dtype = kv.dtype
        if DOT_UPCAST:
            kv = kv.to(tl.float32)
        if HAS_ROPE:
            if EVEN_R:
                k_pe = tl.load(kv_ptr + V_DIM + offs_r[None, :], mask=mask_n[:, None], other=0.0)
            else:
                k_pe = tl.load(kv_ptr + V_DIM + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            if DOT_UPCAST:
                k_pe = k_pe.to(tl.float32)
        if SWAP_AB:
            st = tl.dot(kv, q_nope_t, input_precision=DOT_PRECISION)
            if HAS_ROPE:
                st = tl.dot(k_pe, q_pe_t, acc=st, input_precision=DOT_PRECISION)
            st = tl.where(mask_n[:, None], st * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(st, 0, MAX_COMBINE))
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.reduce(pt, 0, SUM_COMBINE)
            acc_t = acc_t * alpha[None, :]
            pt = pt.to(p_dtype)
            if DOT_UPCAST:
                pt = pt.to(tl.float32)
            acc_t = tl.dot(tl.trans(kv), pt, acc=acc_t, input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
            if HAS_ROPE:
                s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)
            s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
            # Every tile has >= 1 valid token, so m_new is finite and alpha = exp2(-inf) = 0 at first.
            m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            acc = acc * alpha[:, None]
            p = p.to(p_dtype)  # the cache dtype: bf16/fp16 tensor-core operand
            if DOT_UPCAST:
                p = p.to(tl.float32)
            acc = tl.dot(p, kv, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if SWAP_AB:
        acc = tl.trans(acc_t)
    has_tok = l_i > 0.0
    inv_l = tl.where(has_tok, 1.0 / tl.where(has_tok, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]  # empty split / empty sequence -> exact zeros
    store_mask = mask_h[:, None] & mask_v[None, :]
    if DIRECT_OUT:
        o_ptr = OUT + b * stride_ob + offs_h[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=store_mask)
    else:
        o_ptr = O_PART + b * stride_pb + offs_h[:, None] * stride_ph + pid_s * stride_ps + offs_v[None, :]
        tl.store(o_ptr, out, mask=store_mask)
        lse = tl.where(has_tok, m_i + tl.log2(tl.where(has_tok, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + offs_h * stride_lh + pid_s, lse, mask=mask_h)


@lazy_jit(do_not_specialize=("NUM_SPLITS", "stride_lb", "stride_lh"))
def _mla_decode_stage2(
    O_PART,
    LSE,
    OUT,
    V_DIM,
    NUM_SPLITS,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_VC: tl.constexpr,
):
    """Merge the split partials of one (sequence, head, v-chunk) with their log-sum-exps.

    One pass with a running max (online merge), in chunks of BLOCK_S splits: each chunk's lse and
    partial tile are loaded together, so a merge of <= BLOCK_S splits is a single round trip to
    memory (the first version looped over splits in a dependent chain and cost ~10 us at B=1).
    """
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_v = pid_v * BLOCK_VC + tl.arange(0, BLOCK_VC)
    mask_v = offs_v < V_DIM
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = LSE + b * stride_lb + h * stride_lh
    o_row = O_PART + b * stride_pb + h * stride_ph

    # fp32 scalars (-inf and 0) built by reductions, so their type matches the loop-carried values
    m_run = tl.reduce(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0, MAX_COMBINE)
    d_run = tl.reduce(tl.full([BLOCK_S], 0.0, dtype=tl.float32), 0, SUM_COMBINE)
    acc = tl.full([BLOCK_VC], 0.0, dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        ss = s0 + offs_s
        ms = ss < NUM_SPLITS
        lse = tl.load(lse_row + ss, mask=ms, other=float("-inf"))
        o = tl.load(o_row + ss[:, None] * stride_ps + offs_v[None, :], mask=ms[:, None] & mask_v[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.reduce(lse, 0, MAX_COMBINE))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far -> weights 0
        rescale = tl.exp2(m_run - m_safe)  # exp2(-inf) = 0 on the first non-empty chunk
        w = tl.exp2(lse - m_safe)  # empty split: exp2(-inf) = 0, and its partial is 0 too
        d_run = d_run * rescale + tl.reduce(w, 0, SUM_COMBINE)
        acc = acc * rescale + tl.reduce(w[:, None] * o, 0, SUM_COMBINE)
        m_run = m_new
    out = tl.where(d_run > 0.0, acc / tl.where(d_run > 0.0, d_run, 1.0), 0.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_v, out.to(OUT.dtype.element_ty), mask=mask_v)


# ---- Launch configuration ----


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile/launch knobs of the Triton kernel.  None of them changes the math (only fp rounding
    order of the softmax accumulation), so they are safe to sweep/pick per GPU.

    * ``block_h``: heads per program (>= 16 for tl.dot; fewer heads are masked).  Larger tiles
      re-read the cache fewer times (H / block_h times per split) but need more registers
      (fp32 accumulator block_h x v_dim).
    * ``block_n``: tokens per tile; clipped to a divisor of ``page_size`` when possible.
    * ``num_warps`` / ``num_stages``: Triton launch params; ``num_stages`` is the software-pipeline
      depth (cache tiles in flight per program, each ``block_n * D * elem`` bytes of shared memory).
    * ``swap_ab``: compute the transposed products (S^T = KV Q^T, O^T = KV^T P^T) so the MMA M
      dimension is the token tile / v_dim rather than the (small) head tile.
    * ``ctas_per_sm``: how many programs of this config one SM holds at once (registers / shared
      memory); only used by :func:`choose_num_splits` to size the grid, never by the kernel.
    * ``tma``: run :mod:`mla_decode_tma`'s kernel (tiles by TMA, transposed products; ``swap_ab`` is then implied)
      where it can run the call (``mla_decode_tma.usable``), this module's otherwise.
    """

    block_h: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    swap_ab: bool = False
    ctas_per_sm: int = 2
    tma: bool = False


# Up to 16 heads where mla_decode_tma's kernel can run and is on (``MLA_FUSER_DECODE_TMA``; its probe on an H100:
# ``mla_decode_tma_probe_h100.json``; 1 program per SM: 2 stages of 64-token tiles fill its shared memory)
TMA_CONFIG = MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, swap_ab=True, ctas_per_sm=1, tma=True)
TMA_MAX_HEADS = 16


@functools.lru_cache(maxsize=None)  # (asked on every call; frozen config)
def default_config(num_heads: int, dtype: torch.dtype) -> MLADecodeConfig:
    """Defaults for Hopper (H100/H200), D=576, picked from sweeps on an H200 (triton 3.6, bf16,
    page 64; ``benchmarks/bench_mla_decode_kernel.py --sweep``); a launch takes the tuned table's tiles
    (``decode_tiles``) first where the shape and GPU match it:

    * H <= 16 (memory bound, ~30 FLOP/byte): one 16-head tile, so the cache is read once;
      64-token tiles, 4 warps (mma.sync path; 255 registers, 94 KB shared memory -> 2 programs per
      SM, one loading while the other computes).  3630-3740 GB/s (0.85-0.88x copy bandwidth) on
      64x8192 / 128x4096 / 16x32768.  Measured worse: BLOCK_N=32 (-15%), 8 warps (-30%),
      ``swap_ab`` (wgmma, -20%), BLOCK_N=128 (spills).
    * H > 32 (toward compute bound): 64-head tiles with 8 warps (two warpgroups, wgmma; the
      64 x 512 fp32 accumulator is 128 registers/thread; 2 stages of 64-token tiles + q = 221 KB of
      shared memory, one program per SM).  The cache is re-read H/64 times, mostly from L2
      because the head tiles of a split are adjacent programs.  ~275 TFLOP/s at H=128.
    * 16 < H <= 32: 32-head tiles, 4 warps (from the H=128 sweep, where it ran second best).
    * fp32 inputs (not tuned on a GPU): tiles sized so q + 2 stages fit in shared memory.
    """
    if torch.empty((), dtype=dtype).element_size() > 2:
        if num_heads <= 16:
            return MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1)
        return MLADecodeConfig(block_h=32, block_n=16, num_warps=4, num_stages=2, ctas_per_sm=1)
    if num_heads <= 16:
        return MLADecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, swap_ab=False, ctas_per_sm=2)
    if num_heads <= 32:
        return MLADecodeConfig(block_h=32, block_n=64, num_warps=4, num_stages=2, swap_ab=False, ctas_per_sm=1)
    return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, swap_ab=False, ctas_per_sm=1)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if torch.cuda.is_available() and device_index is not None:
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 132  # H100/H200 SXM; only affects how the work is split, never the result


def _tile_n(block_n: int, page_size: int) -> tuple[int, bool]:
    """BLOCK_N for this page size and whether rows must look their page up one by one.

    A tile inside one page (``page_size % BLOCK_N == 0``) needs one block-table lookup.  Otherwise
    (pages smaller than the tile, or odd page sizes) each row looks its own page up: still one
    contiguous D-wide row per token, so loads stay wide, at the cost of a [BLOCK_N] index load.
    """
    block_n = max(16, next_pow2(block_n))
    return block_n, page_size % block_n != 0


@functools.lru_cache(maxsize=4096)  # a pure function of a few ints, asked on every eager call: its search runs once
def choose_num_splits(
    batch: int,
    head_tiles: int,
    max_pages: int,
    page_size: int,
    block_n: int,
    num_sms: int = 132,
    ctas_per_sm: int = 1,
) -> int:
    """Split count so that the ``batch * head_tiles * splits`` programs fill the GPU in one go.

    ``slots = num_sms * ctas_per_sm`` programs run at once.  Returns the smallest S whose programs
    fill the slots at >= 90% wave efficiency (programs / (waves * slots)), else the most efficient
    S.  Fewer, longer splits are preferred among equals: each split costs a q load, a partial
    write and a share of the merge.  On the H200, H=128 measured fastest with one split at
    B*head_tiles = 128 programs (one per SM), and H=16 with ~2 programs per SM.  S is capped by the
    pages of the longest sequence the block table can hold (more splits than pages only add empty
    programs) and by ``MIN_TILES_PER_SPLIT`` tiles per split.

    Only split counts that leave no split empty at that longest sequence are candidates: the kernel gives each
    split ``ceil(tiles / S)`` tiles, so S = 15 over 16 tiles runs 8 splits of two tiles beside 7 empty programs
    whose partials the merge still reads.  On an H100 (``mla_decode_joint_sweep_h100.json``) that cost 21.8 against
    20.2 us at 16x1024 (S = 15 against 16) and 29.3 against 26.6 us at 1x32k (238 against 256).  Depends only on
    shapes, not on ``seq_lens`` values: no device sync, and CUDA-graph safe.
    """
    base = max(1, batch * head_tiles)
    slots = max(1, num_sms * max(1, ctas_per_sm))
    max_tiles = max(1, -(-max_pages * page_size // block_n))
    cap = max(1, min(max_pages, max_pages * page_size // (block_n * MIN_TILES_PER_SPLIT)))
    if base >= 0.9 * slots or cap == 1:
        return 1
    # S = ceil(tiles / k) for k tiles per split: every split of the longest sequence has work
    candidates = sorted(s for s in {-(-max_tiles // k) for k in range(1, max_tiles + 1)} if s <= cap)
    best, best_eff = 1, -1.0
    for s in candidates:
        progs = base * s
        eff = progs / (math.ceil(progs / slots) * slots)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


# ---- Launcher ----


def split_partials(out: torch.Tensor, num_splits: int, width: int):
    """``(o_part, lse, o_part strides, lse strides)`` a stage 1 of ``num_splits`` splits writes into: fp32
    ``[B, H, S, width]`` partials and ``[B, H, S]`` log-sum-exps, or, with one split (the kernel writes ``out``
    directly), ``out`` itself as unused pointer placeholders with zero strides.  Shared by every latent decode
    launcher (this one, ``mla_decode_split``, ``mla_decode_fp8``), as is :func:`merge_splits`."""
    if num_splits == 1:
        return out, out, (0, 0, 0), (0, 0)
    B, H = out.shape[0], out.shape[1]
    o_part = out.new_empty((B, H, num_splits, width), dtype=torch.float32)
    lse = out.new_empty((B, H, num_splits), dtype=torch.float32)
    return o_part, lse, o_part.stride()[:3], lse.stride()[:2]


def merge_splits(o_part, lse, out, width: int, num_splits: int, sp, sl, block_s: int, block_vc: int) -> None:
    """Stage 2: the splits' partials merged into ``out`` (nothing to do with one split).  Up to 128 splits are merged
    in one load round; the v chunk shrinks as splits grow so a program's tile stays <= 8K fp32 (64 registers/thread
    at 4 warps): ``_launch_plan``."""
    if num_splits == 1:
        return
    out_st = out.stride()
    _mla_decode_stage2[(cdiv(width, block_vc), out.shape[1], out.shape[0])](
        o_part, lse, out, width, num_splits, *sp, *sl, out_st[0], out_st[1],
        BLOCK_S=block_s, BLOCK_VC=block_vc, num_warps=4,
    )  # fmt: skip


def dot_mode(dtype: torch.dtype) -> tuple[str, bool]:
    """``(input_precision, upcast)`` of a launcher's ``tl.dot``s for q of ``dtype``.  Triton 3.9's interpreter
    computes bf16 ``tl.dot`` wrongly (garbage magnitudes), so under the interpreter bf16 operands are upcast to fp32
    after loading (p still rounded to bf16 first); compiled kernels never take this path."""
    upcast = dtype == torch.bfloat16 and triton_interpreting()
    return ("ieee" if (dtype == torch.float32 or upcast) else "tf32"), upcast


# What the last Triton launch used (stage-1 compiled kernel, split count, tiles): for benchmarks
# (registers / spills via ``LAST_LAUNCH["stage1"].n_regs``), never read by the kernels.
LAST_LAUNCH: dict = {}


@functools.lru_cache(maxsize=4096)  # pure function of ints, a dtype and a frozen config, asked on every eager call
def _launch_plan(B, H, v_dim, rope, page_size, max_pages, dtype, config, num_splits, dev, tiles=None, tma=False):
    """What one launch shape needs, computed once: ``(cfg, block_h, block_n, per_row, block_v, block_r, head_tiles,
    num_splits, block_s, block_vc)``; ``cfg`` is ``config``, else ``TMA_CONFIG`` where ``tma`` (the caller runs the
    TMA kernel: ``mla_decode_triton`` decides), else the tuned tiles of ``(H, v_dim, rope)`` on this GPU in table
    ``tiles`` (a path, ``decode_tiles``; None where H does not count heads), else the default for ``(H, dtype)``;
    ``dev`` the CUDA device index (None off CUDA), whose SM count sizes the split search when ``num_splits`` is
    None."""
    tuned = None
    if tma:  # (before the tuned tiles, which are the pointer kernel's)
        config = TMA_CONFIG
    if config is None and tiles is not None:
        tuned = decode_tiles.tuned_tiles(H, v_dim, rope, dtype, dev, tiles)
    cfg = config or (MLADecodeConfig(**tuned) if tuned else default_config(H, dtype))
    block_h = min(max(16, next_pow2(cfg.block_h)), max(16, next_pow2(H)))
    block_n, per_row = _tile_n(cfg.block_n, page_size)
    block_v = max(16, next_pow2(v_dim))
    block_r = max(16, next_pow2(rope)) if rope > 0 else 16
    head_tiles = cdiv(H, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(B, head_tiles, max_pages, page_size, block_n, _num_sms(dev), cfg.ctas_per_sm)
    num_splits = max(1, int(num_splits))
    # the merge (num_splits > 1): up to 128 splits in one load round, v chunks of <= 8K fp32 per program
    block_s = min(128, next_pow2(num_splits))
    block_vc = max(16, min(128, block_v, 8192 // block_s))
    return cfg, block_h, block_n, per_row, block_v, block_r, head_tiles, num_splits, block_s, block_vc


def launch_plan(q, v_dim, page_size, max_pages, config, num_splits, rope_apart: int = 0, rows=None, tma=False):
    """:func:`_launch_plan` for the absorbed query ``q [B, H, D]`` (every latent decode launcher plans here), or its
    latent part when the rope part (``rope_apart`` wide) is a tensor of its own; ``rows``: ``(programs along B, rows
    per program)`` when they are not ``(B, H)`` (``mla_decode_split``'s grouped tokens); ``tma``: the caller runs the
    TMA kernel (no ``config`` given, up to ``TMA_MAX_HEADS`` heads, ``mla_decode_tma.usable``)."""
    dev = cuda_index(q) if q.is_cuda else None  # the device whose tuned tiles apply and whose SMs size the splits
    B, H, D = q.shape
    B, H = (B, H) if rows is None else rows
    tiles = decode_tiles.table_path() if dev is not None and rows is None and config is None else None
    return _launch_plan(B, H, v_dim, D + rope_apart - v_dim, page_size, max_pages, q.dtype, config, num_splits, dev,
                        tiles, tma)


def _check_inputs(q, kv_pages, block_table, seq_lens, v_dim, q_rope=None):
    """``(q.shape, kv_pages.shape)`` after checking the operands' shapes (each shape read once); with ``q_rope``,
    ``q`` is the latent part and the shape the joined query's."""
    qs, ks = q.shape, kv_pages.shape
    if q_rope is not None:
        if q_rope.shape[:2] != qs[:2] or q_rope.dim() != 3 or q_rope.dtype != q.dtype or qs[-1] != v_dim:
            raise ValueError(f"q_rope {tuple(q_rope.shape)} does not go with a latent query {tuple(qs)}")
        qs = torch.Size((*qs[:2], v_dim + q_rope.shape[2]))
    if len(qs) != 3 or len(ks) != 3:
        raise ValueError(f"q must be [B, H, D] and kv_pages [P, page_size, D]; got {tuple(qs)}, {tuple(ks)}")
    if qs[2] != ks[2]:
        raise ValueError(f"q has D={qs[2]} but kv_pages rows are {ks[2]} wide")
    if not 0 < v_dim <= qs[2]:
        raise ValueError(f"v_dim={v_dim} must be in (0, D={qs[2]}]")
    bs = block_table.shape
    if len(bs) != 2 or bs[0] != qs[0] or seq_lens.shape != qs[:1]:
        raise ValueError("block_table must be [B, max_pages] and seq_lens [B]")
    return qs, ks


def mla_decode_triton(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    starts: torch.Tensor | None = None,
    q_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton path of :func:`mla_decode` (no dispatch).  ``config`` overrides the tile knobs."""
    (B, H, D), ks = _check_inputs(q, kv_pages, block_table, seq_lens, v_dim, q_rope)
    page_size = ks[1]
    rope = D - v_dim
    if q.stride(-1) != 1:
        q = q.contiguous()
    if q_rope is None:
        q_rope = q.narrow(-1, v_dim, rope)  # (a view: the joined query's rope columns)
    elif q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    if kv_pages.stride(-1) != 1:  # rare (would copy the whole cache); rows must be unit-stride
        kv_pages = kv_pages.contiguous()
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    if starts is not None:
        if starts.shape != (B,):
            raise ValueError(f"starts must be [B] = [{B}], got {tuple(starts.shape)}")
        if starts.dtype != torch.int32:
            starts = starts.to(torch.int32)
    if kv_pages.dtype != q.dtype:  # converting would silently copy the whole cache every call
        raise ValueError(f"q ({q.dtype}) and kv_pages ({kv_pages.dtype}) must have the same dtype")

    out = q.new_empty((B, H, v_dim))
    if B == 0 or H == 0:
        return out
    max_pages = block_table.shape[1]

    tma = config is None and H <= TMA_MAX_HEADS and mla_decode_tma.usable(
        q, kv_pages, v_dim, rope, page_size % TMA_CONFIG.block_n != 0)
    cfg, block_h, block_n, per_row, block_v, block_r, head_tiles, num_splits, block_s, block_vc = launch_plan(
        q, v_dim, page_size, max_pages, config, num_splits, D - q.shape[-1], tma=tma)
    direct = num_splits == 1
    o_part, lse, sp, sl = split_partials(out, num_splits, v_dim)
    dot_precision, dot_upcast = dot_mode(q.dtype)
    if tma:
        k1 = mla_decode_tma.launch_stage1(
            q, q_rope, kv_pages, block_table, seq_lens, starts, o_part, lse, out, float(scale) * _LOG2E, H, v_dim,
            rope, num_splits, sp, sl, page_size, block_h, block_n, head_tiles, cfg, dot_precision, dot_upcast)
    else:
        grid = (head_tiles, num_splits, B)
        q_st, qr_st, kv_st, out_st = q.stride(), q_rope.stride(), kv_pages.stride(), out.stride()  # (one call each)
        k1 = _mla_decode_stage1[grid](
            q, q_rope, kv_pages, block_table, seq_lens,
            starts if starts is not None else seq_lens,  # unused pointer without starts
            o_part, lse, out,
            float(scale) * _LOG2E, H, v_dim, rope, num_splits,
            q_st[0], q_st[1], qr_st[0], qr_st[1], kv_st[0], kv_st[1], block_table.stride(0),
            *sp, *sl, out_st[0], out_st[1],
            PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_R=block_r,
            HAS_ROPE=rope > 0, EVEN_V=block_v == v_dim, EVEN_R=block_r == rope, PER_ROW_PAGES=per_row,
            DIRECT_OUT=direct, DOT_PRECISION=dot_precision, DOT_UPCAST=dot_upcast, SWAP_AB=bool(cfg.swap_ab),
            HAS_STARTS=starts is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(stage1=k1, config=cfg, num_splits=num_splits, block_h=block_h, block_n=block_n,
                       per_row_pages=per_row)
    merge_splits(o_part, lse, out, v_dim, num_splits, sp, sl, block_s, block_vc)
    return out


# ---- Custom op + public entry point ----


@kernel_op("mla_decode")
def _mla_decode_op(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_dim: int,
    num_splits: int | None = None,
    starts: torch.Tensor | None = None,
    q_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(q):
        return mla_decode_triton(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits, starts=starts,
                                 q_rope=q_rope)
    if q_rope is not None:
        q = torch.cat([q, q_rope], dim=-1)
    if q.is_cpu:  # host reads are free there: each sequence's exact rows (paged_cpu)
        return mla_decode_cpu(q, kv_pages, block_table, seq_lens, scale, v_dim, starts)
    return mla_decode_ref(q, kv_pages, block_table, seq_lens, scale, v_dim, starts)


@_mla_decode_op.register_fake
def _mla_decode_fake(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None, starts=None, q_rope=None):
    return q.new_empty((q.shape[0], q.shape[1], v_dim))


def mla_decode(q, kv_pages, block_table, seq_lens, scale, v_dim, num_splits=None, starts=None,
               q_rope=None) -> torch.Tensor:
    """Absorbed MLA decode attention over a paged latent cache.

    Args:
        q: ``[B, H, D]`` absorbed query (``[q_nope @ W_UK | q_pe]``), bf16/fp16/fp32.
        kv_pages: ``[num_pages, page_size, D]`` latent cache, same dtype; row = ``[kv_c | k_pe]``.
        block_table: int32 ``[B, max_pages]`` page ids of each sequence in order; entries past the
            sequence's last page are never read.
        seq_lens: int32 ``[B]`` tokens per sequence (0 gives a zero output).
        scale: softmax scale.
        v_dim: value width (= kv_lora_rank), the first ``v_dim`` columns of each latent row.
        num_splits: KV splits per sequence (None: chosen from shapes and the SM count).
        starts: int32 ``[B]`` or None: sequence ``b`` attends only to tokens ``>= starts[b]`` (left padding).
        q_rope: ``[B, H, rope]`` or None: the query's rope part apart (``q`` then holds ``q_nope @ W_UK`` only,
            any strides): the kernel reads both, so no joined copy is made (one launch fewer per layer).

    Returns ``[B, H, v_dim]`` in q's dtype.  Backend choice: ``dispatch.use_triton(q)``; the torch backend runs
    ``paged_cpu.mla_decode_cpu`` on CPU tensors, the reference elsewhere.  Under
    torch.compile (and for tensor subclasses such as FakeTensor) the call goes through the
    ``mla_fuser::mla_decode`` custom op, so the compiled graph holds one opaque node; in eager mode
    the op's implementation is called directly to save the dispatcher's host overhead (``dispatch.KernelOp``).
    """
    return _mla_decode_op(q, kv_pages, block_table, seq_lens, float(scale), int(v_dim), num_splits, starts, q_rope)
