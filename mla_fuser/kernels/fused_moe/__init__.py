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
  rarely share experts there, so reading down weights per token costs nothing extra), GEMM1 too a GEMV (one program
  per pair and row tile, no MMA padding of a pair's row to 16) where the tuned tiles say it wins (:mod:`.gemv_tiles`:
  per layer size, dtype and token count; on an H200 one or two tokens at V2-Lite's size).  Why the small path
  at all: measured on an H200, one DeepSeek-V2-Lite layer at 1 token takes ~0.047 ms of GPU time but
  eager calls are host-bound (tens of us per launch/op on that host), so launches are what it saves
  (0.071 ms eager vs 0.148 for the aligned path at 1 token; equal at 16 tokens, hence the threshold).  The
  choice depends on shapes only, also under CUDA-graph capture (a captured step runs the kernels its eager
  warm-up compiled).  The block-FP8 op leaves the small path above 4 tokens (``fp8_launch``: measured by GPU time).
* **aligned / prefill**: the classic grouped GEMM.  ``align_tokens_to_experts`` (one Triton launch, no
  sort) lists the (token, k) pairs grouped by expert, each expert's group padded to a multiple of
  ``BLOCK_M`` so every ``BLOCK_M`` tile belongs to one expert; GEMM1 then runs one program per
  (tile, N-tile) with ``act(gate) * up`` fused, GEMM2 multiplies by ``down_w`` and the routing weight,
  and a tiny kernel sums the ``K`` pair outputs per token in fp32 (deterministic, unlike atomics).
  Tiles are visited in ``GROUP_M`` super-rows so neighbouring programs share weight tiles in L2.

All matmuls accumulate in fp32.  Precision contract: the intermediate ``act(gate) * up`` and each pair's
output are rounded to the weight dtype (tensor-core inputs/outputs; the decode GEMV keeps pair outputs in
fp32), the K-sum is done in fp32, the result is returned in ``hidden``'s dtype.  fp32 inputs use IEEE fp32 dot products (no TF32).

Layout (one concern per module): :mod:`.reference` (input checks and the torch references that define the
math), :mod:`.cpu` (the torch path for CPU tensors: the reference's math with the pairs grouped on the host),
:mod:`.triton_kernels` (the Triton kernels), :mod:`.launch` (path choice, alignment and launches:
:func:`fused_experts_triton`), :mod:`.configs` (default and tuned tiles).  This module is the public op:
:func:`fused_experts` (a ``torch.library`` custom op ``mla_fuser::fused_experts`` with a fake impl, Triton or
torch chosen by :func:`mla_fuser.kernels.dispatch.use_triton`; the decode GEMVs' tuned tiles in :mod:`.gemv_tiles`),
re-exporting :func:`fused_experts_ref`, :func:`fused_experts_cpu`,
:func:`fused_experts_triton`, :func:`align_tokens_to_experts` / :func:`align_tokens_to_experts_ref`, the router
reference :func:`route_topk_ref` and the config helpers.

Block-FP8 experts (e4m3 stacks with fp32 scales per expert and block, as DeepSeek-format checkpoints ship them):
:func:`fused_experts_fp8` (custom op ``mla_fuser::fused_experts_fp8``), the same paths with a weight-only
dequantising GEMM (:mod:`.fp8_kernels`, launched from :mod:`.fp8_launch`), up to ``GEMV_DOWN_MAX_TOKENS`` tokens two
GEMVs (gate/up + activation, down + routing weights + combine) instead, and the torch reference
:func:`fused_experts_fp8_ref` (:mod:`.fp8_reference`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..dispatch import kernel_op, use_triton
from .configs import default_config, get_moe_config
from .launch import (
    GEMV_DOWN_MAX_TOKENS,
    SMALL_BATCH_MAX_PAIRS,
    SMALL_BATCH_MAX_TOKENS,
    align_tokens_to_experts,
    fused_experts_triton,
    gemv_down_max_tokens,
    launch_down_gemv,
    launch_gemm,
    small_batch_max_tokens,
)
from .cpu import fused_experts_cpu
from .fp8_launch import fused_experts_fp8, fused_experts_fp8_triton
from .fp8_reference import fused_experts_fp8_ref
from .reference import align_tokens_to_experts_ref, fused_experts_ref, route_topk_ref

__all__ = [
    "GEMV_DOWN_MAX_TOKENS",
    "SMALL_BATCH_MAX_PAIRS",
    "SMALL_BATCH_MAX_TOKENS",
    "align_tokens_to_experts",
    "align_tokens_to_experts_ref",
    "default_config",
    "fused_experts",
    "fused_experts_cpu",
    "fused_experts_fp8",
    "fused_experts_fp8_ref",
    "fused_experts_fp8_triton",
    "fused_experts_ref",
    "fused_experts_triton",
    "get_moe_config",
    "gemv_down_max_tokens",
    "launch_down_gemv",
    "launch_gemm",
    "route_topk_ref",
    "small_batch_max_tokens",
]


@kernel_op("fused_experts")
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
    # fused_experts_triton is read from this module's namespace at each call, so patching
    # ``fused_moe.fused_experts_triton`` reaches it (tests count launches that way).
    flat = hidden.dim() == 2  # (what experts modules pass: no reshapes, each a few us of an eager decode step)
    hidden2d = hidden if flat else hidden.reshape(-1, hidden.shape[-1])
    ids2d = topk_ids if topk_ids.dim() == 2 else topk_ids.reshape(-1, topk_ids.shape[-1])
    w2d = topk_weights if topk_weights.dim() == 2 else topk_weights.reshape(-1, topk_weights.shape[-1])
    if use_triton(hidden, gate_up_w, down_w):
        out = fused_experts_triton(
            hidden2d, gate_up_w, down_w, ids2d, w2d, gate_up_bias=gate_up_bias, down_bias=down_bias,
            interleaved=interleaved, activation=activation, path=path,
        )  # fmt: skip
    else:  # the torch path: grouped on the host for CPU tensors (reads the ids, free there), else the reference
        torch_path = fused_experts_cpu if hidden.is_cpu else fused_experts_ref
        out = torch_path(
            hidden2d, gate_up_w, down_w, ids2d, w2d, gate_up_bias=gate_up_bias, down_bias=down_bias,
            interleaved=interleaved, activation=activation,
        )  # fmt: skip
    # always a fresh tensor (custom ops may not return an alias of an input)
    return out if flat else out.reshape(*hidden.shape[:-1], hidden.shape[-1])


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
    return _fused_experts_op(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias, interleaved, activation, path
    )
