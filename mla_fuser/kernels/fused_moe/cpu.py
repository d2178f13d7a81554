"""The torch path of ``fused_experts`` for CPU tensors: :func:`fused_experts_ref`'s math, grouped on the host.

Why not the reference itself: it finds each picked expert's pairs with tensor ops (``unique``, then a comparison and
``nonzero`` per expert) and upcasts through extra calls, about twenty small ops per expert.  On a CPU a small op
costs microseconds of dispatch, which at decode (one token, a few experts) is most of the layer, and reading the
routing ids on the host is free.  Here the ids are read once as Python ints and grouped in Python; each picked
expert then costs two ``F.linear`` calls, the activation and one accumulation, a pair that is its expert's only
one is taken as a view (no gather), and one token's sum needs no zeroed buffer.  Measured on a 2-core CPU, fp32, at
the embedded preset's shape (one token, top-2 of 8 experts): 53 us against 125 us for the reference and 114 us for
Transformers' ``grouped_mm``.  Between a few tokens and about a thousand ``grouped_mm`` is faster on a CPU; the MoE
fuser runs it there (``fusers.moe.experts.CPU_GROUPED_MM_TOKENS``).

Same rounding points as the reference (fp32 math, ``act(gate) * up`` rounded to the weights' dtype, fp32
accumulation, the result in ``hidden``'s dtype); ``tests/test_kernel_fused_moe.py`` checks it against it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .reference import _apply_activation_ref, check_shapes

__all__ = ["fused_experts_cpu"]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def fused_experts_cpu(
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
    """:func:`~.reference.fused_experts_ref` with the pairs grouped by expert on the host (same arguments)."""
    num_tokens, hidden_size, num_experts, inter, topk = check_shapes(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias
    )
    if num_tokens == 0 or topk == 0:
        return torch.zeros(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    x = _fp32(hidden.to(gate_up_w.dtype))
    w_col = _fp32(topk_weights.reshape(-1, 1))  # [pairs, 1]
    groups: dict[int, list[int]] = {}
    for pair, expert in enumerate(topk_ids.reshape(-1).tolist()):
        if 0 <= expert < num_experts:
            groups.setdefault(expert, []).append(pair)
    # one token, each expert picked once (decode): the sum is kept as a tensor of its own, no zeros and no indexing
    # (0 + a is a, so the additions are the reference's)
    one_row = num_tokens == 1 and all(len(pairs) == 1 for pairs in groups.values())
    out = None if one_row else torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    rounds = down_w.dtype != torch.float32  # the reference rounds act(gate) * up to the weights' dtype
    for expert in sorted(groups):  # the reference's order, so each token sums its experts in the same order
        pairs = groups[expert]
        if len(pairs) == 1:  # views: no gather of one row
            token = pairs[0] // topk
            rows, weight = (x if num_tokens == 1 else x[token:token + 1]), w_col[pairs[0]:pairs[0] + 1]
        else:
            index = torch.tensor(pairs, device=hidden.device)
            tokens = index // topk
            rows, weight = x[tokens], w_col[index]
        gate_up = F.linear(rows, _fp32(gate_up_w[expert]))
        if gate_up_bias is not None:
            gate_up = gate_up + _fp32(gate_up_bias[expert])
        gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
        h = _apply_activation_ref(gate, activation) * up
        if rounds:
            h = h.to(down_w.dtype).float()
        y = F.linear(h, _fp32(down_w[expert]))
        if down_bias is not None:
            y = y + _fp32(down_bias[expert])
        y = y * weight
        if one_row:
            out = y if out is None else out + y
        elif len(pairs) == 1:
            out[token:token + 1].add_(y)
        else:
            out.index_add_(0, tokens, y)
    if out is None:  # no valid expert at all
        out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    return out if out.dtype == hidden.dtype else out.to(hidden.dtype)
