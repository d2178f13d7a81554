"""The fused MoE contract in torch: input checks, activations, and the references that define the math.

:func:`fused_experts_ref` is also the torch path of ``fused_experts``; :func:`align_tokens_to_experts_ref`
defines the alignment format the Triton launch reproduces bit for bit; :func:`route_topk_ref` is the router
(routing is a few small torch ops, so there is no Triton router).  The checks, activation codes and padded
length here are shared with the Triton launchers (:mod:`.launch`), so both paths accept the same inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..dispatch import cdiv

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "gelu_tanh": 2, "relu": 3}


def activation_code(activation: str) -> int:
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"activation {activation!r} is not one of {sorted(_ACTIVATIONS)}") from None


def _apply_activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    code = activation_code(activation)
    if code == 0:
        return torch.nn.functional.silu(x)
    if code == 1:
        return torch.nn.functional.gelu(x)
    if code == 2:
        return torch.nn.functional.gelu(x, approximate="tanh")
    return torch.relu(x)


def check_stacks_and_routing(hidden, gate_up_w, down_w, topk_ids, topk_weights):
    """``(T, H, E, I, K)`` after checking what every experts entry point takes: ``hidden [T, H]``, stacks
    ``gate_up_w [E, 2I, H]`` / ``down_w [E, H, I]``, integer ``topk_ids [T, K]`` and ``topk_weights`` of its shape."""
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
    return num_tokens, hidden_size, num_experts, inter, topk_ids.shape[1]


def check_shapes(hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias):
    dims = check_stacks_and_routing(hidden, gate_up_w, down_w, topk_ids, topk_weights)
    _, hidden_size, num_experts, inter, _ = dims
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (num_experts, 2 * inter):
        raise ValueError(f"gate_up_bias must be [E, 2I], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (num_experts, hidden_size):
        raise ValueError(f"down_bias must be [E, H], got {tuple(down_bias.shape)}")
    if down_w.dtype != gate_up_w.dtype:
        raise TypeError(f"gate_up_w ({gate_up_w.dtype}) and down_w ({down_w.dtype}) must share a dtype")
    return dims


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
    num_tokens, hidden_size, num_experts, inter, topk = check_shapes(
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


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded length, known on the host without looking at the ids (no sync):
    at most ``min(E, pairs)`` experts are non-empty and each adds fewer than ``block_m`` padding slots."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


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
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
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
