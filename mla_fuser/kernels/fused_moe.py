"""Fused mixture-of-experts (MoE) experts compute, with a torch reference.

What is computed (the contract of Transformers' experts modules, e.g. ``DeepseekV2Experts``)::

    out[t] = sum_k  w[t, k] * ( down_w[e] @ ( act(gate) * up ) + down_bias[e] ),   e = topk_ids[t, k]
    gate, up = split(gate_up_w[e] @ x[t] + gate_up_bias[e])

``gate_up_w`` is ``[E, 2I, H]`` and ``down_w`` is ``[E, H, I]`` (Transformers' non-transposed layout).  The
gate/up rows are either concatenated (``[gate_0..gate_{I-1}, up_0..up_{I-1}]``, Transformers'
``is_concatenated=True``, the default) or interleaved (``[gate_0, up_0, gate_1, up_1, ...]``).  Routing ids
outside ``[0, E)`` (expert-parallel sentinels) contribute nothing.

Why a fused kernel: Transformers' ``grouped_mm`` path sorts, gathers the hidden states per pair, runs
two grouped GEMMs, applies the activation, scales, un-permutes and sums -- about a dozen launches and
several full passes over ``[T*K, 2I]``/``[T*K, H]`` tensors.  Here the gather of hidden rows, the
activation (``act(gate) * up``), biases and the routing weight live in the GEMM prologue/epilogue, so the
only extra traffic is the ``[T*K, I]`` intermediate and one ``[T*K, H]`` per-pair output.

Two Triton paths, chosen by token count (``path="auto"``):

* **small batch / decode** (``T <= SMALL_BATCH_MAX_TOKENS``, default 16): a weight-streaming GEMV.  The
  cost here is reading the experts' weights (one DeepSeek-V2-Lite expert is 17 MB in bf16; a token reads six).
  A "one program per (token, k) pair" GEMV would read an expert's weights once per pair that picked it:
  at 16 tokens that is ~2x the bytes of the distinct experts, at 64 tokens ~6x.  So instead one program
  owns one (expert, N-tile): it scans the (at most a few hundred) routing ids, compacts the pairs that chose
  its expert into rows of a tile in registers (a one-hot rank match, no sort, no padding buffer, no
  extra launch), and streams that expert's weight tile exactly once for all of them.  Programs of
  experts nobody picked exit after reading the ids.  This needs no host synchronisation and no
  preparation launch, so it is CUDA-graph friendly and costs 3 launches (GEMM1, GEMM2, combine) -- or 2
  up to ``GEMV_DOWN_MAX_TOKENS`` (4) tokens, where GEMM2 and the K-sum become one per-token GEMV (tokens
  rarely share experts there, so reading down weights per token costs nothing extra).  Why the small path
  at all: measured on an H200, one DeepSeek-V2-Lite layer at 1 token takes ~0.047 ms of GPU time but
  eager calls are host-bound (tens of us per launch/op on that host), so launches are what it saves
  (0.071 ms eager vs 0.148 for the aligned path at 1 token; equal at 16 tokens, hence the threshold).
  Under CUDA-graph capture, where launches are free, "auto" uses the aligned path above 4 tokens.
* **aligned / prefill**: the classic grouped GEMM.  ``align_tokens_to_experts`` (one Triton launch, no
  sort) lists the (token, k) pairs grouped by expert, each expert's group padded to a multiple of
  ``BLOCK_M`` so every ``BLOCK_M`` tile belongs to one expert; GEMM1 then runs one program per
  (tile, N-tile) with ``act(gate) * up`` fused, GEMM2 multiplies by ``down_w`` and the routing weight,
  and a tiny kernel sums the ``K`` pair outputs per token in fp32 (deterministic, unlike atomics).
  Tiles are visited in ``GROUP_M`` super-rows so neighbouring programs share weight tiles in L2.

All matmuls accumulate in fp32.  Precision contract: the intermediate ``act(gate) * up`` and each pair's
output are rounded to the weight dtype (tensor-core inputs/outputs; the decode GEMV keeps pair outputs in
fp32), the K-sum is done in fp32, the result is returned in ``hidden``'s dtype.  fp32 inputs use IEEE fp32 dot products (no TF32).

Public API: :func:`fused_experts` (a ``torch.library`` custom op ``mla_fuser::fused_experts`` with a fake
impl, Triton or torch chosen by :func:`mla_fuser.kernels.dispatch.use_triton`), :func:`fused_experts_ref`,
:func:`align_tokens_to_experts` / :func:`align_tokens_to_experts_ref` and the router reference
:func:`route_topk_ref` (there is no Triton router: routing is a few small torch ops).

Triton note (interpreter, checked on Triton 3.9): ``triton.jit`` decides interpreter vs compiler when it
*wraps* a function (reading ``TRITON_INTERPRET`` through ``triton.knobs``), and Triton's own helpers
``tl.sum``/``tl.cumsum``/``tl.cdiv``/``tl.zeros`` are wrapped when ``triton`` is imported -- compiled ones
raise "Cannot call @triton.jit'd outside of the scope of a kernel" inside an interpreted kernel.  So the
kernels here are wrapped lazily at their first launch, once per mode (:class:`_LazyJit`), and use only
builtins plus ``tl.reduce``/``tl.associative_scan`` with Triton's standard sum combine function (which the
interpreter recognises by identity and runs in numpy).  Setting ``TRITON_INTERPRET=1`` before the first
call is then enough, whatever was imported before.  Interpreter-only deviations: its ``tl.dot`` multiplies
bf16 bit patterns as integers, so bf16 operands are upcast to fp32 there (``UPCAST``, off when compiled),
and its fp32->bf16 conversions truncate instead of rounding to nearest (tests allow for it).
"""

