"""Gated MLPs (``down(act(gate(x)) * up(x))``), recognised by what they compute: one stacked gate+up GEMM, then
``act(gate) * up`` in one kernel (``kernels.act_mul``), then the down projection as itself (its
instance forward on ``kernels.skinny_linear`` where that runs: ``fusers.linear``).

Why: in a graphed decode step such an MLP (a dense layer's, or an MoE block's shared experts) is five launches of
similar cost: gate GEMM, activation, up GEMM, product, down GEMM.  Stacking the gate and up weights makes the two
GEMMs one (one weight read, one launch) and the kernel makes the activation and the product one: three launches.

What is matched (never by class or attribute names):

* **candidates** (``is_candidate``, cheap): exactly three linear children (``nn.Linear`` or a subclass), any other
  children free of parameters and buffers (an activation module), no state of the module's own;
  ``candidate_names`` leaves out the items of an ``nn.ModuleList``: those are experts, which the MoE fuser stacks
  into ``[E, 2I, H]`` itself (stacking them here too would fight over their storage);
* **the roles**, from ``fusers.moe.mlp.mlp_spec`` (the trace the MoE fuser reads shared experts with): gated
  (``glu``), one activation it can name (silu, gelu, gelu_tanh, relu);
* **the whole graph, strictly** (``_check_graph``): the hidden states, the gate and up linears called on them,
  one activation of the gate, one product, the down linear on it, returned as it is.  A reshape, a cast, a second
  input, a constant: declined (``mlp_spec`` lets views through, which could change the output's shape or where it
  rounds);
* **the activation's rounding**: its 16-bit results must equal, bit for bit, those of the torch op the kernel
  computes (an activation spelled out in 16-bit ops, e.g. ``gelu_new``, rounds at every step: declined);
* **the linears**: gate and up of the same width on the hidden states, down from that width; weights of one
  floating dtype (float8 included: ``StackedLinear`` stacks block-FP8 scales too; packed integer weights decline),
  on one device.  Biases need nothing (``StackedLinear`` stacks them, a missing one as zeros).

How it is fused: ``apply`` makes a ``rewrite.StackedLinear`` of gate and up (one ``[2I, H]`` weight whose halves
the original parameters' ``.data`` become: same ``state_dict``, no second copy; re-stacked after a dtype or device
move; adapters, meta, DTensor weights and torch.compile call the two linears as themselves) and binds
``_fused_forward`` to the instance (under an accelerate hook, to what the hook wraps).  The fused forward runs
``act_mul`` on the stack's two halves (views, read in place) and calls the down linear module itself, so hooks and
adapters on it still run.  A call the match cannot vouch for (more than the hidden states, not a floating tensor,
autograd recording) runs the original forward.  Before keeping it, the bound forward is compared with the
original on random inputs (``_check_against_original``, tolerances there); a mismatch restores the original
forward and reports a fallback (the weights stay views of the stack: same values, nothing to undo).

Ordering (``fusion.BLOCK_FUSERS``): after ``MoEFuser``, so MoE blocks are traced and matched (their shared experts
read by ``mlp_spec`` from the class forward) before a shared expert gets its instance forward.  The plan is the
module's ``"mlp"`` plan (``plans``).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import graph as g
from ..fx_ops import describe, op_name
from ..kernels.act_mul import TORCH_ACTIVATIONS, act_mul, act_mul_ref
from ..kernels.dispatch import launches_are_free, use_triton
from ..plans import clear_plan, plan_of, set_plan
from ..rewrite import StackedLinear
from .base import (Fuser, FusionRow, NoMatch, bind_instance_forward, common_input_width, shape_key,
                   unbind_instance_forward)
from .linear import bind_skinny_forward
from .moe.mlp import fingerprint, mlp_spec

# Below this many rows an eager CUDA call computes ``act(gate) * up`` with torch's two ops: a Triton launch costs
# more host time than the two small launches it replaces (as for the norm kernel, ``fusers.norm``).  Captured,
# warm-up and compiled calls, where launches are free, and many rows always take the kernel.  The stacked GEMM
# always pays: one launch fewer either way.
EAGER_MIN_ROWS = 2048


@dataclass(frozen=True)
class GatedMLPMatch:
    """Roles (child names), sizes and the activation's kernel name."""

    gate: str
    up: str
    down: str
    activation: str
    hidden_size: int
    intermediate_size: int
    bias: bool

    def describe(self, stacked: bool = True) -> str:
        if stacked:
            how = "gate and up stacked into one GEMM" + (" (biases too)" if self.bias else "")
        else:  # (``StackedLinear`` calls them as themselves: e.g. FP8 blocks that do not align, DTensor weights)
            how = "gate and up called as themselves (their weights cannot be stacked)"
        return f"gated MLP ({self.activation}) {self.hidden_size} -> 2x{self.intermediate_size}: {how}, " \
               "act(gate) * up in one kernel"


