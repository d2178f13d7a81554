"""The MoE fuser: which blocks are MoE blocks (by structure), and how each is switched to the fused kernel.

What is matched (never by class or attribute names; the only names used are the ones Transformers' experts
*contract* prescribes: ``gate_up_proj``/``down_proj`` and the decorator's flags on the instance): one experts
child, either a ``@use_experts_implementation`` module with 3-D weights or a ``ModuleList`` of gated MLPs; the
block's traced forward with its router child inlined, every node given a role by the router analysis
(``router.py``); shared experts recognised as MLPs (``mlp.py``).  Fail closed: an unaccounted node reaching the
output, an in-place op not understood, a module call or a parameter/buffer not in one of the roles, a tuple
output -- each declines with a reason.

``apply`` switches decorated experts to the registered implementation (``experts.py``) or binds a forward to a
ModuleList block (``stacking.py``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ... import compat
from ... import graph as g
from ...fx_ops import attr_of, op_name
from ...kernels.fp8.format import FP8_DTYPE
from ..base import Fuser, FusionRow, NoMatch, common_input_width, shape_key
from .experts import apply_interface, explain_fp8_experts_module, interface_experts_dispatcher
from .inline import inline_children
from .mlp import activation_name, fingerprint, mlp_spec
from .router import Interpreter, Sym, router_spec, shape_of
from .router_binding import bind_router
from .shared_overlap import attach_shared_overlap
from .specs import MLPSpec, MoEMatch, SharedExpert
from .stacking import apply_module_list


class MoEFuser(Fuser):
    name = "moe"

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        """Cheap prefilter: a decorated experts child, or a ModuleList child of MLP-like items."""
        return any(
            interface_experts_dispatcher(c) is not None or _module_list_of_mlps(c) for c in module.children()
        )

    @classmethod
    def cache_key(cls, module: nn.Module, example_inputs=None) -> tuple:
        """``fingerprint(module)`` added to the base key: the router's settings are plain attributes and the
        recorded casts depend on the dtypes, so class and shapes are not enough."""
        return (shape_key(module, example_inputs), fingerprint(module))

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> MoEMatch:
        experts_name, experts_kind, experts = _find_experts(module)
        if experts_kind == "interface":
            layout = _interface_layout(experts)
            hidden_size, num_experts, inter = layout["hidden"], layout["experts"], layout["inter"]
        else:
            item_modules = list(experts.children())
            hidden_size = _module_list_hidden_size(module, item_modules[0], example_inputs)
            spec = _module_list_spec(item_modules, hidden_size)
            num_experts = len(item_modules)
            inter = item_modules[0].get_submodule(spec.gate).out_features
        if example_inputs is None:
            example_inputs = _synthetic_inputs(module, hidden_size, num_experts)
        traced = cls.trace(module, example_inputs, hidden_size if example_inputs is None else None)
        items = {f"{experts_name}.{n}" for n, _ in experts.named_children()} if experts_kind == "module_list" else set()
        shared_specs = {}

        def keep(node):
            mod = traced.module.get_submodule(node.target)
            if node.target == experts_name or node.target in items or g.is_linear(mod):
                return True
            if node.target in shared_specs:
                return True
            try:
                shared_specs[node.target] = mlp_spec(mod, hidden_size)
                return True
            except NoMatch:
                return False

        inline_children(traced, keep)
        interp = Interpreter(traced, experts_name, experts_kind, items, shared_specs)
        interp.run()
        out = _check_output(traced, interp)
        _check_accounted(module, traced, interp, out, experts_name, items)
        router = router_spec(out.info["router"])
        if router.linear_is_module:
            width = module.get_submodule(router.linear).out_features
        else:
            width = attr_of(module, router.linear).shape[0]
        if width != num_experts:
            raise NoMatch(f"router scores {width} experts, the experts module holds {num_experts}")
        if experts_kind == "module_list":
            called = set(out.info["items"])
            if not called:
                raise NoMatch("no expert of the ModuleList is called")
            act, interleaved, transposed = spec.activation, False, False
            has_bias = _items_have_bias(items, spec, module)
        else:
            act, interleaved, transposed, has_bias = layout["activation"], False, layout["transposed"], layout["bias"]
            spec = None
        shared = tuple(
            SharedExpert(mlp, shared_specs[mlp].kind, gate, flat, gate_flat if gate is not None else flat)
            for mlp, gate, flat, gate_flat in out.info.get("parts", ())
        )
        return MoEMatch(
            router=router, experts=experts_name, experts_kind=experts_kind, num_experts=num_experts,
            top_k=router.top_k, hidden_size=hidden_size, intermediate_size=inter, activation=act,
            interleaved=interleaved, transposed=transposed, has_bias=has_bias, expert_mlp=spec, shared=shared,
            output_flat=out.info["flat"],
        )

    @classmethod
    def apply(cls, module: nn.Module, match: MoEMatch, qualname: str) -> FusionRow:
        """Switch this block's experts to the fused kernel; on any doubt leave it as it is (fallback row)."""
        row = FusionRow(qualname, type(module).__name__, cls.name, "fallback")
        try:
            if match.experts_kind == "interface":
                how = apply_interface(module, match)
                how += "; " + bind_router(module, match)
            else:
                how = apply_module_list(module, match)
            overlap = attach_shared_overlap(module, match)
            how += f"; {overlap}" if overlap else ""
        except NoMatch as exc:
            row.reason = str(exc)
            return row
        row.status = "fused"
        shared = ", ".join(f"shared {s.kind}{' gated' if s.gate else ''}" for s in match.shared)
        row.reason = f"{match.num_experts} experts, router {match.router.describe()}"
        row.reason += (f", {shared}" if shared else "") + f"; {how}"
        return row


