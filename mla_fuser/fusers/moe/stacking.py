"""ModuleList experts: the items' weights stacked for the kernel, and a forward bound to the fused block.

The per-expert weights are stacked once into ``[E, 2I, H]`` / ``[E, H, I]`` (the originals' ``.data`` become views
of the stacked tensors: same state_dict keys, no second copy) and a new forward is bound to that block instance
only: routing replayed from the ``RouterSpec`` (``route``: the same torch ops in the same order),
``fused_experts``, shared experts called as they are.  Before binding, the new forward is checked against the
original one on a few random tokens; at run time it defers to the original forward whenever its assumptions do
not hold (training mode, gradients, other dtypes, extra arguments).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ...fx_ops import attr_of
from ...plans import clear_plan, plan_of, set_plan
from ..base import NoMatch
from .specs import KERNEL_DTYPES, MLPSpec, MoEMatch, RouterSpec



class StackedExperts:
    """The ModuleList experts' weights as ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (plus biases).

    Not an ``nn.Module`` and holding no parameters (``state_dict``, ``.to()`` and ``save_pretrained`` only ever
    see the original linears).  The originals' ``.data`` are views into the stacked tensors, so there is one
    copy; when something replaces their storage (a dtype/device move, a load that assigns new tensors) the
    aliasing check at the next call notices and re-stacks once.  In-place loads write through the views.
    """

    def __init__(self, items: list[nn.Module], spec: MLPSpec):
        self.linears = [[it.get_submodule(spec.gate), it.get_submodule(spec.up), it.get_submodule(spec.down)]
                        for it in items]
        self.gate_up = self.down = self.gate_up_bias = self.down_bias = None
        self._ptrs: list[int] = []
        self.restack()

    def _current_ptrs(self) -> list[int]:
        return [t.data_ptr() for lins in self.linears for lin in lins for t in (lin.weight, lin.bias) if t is not None]

    @torch.no_grad()
    def restack(self) -> None:
        inter = self.linears[0][0].out_features
        gate_up = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in self.linears])
        down = torch.stack([d.weight for _, _, d in self.linears])
        for e, (gate, up, dn) in enumerate(self.linears):
            gate.weight.data, up.weight.data, dn.weight.data = gate_up[e, :inter], gate_up[e, inter:], down[e]
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias = self.down_bias = None
        if self.linears[0][0].bias is not None:
            gub = torch.stack([torch.cat([g.bias, u.bias]) for g, u, _ in self.linears])
            db = torch.stack([d.bias for _, _, d in self.linears])
            for e, (gate, up, dn) in enumerate(self.linears):
                gate.bias.data, up.bias.data, dn.bias.data = gub[e, :inter], gub[e, inter:], db[e]
            self.gate_up_bias, self.down_bias = gub, db
        self._ptrs = self._current_ptrs()

    def tensors(self):
        first = self.linears[0][0].weight
        if (self._current_ptrs() != self._ptrs or first.dtype != self.gate_up.dtype
                or first.device != self.gate_up.device):
            self.restack()
        return self.gate_up, self.down, self.gate_up_bias, self.down_bias


def route(spec: RouterSpec, block: nn.Module, x: torch.Tensor):
    """Replay the traced routing: the same torch ops, in the same order, with the recorded constants and casts.
    Returns ``(weights, ids)``."""
    for dtype in spec.input_dtypes:
        x = x.to(dtype)
    if spec.linear_is_module:
        logits = block.get_submodule(spec.linear)(x)
    else:
        weight = attr_of(block, spec.linear)
        for dtype in spec.weight_dtypes:
            weight = weight.to(dtype)
        logits = F.linear(x, weight, attr_of(block, spec.linear_bias) if spec.linear_bias else None)
    for dtype in spec.logits_dtypes:
        logits = logits.to(dtype)
    if spec.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=spec.softmax_dtype)
    else:
        scores = torch.sigmoid(logits)
    for dtype in spec.score_dtypes:
        scores = scores.to(dtype)
    choice = scores
    if spec.correction_bias is not None:
        bias = attr_of(block, spec.correction_bias)
        for dtype in spec.correction_bias_dtypes:
            bias = bias.to(dtype)
        choice = scores + bias
    selected = choice
    if spec.n_group is not None:
        experts = choice.shape[-1]
        grouped = choice.view(-1, spec.n_group, experts // spec.n_group)
        if spec.group_scoring == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(spec.group_topn, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=spec.group_sorted)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, experts // spec.n_group).reshape(-1, experts)
        selected = choice.masked_fill(~expert_mask.view(choice.shape), spec.group_fill)
    values, ids = torch.topk(selected, spec.top_k, dim=-1, sorted=spec.sorted)
    if spec.weights_from == "values":
        weights = values
    else:
        weights = (scores if spec.weights_from == "scores" else choice).gather(-1, ids)
    for op, arg in spec.steps:
        if op == "renorm":
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + arg if arg is not None else total)
        elif op == "scale":
            weights = weights * arg
        elif op == "div":
            weights = weights / arg
        else:
            weights = weights.to(arg)
    return weights, ids


class _ModuleListPlan:
    """What the bound forward of one fused ModuleList block needs, and when it must defer to the original."""

    def __init__(self, module: nn.Module, match: MoEMatch):
        self.match = match
        self.original = types.MethodType(type(module).forward, module)
        items = list(module.get_submodule(match.experts).children())
        self.stacked = StackedExperts(items, match.expert_mlp)
        self.training = module.training
        self.dtype = self.stacked.gate_up.dtype
        self.first_weight = self.stacked.linears[0][0]

    def runs_fused(self, module: nn.Module, hidden: torch.Tensor) -> bool:
        weight = self.first_weight.weight
        return (
            module.training == self.training and hidden.dtype == self.dtype == weight.dtype
            and hidden.shape[-1] == self.match.hidden_size and weight.device.type != "meta"
            and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
        )


def _fused_module_list_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Bound to one fused block instance: routing replayed, experts through ``fused_experts``, shared experts
    called as they are; anything the plan cannot vouch for runs the block's original forward."""
    from ...kernels.fused_moe import fused_experts

    plan: _ModuleListPlan = plan_of(self, "moe")
    if args or kwargs or not plan.runs_fused(self, hidden_states):
        return plan.original(hidden_states, *args, **kwargs)
    m = plan.match
    flat = hidden_states.reshape(-1, m.hidden_size)
    weights, ids = route(m.router, self, flat if m.router.input_flat else hidden_states)
    gate_up, down, gate_up_bias, down_bias = plan.stacked.tensors()
    out = fused_experts(flat, gate_up, down, ids.reshape(-1, m.top_k), weights.reshape(-1, m.top_k),
                        gate_up_bias=gate_up_bias, down_bias=down_bias, activation=m.activation)
    for shared in m.shared:
        y = self.get_submodule(shared.mlp)(flat if shared.flat else hidden_states)
        if shared.gate is not None:
            y = torch.sigmoid(self.get_submodule(shared.gate)(flat if shared.gate_flat else hidden_states)) * y
        out = out + y.reshape(out.shape)
    return out if m.output_flat else out.view(hidden_states.shape)