def mlp_plan(module: nn.Module):
    """The plan of a fused gated MLP, or None."""
    return plan_of(module, "mlp")


class GatedMLPFuser(Fuser):
    name = "mlp"

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        """Three linear children, the others stateless (an activation), no state of its own."""
        linears = 0
        for child in module.children():
            if g.is_linear(child):
                linears += 1
            elif next(child.parameters(), None) is not None or next(child.buffers(), None) is not None:
                return False
        if linears != 3:
            return False
        return not module._parameters and not module._buffers

    @classmethod
    def candidate_names(cls, model: nn.Module) -> list[str]:
        """Candidates of ``model`` except the items of a ``ModuleList`` (experts: the MoE fuser stacks those)."""
        skipped = {f"{name}.{item}" if name else item for name, mod in model.named_modules()
                   if isinstance(mod, nn.ModuleList) for item, _ in mod.named_children()}
        return [n for n, m in model.named_modules() if n and n not in skipped and cls.is_candidate(m)]

    @classmethod
    def cache_key(cls, module: nn.Module, example_inputs=None) -> tuple:
        """``fingerprint`` added to the base key: the activation child's class and settings decide the match."""
        return (shape_key(module, example_inputs), fingerprint(module))

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> GatedMLPMatch:
        if not cls.is_candidate(module):
            raise NoMatch("not three linear children (plus stateless ones) and no state of its own")
        hidden = _hidden_size(module, example_inputs)
        spec = mlp_spec(module, hidden)
        if spec.kind != "glu":
            raise NoMatch("a plain MLP (no gated product): nothing to stack")
        if spec.activation is None:
            raise NoMatch("the activation is not silu, gelu, gelu_tanh or relu")
        act_fn = _check_graph(g.trace_module(module, hidden_size=hidden), spec)
        _check_rounding(act_fn, spec.activation)
        gate, up, down = (module.get_submodule(n) for n in (spec.gate, spec.up, spec.down))
        if gate.in_features != hidden or up.in_features != hidden:
            raise NoMatch(f"gate / up take {gate.in_features} / {up.in_features} features, the input has {hidden}")
        if gate.out_features != up.out_features or down.in_features != gate.out_features:
            raise NoMatch(f"gate {gate.out_features}, up {up.out_features} and down {down.in_features} widths differ")
        weights = [lin.weight for lin in (gate, up)]
        if weights[0].dtype != weights[1].dtype or weights[0].device != weights[1].device:
            raise NoMatch("gate and up weights differ in dtype or device: they cannot be one tensor")
        if not weights[0].is_floating_point():
            raise NoMatch(f"gate and up weights are {weights[0].dtype} (packed / quantised): not stacked")
        return GatedMLPMatch(spec.gate, spec.up, spec.down, spec.activation, hidden, gate.out_features,
                             gate.bias is not None or up.bias is not None)

    @classmethod
    def apply(cls, module: nn.Module, match: GatedMLPMatch, qualname: str) -> FusionRow:
        """Stack gate and up, bind the fused forward to this instance, keep it only when it agrees."""
        row = FusionRow(qualname, type(module).__name__, cls.name, "fallback")
        if mlp_plan(module) is not None:
            row.status, row.reason = "fused", "already fused"
            return row
        gate, up = module.get_submodule(match.gate), module.get_submodule(match.up)
        if any(lin.weight.device.type == "meta" for lin in (gate, up, module.get_submodule(match.down))):
            row.reason = "meta weights: the fused forward cannot be checked"
            return row
        original, why_not = bind_instance_forward(module, _fused_forward)
        if original is None:
            row.reason = why_not
            return row
        stacked = StackedLinear(gate, up, owner=module, names=(match.gate, match.up))
        set_plan(module, "mlp", _MLPPlan(match, original, stacked))
        problem = _check_against_original(module, match, original, types.MethodType(_fused_forward, module))
        if problem:
            unbind_instance_forward(module, original)
            clear_plan(module, "mlp")
            row.reason = f"fused forward differs from the original: {problem}"
            return row
        bind_skinny_forward(module.get_submodule(match.down))  # (decode-size rows on kernels.skinny_linear)
        row.status, row.reason = "fused", match.describe(stacked.weight is not None)
        return row