def _module_list_of_mlps(module: nn.Module) -> bool:
    items = list(module.children()) if isinstance(module, nn.ModuleList) else []
    return len(items) >= 2 and all(sum(isinstance(c, nn.Linear) for c in it.children()) >= 2 for it in items)


def _is_state(module: nn.Module, target: str) -> bool:
    """False for the ``_tensor_constant`` attributes fx made of tensors built inside the forward (removed
    from the module again after tracing)."""
    try:
        attr_of(module, target)
    except AttributeError:
        return False
    return True


def _find_experts(module: nn.Module):
    found = []
    for name, child in module.named_children():
        if interface_experts_dispatcher(child) is not None:
            found.append((name, "interface", child))
        elif _module_list_of_mlps(child):
            found.append((name, "module_list", child))
    if len(found) != 1:
        raise NoMatch(f"expected one experts child, found {len(found)}")
    return found[0]


def _interface_layout(experts: nn.Module) -> dict:
    """The decorated experts' layout, from the decorator's flags on the instance and the 3-D weights."""
    gate_up = getattr(experts, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor) and gate_up.dtype == FP8_DTYPE:
        return _fp8_interface_layout(experts)
    flags = {k: getattr(experts, k, None) for k in ("has_gate", "has_bias", "has_post_expert_norm", "is_transposed",
                                                      "is_concatenated")}
    if flags["has_gate"] is not True:
        raise NoMatch("experts without gate (up projection only): not supported by the fused kernel")
    if flags["has_post_expert_norm"]:
        raise NoMatch("experts with a post-expert norm: not supported by the fused kernel")
    if getattr(type(experts), "_apply_gate", None) is not compat.default_apply_gate():
        raise NoMatch("experts with a custom gating function (_apply_gate)")
    if flags["is_concatenated"] is False:
        # the default gate chunks [gate; up] (grouped_mm, batched_mm) while sonicmoe reads the flag as an
        # interleaved layout: Transformers' own implementations disagree, so there is no "native" to match
        raise NoMatch("is_concatenated=False with the default gating function is ambiguous")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == 3
            and down.ndim == 3):
        raise NoMatch("experts weights are not 3-D gate_up_proj / down_proj tensors")
    transposed = bool(flags["is_transposed"])
    gu = gate_up.transpose(1, 2) if transposed else gate_up
    dn = down.transpose(1, 2) if transposed else down
    num, two_inter, hidden = gu.shape
    if two_inter % 2 or tuple(dn.shape) != (num, hidden, two_inter // 2):
        raise NoMatch(f"experts weights {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit [E,2I,H] / [E,H,I]")
    bias = bool(flags["has_bias"])
    if bias:
        gb, db = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
        if not (isinstance(gb, torch.Tensor) and isinstance(db, torch.Tensor) and tuple(gb.shape) == (num, two_inter)
                and tuple(db.shape) == (num, hidden)):
            raise NoMatch("experts biases do not fit [E, 2I] / [E, H]")
    act = activation_name(getattr(experts, "act_fn", None))
    if act is None:
        raise NoMatch("experts activation is not silu, gelu, gelu_tanh or relu")
    state = {n for n, _ in experts.named_parameters()} | {n for n, _ in experts.named_buffers()}
    known = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if bias else set())
    if state - known:
        raise NoMatch(f"experts hold state the kernel does not use: {sorted(state - known)}")
    return dict(hidden=hidden, experts=num, inter=two_inter // 2, activation=act, transposed=transposed, bias=bias)


def _fp8_interface_layout(experts: nn.Module) -> dict:
    """Block-FP8 stacks (``kernels.fp8.experts``): their scales are state the kernel uses, and the gate may be a
    class's own ``_apply_gate`` as long as it computes the default one (``experts.gate_is_default``)."""
    layout, reason = explain_fp8_experts_module(experts)
    if layout is None:
        raise NoMatch(reason)
    state = {n for n, _ in experts.named_parameters()} | {n for n, _ in experts.named_buffers()}
    known = {"gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"}
    if layout.static_activation_scale:
        known |= {"gate_up_proj_activation_scale", "down_proj_activation_scale"}
    if state - known:
        raise NoMatch(f"FP8 experts hold state the kernel does not use: {sorted(state - known)}")
    return dict(hidden=layout.hidden, experts=layout.num_experts, inter=layout.inter,
                activation=activation_name(experts.act_fn), transposed=False, bias=False)


def _module_list_spec(items: list[nn.Module], hidden_size: int) -> MLPSpec:
    first = items[0]
    shapes = [(type(it), tuple((n, tuple(p.shape)) for n, p in it.named_parameters())) for it in items]
    if len(set(shapes)) != 1:
        raise NoMatch("the experts of the ModuleList differ in class or shapes")
    try:
        spec = mlp_spec(first, hidden_size)
    except NoMatch as exc:
        raise NoMatch(f"ModuleList experts are not MLPs: {exc}") from exc
    if spec.kind != "glu":
        raise NoMatch("ModuleList experts are plain (non-gated) MLPs: the fused kernel is gated")
    if spec.activation is None:
        raise NoMatch("ModuleList experts' activation is not silu, gelu, gelu_tanh or relu")
    return spec


def _module_list_hidden_size(module: nn.Module, item: nn.Module, example_inputs) -> int:
    """The block's width: the example input's last dimension, else the input width shared by the item's
    gate and up projections (the down projection's is the intermediate size), else the block's linears'."""
    if example_inputs is not None and example_inputs[0] and isinstance(example_inputs[0][0], torch.Tensor):
        return int(example_inputs[0][0].shape[-1])
    counts: dict[int, int] = {}
    for child in item.children():
        if isinstance(child, nn.Linear):
            counts[child.in_features] = counts.get(child.in_features, 0) + 1
    best = sorted(counts.items(), key=lambda kv: -kv[1])
    if len(best) == 1 or (len(best) > 1 and best[0][1] > best[1][1]):
        return best[0][0]
    width = common_input_width(module)
    if width is None:
        raise NoMatch("hidden size of the ModuleList experts is ambiguous")
    return width


def _items_have_bias(items: set, spec: MLPSpec, module: nn.Module) -> bool:
    flags = set()
    for name in items:
        item = module.get_submodule(name)
        flags.update(item.get_submodule(r).bias is not None for r in (spec.gate, spec.up, spec.down))
    if len(flags) > 1:
        raise NoMatch("some expert linears have a bias and others not")
    return flags == {True}


def _synthetic_inputs(module: nn.Module, hidden_size: int, num_experts: int):
    """Real example inputs for a standalone match: enough random tokens that a dispatch loop over the
    experts traces (data-dependent shapes get real values); None on meta weights."""
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta":
        return None
    tokens = max(8, min(4 * num_experts, 256))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden_size, generator=gen).to(device=param.device, dtype=param.dtype)
    return ((x,), {})