def apply_module_list(module: nn.Module, match: MoEMatch) -> str:
    """Stack this block's experts and bind the fused forward to it; says how, or raises ``NoMatch``."""
    if isinstance(plan_of(module, "moe"), _ModuleListPlan):
        return "forward bound to this block (already)"
    if "forward" in module.__dict__:
        raise NoMatch("the block instance already has its own forward")
    param = next(module.parameters())
    if param.device.type == "meta":
        raise NoMatch("meta weights: the fused forward cannot be checked")
    if param.dtype not in KERNEL_DTYPES:
        raise NoMatch(f"weights are {param.dtype}: the kernel takes float16, bfloat16 or float32")
    plan = _ModuleListPlan(module, match)
    set_plan(module, "moe", plan)
    module.forward = types.MethodType(_fused_module_list_forward, module)
    problem = _check_against_original(module, plan)
    if problem:
        del module.__dict__["forward"]
        clear_plan(module, "moe")
        plan.stacked = None  # the originals keep their (view) storage: same values, nothing to undo
        raise NoMatch(f"fused forward differs from the original: {problem}")
    return "weights stacked, forward bound to this block"


def _check_against_original(module: nn.Module, plan: _ModuleListPlan) -> str:
    """Run the bound forward and the original on a few random tokens: the structure said they compute the
    same thing, this makes sure (a dispatch loop is only matched loosely)."""
    param = plan.first_weight.weight
    tokens = max(8, min(2 * plan.match.num_experts, 64))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, plan.match.hidden_size, generator=gen).to(device=param.device, dtype=param.dtype)
    try:
        with torch.no_grad():
            ref = plan.original(x)
            got = module(x)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not fuse
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(ref, torch.Tensor) or ref.shape != got.shape:
        return "different output shapes"
    tol = 1e-4 if param.dtype == torch.float32 else 3e-2
    err = ((ref.float() - got.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()
    return "" if err <= tol else f"relative error {err:.2e}"