# ---------------------------------------------------------------------------------------------------------
# checks


def _hidden_size(module: nn.Module, example_inputs) -> int:
    """The input width: the captured call's (which must be the hidden states alone), else the linears' common one."""
    signature = inspect.signature(inspect.unwrap(type(module).forward))
    params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    params = params[1:] if params and params[0].name == "self" else params
    if not params or any(p.default is inspect.Parameter.empty for p in params[1:]):
        raise NoMatch(f"forward takes {[p.name for p in params]}: not the hidden states alone")
    if example_inputs is not None:
        args, kwargs = example_inputs
        given = list(args) + list(kwargs.values())
        if len(given) != 1 or not isinstance(given[0], torch.Tensor):
            raise NoMatch("called with more than the hidden states")
        return int(given[0].shape[-1])
    width = common_input_width(module)
    if width is None:
        raise NoMatch("the input width is ambiguous")
    return width


def _check_graph(traced: g.TracedModule, spec) -> Callable:
    """The traced forward is exactly ``down(act(gate(x)) * up(x))`` (operands in either order); returns the
    activation as a callable.  Anything else in the graph declines, naming the op."""
    x = traced.hidden
    nodes = {}
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            if node is not x and node.users:
                raise NoMatch(f"uses the forward input {node.target!r} besides the hidden states")
            continue
        if node.op == "output":
            continue
        if node.op == "call_module" and node.target in (spec.gate, spec.up, spec.down):
            role = {spec.gate: "gate", spec.up: "up", spec.down: "down"}[node.target]
        elif op_name(node) == "mul" and node.op == "call_function":
            role = "mul"
        elif node.op in ("call_module", "call_function") and len(node.all_input_nodes) == 1:
            role = "act"
        else:
            raise NoMatch(f"an op outside down(act(gate(x)) * up(x)): {describe(node)}")
        if role in nodes:
            raise NoMatch(f"a second {role} step: {describe(node)}")
        nodes[role] = node
    if set(nodes) != {"gate", "up", "act", "mul", "down"}:
        raise NoMatch(f"steps found: {sorted(nodes)}, not a gated MLP")
    n = nodes
    expected = {
        "gate": (x,), "up": (x,), "act": (n["gate"],), "down": (n["mul"],),
    }
    for role, args in expected.items():
        if tuple(n[role].args) != args or (role != "act" and n[role].kwargs):
            raise NoMatch(f"the {role} step is not called on what a gated MLP feeds it: {describe(n[role])}")
    if n["mul"].kwargs or set(n["mul"].args) != {n["act"], n["up"]} or len(n["mul"].args) != 2:
        raise NoMatch(f"the product is not act(gate) * up: {describe(n['mul'])}")
    if traced.output.args[0] is not n["down"]:
        raise NoMatch("the forward does not return the down projection as it is")
    act = n["act"]
    if act.op == "call_module":
        if act.kwargs:
            raise NoMatch(f"the activation module is called with keyword arguments: {describe(act)}")
        return traced.submodule(act)
    kwargs = dict(act.kwargs)
    return lambda t: act.target(t, **kwargs)