import functools
import json
import types
from typing import Optional

import torch

from .. import envs
from .dispatch import LazyJit, on_tensor_device, triton_available, triton_interpreting, use_triton

if triton_available():
    import triton
    import triton.language as tl
    # Triton's own sum combine function: used through tl.reduce / tl.associative_scan instead of the
    # tl.sum / tl.cumsum wrappers (see the module docstring).
    _SUM = tl.standard._sum_combine
else:  # pragma: no cover - depends on the installation
    # Only the kernels' `tl.constexpr` annotations are evaluated without Triton; nothing launches.
    triton = None
    tl = types.SimpleNamespace(constexpr=None)
    _SUM = None


_LazyJit = LazyJit  # see dispatch.LazyJit


__all__ = [
    "SMALL_BATCH_MAX_TOKENS",
    "align_tokens_to_experts",
    "align_tokens_to_experts_ref",
    "fused_experts",
    "fused_experts_ref",
    "fused_experts_triton",
    "get_moe_config",
    "route_topk_ref",
]

# Up to this many tokens the decode (small-batch) path runs; env override MLA_FUSER_MOE_SMALL_BATCH_TOKENS (read per
# call).  H200, DeepSeek-V2-Lite layer, eager: small vs aligned = 0.071 vs 0.148 ms at 1 token, 0.112 vs 0.181 at 4,
# 0.230 vs 0.225 at 16, 0.301 vs 0.285 at 64 -- the launches the small path saves stop mattering around 16 tokens.
SMALL_BATCH_MAX_TOKENS = 16
# Every small-batch program scans all routing ids (twice); past this many (token, k) pairs "auto" prefers the
# aligned path even under a raised token threshold.
SMALL_BATCH_MAX_PAIRS = 1024
# Up to this many tokens the small path fuses the down projection with the K-sum: one program per
# (token, H-tile) streams the down rows of the token's K experts (a GEMV; no per-pair output, no combine
# launch).  It reads an expert's down weights once per token that picked it, so it only pays while
# tokens rarely share experts: decode of a few sequences.  Env override: MLA_FUSER_MOE_GEMV_TOKENS.
GEMV_DOWN_MAX_TOKENS = 4

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "gelu_tanh": 2, "relu": 3}


def _small_batch_max_tokens() -> int:
    return envs.moe_small_batch_tokens(SMALL_BATCH_MAX_TOKENS)


def _gemv_down_max_tokens() -> int:
    return envs.moe_gemv_tokens(GEMV_DOWN_MAX_TOKENS)


def _activation_code(activation: str) -> int:
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"activation {activation!r} is not one of {sorted(_ACTIVATIONS)}") from None


def _apply_activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    code = _activation_code(activation)
    if code == 0:
        return torch.nn.functional.silu(x)
    if code == 1:
        return torch.nn.functional.gelu(x)
    if code == 2:
        return torch.nn.functional.gelu(x, approximate="tanh")
    return torch.relu(x)


