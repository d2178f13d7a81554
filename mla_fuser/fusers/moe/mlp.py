"""MLPs recognised by what they compute: the shared experts and the items of a ModuleList of experts.

``mlp_spec`` traces one MLP child and gives each node a role (linear on the input, activation, gated product, down
projection); anything else declines.  The activation is named by what it computes on a probe
(``activation_name``), which the decorated experts' ``act_fn`` is checked with too.  ``fingerprint`` is what such
a trace depends on beyond class and shapes (the fuser's cache key uses it as well).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import graph as g
from ...fx_ops import VIEW_METHODS, describe, op_name
from ...kernels.act_mul import TORCH_ACTIVATIONS
from ..base import Fuser, NoMatch, shape_key
from .specs import MLPSpec



def activation_name(fn) -> str | None:
    """The kernel's name for an activation, found by what it computes on a probe, not by its name."""
    x = torch.linspace(-6.0, 6.0, 241, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for name, ref in TORCH_ACTIVATIONS.items():
        if torch.allclose(y.float(), ref(x), atol=1e-5, rtol=1e-5):
            return name
    return None


def fingerprint(module: nn.Module) -> tuple:
    """What the traced graph of a module depends on beyond the base cache key (class, parameter shapes):
    every submodule's class and plain Python attributes (routers keep ``top_k``, the scaling factor,
    ``topk_method``, ``training`` there) and the parameters' dtypes (the recorded casts depend on them)."""
    out = []
    for name, mod in module.named_modules():
        items = tuple(sorted((k, v) for k, v in vars(mod).items() if isinstance(v, (bool, int, float, str))))
        out.append((name, type(mod), items))
    return tuple(out), tuple(str(p.dtype) for p in module.parameters())


def mlp_spec(module: nn.Module, hidden_size: int) -> MLPSpec:
    """Roles of an MLP child found in its trace; raises ``NoMatch`` when it is not exactly an MLP.
    Cached with the fusers' matches (``Fuser.cache_clear`` clears both)."""
    key = ("mlp", shape_key(module), fingerprint(module), hidden_size)
    cache = Fuser._cache
    with g.TRACE_LOCK:
        if key not in cache:
            try:
                cache[key] = _mlp_spec(module, hidden_size)
            except (NoMatch, g.TraceError) as exc:
                cache[key] = NoMatch(str(exc))
        result = cache[key]
    if isinstance(result, NoMatch):
        raise result
    return result


def _mlp_spec(module: nn.Module, hidden_size: int) -> MLPSpec:
    traced = g.trace_module(module, hidden_size=hidden_size)
    sub = traced.submodule
    role: dict[fx.Node, tuple] = {traced.hidden: ("x",)}
    linears, act_fns = [], []
    for node in traced.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        name = op_name(node)
        ins = [role.get(a) for a in node.all_input_nodes]
        if name in VIEW_METHODS and ins and ins[0] is not None:
            role[node] = ins[0]
        elif g.is_linear(sub(node)) and ins == [("x",)]:
            role[node] = ("lin", node.target)
            linears.append(node.target)
        elif g.is_linear(sub(node)) and len(ins) == 1 and ins[0] and ins[0][0] in ("glu", "act"):
            role[node] = ("down", node.target, ins[0])
            linears.append(node.target)
        elif len(ins) == 1 and ins[0] and ins[0][0] == "lin" and _is_activation_node(traced, node):
            role[node] = ("act", ins[0][1])
            act_fns.append(_activation_callable(traced, node))
        elif name == "mul" and len(ins) == 2 and {r[0] for r in ins if r} == {"act", "lin"}:
            act = next(r for r in ins if r[0] == "act")
            lin = next(r for r in ins if r[0] == "lin")
            role[node] = ("glu", act[1], lin[1])
        else:
            raise NoMatch(f"unaccounted op in MLP: {describe(node)}")
    out = traced.output.args[0]
    final = role.get(out) if isinstance(out, fx.Node) else None
    if final is None or final[0] != "down":
        raise NoMatch("MLP output is not a down projection")
    if len(set(linears)) != len(linears) or len(act_fns) != 1:
        raise NoMatch("MLP calls a linear twice or has several activations")
    params = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    owned = {p for p in params if any(p.startswith(t + ".") for t in linears)}
    if params - owned:
        raise NoMatch(f"MLP state outside its linears: {sorted(params - owned)}")
    inner = final[2]
    act = activation_name(act_fns[0])
    if inner[0] == "glu":
        if len(linears) != 3:
            raise NoMatch("gated MLP with other than three linears")
        return MLPSpec("glu", inner[1], inner[2], final[1], act)
    if len(linears) != 2:
        raise NoMatch("plain MLP with other than two linears")
    return MLPSpec("plain", None, inner[1], final[1], act)


def _is_activation_node(traced, node) -> bool:
    if node.op == "call_module":
        mod = traced.submodule(node)
        return not any(True for _ in mod.parameters()) and not any(True for _ in mod.buffers())
    return node.op == "call_function" and node.target in (F.silu, F.gelu, F.relu, torch.relu, F.mish, F.selu)


def _activation_callable(traced, node):
    if node.op == "call_module":
        return traced.submodule(node)
    kwargs = dict(node.kwargs)
    return lambda x: node.target(x, **kwargs)