def _check_rounding(act_fn: Callable, activation: str) -> None:
    """The activation's 16-bit results are bitwise those of the torch op the kernel computes (same fp32 math,
    one rounding): an activation spelled out in 16-bit steps rounds at each of them."""
    probe = torch.cat([torch.linspace(-12.0, 12.0, 4801), torch.tensor([-80.0, -30.0, 30.0, 80.0, 0.0])])
    reference = TORCH_ACTIVATIONS[activation]
    for dtype in (torch.bfloat16, torch.float16):
        x = probe.to(dtype)
        try:
            with torch.no_grad():
                got = act_fn(x)
        except Exception as exc:  # noqa: BLE001 - an activation that cannot run on 16-bit inputs
            raise NoMatch(f"the activation fails on {dtype}: {type(exc).__name__}") from exc
        want = reference(x)
        if not (isinstance(got, torch.Tensor) and got.dtype == dtype and torch.equal(got, want)):
            raise NoMatch(f"the activation ({activation} by its values) rounds differently from the kernel's on "
                          f"{dtype} inputs")


# ---------------------------------------------------------------------------------------------------------
# the bound forward and its check


@dataclass
class _MLPPlan:
    match: GatedMLPMatch
    original: Callable
    stacked: StackedLinear


def _fused_forward(self: nn.Module, *args, **kwargs):
    """Bound to one gated MLP instance: one stacked gate+up GEMM, ``act_mul`` on its halves, the down linear
    called as itself.  The matched forward takes the hidden states alone, so a lone argument is them; anything
    else, and calls while autograd records (the original's ops have the backward), run the original forward."""
    plan: _MLPPlan = plan_of(self, "mlp")
    if len(args) + len(kwargs) != 1:
        return plan.original(*args, **kwargs)
    x = args[0] if args else next(iter(kwargs.values()))
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or (
            torch.is_grad_enabled() and (x.requires_grad or _any_requires_grad(self))):
        return plan.original(*args, **kwargs)
    m = plan.match
    gate, up = plan.stacked(x)
    if gate.is_cuda:
        if not launches_are_free() and gate.numel() < EAGER_MIN_ROWS * m.intermediate_size:
            h = act_mul_ref(gate, up, m.activation)  # eager, few rows: two torch launches cost less host time
        else:
            h = act_mul(gate, up, m.activation)
    else:  # (the twin directly where no kernel runs: this is every MLP call of an eager CPU step)
        h = act_mul(gate, up, m.activation) if use_triton(gate) else act_mul_ref(gate, up, m.activation)
    down = self._modules.get(m.down)
    return (down if down is not None else self.get_submodule(m.down))(h)


def _any_requires_grad(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _check_against_original(module: nn.Module, match: GatedMLPMatch, original: Callable, fused: Callable) -> str:
    """Fused vs original on ``randn * 3`` rows plus a row of large values.  '' when they agree.

    The tolerance is relative to the largest output: 1e-6 in fp32 on the torch path (the same ops, only the GEMM
    over the stacked weight may sum in another order); 1e-5 in fp32 when the kernel runs (Triton's ``exp`` /
    ``erf`` are a few units off torch's); four units of the dtype's precision in 16-bit (a flipped rounding of the
    activation or of a GEMM output moves the down projection by about one unit; the MoE fuser allows 3e-2 in bf16),
    and of TF32's in fp32 on CUDA when float32 matmuls may use TF32.
    """
    weight = module.get_submodule(match.gate).weight
    # (a float8 weight computes in a 16-bit dtype: bfloat16 stands in for it)
    dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() >= 2 else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, match.hidden_size, generator=gen) * 3
    x[1, 2] = torch.randn(match.hidden_size, generator=gen) * 30
    x = x.to(device=weight.device, dtype=dtype)
    try:
        with torch.no_grad():
            ref, got = original(x), fused(x)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not fuse
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        return "not a tensor"
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    if dtype in (torch.float16, torch.bfloat16):
        tol = 4 * torch.finfo(dtype).eps
    elif x.is_cuda and torch.get_float32_matmul_precision() != "highest":
        tol = 4 * 2.0 ** -10  # TF32 GEMMs (10-bit mantissa): the stacked and the separate GEMMs round apart
    else:
        tol = 1e-5 if use_triton(x) else 1e-6
    scale = ref.float().abs().max().clamp(min=1e-30)
    err = ((got.float() - ref.float()).abs().max() / scale).item()
    if not err <= tol:  # (NaN fails too)
        return f"relative error {err:.2e} (at most {tol:.0e} allowed)"
    return ""
