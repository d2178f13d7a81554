"""MoE routing in two launches: the router logits, then expert selection (scores, optional group limit, top-k and
the weight steps).

Why kernels: a replayed router is a row of small torch ops: the fp32 casts of the hidden states (and of a 16-bit
gate), ``F.linear`` (cuBLAS's fp32 GEMM plus its split-K reduction at decode sizes), ``softmax``/``sigmoid``, the
group mask, ``topk``, ``gather``, renormalisation, scaling: 6-13 launches per MoE layer.  A decode step is bound by
launches there, not bytes.  :func:`router_logits` computes a few rows' fp32 logits in one launch straight from the
16-bit hidden states and gate (one program per row and block of experts, so even one row spreads the gate over
many SMs), and hundreds of 16-bit rows (a continuous-batching or prefill step) in blocks of rows per program on
tensor cores, where cuBLAS's fp32 GEMM runs few, long programs; :func:`select_experts` does everything after the
logits in one program per row, in registers (``E <= MAX_EXPERTS``).

The math (all fp32, what DeepSeek-V2/V3 do; :func:`select_experts_ref` is the same in torch ops)::

    scores = softmax(logits) | sigmoid(logits)
    choice = scores (+ correction_bias)                   # the bias steers the choice only
    groups (n_group > 0): group score = max of the group's choice, or the sum of its top ``group_topn``;
        the ``topk_group`` best groups stay, other experts' choice becomes ``group_fill``
    ids = top_k(choice, after the group fill), in decreasing order
    weights = the chosen values | scores[ids] | choice[ids]  (``weights_from``)
    then: optional renorm (``w / (sum(w) + eps)``), up to two ``scale`` (``w * c``) / ``div`` (``w / c``) steps,
    a cast to ``out_dtype``.

Ties: the kernel's top-k is an iterative argmax, so among *exactly* equal values the lowest index wins (groups
too); ``torch.topk`` leaves the order of ties unspecified, so ids may differ from torch's there, and only there.
The kernel's softmax sums in another order than torch, so weights differ from the reference by a few fp32 ulps,
and a near-tie (within those ulps) can pick the other expert.  Ids come out sorted by decreasing choice (what
``topk(sorted=True)`` gives; the experts kernel does not care about order).  NaN scores give unspecified (but
in-range) ids.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import MAX_COMBINE, SUM_COMBINE, LazyJit, cdiv, next_pow2, tl, use_triton

__all__ = ["LOGITS_MAX_WEIGHT", "LOGITS_MAX_WORK", "MAX_EXPERTS", "MAX_TOP_K", "ROWS", "ROW_BLOCKS", "RouteParams",
           "logits_fit", "logits_path", "router_logits", "router_logits_ref", "router_logits_triton",
           "rows_per_program", "scores_and_choice", "select_experts", "select_experts_ref", "select_experts_triton"]

MAX_EXPERTS = 256  # the scores of one row stay in registers
MAX_TOP_K = 16
MAX_POST = 2  # scale / div steps after the renorm
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # loaded and widened to fp32 (exact)
# The per-row logits kernel re-reads the gate weight (from L2) for every row: it is for a decode step's few rows
# (many rows: the row-block kernel below, or cuBLAS; gates far larger than DeepSeek-V2's 160 x 5120: cuBLAS).  H200
# (benchmarks/results/router_logits.json, logits + selection against fp32 copies + cuBLAS + selection): the kernel
# wins up to about 2^24 row-times-gate elements (V2-Lite 64 x 2048: 128 rows; GLM-4.5-Air's 128 x 4096 and V2's
# 160 x 5120: 16 rows) and loses beyond; V3's fp32 256 x 7168 gate loses even at one row
LOGITS_MAX_WEIGHT = 1 << 20  # gate elements
LOGITS_MAX_WORK = 1 << 24  # rows x gate elements
# Beyond that, from ROW_BLOCK_MIN_ROWS rows of 16-bit values, a second kernel takes blocks of rows per program on
# tensor cores (every product exact: see _logits_rows_kernel).  cuBLAS's fp32 GEMM at those sizes runs few, long
# programs (a continuous-batching step's 256-2048 rows: 18-40 us on V2-Lite's gate).  H200, logits + selection,
# CUDA-graph replay from a cold L2 (router_row_blocks_tf32.json): V2-Lite 256 / 1024 / 2048 / 8192 rows 14.7 / 16.5 /
# 17.4 / 31.9 us against torch's 18.2 / 29.7 / 40.5 / 120; GLM-4.5-Air's gate 28.6 / 31.9 / 36.0 / 88.5 against
# 27.5 / 57.9 / 95.7 / 310 (at 128 rows torch's 23.7 beat its 28.3: hence the floor); V2's 33.1 / 38.6 / 45.9 /
# 136.5 against 36.8 / 80.8 / 134.1 / 502.6.  Rows per program (experts per program alike), the first that applies:
ROW_BLOCK_MIN_ROWS = 256
LOGITS_ROW_BLOCKS = ((4096, 64), (1024, 32), (0, 16))
ROW_BLOCK_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RouteParams:
    """The constants of one router (see the module docstring); hashable, built once per router.

    ``n_group=0``: no group limit; ``group_topn=0``: a group's score is its max.  ``post``: the ``("scale", c)``
    / ``("div", c)`` steps after the renorm, in order.
    """

    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 0
    topk_group: int = 0
    group_topn: int = 0
    group_fill: float = 0.0
    weights_from: str = "values"  # "values" | "scores" | "choice"
    renorm: bool = False
    renorm_eps: Optional[float] = None
    post: tuple = ()
    out_dtype: torch.dtype = torch.float32

    def fits(self, num_experts: int) -> bool:
        """Whether the kernel takes this router over ``num_experts`` experts (else: the torch path)."""
        if not (1 <= self.top_k <= min(MAX_TOP_K, num_experts) and num_experts <= MAX_EXPERTS):
            return False
        if self.scoring not in ("softmax", "sigmoid") or self.weights_from not in _WEIGHTS_FROM:
            return False
        if len(self.post) > MAX_POST or any(op not in _POST_OPS for op, _ in self.post):
            return False
        if self.n_group:
            size = num_experts // self.n_group
            return (num_experts % self.n_group == 0 and 1 <= self.topk_group <= self.n_group
                    and 0 <= self.group_topn <= size)
        return True


_WEIGHTS_FROM = {"values": 0, "scores": 1, "choice": 2}
_POST_OPS = {"scale": 1, "div": 2}


def scores_and_choice(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], p: RouteParams):
    """``(scores, choice)`` in fp32: the softmax or sigmoid of the logits, and those plus the correction bias (what
    the experts are chosen on; the scores themselves when there is no bias)."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if p.scoring == "softmax" else torch.sigmoid(logits)
    return scores, scores if correction_bias is None else scores + correction_bias.float()


