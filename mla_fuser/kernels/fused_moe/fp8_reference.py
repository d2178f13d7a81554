"""The block-FP8 experts contract in torch: input checks, per-expert dequantisation, and the reference.

Same math as :func:`~.reference.fused_experts_ref` with the experts' weights given as e4m3 stacks and fp32 scales
per ``(expert, n-block, k-block)``: ``W[e, n, k] = q[e, n, k] * scale[e, row(n), k // bk]``, where ``row(n)`` is
``n // bn`` except for the up half of ``gate_up`` in the halves layout (``kernels.fp8.experts``), whose rows are
``up_scale_base + (n - I) // bn``; in general ``up_scale_base + (n - I + up_row_shift) // bn``.  The deliberate
rounding point moves with the weights: e4m3 weights are widened to the activations' dtype in the kernel, so
``act(gate) * up`` is rounded to ``hidden``'s dtype (not the weights') before the down projection.  Everything else
is fp32.  This is also the torch path of ``fused_experts_fp8`` (CPU tensors, autograd): one pass per picked expert,
each expert's weights dequantised in fp32 when it is used (never the whole stack at once).

``act_quant`` gives the W8A8 GEMMs' math (``fp8_kernels``' ``ACT_QUANT``): each GEMM's input rows quantised to e4m3
per token and ``bk`` features (max-abs / 448, ``fp8.quant.quantize_token_groups_ref``) before the fp32 products,
the down projection's after its rounding to ``hidden``'s dtype.
"""

from __future__ import annotations

import torch

from ..fp8.format import FP8_DTYPE
from ..fp8.quant import dequantize_token_groups, quantize_token_groups_ref
from .reference import _apply_activation_ref, check_stacks_and_routing


def _expand(scale: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    return scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], *, gated: bool = False,
                      up_scale_base: int = 0, up_row_shift: int = 0) -> torch.Tensor:
    """One expert's ``weight [N, K]`` e4m3 times its scales ``[rows, cols]``, in fp32.  ``gated``: ``weight`` is
    ``[gate; up]`` and the up half's scale rows follow ``up_scale_base`` / ``up_row_shift``."""
    n, k = weight.shape
    bn, bk = block
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if not gated or (up_scale_base == 0 and up_row_shift == n // 2):  # one grid over the whole matrix
        return w * _expand(s, n, k, bn, bk)
    half = n // 2
    gate = w[:half] * _expand(s, half, k, bn, bk)
    up_rows = (torch.arange(half, device=w.device) + up_row_shift) // bn + up_scale_base
    up = w[half:] * s[up_rows].repeat_interleave(bk, 1)[:, :k]
    return torch.cat([gate, up])


def _fake_quant(rows: torch.Tensor, group: int) -> torch.Tensor:
    """``rows`` quantised to e4m3 per row and ``group`` features, and back, in fp32."""
    return dequantize_token_groups(*quantize_token_groups_ref(rows, group), group)


def check_fp8_shapes(hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights):
    dims = check_stacks_and_routing(hidden, gate_up_w, down_w, topk_ids, topk_weights)
    num_experts = dims[2]
    if gate_up_w.dtype != FP8_DTYPE or down_w.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 experts need float8_e4m3fn stacks, got {gate_up_w.dtype} / {down_w.dtype}")
    for name, s in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        if s.dim() != 3 or s.shape[0] != num_experts or s.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [E={num_experts}, rows, cols], got {s.dtype} {tuple(s.shape)}")
    return dims


def fused_experts_fp8_ref(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_w: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_block: tuple[int, int],
    down_block: tuple[int, int],
    up_scale_base: int = 0,
    up_row_shift: int | None = None,
    activation: str = "silu",
    act_quant: bool = False,
) -> torch.Tensor:
    """Reference block-FP8 experts forward (fp32 math); ``up_row_shift`` None means ``I`` (one grid over
    ``gate_up``, the whole layout); ``act_quant``: activations quantised as the W8A8 GEMMs do."""
    num_tokens, hidden_size, num_experts, inter, topk = check_fp8_shapes(
        hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights
    )
    shift = inter if up_row_shift is None else up_row_shift
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0 or topk == 0:
        return out.to(hidden.dtype)
    x = _fake_quant(hidden.float(), gate_up_block[1]) if act_quant else hidden.float()
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    rounds = hidden.dtype != torch.float32
    for e in torch.unique(flat_ids[valid]).tolist():
        pairs = torch.nonzero(flat_ids == e).squeeze(1)
        tokens = pairs // topk
        w1 = dequantize_expert(gate_up_w[e], gate_up_scale[e], gate_up_block, gated=True,
                               up_scale_base=up_scale_base, up_row_shift=shift)
        gate_up = x[tokens] @ w1.t()
        h = _apply_activation_ref(gate_up[:, :inter], activation) * gate_up[:, inter:]
        if rounds:
            h = h.to(hidden.dtype).float()
        if act_quant:
            h = _fake_quant(h, down_block[1])
        y = h @ dequantize_expert(down_w[e], down_scale[e], down_block).t()
        out.index_add_(0, tokens, y * flat_w[pairs, None])
    return out.to(hidden.dtype)