def _check_shapes(hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias):
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    num_tokens, hidden_size = hidden.shape
    if gate_up_w.dim() != 3 or gate_up_w.shape[2] != hidden_size or gate_up_w.shape[1] % 2:
        raise ValueError(f"gate_up_w must be [E, 2I, H={hidden_size}], got {tuple(gate_up_w.shape)}")
    num_experts, two_inter, _ = gate_up_w.shape
    inter = two_inter // 2
    if tuple(down_w.shape) != (num_experts, hidden_size, inter):
        raise ValueError(f"down_w must be [E, H, I]={(num_experts, hidden_size, inter)}, got {tuple(down_w.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [T={num_tokens}, K], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (num_experts, two_inter):
        raise ValueError(f"gate_up_bias must be [E, 2I], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (num_experts, hidden_size):
        raise ValueError(f"down_bias must be [E, H], got {tuple(down_bias.shape)}")
    if down_w.dtype != gate_up_w.dtype:
        raise TypeError(f"gate_up_w ({gate_up_w.dtype}) and down_w ({down_w.dtype}) must share a dtype")
    return num_tokens, hidden_size, num_experts, inter, topk_ids.shape[1]


# ----------------------------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------------------------


def fused_experts_ref(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """Reference MoE experts forward in fp32 (also the CPU fallback of :func:`fused_experts`).

    One pass per expert that was picked (like Transformers' eager loop) so it stays usable on real
    shapes.  It mirrors the Triton kernels' single deliberate rounding point: ``act(gate) * up`` is
    rounded to the weights' dtype before the down projection, because the down GEMM consumes it on
    tensor cores in that dtype (Transformers' own paths round there too).  Everything else is fp32.
    """
    num_tokens, hidden_size, num_experts, inter, topk = _check_shapes(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias
    )
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0 or topk == 0:
        return out.to(hidden.dtype)
    x = hidden.to(gate_up_w.dtype).float()
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    for e in torch.unique(flat_ids[valid]).tolist():
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        tokens = pairs // topk
        gate_up = x[tokens] @ gate_up_w[e].float().t()
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e].float()
        if interleaved:
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        h = (_apply_activation_ref(gate, activation) * up).to(down_w.dtype).float()
        y = h @ down_w[e].float().t()
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tokens, y * flat_w[pairs, None])
    return out.to(hidden.dtype)


def _max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length, known on the host without looking at the ids (no sync):
    at most ``min(E, pairs)`` experts are non-empty and each adds fewer than ``block_m`` padding slots."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton_cdiv(bound, block_m) * block_m


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_tokens_to_experts_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Torch reference of :func:`align_tokens_to_experts` (same outputs, bit for bit).

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_pad)``:

    * ``sorted_token_ids`` int32 ``[max_padded]``: flat pair indices ``t * K + k`` grouped by expert
      (ascending pair index inside a group), each group padded to a multiple of ``block_m`` with the
      sentinel ``T * K``; slots past ``num_tokens_post_pad`` also hold the sentinel.
      ``max_padded = roundup(T*K + min(E, T*K) * (block_m - 1), block_m)`` so it needs no sync.
    * ``expert_ids`` int32 ``[max_padded // block_m]``: the expert of each ``block_m`` block, ``-1`` for
      blocks past ``num_tokens_post_pad``.
    * ``num_tokens_post_pad`` int32 ``[1]`` (a tensor, to stay on the device).

    Ids outside ``[0, E)`` are dropped (expert-parallel sentinels).
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    max_padded = _max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid -> extra bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = torch.cat([pad_end.new_zeros(1), pad_end[:-1]])
    raw_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - raw_start[sorted_key]
    # Invalid pairs are sent to one trash slot past the end.
    dest_start = torch.cat([pad_start, pad_start.new_full((1,), max_padded)])
    dest = torch.where(sorted_key < num_experts, dest_start[sorted_key] + rank, dest_start[-1])
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:max_padded].clone()
    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_post = (pad_end[-1:] if num_experts > 0 else pad_end.new_zeros(1)).to(torch.int32)
    return sorted_ids, expert_ids, num_post