def _check_output(traced: g.TracedModule, interp: Interpreter) -> Sym:
    arg = traced.output.args[0]
    if not isinstance(arg, fx.Node):
        raise NoMatch(f"the block returns a {type(arg).__name__}, not one tensor")
    out = interp.sym(arg)
    if out.kind not in ("out", "routed"):
        # name the first unaccounted node on the way to the output (and an unaccounted selection after it:
        # it says more than whatever made its input)
        unknown = [n for n in traced.graph.nodes
                   if interp.syms.get(n) is not None and interp.syms[n].kind == "unknown" and g.reaches(n, arg)]
        if unknown:
            why = [interp.syms[unknown[0]].info["why"]]
            why += [interp.syms[n].info["why"] for n in unknown[1:] if op_name(n) == "topk"][:1]
            raise NoMatch("unaccounted computation: " + "; then ".join(why))
        raise NoMatch(f"the block output is {out.kind}, not the routed experts' output")
    flat = interp.hidden_flat(arg)
    if flat is None and (shape_of(arg) is not None or not out.info.get("fresh")):
        raise NoMatch("the block output has another shape than its input")
    return out.but(flat=bool(flat))  # unknown only for an accumulator fx lost track of: the check decides


def _check_accounted(module, traced, interp, out, experts_name, items) -> None:
    """Every module call, tensor attribute, in-place op and parameter/buffer must have a role."""
    router = out.info["router"]
    modules = {experts_name} | set(out.info["items"])
    if router["linear_is_module"]:
        modules.add(router["linear"])
    attrs = {a for a in (router.get("correction_bias"), router.get("linear_bias")) if a}
    if not router["linear_is_module"]:
        attrs.add(router["linear"])
    for mlp, gate, _, _ in out.info.get("parts", ()):
        modules.add(mlp)
        if gate:
            modules.add(gate)
    for node in traced.graph.nodes:
        s = interp.syms.get(node)
        if node.op == "call_module" and node.target not in modules:
            raise NoMatch(f"unaccounted call of {node.target!r}")
        if node.op == "get_attr" and node.target not in attrs and _is_state(module, node.target):
            raise NoMatch(f"unaccounted state used: {node.target!r}")
        if s is not None and s.kind == "unknown" and node.op in ("call_method", "call_function"):
            name = op_name(node)
            if name.endswith("_") or name.startswith("__i"):
                raise NoMatch(f"unaccounted in-place op: {s.info['why']}")
    if out.info["items"] and set(out.info["items"]) - items:
        raise NoMatch("experts outside the ModuleList")
    state = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    prefixes = tuple(m + "." for m in modules | set(items))
    loose = [n for n in state if n not in attrs and not n.startswith(prefixes)]
    if loose:
        raise NoMatch(f"unaccounted state: {loose}")