def select_experts_ref(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], p: RouteParams):
    """Torch twin of the kernel: the module docstring's math in torch ops on ``logits [T, E]``; returns ``(weights
    [T, k] out_dtype, ids [T, k] int64)``, ids by decreasing choice (``torch.topk``'s order for ties)."""
    scores, choice = scores_and_choice(logits, correction_bias, p)
    selected = choice
    if p.n_group:
        grouped = choice.view(choice.shape[0], p.n_group, -1)
        if p.group_topn:
            group_scores = grouped.topk(p.group_topn, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, p.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        selected = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), p.group_fill)
    values, ids = torch.topk(selected, p.top_k, dim=-1, sorted=True)
    weights = values if p.weights_from == "values" else (scores if p.weights_from == "scores" else choice).gather(
        -1, ids)
    if p.renorm:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total if p.renorm_eps is None else total + p.renorm_eps)
    for op, c in p.post:
        weights = weights * c if op == "scale" else weights / c
    return weights.to(p.out_dtype), ids


@LazyJit
def _select_kernel(LOGITS, CB, OUT_W, OUT_ID, stride_l, E, group_size, n_group, fill, eps, c0, c1,
                   BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                   TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_CORR: tl.constexpr,
                   GROUPED: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOPN: tl.constexpr,
                   WEIGHTS_FROM: tl.constexpr, RENORM: tl.constexpr, HAS_EPS: tl.constexpr,
                   OP0: tl.constexpr, OP1: tl.constexpr):
    # One program per token row.  Minimum indices are taken as -max(-i) (only MAX/SUM combines are shared).
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    acc = tl.load(LOGITS + row * stride_l + e, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-acc))
    else:
        top = tl.reduce(tl.where(valid, acc, float("-inf")), 0, MAX_COMBINE)
        ex = tl.where(valid, tl.exp(acc - top), 0.0)
        scores = ex / tl.reduce(ex, 0, SUM_COMBINE)
    choice = scores
    if HAS_CORR:
        choice = scores + tl.load(CB + e, mask=valid, other=0.0).to(tl.float32)
    selected = choice
    if GROUPED:  # [BLOCK_G, BLOCK_E] membership matrix: group scores, the best groups, the experts they keep
        g = tl.arange(0, BLOCK_G)
        member = ((e[None, :] // group_size) == g[:, None]) & valid[None, :]
        vals = tl.where(member, choice[None, :], float("-inf"))
        if GROUP_TOPN == 0:
            gscore = tl.reduce(vals, 1, MAX_COMBINE)
        else:  # sum of the top-n: take the max, drop its first occurrence, repeat
            gscore = tl.full([BLOCK_G], 0.0, tl.float32)
            for _ in tl.static_range(GROUP_TOPN):
                best = tl.reduce(vals, 1, MAX_COMBINE)
                gscore += best
                first = -tl.reduce(tl.where(vals == best[:, None], -e[None, :], -BLOCK_E), 1, MAX_COMBINE)
                vals = tl.where(e[None, :] == first[:, None], float("-inf"), vals)
        kept = tl.full([BLOCK_G], 0, tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            cand = (g < n_group) & (kept == 0)
            best = tl.reduce(tl.where(cand, gscore, float("-inf")), 0, MAX_COMBINE)
            first = -tl.reduce(tl.where(cand & (gscore == best), -g, -BLOCK_G), 0, MAX_COMBINE)
            kept = tl.where(g == first, 1, kept)
        allowed = tl.reduce(tl.where(member & (kept[:, None] == 1), 1, 0), 0, MAX_COMBINE)
        selected = tl.where(allowed == 1, choice, fill)
    k = tl.arange(0, BLOCK_K)
    weights = tl.full([BLOCK_K], 0.0, tl.float32)
    ids = tl.full([BLOCK_K], 0, tl.int32)
    taken = tl.full([BLOCK_E], 0, tl.int32)
    for i in tl.static_range(TOP_K):  # iterative argmax: the lowest index wins among equal values
        cand = valid & (taken == 0)
        best = tl.reduce(tl.where(cand, selected, float("-inf")), 0, MAX_COMBINE)
        pick = -tl.reduce(tl.where(cand & (selected == best), -e, -BLOCK_E), 0, MAX_COMBINE)
        pick = tl.minimum(pick, E - 1)  # (no lane equals a NaN best: keep the id in range)
        hit = e == pick
        taken = tl.where(hit, 1, taken)
        if WEIGHTS_FROM == 0:
            w = best
        elif WEIGHTS_FROM == 1:
            w = tl.reduce(tl.where(hit, scores, float("-inf")), 0, MAX_COMBINE)
        else:
            w = tl.reduce(tl.where(hit, choice, float("-inf")), 0, MAX_COMBINE)
        weights = tl.where(k == i, w, weights)
        ids = tl.where(k == i, pick, ids)
    if RENORM:
        total = tl.reduce(weights, 0, SUM_COMBINE)  # lanes past TOP_K hold 0
        if HAS_EPS:
            total = total + eps
        weights = weights / total
    if OP0 == 1:
        weights = weights * c0
    elif OP0 == 2:
        weights = weights / c0
    if OP1 == 1:
        weights = weights * c1
    elif OP1 == 2:
        weights = weights / c1
    out = row * TOP_K + k
    tl.store(OUT_W + out, weights.to(OUT_W.dtype.element_ty), mask=k < TOP_K)
    tl.store(OUT_ID + out, ids.to(tl.int64), mask=k < TOP_K)


@functools.lru_cache(maxsize=64)  # (asked at every call)
def _tiles(num_experts: int, n_group: int, top_k: int) -> tuple[int, int, int, int]:
    block_e = next_pow2(num_experts)
    return block_e, next_pow2(max(n_group, 1)), next_pow2(top_k), 1 if block_e <= 64 else 2


def select_experts_triton(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], p: RouteParams):
    """Triton path of :func:`select_experts` (no dispatch); rows are made unit-stride if needed."""
    rows, num_experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out_w = logits.new_empty((rows, p.top_k), dtype=p.out_dtype)
    out_id = logits.new_empty((rows, p.top_k), dtype=torch.int64)
    if rows == 0:
        return out_w, out_id
    block_e, block_g, block_k, warps = _tiles(num_experts, p.n_group, p.top_k)
    ops = [_POST_OPS[op] for op, _ in p.post] + [0] * (MAX_POST - len(p.post))
    args = [float(c) for _, c in p.post] + [1.0] * (MAX_POST - len(p.post))
    _select_kernel[(rows,)](
        logits, correction_bias if correction_bias is not None else logits, out_w, out_id, logits.stride(0),
        num_experts, num_experts // max(p.n_group, 1), p.n_group, float(p.group_fill),
        float(p.renorm_eps) if p.renorm_eps is not None else 0.0, args[0], args[1],
        BLOCK_E=block_e, BLOCK_G=block_g, BLOCK_K=block_k, TOP_K=p.top_k,
        SIGMOID=p.scoring == "sigmoid", HAS_CORR=correction_bias is not None,
        GROUPED=p.n_group > 0, TOPK_GROUP=max(p.topk_group, 1), GROUP_TOPN=p.group_topn,
        WEIGHTS_FROM=_WEIGHTS_FROM[p.weights_from], RENORM=p.renorm, HAS_EPS=p.renorm_eps is not None,
        OP0=ops[0], OP1=ops[1], num_warps=warps,
    )
    return out_w, out_id


def select_experts(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], p: RouteParams):
    """Select ``p.top_k`` experts per row of ``logits [T, E]`` (fp32; ``correction_bias [E]`` or None) as ``p``
    says; returns ``(weights [T, k] p.out_dtype, ids [T, k] int64)``, ids by decreasing choice.

    The caller checks ``p.fits(E)``.  Backend: ``dispatch.use_triton(logits)``, else :func:`select_experts_ref`.
    No backward and no custom op: callers keep autograd and torch.compile on torch (``fusers.moe.router_binding``
    does)."""
    if use_triton(logits) and logits.dtype == torch.float32 and (
            correction_bias is None or correction_bias.dtype in INPUT_DTYPES):
        return select_experts_triton(logits, correction_bias, p)
    return select_experts_ref(logits, correction_bias, p)


# ---------------------------------------------------------------------------------------------------- the logits
ROWS, ROW_BLOCKS = "rows", "row_blocks"


def logits_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> str:
    """Which kernel :func:`router_logits` runs for ``x [T, H]`` over ``weight [E, H]``: ``ROWS`` (one program per row)
    up to ``LOGITS_MAX_WORK`` rows times gate elements, ``ROW_BLOCKS`` from ``ROW_BLOCK_MIN_ROWS`` rows of 16-bit
    values beyond that, "" (torch) otherwise; either kernel takes a gate of at most ``LOGITS_MAX_WEIGHT`` elements,
    16/32-bit floats on one device."""
    if not (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.numel() <= LOGITS_MAX_WEIGHT and x.dtype in INPUT_DTYPES and weight.dtype in INPUT_DTYPES
            and (bias is None or (bias.dtype in INPUT_DTYPES and bias.shape == weight.shape[:1]))
            and x.device == weight.device and use_triton(x, weight)):
        return ""
    if x.shape[0] * weight.numel() <= LOGITS_MAX_WORK:
        return ROWS
    if x.shape[0] >= ROW_BLOCK_MIN_ROWS and x.dtype in ROW_BLOCK_DTYPES and weight.dtype in ROW_BLOCK_DTYPES:
        return ROW_BLOCKS
    return ""


def logits_fit(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether :func:`router_logits` takes these rows and gate on a kernel (:func:`logits_path`)."""
    return bool(logits_path(x, weight, bias))


def row_block_rows(rows: int) -> int:
    """Rows per program of the row-block kernel for a call of ``rows`` rows (``LOGITS_ROW_BLOCKS``)."""
    return next(block_m for least, block_m in LOGITS_ROW_BLOCKS if rows >= least)


def rows_per_program(path: str, rows: int) -> int:
    """:func:`router_logits_triton`'s ``block_m`` for a call of ``rows`` rows that :func:`logits_path` sent down
    ``path`` (0: one row per program), for callers that already asked it."""
    return row_block_rows(rows) if path == ROW_BLOCKS else 0


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Torch twin of the logits kernel: ``F.linear`` of ``x`` and ``weight`` (and ``bias``) widened to fp32, what
    DeepSeek-V2/V3's routers compute; ``[T, E]`` fp32."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@LazyJit
def _logits_kernel(X, W, BIAS, OUT, stride_x, stride_w, H, E,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr):
    # One program per (row, block of experts): products summed per lane over the hidden chunks, then across lanes.
    row = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    valid = e < E
    acc = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xv = tl.load(X + row * stride_x + h, mask=hm, other=0.0).to(tl.float32)
        wv = tl.load(W + e[:, None].to(tl.int64) * stride_w + h[None, :], mask=valid[:, None] & hm[None, :],
                     other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    logits = tl.reduce(acc, 1, SUM_COMBINE)
    if HAS_BIAS:
        logits += tl.load(BIAS + e, mask=valid, other=0.0).to(tl.float32)
    tl.store(OUT + row * E + e, logits, mask=valid)


@LazyJit
def _logits_rows_kernel(X, W, BIAS, OUT, stride_x, stride_w, T, H, E,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr):
    # One program per (block of rows, block of experts): each gate tile read once per block of rows (not once per
    # row), on tensor cores.  16-bit values only: widened to fp32 they lose nothing to TF32, so every product is
    # exact and the sums are fp32, as F.linear's on fp32 copies (fp32 values would be rounded: they stay on torch)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok, e_ok = rows < T, e < E
    acc = tl.full([BLOCK_M, BLOCK_E], 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        xv = tl.load(X + rows[:, None].to(tl.int64) * stride_x + h[None, :], mask=row_ok[:, None] & hm[None, :],
                     other=0.0).to(tl.float32)
        wv = tl.load(W + e[:, None].to(tl.int64) * stride_w + h[None, :], mask=e_ok[:, None] & hm[None, :],
                     other=0.0).to(tl.float32)
        acc = tl.dot(xv, tl.trans(wv), acc, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(BIAS + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None].to(tl.int64) * E + e[None, :], acc, mask=row_ok[:, None] & e_ok[None, :])


# experts per program: one up to LOGITS_FEW_ROWS rows (every expert's row of the gate in its own program: the most
# loads in flight), eight above (fewer re-reads of each row's hidden states).  H200 sweep of 1, 2, 4 and 8
# (router_logits_block_e.json, logits + selection): V2-Lite's gate 4.7 / 5.1 / 6.1 / 4.9 us at one row, 8.2 / 7.5 /
# 9.2 / 7.4 at 64 rows
LOGITS_FEW_ROWS = 16


@functools.lru_cache(maxsize=64)  # (asked at every call)
def _logits_tiles(num_experts: int, hidden: int, block_e: int) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_H, num_warps)``: the whole hidden size in one pass up to 2048, ``block_e`` experts per
    program (fewer where the gate has fewer), 8 warps from a 16K-value tile."""
    block_h = min(next_pow2(hidden), 2048)
    block_e = min(block_e, next_pow2(num_experts))
    return block_e, block_h, 8 if block_e * block_h >= 16384 else 4


@functools.lru_cache(maxsize=64)
def _row_block_tiles(num_experts: int, hidden: int, block_m: int, block_e: int | None) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_H, num_warps)`` of the row-block kernel: as many experts per program as rows (16 at least: a
    ``tl.dot`` side; fewer where the gate has fewer), 64 hidden features per step, 4 warps."""
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"router logits: block_m must be a power of two >= 16, got {block_m}")
    block_e = max(16, min(block_e or block_m, next_pow2(num_experts)))
    return block_e, min(64, max(16, next_pow2(hidden))), 4


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         block_e: int | None = None, block_m: int | None = None) -> torch.Tensor:
    """Triton path of :func:`router_logits` (no dispatch); hidden and gate rows are made unit-stride if needed.
    ``block_e``: experts per program (a power of two; default: 1 up to ``LOGITS_FEW_ROWS`` rows, else 8);
    ``block_m``: rows per program (a power of two >= 16: the row-block kernel; default from ``LOGITS_ROW_BLOCKS``;
    0: one row per program)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows, hidden = x.shape
    num_experts = weight.shape[0]
    out = x.new_empty((rows, num_experts), dtype=torch.float32)
    if rows == 0:
        return out
    if block_m is None:
        block_m = rows_per_program(logits_path(x, weight, bias), rows)
    if block_m:
        if x.dtype not in ROW_BLOCK_DTYPES or weight.dtype not in ROW_BLOCK_DTYPES:
            raise ValueError(f"router logits: the row-block kernel takes 16-bit values, got {x.dtype} rows and a "
                             f"{weight.dtype} gate")
        block_e, block_h, warps = _row_block_tiles(num_experts, hidden, block_m, block_e)
        _logits_rows_kernel[(cdiv(rows, block_m), cdiv(num_experts, block_e))](
            x, weight, bias if bias is not None else weight, out, x.stride(0), weight.stride(0), rows, hidden,
            num_experts, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_H=block_h, HAS_BIAS=bias is not None,
            num_warps=warps,
        )
        return out
    if block_e is None:
        block_e = 1 if rows <= LOGITS_FEW_ROWS else 8
    block_e, block_h, warps = _logits_tiles(num_experts, hidden, block_e)
    _logits_kernel[(rows, cdiv(num_experts, block_e))](
        x, weight, bias if bias is not None else weight, out, x.stride(0), weight.stride(0), hidden, num_experts,
        BLOCK_E=block_e, BLOCK_H=block_h, HAS_BIAS=bias is not None, num_warps=warps,
    )
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The router logits ``x @ weight.T (+ bias)`` in fp32 for ``x [T, H]``, ``weight [E, H]``: on a kernel where
    :func:`logits_path` names one (one launch, no fp32 copies of the hidden states or the gate), else
    :func:`router_logits_ref`.  The kernels sum in another order than cuBLAS (a few fp32 ulps of the terms' total)
    and, for one tile (``block_e``, ``block_m``), a row's result does not depend on the rows beside it."""
    path = logits_path(x, weight, bias)
    if path:
        return router_logits_triton(x, weight, bias, block_m=rows_per_program(path, x.shape[0]))
    return router_logits_ref(x, weight, bias)