def route_topk_ref(
    logits: torch.Tensor,
    k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    scaling: float = 1.0,
    correction_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_scoring: str = "auto",
):
    """Torch reference of the common MoE routers; returns ``(weights fp32 [T, k], ids int64 [T, k])``.

    * Mixtral / Qwen-MoE: ``scoring="softmax", renormalize=True``.
    * DeepSeek-V2 ``greedy``: ``scoring="softmax"``, ``scaling=routed_scaling_factor``;
      ``group_limited_greedy``: additionally ``n_group``/``topk_group`` (group score = max of the group).
    * DeepSeek-V3: ``scoring="sigmoid"``, ``correction_bias=e_score_correction_bias``, ``n_group``,
      ``topk_group``, ``renormalize=norm_topk_prob``, ``scaling``.  The bias only steers *selection*
      (group scores and top-k); the returned weights come from the unbiased sigmoid scores; the group
      score is the sum of the group's top-2 biased scores.

    ``group_scoring``: ``"max"``, ``"top2_sum"`` or ``"auto"`` (top2_sum when a correction bias is given,
    as DeepSeek-V3, else max, as DeepSeek-V2).  Scores are computed in fp32.  Ties are broken by
    ``torch.topk``; ids come out sorted by decreasing selection score.
    """
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    num_experts = scores.shape[-1]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        if group_scoring == "auto":
            group_scoring = "top2_sum" if correction_bias is not None else "max"
        grouped = choice.view(-1, n_group, num_experts // n_group)
        if group_scoring == "max":
            group_scores = grouped.max(dim=-1).values
        elif group_scoring == "top2_sum":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            raise ValueError(f"group_scoring must be 'auto', 'max' or 'top2_sum', got {group_scoring!r}")
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------


@_LazyJit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_post_ptr,
    NP,
    E,
    MAX_PADDED,
    NUM_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per expert; no sort.  Every program histograms all ids (cheap: a few hundred KB
    from L2 at most) to learn where its padded group starts, then writes its pairs in ascending order
    (rank = running count + in-chunk prefix sum), its padding, and its blocks' expert id.  Program 0
    also writes the total and marks the unused tail.  One launch, deterministic."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_POW2)
    counts = tl.full([E_POW2], 0, tl.int32)
    for start in range(0, NP, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < NP, other=-1).to(tl.int32)
        valid = (offs < NP) & (ids >= 0) & (ids < E)
        # invalid ids and the chunk's tail go to the spare bin E (E_POW2 > E), ignored below; no `mask=`
        # argument so older Triton releases (no masked histogram) compile this too
        counts += tl.histogram(tl.where(valid, ids, E), E_POW2)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    my_start = tl.reduce(tl.where(bins < e, padded, 0), 0, _SUM)
    my_count = tl.reduce(tl.where(bins == e, counts, 0), 0, _SUM)
    my_padded = tl.reduce(tl.where(bins == e, padded, 0), 0, _SUM)
    cursor = my_start
    for start in range(0, NP, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < NP, other=-1).to(tl.int32)
        hit = ((offs < NP) & (ids == e)).to(tl.int32)
        rank = tl.associative_scan(hit, 0, _SUM) - 1
        tl.store(sorted_ptr + cursor + rank, offs, mask=hit > 0)
        cursor += tl.reduce(hit, 0, _SUM)
    pad = my_count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + my_start + pad, tl.full([BLOCK_M], 0, tl.int32) + NP, mask=pad < my_padded)
    first_block = my_start // BLOCK_M
    n_blocks = my_padded // BLOCK_M
    for b in range(0, n_blocks, CHUNK):
        bo = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + first_block + bo, tl.full([CHUNK], 0, tl.int32) + e, mask=bo < n_blocks)
    if e == 0:
        total = tl.reduce(padded, 0, _SUM)
        tl.store(num_post_ptr, total)
        for b in range(total // BLOCK_M, NUM_BLOCKS, CHUNK):
            bo = b + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + bo, tl.full([CHUNK], -1, tl.int32), mask=bo < NUM_BLOCKS)
        for s in range(total, MAX_PADDED, CHUNK):
            so = s + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + so, tl.full([CHUNK], 0, tl.int32) + NP, mask=so < MAX_PADDED)


@_LazyJit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    ids_ptr,
    rw_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_post_ptr,
    NP,
    N,
    K,
    NUM_M_BLOCKS,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,
    ALIGNED: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTING: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    SCAN_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Expert-grouped GEMM ``C[pair, n] = epilogue(A[pair // A_ROW_DIV, :] @ W[e, n, :])``.

    GEMM1 (``GATED``): A = hidden (row = pair // K), W = gate_up_w; two accumulators (gate and up rows
    of the same N-tile) so ``act(gate) * up`` is formed in registers and only ``[pairs, I]`` is written.
    GEMM2: A = the intermediate (row = pair), W = down_w, routing weight multiplied in the epilogue.
    Rows are written at their pair index (not their padded position), so no padded buffers exist.

    ``ALIGNED``: grid = (tiles of the padded pair list) x (N-tiles), in GROUP_M super-rows.
    otherwise (small batch): grid = (E, N-tiles); the program compacts the pairs of its expert from the
    ids (one-hot rank match) and loops over them BLOCK_M at a time (one chunk in the common case, so each
    weight tile is read from HBM once for every token that picked the expert).
    """
    if ALIGNED:
        pid = tl.program_id(0)
        num_n = (N + BLOCK_N - 1) // BLOCK_N
        per_group = GROUP_M * num_n
        group = pid // per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(NUM_M_BLOCKS - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m)
        n_chunks = 1
    else:
        e = tl.program_id(0)
        pid_n = tl.program_id(1)
        cnt = tl.program_id(0) * 0  # int32 scalar 0
        for s0 in range(0, NP, SCAN_P):
            q = s0 + tl.arange(0, SCAN_P)
            ids = tl.load(ids_ptr + q, mask=q < NP, other=-1).to(tl.int32)
            cnt += tl.reduce((ids == e).to(tl.int32), 0, _SUM)
        if cnt == 0:
            return
        n_chunks = (cnt + BLOCK_M - 1) // BLOCK_M

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if GATED:
        if INTERLEAVED:
            g_rows = 2 * offs_n
            u_rows = 2 * offs_n + 1
        else:
            g_rows = offs_n
            u_rows = offs_n + N
    else:
        g_rows = offs_n
        u_rows = offs_n
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we

    for c in range(0, n_chunks):
        if ALIGNED:
            rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            row_ok = rows < NP
        else:
            # Rows of this chunk = the pairs whose rank among this expert's pairs is in [c*BM, (c+1)*BM):
            # a one-hot match of ranks against slots, SCAN_P ids at a time (the ids are tiny and hit L1/L2),
            # which keeps the [BLOCK_M, SCAN_P] temporaries small (registers) whatever the batch size.
            j = c * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = tl.full([BLOCK_M], 0, tl.int32)
            seen = cnt * 0
            for s0 in range(0, NP, SCAN_P):
                q = s0 + tl.arange(0, SCAN_P)
                ids = tl.load(ids_ptr + q, mask=q < NP, other=-1).to(tl.int32)
                hit = (ids == e).to(tl.int32)
                rank = seen + tl.associative_scan(hit, 0, _SUM) - 1
                sel = (rank[None, :] == j[:, None]) & (hit[None, :] > 0)
                rows += tl.reduce(tl.where(sel, q[None, :], 0), 1, _SUM)
                seen += tl.reduce(hit, 0, _SUM)
            row_ok = j < cnt
        a_rows = (rows // A_ROW_DIV).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        wg_ptrs = w_base + g_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = w_base + u_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, wg, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wg, acc)
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    wu = wu.to(tl.float32)
                if IEEE:
                    acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
                else:
                    acc_u = tl.dot(a, wu, acc_u)
            a_ptrs += BLOCK_K * stride_ak
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk

        if HAS_BIAS:
            b_base = bias_ptr + e.to(tl.int64) * stride_be
            acc += tl.load(b_base + g_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_base + u_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            if ACT == 0:
                acc = acc / (1.0 + tl.exp(-acc))
            elif ACT == 1:
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            elif ACT == 2:
                inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))  # 0.5 * (1 + tanh(inner)) * acc
            else:
                acc = tl.maximum(acc, 0.0)
            acc = acc * acc_u
        if MUL_ROUTING:
            rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@_LazyJit
def _moe_combine_kernel(
    src_ptr,
    ids_ptr,
    out_ptr,
    H,
    E,
    stride_sp,
    stride_sh,
    stride_ot,
    stride_oh,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k src[t*K + k] in fp32, skipping pairs whose id is outside [0, E) (their rows were
    never written).  Deterministic replacement for atomics / index_add."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.full([BLOCK_H], 0.0, tl.float32)
    for k in tl.static_range(TOPK):
        pair = t * TOPK + k
        eid = tl.load(ids_ptr + pair)
        limit = tl.where((eid >= 0) & (eid < E), H, 0)  # scalar; invalid pair -> nothing loaded
        v = tl.load(src_ptr + pair.to(tl.int64) * stride_sp + offs * stride_sh, mask=offs < limit, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


@_LazyJit
def _moe_down_gemv_kernel(
    h_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    rw_ptr,
    N,
    K,
    E,
    stride_hp,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_ot,
    stride_on,
    TOPK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Decode-size GEMM2 + combine: ``out[t, n] = sum_k w[t,k] * (down_w[e_k, n, :] . h[t*K+k, :] + b[e_k, n])``.

    One program per (token, N-tile).  The K experts are unrolled inside each step over I, so K
    independent weight-tile loads are in flight at once (bandwidth), and the routing weight is folded
    into h, so one [BLOCK_N, BLOCK_K] fp32 accumulator serves all K experts and is reduced once at the end.
    Deterministic (no atomics).  Pairs with an id outside [0, E) load nothing."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        for j in tl.static_range(TOPK):
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair)
            limit = tl.where((e >= 0) & (e < E), K, 0)  # scalar: K for a valid expert, 0 masks everything
            e_safe = tl.where(limit > 0, e, 0).to(tl.int64)
            wgt = tl.load(rw_ptr + pair).to(tl.float32)
            h = tl.load(h_ptr + pair.to(tl.int64) * stride_hp + kk * stride_hk, mask=kk < limit, other=0.0)
            w = tl.load(
                w_ptr + e_safe * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk,
                mask=n_ok[:, None] & (kk[None, :] < limit),
                other=0.0,
            )
            acc += w.to(tl.float32) * (h.to(tl.float32) * wgt)[None, :]
    out = tl.reduce(acc, 1, _SUM)
    if HAS_BIAS:
        for j in tl.static_range(TOPK):
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair)
            limit = tl.where((e >= 0) & (e < E), N, 0)
            e_safe = tl.where(limit > 0, e, 0).to(tl.int64)
            wgt = tl.load(rw_ptr + pair).to(tl.float32)
            b = tl.load(bias_ptr + e_safe * stride_be + offs_n * stride_bn, mask=offs_n < limit, other=0.0)
            out += wgt * b.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n * stride_on, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# ----------------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------------


def _default_config(path: str, num_tokens: int, topk: int, num_experts: int) -> dict:
    """Starting points for H100/H200-class GPUs (bf16); ``benchmarks/bench_fused_moe.py --sweep``
    measures better ones, loadable through ``MLA_FUSER_MOE_CONFIGS``.

    small: memory bound, one tile of 16 rows (minimum tl.dot M) per expert; narrow N-tiles give enough
    programs to keep all SMs streaming when only 6 experts are live (1 token: 6 x 44 GEMM1 programs);
    4 stages keep bytes in flight, and the modest tile leaves room for several programs per SM.
    aligned: BLOCK_M follows the average number of pairs per expert so an expert's weights are read by
    as few tiles as possible while not padding too much.
    """
    if path == "small":
        # sm_90 build of these: GEMM1 140 registers / 60 KB smem, GEMM2 108 / 36 KB, no spills.
        g1 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        # GEMV down+combine (T <= GEMV_DOWN_MAX_TOKENS): 8 rows x 512 per expert tile, 6 tiles in flight per
        # step; H/8 = 256 programs for one token (two per SM).
        gv = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)
        return {"gemm1": g1, "gemm2": g2, "gemv2": gv}
    avg = num_tokens * topk / max(1, num_experts)
    if avg <= 16:
        g = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif avg <= 32:
        g = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
    elif avg <= 96:
        g = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif avg > 256:
        # prefill-sized (compute-bound); the best of a sweep on an H200 at 8192 tokens (avg 768 pairs per
        # expert, benchmarks/results/fused_moe_sweep_prefill.json): 2.07 ms vs 2.16 with the tile below
        return {"gemm1": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4),
                "gemm2": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)}
    else:
        g = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    g1 = dict(g)
    if g["BLOCK_M"] == 128:  # GEMM1 carries two accumulators; keep its register footprint like GEMM2's
        g1["BLOCK_N"] = 64
        g1["num_warps"] = 4
    return {"gemm1": g1, "gemm2": dict(g)}


@functools.lru_cache(maxsize=4)
def _load_tuned(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def get_moe_config(path: str, num_tokens: int, topk: int, num_experts: int) -> dict:
    """Config for one call: tuned (JSON at ``$MLA_FUSER_MOE_CONFIGS``, the ``best_configs`` format written
    by the benchmark: ``{path: {"<max_tokens>": {"gemm1": {...}, "gemm2": {...}}}}``, the smallest bucket
    >= num_tokens wins, and the aligned path's gemm1/gemm2 must share ``BLOCK_M``) or the defaults."""
    tuned_file = envs.moe_configs_path()
    if tuned_file:
        table = _load_tuned(tuned_file).get(path, {})
        buckets = sorted(int(b) for b in table)
        for b in buckets:
            if b >= num_tokens:
                return table[str(b)]
        if buckets:
            return table[str(buckets[-1])]
    return _default_config(path, num_tokens, topk, num_experts)


# ----------------------------------------------------------------------------------------------------------------------
# Triton launchers
# ----------------------------------------------------------------------------------------------------------------------


def align_tokens_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the flat (token, k) pairs by expert, padding each group to a multiple of ``block_m``.

    Output format: see :func:`align_tokens_to_experts_ref`.  Triton (one launch, no sort, no host sync)
    when :func:`use_triton` says so, otherwise the torch reference.
    """
    if not use_triton(topk_ids):
        return align_tokens_to_experts_ref(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_padded = _max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    num_post = torch.zeros(1, dtype=torch.int32, device=flat.device)
    if num_experts == 0 or num_pairs == 0:
        sorted_ids.fill_(num_pairs)
        expert_ids.fill_(-1)
        return sorted_ids, expert_ids, num_post
    chunk = min(1024, max(16, _next_pow2(num_pairs)))
    _moe_align_kernel[(num_experts,)](
        flat,
        sorted_ids,
        expert_ids,
        num_post,
        num_pairs,
        num_experts,
        max_padded,
        num_blocks,
        BLOCK_M=block_m,
        E_POW2=_next_pow2(num_experts + 1),
        CHUNK=chunk,
        num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


def _launch_gemm(
    *,
    a,
    w,
    bias,
    c,
    flat_ids,
    routing,
    align,
    num_pairs,
    n_out,
    k_dim,
    a_row_div,
    gated,
    interleaved,
    act,
    cfg,
    num_experts,
    warmup=False,
):
    """Launch one expert-grouped GEMM (GEMM1 if ``gated`` else GEMM2); ``align`` None = small path.
    ``warmup=True`` only compiles (the benchmark's sweep compiles its configs in parallel threads)."""
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dummy = c  # never read when the matching constexpr flag is off
    if align is None:
        grid = (num_experts, triton_cdiv(n_out, block_n))
        sorted_ids = expert_ids = num_post = dummy
        num_m_blocks = 0
    else:
        sorted_ids, expert_ids, num_post = align
        num_m_blocks = expert_ids.numel()
        grid = (num_m_blocks * triton_cdiv(n_out, block_n),)
    kernel = _moe_gemm_kernel.get()
    launch = functools.partial(kernel.warmup, grid=grid) if warmup else on_tensor_device(kernel[grid])
    launch(
        a,
        w,
        bias if bias is not None else dummy,
        c,
        flat_ids,
        routing if routing is not None else dummy,
        sorted_ids,
        expert_ids,
        num_post,
        num_pairs,
        n_out,
        k_dim,
        num_m_blocks,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0,
        c.stride(0),
        c.stride(1),
        A_ROW_DIV=a_row_div,
        ALIGNED=align is not None,
        GATED=gated,
        INTERLEAVED=interleaved,
        HAS_BIAS=bias is not None,
        MUL_ROUTING=routing is not None,
        ACT=act,
        IEEE=w.dtype == torch.float32,
        UPCAST=w.dtype == torch.bfloat16 and not w.is_cuda and triton_interpreting(),
        SCAN_P=cfg.get("SCAN_P", min(512, max(16, _next_pow2(num_pairs)))),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg.get("GROUP_M", 1),
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )


def _launch_down_gemv(inter_buf, down_w, down_bias, out, flat_ids, routing, topk, num_experts, cfg, warmup=False):
    """Launch the small path's GEMM2 + K-sum GEMV (``_moe_down_gemv_kernel``) into ``out [T, H]``."""
    num_tokens, hidden_size = out.shape
    grid = (num_tokens, triton_cdiv(hidden_size, cfg["BLOCK_N"]))
    kernel = _moe_down_gemv_kernel.get()
    launch = functools.partial(kernel.warmup, grid=grid) if warmup else on_tensor_device(kernel[grid])
    has_bias = down_bias is not None
    launch(
        inter_buf, down_w, down_bias if has_bias else out, out, flat_ids, routing,
        hidden_size, inter_buf.shape[1], num_experts,
        inter_buf.stride(0), inter_buf.stride(1), down_w.stride(0), down_w.stride(1), down_w.stride(2),
        down_bias.stride(0) if has_bias else 0, down_bias.stride(1) if has_bias else 0,
        out.stride(0), out.stride(1),
        TOPK=topk, HAS_BIAS=has_bias, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def _choose_path(path: str, num_tokens: int, num_pairs: int) -> str:
    """"auto": the small path (no alignment launch, GEMV down+combine up to ``GEMV_DOWN_MAX_TOKENS``) up to
    ``SMALL_BATCH_MAX_TOKENS`` tokens, the aligned grouped GEMM above.  The choice depends on shapes only, never
    on whether a CUDA graph is being captured: a captured step must use the kernels its eager warm-up compiled
    (at 16 tokens, where the two meet, an H200 measured 0.230 vs 0.225 ms eager)."""
    if path == "auto":
        small = num_tokens <= _small_batch_max_tokens() and num_pairs <= SMALL_BATCH_MAX_PAIRS
        return "small" if small else "aligned"
    if path not in ("small", "aligned"):
        raise ValueError(f"path must be 'auto', 'small' or 'aligned', got {path!r}")
    return path


def fused_experts_triton(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    activation: str = "silu",
    path: str = "auto",
    config: Optional[dict] = None,
) -> torch.Tensor:
    """The Triton implementation (no dispatch); ``path`` in {"auto", "small", "aligned"}; ``config``
    ``{"gemm1": {...}, "gemm2": {...}, "gemv2": {...}}`` overrides the tile configs (benchmark sweeps;
    ``gemv2`` is the small path's down+combine GEMV used up to ``GEMV_DOWN_MAX_TOKENS`` tokens).  For the
    aligned path both GEMMs must use the same ``BLOCK_M`` (they share one alignment)."""
    num_tokens, hidden_size, num_experts, inter, topk = _check_shapes(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias
    )
    act = _activation_code(activation)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    num_pairs = num_tokens * topk
    if num_pairs == 0:
        return out.zero_()
    path = _choose_path(path, num_tokens, num_pairs)
    cfg = config if config is not None else get_moe_config(path, num_tokens, topk, num_experts)
    wdtype = gate_up_w.dtype
    x = hidden if hidden.dtype == wdtype else hidden.to(wdtype)
    flat_ids = topk_ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    routing = topk_weights.reshape(-1)
    if not routing.is_contiguous():
        routing = routing.contiguous()

    align = None
    if path == "aligned":
        block_m = cfg["gemm1"]["BLOCK_M"]
        if cfg["gemm2"]["BLOCK_M"] != block_m:
            raise ValueError("the aligned path needs the same BLOCK_M for gemm1 and gemm2")
        align = align_tokens_to_experts(flat_ids, num_experts, block_m)

    inter_buf = torch.empty(num_pairs, inter, dtype=wdtype, device=hidden.device)
    _launch_gemm(
        a=x, w=gate_up_w, bias=gate_up_bias, c=inter_buf, flat_ids=flat_ids, routing=None, align=align,
        num_pairs=num_pairs, n_out=inter, k_dim=hidden_size, a_row_div=topk, gated=True,
        interleaved=interleaved, act=act, cfg=cfg["gemm1"], num_experts=num_experts,
    )  # fmt: skip
    if path == "small" and num_tokens <= _gemv_down_max_tokens():
        gv = cfg.get("gemv2") or _default_config("small", num_tokens, topk, num_experts)["gemv2"]
        _launch_down_gemv(inter_buf, down_w, down_bias, out, flat_ids, routing, topk, num_experts, gv)
        return out
    pair_out = torch.empty(num_pairs, hidden_size, dtype=wdtype, device=hidden.device)
    _launch_gemm(
        a=inter_buf, w=down_w, bias=down_bias, c=pair_out, flat_ids=flat_ids, routing=routing, align=align,
        num_pairs=num_pairs, n_out=hidden_size, k_dim=inter, a_row_div=1, gated=False,
        interleaved=False, act=act, cfg=cfg["gemm2"], num_experts=num_experts,
    )  # fmt: skip
    block_h = min(1024, max(16, _next_pow2(hidden_size)))
    _moe_combine_kernel[(num_tokens, triton_cdiv(hidden_size, block_h))](
        pair_out,
        flat_ids,
        out,
        hidden_size,
        num_experts,
        pair_out.stride(0),
        pair_out.stride(1),
        out.stride(0),
        out.stride(1),
        TOPK=topk,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------------------------------


def _fused_experts_impl(hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias, interleaved,
                        activation, path):  # fmt: skip
    lead = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    ids2d = topk_ids.reshape(-1, topk_ids.shape[-1])
    w2d = topk_weights.reshape(-1, topk_weights.shape[-1])
    if use_triton(hidden, gate_up_w, down_w):
        out = fused_experts_triton(
            hidden2d, gate_up_w, down_w, ids2d, w2d, gate_up_bias=gate_up_bias, down_bias=down_bias,
            interleaved=interleaved, activation=activation, path=path,
        )  # fmt: skip
    else:
        out = fused_experts_ref(
            hidden2d, gate_up_w, down_w, ids2d, w2d, gate_up_bias=gate_up_bias, down_bias=down_bias,
            interleaved=interleaved, activation=activation,
        )  # fmt: skip
    return out.reshape(*lead, hidden.shape[-1])


@torch.library.custom_op("mla_fuser::fused_experts", mutates_args=())
def _fused_experts_op(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    interleaved: bool,
    activation: str,
    path: str,
) -> torch.Tensor:
    out = _fused_experts_impl(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias, interleaved, activation, path
    )
    return out  # always a fresh tensor (custom ops may not return an alias of an input)


@_fused_experts_op.register_fake
def _fused_experts_fake(hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias, interleaved,
                        activation, path):  # fmt: skip
    return hidden.new_empty(hidden.shape)


def fused_experts(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    activation: str = "silu",
    path: str = "auto",
) -> torch.Tensor:
    """MoE experts forward: ``hidden [T, H]`` (or ``[..., H]``), ``gate_up_w [E, 2I, H]``, ``down_w [E, H, I]``,
    ``topk_ids`` int ``[T, K]``, ``topk_weights [T, K]`` (fp32 or hidden dtype) -> ``[T, H]`` in hidden's dtype.

    Optional ``gate_up_bias [E, 2I]`` (same row layout as ``gate_up_w``) and ``down_bias [E, H]``;
    ``interleaved`` selects the gate/up row layout; ``activation`` in silu/gelu/gelu_pytorch_tanh/relu.
    ``path``: "auto" (small-batch kernel up to ``MLA_FUSER_MOE_SMALL_BATCH_TOKENS``/``SMALL_BATCH_MAX_TOKENS``
    tokens, aligned grouped GEMM above), or force "small" / "aligned" (Triton backend only).
    Exposed as the custom op ``torch.ops.mla_fuser.fused_experts`` (opaque to torch.compile, fake impl given),
    which is what runs under torch.compile / tracing / tensor subclasses; plain eager calls skip the
    dispatcher and run the same implementation directly.
    """
    args = (hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias, interleaved, activation, path)
    if type(hidden) is torch.Tensor and not torch.compiler.is_compiling():
        # Plain eager call: skip the dispatcher round trip of the custom op (~10-25 us of host time, which
        # is a large share of a decode step's MoE); tracing/compiling, fake or subclass tensors use the op.
        return _fused_experts_impl(*args)
    return torch.ops.mla_fuser.fused_experts(*args)
