"""Mixture-of-experts blocks: recognised by structure, experts run by the fused kernel.

What is matched (never by class or attribute names; the only names used are the ones Transformers' experts
*contract* prescribes: ``gate_up_proj``/``down_proj`` and the decorator's flags on the instance):

* **the block's traced forward** (``trace_module``, every child a leaf) with the router child inlined (its own
  trace spliced in), read by a small abstract interpreter: every node gets a role (hidden states, router
  logits, scores, group mask, top-k ids, routing weights, expert outputs, shared-expert output, ...) only
  when its op and its inputs' roles form a known step; anything else is "unaccounted" and the block is
  declined with that node named in the reason;
* **router**: one linear on the block input (an ``nn.Linear`` child or ``F.linear`` on a 2-D parameter) ->
  softmax or sigmoid -> optional correction bias (a 1-D tensor added to the scores) -> optional group-limited
  selection (group score = max or sum of the top-n, top groups, masked fill) -> top-k -> weights (top-k values
  or the scores gathered at the ids) -> renormalisation / scaling / casts.  Every cast, dtype, constant and
  the order of the post-selection steps is read off the graph (``RouterSpec``);
* **experts**: a ``@use_experts_implementation`` module (recognised by the decorator's wrapper code, flags read
  from the instance) with 3-D ``gate_up_proj``/``down_proj`` called as ``experts(x, ids, weights)``; or a
  ``ModuleList`` of gated MLPs (gate/up/down roles found by tracing one item) driven by a dispatch loop over
  the ids (one-hot / where / index_add_);
* **shared experts**: a child MLP (GLU or plain, recognised by tracing it) on the block input, optionally
  multiplied by ``sigmoid(linear(x))`` with a 1-wide linear, added to the routed output.

Fail closed: an unaccounted node reaching the output, an in-place op not understood, a module call or a
parameter/buffer not in one of the roles, a tuple output -- each declines with a reason.

How it is fused:

* decorator experts: the block forward is left alone (so every step of it is the original); only the experts
  module is switched to the ``"mla_fuser"`` experts implementation registered in Transformers'
  ``ExpertsInterface`` on import of this module (``experts_implementation="mla_fuser"`` selects it too).
  The decorator picks the implementation at call time from ``self.config._experts_implementation``, and that
  config is shared by the whole model, so ``apply`` gives the one experts instance a config *view*
  (``_ExpertsConfigView``) that names ``"mla_fuser"`` while the model's own choice is unchanged since fusion;
  other blocks (declined ones included) keep their implementation;
* ``ModuleList`` experts: the per-expert weights are stacked once into ``[E, 2I, H]``/``[E, H, I]`` (the
  originals' ``.data`` become views of the stacked tensors: same state_dict keys, no second copy) and a new
  forward is bound to that block instance only: routing replayed from the ``RouterSpec`` (the same torch ops
  in the same order), ``fused_experts``, shared experts called as they are.  Before binding, the new forward
  is checked against the original one on a few random tokens; at run time it defers to the original forward
  whenever its assumptions do not hold (training mode, gradients, other dtypes, extra arguments).

The kernel backend follows ``MLA_FUSER_BACKEND`` (``kernels.dispatch``), read at every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import operator
import types
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import graph as g
from .base import Fuser, FusionRow, NoMatch, common_input_width, shape_key

IMPL_NAME = "mla_fuser"
PLAN_ATTR = "_mla_fuser_moe_plan"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# match results


@dataclass(frozen=True)
class RouterSpec:
    """The routing computation, step by step as traced (paths are relative to the block).

    ``linear`` is an ``nn.Linear`` submodule (``linear_is_module``) or the path of a 2-D weight used with
    ``F.linear``.  ``*_dtypes`` are the casts found at each point, in order.  ``steps`` are the operations on
    the routing weights after selection, in order: ``("renorm", eps or None)``, ``("scale", c)``,
    ``("div", c)``, ``("cast", dtype)``.
    """

    linear: str
    linear_is_module: bool
    linear_bias: str | None
    input_flat: bool
    input_dtypes: tuple
    weight_dtypes: tuple
    router_dtype: torch.dtype | None
    logits_dtypes: tuple
    scoring: str  # "softmax" | "sigmoid"
    softmax_dtype: torch.dtype | None
    score_dtypes: tuple
    correction_bias: str | None
    correction_bias_dtypes: tuple
    n_group: int | None
    topk_group: int | None
    group_scoring: str | None  # "max" | "topn_sum"
    group_topn: int | None
    group_fill: float | None
    group_sorted: bool | None
    top_k: int
    sorted: bool
    weights_from: str  # "values" (top-k values of what was selected on) | "scores" | "choice" (gathered)
    steps: tuple

    @property
    def renormalize(self) -> bool:
        return any(op == "renorm" for op, _ in self.steps)

    @property
    def scaling(self) -> float:
        value = 1.0
        for op, arg in self.steps:
            value = value * arg if op == "scale" else value / arg if op == "div" else value
        return value

    def describe(self) -> str:
        parts = [f"{self.scoring} top-{self.top_k}"]
        if self.correction_bias:
            parts.append("correction bias")
        if self.n_group:
            parts.append(f"groups {self.topk_group}/{self.n_group} ({self.group_scoring})")
        if self.renormalize:
            parts.append("renormalised")
        if self.scaling != 1.0:
            parts.append(f"x{self.scaling:g}")
        if self.router_dtype is not None:
            parts.append(str(self.router_dtype).replace("torch.", ""))
        return ", ".join(parts)


@dataclass(frozen=True)
class MLPSpec:
    """Roles of a gated (``glu``: ``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``) MLP."""

    kind: str
    gate: str | None
    up: str
    down: str
    activation: str | None  # kernel name ("silu", "gelu", "gelu_tanh", "relu") or None when not one of those


@dataclass(frozen=True)
class SharedExpert:
    mlp: str
    kind: str  # "glu" | "plain"
    gate: str | None  # a 1-wide linear whose sigmoid multiplies the shared output
    flat: bool  # called on the flattened [T, H] hidden states (else on the block input as is)
    gate_flat: bool


@dataclass(frozen=True)
class MoEMatch:
    """A matched MoE block: roles as submodule names, sizes and the routing read from its graph."""

    router: RouterSpec
    experts: str  # the experts module (decorator kind) or the ModuleList
    experts_kind: str  # "interface" | "module_list"
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    interleaved: bool
    transposed: bool
    has_bias: bool
    expert_mlp: MLPSpec | None  # ModuleList items' roles
    shared: tuple  # SharedExpert, in the order they are added
    output_flat: bool


# ---------------------------------------------------------------------------------------------------------
# small structural helpers

_ACT_REFERENCES = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


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
    for name, ref in _ACT_REFERENCES.items():
        if torch.allclose(y.float(), ref(x), atol=1e-5, rtol=1e-5):
            return name
    return None


_DECORATED_CODE = None


def _decorated_forward_code():
    """Code object of the forward that ``@use_experts_implementation`` installs (the same for every class)."""
    global _DECORATED_CODE
    if _DECORATED_CODE is None:
        from transformers.integrations.moe import use_experts_implementation

        class _Probe(nn.Module):
            def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - never run
                return hidden_states

        _DECORATED_CODE = use_experts_implementation(_Probe).forward.__code__
    return _DECORATED_CODE


def interface_experts_dispatcher(module: nn.Module):
    """The ``ExpertsInterface`` a decorated experts module dispatches through, or None if not decorated."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or code is not _decorated_forward_code():
        return None
    cells = dict(zip(code.co_freevars, forward.__closure__ or ()))
    cell = cells.get("experts_interface")
    return cell.cell_contents if cell is not None else None


def _module_list_of_mlps(module: nn.Module) -> bool:
    items = list(module.children()) if isinstance(module, nn.ModuleList) else []
    return len(items) >= 2 and all(sum(isinstance(c, nn.Linear) for c in it.children()) >= 2 for it in items)


def _resolve(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _is_state(module: nn.Module, target: str) -> bool:
    """False for the ``_tensor_constant`` attributes fx made of tensors built inside the forward (removed
    from the module again after tracing)."""
    try:
        _resolve(module, target)
    except AttributeError:
        return False
    return True


def fingerprint(module: nn.Module) -> tuple:
    """What the traced graph of a module depends on beyond the base cache key (class, parameter shapes):
    every submodule's class and plain Python attributes (routers keep ``top_k``, the scaling factor,
    ``topk_method``, ``training`` there) and the parameters' dtypes (the recorded casts depend on them)."""
    out = []
    for name, mod in module.named_modules():
        items = tuple(sorted((k, v) for k, v in vars(mod).items() if isinstance(v, (bool, int, float, str))))
        out.append((name, type(mod), items))
    return tuple(out), tuple(str(p.dtype) for p in module.parameters())


def _shape_of(node):
    """Shape of a node from its meta value, else from the integer arguments of a view/reshape."""
    val = g.meta_val(node) if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("view", "reshape"):
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
            dims = tuple(dims[0])
        if dims and all(isinstance(d, int) for d in dims):
            return tuple(dims)
    return None


# ---------------------------------------------------------------------------------------------------------
# op names

_FUNCTION_NAMES = {
    F.linear: "linear", F.softmax: "softmax", torch.softmax: "softmax", torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid", torch.topk: "topk", operator.add: "add", torch.add: "add", operator.mul: "mul",
    torch.mul: "mul", operator.truediv: "div", torch.div: "div", operator.getitem: "getitem", getattr: "getattr",
    torch.zeros_like: "zeros_like", torch.zeros: "zeros", torch.gather: "gather", operator.invert: "invert",
    torch.logical_not: "invert", torch.sum: "sum", torch.max: "max", torch.amax: "amax", F.one_hot: "one_hot",
    torch.where: "where", torch.masked_fill: "masked_fill", torch.reshape: "reshape", torch.flatten: "flatten",
    torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.transpose: "transpose", torch.permute: "permute",
    torch.greater: "gt", operator.gt: "gt", torch.nonzero: "nonzero", operator.eq: "eq", torch.eq: "eq",
}
_SHAPE = {"view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous", "expand", "permute", "transpose",
          "expand_as", "view_as", "reshape_as"}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type", "type_as"}
_CAST_METHOD_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                       "double": torch.float64}
# roles that shape ops carry through unchanged; routing values only through re-views keeping the last dim
_ROUTER_KINDS = {"logits", "scores", "choice", "masked", "ids", "weights"}
_REVIEWS = {"view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze"}
_SHAPE_TRANSPARENT = {"routed", "shared", "sgate", "out", "eout", "contrib", "aux", "tok", "wsel", "gmask", "nmask",
                      "sgate_logit"}


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return _FUNCTION_NAMES.get(node.target, getattr(node.target, "__name__", str(node.target)))
    return node.op


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _describe(node: fx.Node) -> str:
    def show(a):
        return a.name if isinstance(a, fx.Node) else repr(a)

    args = ", ".join([show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()])
    target = node.target if node.op in ("call_module", "get_attr") else op_name(node)
    return f"{target}({args})"


# ---------------------------------------------------------------------------------------------------------
# MLPs (shared experts and ModuleList items) by structure

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
        if name in _SHAPE and ins and ins[0] is not None:
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
            raise NoMatch(f"unaccounted op in MLP: {_describe(node)}")
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


# ---------------------------------------------------------------------------------------------------------
# inlining the router child


def _inline_children(traced: g.TracedModule, keep) -> None:
    """Splice the trace of every called child that ``keep`` rejects into the block graph (up to 4 levels).

    The router is usually a child returning ``(logits, weights, ids)``; inlined, its steps and the block's
    are one graph.  Targets of the child's ``get_attr``/``call_module`` nodes get the child's prefix.
    """
    for _ in range(4):
        todo = [n for n in traced.graph.nodes if n.op == "call_module" and not keep(n)]
        if not todo:
            return
        for node in todo:
            _inline_one(traced, node)
    raise NoMatch("children nested too deeply to inline")


def _inline_one(traced: g.TracedModule, node: fx.Node) -> None:
    child = traced.module.get_submodule(node.target)

    def meta(a):
        if isinstance(a, fx.Node):
            val = g.meta_val(a)
            if val is None:
                raise NoMatch(f"input of {node.target!r} has an unknown shape")
            return val
        return a

    args = tuple(meta(a) for a in node.args)
    kwargs = {k: meta(v) for k, v in node.kwargs.items()}
    try:
        sub = g.trace_module(child, example_inputs=(args, kwargs))
    except g.TraceError as exc:
        raise NoMatch(f"child {node.target!r} could not be traced: {exc}") from exc
    try:
        signature = inspect.signature(inspect.unwrap(type(child).forward))
        bound = signature.bind(None, *node.args, **node.kwargs)
    except TypeError as exc:
        raise NoMatch(f"call of {node.target!r} does not fit its signature: {exc}") from exc
    bound.apply_defaults()
    val_map = {}
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            val_map[n] = bound.arguments.get(n.target.lstrip("*"), None)
        elif n.op in ("get_attr", "call_module"):
            n.target = f"{node.target}.{n.target}"
    with traced.graph.inserting_before(node):
        out = traced.graph.graph_copy(sub.graph, val_map)
    for user in list(node.users):
        if isinstance(out, (tuple, list)):
            if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
                raise NoMatch(f"the output tuple of {node.target!r} is used as a whole")
            user.replace_all_uses_with(out[user.args[1]])
            traced.graph.erase_node(user)
        else:
            user.replace_input_with(node, out)
    traced.graph.erase_node(node)


# ---------------------------------------------------------------------------------------------------------
# the abstract interpreter


class _Sym:
    """The role of one traced value: ``kind`` plus what was learnt on the way (``info``)."""

    __slots__ = ("kind", "info")

    def __init__(self, kind: str, **info):
        self.kind, self.info = kind, info

    def but(self, kind: str | None = None, **changes) -> "_Sym":
        return _Sym(kind or self.kind, **{**self.info, **changes})

    def __repr__(self):
        return f"<{self.kind}>"


class _Unaccounted(_Sym):
    def __init__(self, why: str):
        super().__init__("unknown", why=why)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Interpreter:
    """Gives every node of the (inlined) block graph a role, or ``unknown`` with the reason."""

    def __init__(self, traced: g.TracedModule, experts_target: str, experts_kind: str, items: set[str],
                 shared_specs: dict[str, MLPSpec]):
        self.traced = traced
        self.module = traced.module
        self.experts_target = experts_target
        self.experts_kind = experts_kind
        self.items = items
        self.shared_specs = shared_specs
        self.syms: dict[fx.Node, _Sym] = {}
        self.fresh: _Sym | None = None  # what was accumulated into tensors built inside the forward
        self.input_shape = _shape_of(traced.hidden)

    # -- helpers
    def sym(self, a) -> _Sym:
        if isinstance(a, fx.Node):
            return self.syms.get(a, _Unaccounted(f"{a.name} has no role"))
        return _Sym("const", value=a)

    def _hidden_flat(self, node) -> bool | None:
        shape = _shape_of(node)
        if shape is None or self.input_shape is None:
            return None
        if tuple(shape) == tuple(self.input_shape):
            return False
        if len(shape) == 2 and shape[-1] == self.input_shape[-1]:
            return True
        return None

    def _cast_dtype(self, node):
        val = g.meta_val(node)
        if isinstance(val, torch.Tensor):
            return val.dtype
        name = op_name(node)
        if name in _CAST_METHOD_DTYPES:
            return _CAST_METHOD_DTYPES[name]
        for a in list(node.args[1:]) + list(node.kwargs.values()):
            if isinstance(a, torch.dtype):
                return a
        return None

    # -- main loop
    def run(self) -> None:
        for node in self.traced.graph.nodes:
            if node.op == "output":
                continue
            try:
                self.syms[node] = self.step(node)
            except NoMatch as exc:
                self.syms[node] = _Unaccounted(str(exc))

    def step(self, node: fx.Node) -> _Sym:
        if node.op == "placeholder":
            if node is self.traced.hidden:
                return _Sym("hidden", flat=False, casts=())
            return _Unaccounted(f"extra input {node.target!r}")
        if node.op == "get_attr":
            try:
                value = _resolve(self.module, node.target)
            except AttributeError:
                # fx stores a tensor the forward built from constants (``torch.zeros(shape)``) as a
                # ``_tensor_constant`` attribute, which ``trace_module`` removes again: fresh, not state.  fx
                # emits one get_attr per use, and ops on it without traced inputs (``out.reshape(b, s, h)``)
                # run at trace time and give another constant, so they are all taken as one accumulator
                # (the ModuleList path checks the fused forward against the original before binding it).
                return self.fresh or _Sym("acc", fresh=True)
            if not isinstance(value, torch.Tensor):
                return _Unaccounted(f"attribute {node.target!r}")
            return _Sym("param", target=node.target, ndim=value.ndim, numel=value.numel(), casts=())
        if node.op == "call_module":
            return self.call_module(node)
        name = op_name(node)
        if name in _SHAPE:
            return self.shape_op(node)
        if name in _CASTS:
            return self.cast(node)
        handler = getattr(self, f"op_{name.rstrip('_')}", None)
        if handler is not None:
            result = handler(node, name)
            if result is not None:
                return result
        ins = [self.sym(a) for a in node.all_input_nodes]
        if ins and all(s.kind in ("ids", "aux") for s in ins) and not name.endswith("_"):
            return _Sym("aux")  # bookkeeping on the routing ids (one_hot, where, permute, ...)
        return _Unaccounted(f"{_describe(node)} on {[s.kind for s in ins]}")

    # -- modules
    def call_module(self, node: fx.Node) -> _Sym:
        mod = self.module.get_submodule(node.target)
        ins = [self.sym(a) for a in node.args]
        if node.target == self.experts_target and self.experts_kind == "interface":
            return self.call_experts(node)
        if node.target in self.items:
            if len(ins) == 1 and not node.kwargs and ins[0].kind == "tok":
                return _Sym("eout", item=node.target)
            return _Unaccounted(f"expert {node.target!r} called on something else than selected tokens")
        if g.is_linear(mod):
            if len(ins) != 1 or node.kwargs or ins[0].kind != "hidden":
                source = _describe(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else "?"
                return _Unaccounted(f"linear {node.target!r} on a computed input: {source}")
            x = ins[0]
            if mod.out_features == 1:
                return _Sym("sgate_logit", gate=node.target, flat=x.info["flat"])
            return _Sym("logits", router=dict(
                linear=node.target, linear_is_module=True, linear_bias=None, input_flat=x.info["flat"],
                input_dtypes=x.info["casts"], weight_dtypes=(), router_dtype=_dtype_of(node),
            ))
        if node.target in self.shared_specs:
            if len(ins) == 1 and not node.kwargs and ins[0].kind == "hidden" and not ins[0].info["casts"]:
                return _Sym("shared", parts=((node.target, None, ins[0].info["flat"], None),))
            return _Unaccounted(f"MLP {node.target!r} on a computed input")
        return _Unaccounted(f"call of {node.target!r}")

    def call_experts(self, node: fx.Node) -> _Sym:
        mod = self.module.get_submodule(node.target)
        try:
            bound = inspect.signature(inspect.unwrap(type(mod).forward)).bind(None, *node.args, **node.kwargs)
        except TypeError:
            return _Unaccounted("experts called with other arguments than (hidden, ids, weights)")
        values = list(bound.arguments.values())[1:]
        if len(values) != 3:
            return _Unaccounted("experts called with other arguments than (hidden, ids, weights)")
        x, ids, w = (self.sym(v) for v in values)
        if x.kind != "hidden" or x.info["casts"]:
            return _Unaccounted("experts get something else than the block input")
        if ids.kind != "ids" or w.kind != "weights" or ids.info["topk"] is not w.info["topk"]:
            return _Unaccounted(f"experts get ids/weights that are not one top-k's ({ids.kind}, {w.kind})")
        return _Sym("routed", router=w.info["router"], topk=w.info["topk"], items=())

    # -- shape ops and casts
    def shape_op(self, node: fx.Node) -> _Sym:
        src = self.sym(node.args[0])
        if src.kind == "hidden":
            flat = self._hidden_flat(node)
            if flat is None:
                return _Unaccounted(f"hidden states reshaped to {_shape_of(node)}")
            return src.but(flat=flat)
        if src.kind in ("scores", "choice") and op_name(node) in ("view", "reshape"):
            # [T, E] -> [T, groups, E / groups] (when the scores' width is known, it must split exactly)
            shape, before = _shape_of(node), _shape_of(node.args[0])
            if shape is not None and len(shape) == 3 and (before is None or before[-1] == shape[1] * shape[2]):
                return _Sym("grouped", router=src.info["router"], source=src, n_group=shape[1])
        if src.kind in _ROUTER_KINDS:
            # routing values may only be re-viewed with the experts dimension kept last (softmax, top-k and
            # gather are taken over the last dimension)
            before, after = _shape_of(node.args[0]), _shape_of(node)
            if op_name(node) not in _REVIEWS or (before and after and before[-1] != after[-1]):
                if src.kind == "ids":
                    return _Sym("aux")  # flattened ids: bookkeeping of a dispatch loop, no longer "the ids"
                return _Unaccounted(f"{_describe(node)} on {src.kind}")
            return src
        if src.kind in _SHAPE_TRANSPARENT:
            return src
        return _Unaccounted(f"{_describe(node)} on {src.kind}")

    def cast(self, node: fx.Node) -> _Sym:
        src = self.sym(node.args[0])
        dtype = self._cast_dtype(node)
        if dtype is None:
            return _Unaccounted(f"cast with unknown dtype: {_describe(node)}")
        if src.kind == "hidden":
            return src.but(casts=src.info["casts"] + (dtype,))
        if src.kind == "param":
            return src.but(casts=src.info["casts"] + (dtype,))
        if src.kind in ("logits", "scores"):
            key = "logits_dtypes" if src.kind == "logits" else "score_dtypes"
            router = dict(src.info["router"])
            router[key] = router.get(key, ()) + (dtype,)
            return src.but(router=router)
        if src.kind == "weights":
            return self._weight_step(src, ("cast", dtype))
        if src.kind in ("ids", "aux", "routed", "shared", "out", "eout", "contrib", "tok", "wsel", "gmask"):
            return src
        return _Unaccounted(f"cast of {src.kind}")

    # -- router ops
    def op_linear(self, node, name):
        x, w = self.sym(_arg(node, 0, "input")), self.sym(_arg(node, 1, "weight"))
        b = self.sym(_arg(node, 2, "bias"))
        if x.kind != "hidden":
            return _Unaccounted(f"router input is not the block input but {_describe(node.args[0])}")
        if w.kind != "param" or w.info["ndim"] != 2 or (b.kind not in ("param", "const") or
                                                          (b.kind == "const" and b.info["value"] is not None)):
            return _Unaccounted(f"linear with a computed weight: {_describe(node)}")
        return _Sym("logits", router=dict(
            linear=w.info["target"], linear_is_module=False,
            linear_bias=b.info["target"] if b.kind == "param" else None, input_flat=x.info["flat"],
            input_dtypes=x.info["casts"], weight_dtypes=w.info["casts"], router_dtype=_dtype_of(node),
        ))

    def _last_dim(self, node, dim) -> bool:
        if dim == -1:
            return True
        val = g.meta_val(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        return isinstance(val, torch.Tensor) and dim == val.ndim - 1

    def op_softmax(self, node, name):
        src = self.sym(node.args[0])
        if src.kind != "logits":
            return _Unaccounted(f"softmax of {src.kind}")
        if not self._last_dim(node, _arg(node, 1, "dim")):
            return _Unaccounted("softmax not over the experts dimension")
        dtype = node.kwargs.get("dtype", next((a for a in node.args[2:] if isinstance(a, torch.dtype)), None))
        return _Sym("scores", router={**src.info["router"], "scoring": "softmax", "softmax_dtype": dtype})

    def op_sigmoid(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "logits":
            return _Sym("scores", router={**src.info["router"], "scoring": "sigmoid", "softmax_dtype": None})
        if src.kind == "sgate_logit":
            return src.but("sgate")
        return _Unaccounted(f"sigmoid of {src.kind}")

    def op_add(self, node, name):
        if name.endswith("_") or len(node.args) != 2 or node.kwargs:
            return None
        a, b = self.sym(node.args[0]), self.sym(node.args[1])
        kinds = {a.kind, b.kind}
        if kinds == {"scores", "param"}:
            scores, bias = (a, b) if a.kind == "scores" else (b, a)
            if bias.info["ndim"] != 1:
                return _Unaccounted("scores plus a tensor that is not one value per expert")
            router = {**scores.info["router"], "correction_bias": bias.info["target"],
                      "bias_dtypes": bias.info["casts"]}
            return _Sym("choice", router=router, scores=scores)
        if kinds == {"wsum", "const"}:
            wsum, eps = (a, b) if a.kind == "wsum" else (b, a)
            if _is_number(eps.info["value"]) and wsum.info["eps"] is None:
                return wsum.but(eps=eps.info["value"])
        if kinds == {"routed", "shared"} or kinds == {"out", "shared"}:
            base, shared = (a, b) if a.kind != "shared" else (b, a)
            parts = base.info.get("parts", ()) + shared.info["parts"]
            return _Sym("out", router=base.info["router"], items=base.info["items"], parts=parts)
        return _Unaccounted(f"{_describe(node)}: add of {a.kind} and {b.kind}")

    def op_getitem(self, node, name):
        src, index = self.sym(node.args[0]), node.args[1]
        if src.kind == "topk" and index in (0, 1):
            return self._topk_part(src, index)
        group_part = self._group_part(src, index)
        if group_part is not None:
            return group_part
        if src.kind == "where":
            return _Sym("aux")
        idx_nodes = [a for a in (index if isinstance(index, (tuple, list)) else (index,)) if isinstance(a, fx.Node)]
        idx_syms = [self.sym(a) for a in idx_nodes]
        if src.kind in ("ids", "aux") and all(s.kind in ("ids", "aux") for s in idx_syms):
            return _Sym("aux")
        if idx_syms and all(s.kind in ("ids", "aux") for s in idx_syms):
            if src.kind == "hidden" and not src.info["casts"]:
                return _Sym("tok")
            if src.kind == "weights":
                return _Sym("wsel", weights=src)
        return _Unaccounted(f"indexing of {src.kind}: {_describe(node)}")

    def op_getattr(self, node, name):
        src, attr = self.sym(node.args[0]), node.args[1]
        index = {"values": 0, "indices": 1}.get(attr)
        if index is None:
            return _Unaccounted(f"attribute {attr!r} of {src.kind}")
        if src.kind == "topk":
            return self._topk_part(src, index)
        return self._group_part(src, index) or _Unaccounted(f"attribute {attr!r} of {src.kind}")

    @staticmethod
    def _group_part(src: _Sym, index) -> _Sym | None:
        """Element ``index`` (0 values, 1 indices) of a group-limited selection step, or None."""
        if src.kind == "gtopk" and index == 0:
            return _Sym("gtopvals", group=src.info["group"])
        if src.kind == "gsel" and index == 1:
            return _Sym("gidx", group=src.info["group"])
        if src.kind == "gmax" and index == 0:
            return _Sym("gscore", group={**src.info["group"], "scoring": "max", "topn": None})
        return None

    def _topk_part(self, src: _Sym, index: int) -> _Sym:
        router = src.info["router"]
        if index == 1:
            return _Sym("ids", topk=src, router=router)
        return _Sym("weights", topk=src, router={**router, "weights_from": "values", "steps": ()})

    def op_topk(self, node, name):
        src = self.sym(node.args[0])
        k = _arg(node, 1, "k")
        dim, largest = _arg(node, 2, "dim", -1), _arg(node, 3, "largest", True)
        is_sorted = _arg(node, 4, "sorted", True)
        if not isinstance(k, int) or largest is not True or not isinstance(is_sorted, bool):
            return _Unaccounted(f"top-k with non-constant or smallest selection: {_describe(node)}")
        if not self._last_dim(node, dim):
            return _Unaccounted("top-k not over the experts dimension")
        if src.kind in ("scores", "choice", "masked"):
            router = {**src.info["router"], "top_k": k, "sorted": is_sorted, "select_from": src.kind}
            return _Sym("topk", router=router)
        if src.kind == "grouped":
            return _Sym("gtopk", group=dict(source=src.info["source"], n_group=src.info["n_group"], topn=k))
        if src.kind == "gscore":
            return _Sym("gsel", group={**src.info["group"], "topk_group": k, "sorted": is_sorted})
        return _Unaccounted(f"top-k over a value that does not depend on the router scores ({src.kind})")

    def op_max(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "grouped" and _arg(node, 1, "dim") == -1 and not _arg(node, 2, "keepdim", False):
            return _Sym("gmax", group=dict(source=src.info["source"], n_group=src.info["n_group"]))
        return None

    def op_amax(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "grouped" and _arg(node, 1, "dim") == -1 and not _arg(node, 2, "keepdim", False):
            return _Sym("gscore", group=dict(source=src.info["source"], n_group=src.info["n_group"],
                                             scoring="max", topn=None))
        return None

    def op_sum(self, node, name):
        src = self.sym(node.args[0])
        dim, keepdim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
        if src.kind == "gtopvals" and dim == -1 and not keepdim:
            return _Sym("gscore", group={**src.info["group"], "scoring": "topn_sum"})
        if src.kind == "weights" and dim == -1 and keepdim:
            return _Sym("wsum", weights=src, eps=None)
        return None

    def op_zeros_like(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "gscore":
            return _Sym("gmask", group=src.info["group"], filled=False)
        if src.kind == "hidden":
            return _Sym("acc")
        return None

    def op_scatter(self, node, name):
        target, dim, index = self.sym(node.args[0]), _arg(node, 1, "dim"), self.sym(_arg(node, 2, "index"))
        value = _arg(node, 3, "value", _arg(node, 3, "src"))
        if (target.kind == "gmask" and not target.info["filled"] and dim in (1, -1) and index.kind == "gidx"
                and value in (1, 1.0, True) and index.info["group"]["source"] is target.info["group"]["source"]):
            filled = target.but(group=index.info["group"], filled=True)
            if name.endswith("_"):
                self.syms[node.args[0]] = filled  # in place: later uses of the zeros see the mask
            return filled
        return _Unaccounted(f"scatter into {target.kind}")

    def op_bool(self, node, name):
        src = self.sym(node.args[0])
        return src if src.kind in ("gmask", "nmask") else None

    def op_invert(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "gmask" and src.info["filled"]:
            return src.but("nmask")
        return None

    op_logical_not = op_invert

    def op_eq(self, node, name):
        src, value = self.sym(node.args[0]), node.args[1]
        if src.kind == "gmask" and src.info["filled"] and value in (0, False):
            return src.but("nmask")
        return None

    def op_masked_fill(self, node, name):
        src, mask, value = self.sym(node.args[0]), self.sym(_arg(node, 1, "mask")), _arg(node, 2, "value")
        if name.endswith("_") or src.kind not in ("scores", "choice") or mask.kind != "nmask" or not _is_number(value):
            return _Unaccounted(f"masked fill of {src.kind} with {mask.kind}")
        group = dict(mask.info["group"])
        if group.pop("source") is not src:
            return _Unaccounted("group mask computed from other scores than the ones it masks")
        return _Sym("masked", router={**src.info["router"], "group": {**group, "fill": float(value)}})

    def op_gather(self, node, name):
        src, dim, index = self.sym(node.args[0]), _arg(node, 1, "dim"), self.sym(_arg(node, 2, "index"))
        if src.kind in ("scores", "choice") and dim in (1, -1) and index.kind == "ids":
            router = {**index.info["router"], "weights_from": src.kind, "steps": ()}
            return _Sym("weights", topk=index.info["topk"], router=router)
        return _Unaccounted(f"gather from {src.kind} at {index.kind}")

    def _weight_step(self, w: _Sym, step) -> _Sym:
        router = {**w.info["router"], "steps": w.info["router"]["steps"] + (step,)}
        return w.but(router=router)

    def op_div(self, node, name):
        a, b = self.sym(node.args[0]), self.sym(node.args[1])
        if a.kind == "weights" and b.kind == "wsum" and b.info["weights"].info["topk"] is a.info["topk"]:
            if b.info["weights"].info["router"]["steps"] != a.info["router"]["steps"]:
                return _Unaccounted("renormalisation by the sum of other weights")
            return self._weight_step(a, ("renorm", b.info["eps"]))
        if a.kind == "weights" and b.kind == "const" and _is_number(b.info["value"]):
            return self._weight_step(a, ("div", b.info["value"]))
        return _Unaccounted(f"{_describe(node)}: division of {a.kind} by {b.kind}")

    def op_mul(self, node, name):
        if len(node.args) != 2:
            return None
        a, b = self.sym(node.args[0]), self.sym(node.args[1])
        kinds = {a.kind, b.kind}
        if kinds == {"weights", "const"}:
            w, c = (a, b) if a.kind == "weights" else (b, a)
            if _is_number(c.info["value"]):
                return self._weight_step(w, ("scale", c.info["value"]))
        if kinds == {"sgate", "shared"}:
            gate, shared = (a, b) if a.kind == "sgate" else (b, a)
            (mlp, old_gate, flat, _), = shared.info["parts"]
            if old_gate is None:
                return shared.but(parts=((mlp, gate.info["gate"], flat, gate.info["flat"]),))
        if kinds == {"eout", "wsel"}:
            eout, wsel = (a, b) if a.kind == "eout" else (b, a)
            return _Sym("contrib", item=eout.info["item"], weights=wsel.info["weights"])
        return _Unaccounted(f"{_describe(node)}: product of {a.kind} and {b.kind}")

    # -- ModuleList dispatch
    def op_one_hot(self, node, name):
        return _Sym("aux") if self.sym(node.args[0]).kind == "ids" else None

    def op_where(self, node, name):
        if len(node.args) == 1 and not node.kwargs and self.sym(node.args[0]).kind in ("ids", "aux"):
            return _Sym("where")
        return None

    def op_zeros(self, node, name):
        if all(not isinstance(a, fx.Node) for a in node.args):
            return _Sym("acc")
        return None

    def op_index_add(self, node, name):
        acc, dim, index, src = (self.sym(node.args[0]), _arg(node, 1, "dim"), self.sym(_arg(node, 2, "index")),
                                self.sym(_arg(node, 3, "source")))
        if acc.kind not in ("acc", "routed") or dim != 0 or index.kind != "aux" or src.kind != "contrib":
            return _Unaccounted(f"index_add of {src.kind} into {acc.kind}")
        w = src.info["weights"]
        if acc.kind == "routed" and acc.info["topk"] is not w.info["topk"]:
            return _Unaccounted("experts weighted by different routings")
        items = (acc.info["items"] if acc.kind == "routed" else ()) + (src.info["item"],)
        routed = _Sym("routed", router=w.info["router"], topk=w.info["topk"], items=items)
        if name.endswith("_"):
            self.syms[node.args[0]] = routed
            if node.args[0].op == "get_attr":
                self.fresh = routed.but(fresh=True)
        return routed


def _dtype_of(node):
    val = g.meta_val(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


# ---------------------------------------------------------------------------------------------------------
# the fuser


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

        _inline_children(traced, keep)
        interp = _Interpreter(traced, experts_name, experts_kind, items, shared_specs)
        interp.run()
        out = _check_output(traced, interp)
        _check_accounted(module, traced, interp, out, experts_name, items)
        router = _router_spec(out.info["router"])
        if router.linear_is_module:
            width = module.get_submodule(router.linear).out_features
        else:
            width = _resolve(module, router.linear).shape[0]
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
                how = _apply_interface(module, match)
            else:
                how = _apply_module_list(module, match)
        except NoMatch as exc:
            row.reason = str(exc)
            return row
        row.status = "fused"
        shared = ", ".join(f"shared {s.kind}{' gated' if s.gate else ''}" for s in match.shared)
        row.reason = f"{match.num_experts} experts, router {match.router.describe()}"
        row.reason += (f", {shared}" if shared else "") + f"; {how}"
        return row


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
    flags = {k: getattr(experts, k, None) for k in ("has_gate", "has_bias", "has_post_expert_norm", "is_transposed",
                                                      "is_concatenated")}
    if flags["has_gate"] is not True:
        raise NoMatch("experts without gate (up projection only): not supported by the fused kernel")
    if flags["has_post_expert_norm"]:
        raise NoMatch("experts with a post-expert norm: not supported by the fused kernel")
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", None) is not _default_apply_gate:
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


def _check_output(traced: g.TracedModule, interp: _Interpreter) -> _Sym:
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
    flat = interp._hidden_flat(arg)
    if flat is None and (_shape_of(arg) is not None or not out.info.get("fresh")):
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


def _router_spec(r: dict) -> RouterSpec:
    group = r.get("group")
    return RouterSpec(
        linear=r["linear"], linear_is_module=r["linear_is_module"], linear_bias=r["linear_bias"],
        input_flat=r["input_flat"], input_dtypes=tuple(r["input_dtypes"]), weight_dtypes=tuple(r["weight_dtypes"]),
        router_dtype=r["router_dtype"], logits_dtypes=tuple(r.get("logits_dtypes", ())), scoring=r["scoring"],
        softmax_dtype=r["softmax_dtype"], score_dtypes=tuple(r.get("score_dtypes", ())),
        correction_bias=r.get("correction_bias"), correction_bias_dtypes=tuple(r.get("bias_dtypes", ())),
        n_group=group["n_group"] if group else None, topk_group=group["topk_group"] if group else None,
        group_scoring=group["scoring"] if group else None, group_topn=group["topn"] if group else None,
        group_fill=group["fill"] if group else None, group_sorted=group["sorted"] if group else None,
        top_k=r["top_k"], sorted=r["sorted"],
        weights_from=r["weights_from"], steps=tuple(r["steps"]),
    )


# ---------------------------------------------------------------------------------------------------------
# decorator experts: the registered implementation and the per-instance switch


class _ExpertsConfigView:
    """What one fused experts module reads as ``self.config``: the model's config, except that
    ``_experts_implementation`` says ``"mla_fuser"`` as long as the model's own choice is still the one it
    had when the block was fused.

    ``@use_experts_implementation`` picks the implementation at every call from
    ``self.config._experts_implementation``; that config object is shared by every experts module of the model,
    so setting it would switch blocks that were declined too.  The view switches this instance only, and a later
    ``model.set_experts_implementation(...)`` still wins.  Every other attribute (and every write) goes to the
    model's config.
    """

    def __init__(self, base):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_fused_over", getattr(base, "_experts_implementation", None))

    def __getattr__(self, name):
        if name in ("_base", "_fused_over") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name, value):
        setattr(self._base, name, value)

    @property
    def _experts_implementation(self):
        current = getattr(self._base, "_experts_implementation", None)
        if current == self._fused_over:
            return IMPL_NAME
        if current == "batched_mm" and self._fused_over == "grouped_mm" and id(self._base) in _DECODE_SWAP_KEPT.get():
            return IMPL_NAME  # generate()'s own decode-time swap, not a choice of the user (see keep_fused_experts)
        return current

    def __repr__(self):
        return f"_ExpertsConfigView({IMPL_NAME!r} over {self._fused_over!r} of {type(self._base).__name__})"


# Configs (by id) whose ``grouped_mm`` -> ``batched_mm`` switch is Transformers' ``generate`` swapping implementations
# for its decode steps (``_optimize_model_for_decode``) rather than a user's choice: fused experts stay fused there.
_DECODE_SWAP_KEPT: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mla_fuser_decode_swap", default=frozenset())


@contextlib.contextmanager
def keep_fused_experts(model: nn.Module):
    """Within the block, ``generate``'s decode-time switch from ``grouped_mm`` to ``batched_mm`` leaves this model's
    fused experts on the ``"mla_fuser"`` kernel (it would otherwise replace them with ``batched_mm`` for every
    decode step).  A model whose user chose another implementation before the call keeps that choice."""
    configs = {id(m.config._base) for m in model.modules()
               if isinstance(getattr(m, "config", None), _ExpertsConfigView)
               and getattr(m.config._base, "_experts_implementation", None) == m.config._fused_over == "grouped_mm"}
    token = _DECODE_SWAP_KEPT.set(_DECODE_SWAP_KEPT.get() | configs)
    try:
        yield
    finally:
        _DECODE_SWAP_KEPT.reset(token)


def install_generate_keeping_fused_experts(model: nn.Module) -> bool:
    """Wrap this instance's ``generate`` (whatever it is now: Transformers' or one of ours) in
    :func:`keep_fused_experts`.  False when the model has no generate or no experts switched by the fuser."""
    if not hasattr(model, "generate") or getattr(model, "_mla_fuser_keeps_experts", False):
        return False
    if not any(isinstance(getattr(m, "config", None), _ExpertsConfigView) for m in model.modules()):
        return False
    inner = model.generate

    def generate_keeping_fused_experts(self, *args, **kwargs):
        with keep_fused_experts(self):
            return inner(*args, **kwargs)

    model.generate = types.MethodType(generate_keeping_fused_experts, model)
    object.__setattr__(model, "_mla_fuser_keeps_experts", True)
    return True


_ACTIVATION_ATTR = "_mla_fuser_activation"


def _experts_activation(experts: nn.Module) -> str | None:
    """The experts' activation by what it computes, remembered on the module itself (a plain attribute, which
    torch.compile traces without guarding on a global cache)."""
    act = getattr(experts, "act_fn", None)
    cached = experts.__dict__.get(_ACTIVATION_ATTR)
    if cached is None or cached[0] is not act:
        cached = (act, activation_name(act) if act is not None else None)
        object.__setattr__(experts, _ACTIVATION_ATTR, cached)
    return cached[1]


def _previous_implementation(experts: nn.Module):
    """What runs when the kernel cannot: the implementation the model had chosen before fusion
    (``grouped_mm``, Transformers' default, when "mla_fuser" was asked for directly)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    config = getattr(experts, "config", None)
    name = config._fused_over if isinstance(config, _ExpertsConfigView) else None
    if name in (None, IMPL_NAME):
        name = "grouped_mm"
    original = inspect.unwrap(type(experts).forward)
    return ALL_EXPERTS_FUNCTIONS.get(name, original)


def _kernel_supports(experts: nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dtype not in _KERNEL_DTYPES or gate_up.device.type == "meta":
        return False
    if hidden.dtype not in _KERNEL_DTYPES or hidden.device != gate_up.device:
        return False
    if (getattr(experts, "has_gate", True) is not True or getattr(experts, "has_post_expert_norm", False)
            or getattr(experts, "_is_expert_parallel", False) or getattr(experts, "is_concatenated", True) is False
            or getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate):
        return False
    if torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad or gate_up.requires_grad):
        return False  # the kernel has no backward: training runs the previous implementation
    return _experts_activation(experts) is not None


def mla_fuser_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"mla_fuser"`` experts implementation: ``fused_experts`` on the module's 3-D weights.

    Same contract as Transformers' ``grouped_mm``/``batched_mm`` implementations (the decorator's flags on the
    instance give the layout; the default gate splits ``[gate; up]`` by halves).  What the kernel does not cover
    (no gate, post-expert norm, custom or ambiguous gating, expert parallelism, gradients, float64) runs the
    implementation chosen before.
    """
    from ..kernels.fused_moe import fused_experts

    if not _kernel_supports(self, hidden_states, top_k_weights):
        return _previous_implementation(self)(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = self.gate_up_proj, self.down_proj
    if getattr(self, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    bias = getattr(self, "has_bias", False)
    return fused_experts(
        hidden_states, gate_up, down, top_k_index, top_k_weights,
        gate_up_bias=self.gate_up_proj_bias if bias else None, down_bias=self.down_proj_bias if bias else None,
        activation=_experts_activation(self),
    )


def register_experts_implementation() -> None:
    """Register ``"mla_fuser"`` in Transformers' ``ExpertsInterface`` (class-wide, every instance sees it)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPL_NAME, mla_fuser_experts_forward)


register_experts_implementation()


def _apply_interface(module: nn.Module, match: MoEMatch) -> str:
    experts = module.get_submodule(match.experts)
    if isinstance(getattr(experts, "config", None), _ExpertsConfigView):
        return f"experts_implementation {IMPL_NAME!r} (already)"
    dispatcher = interface_experts_dispatcher(experts)
    if dispatcher is None or IMPL_NAME not in dispatcher:
        raise NoMatch("the experts dispatch through an interface without the 'mla_fuser' implementation")
    dtype = experts.gate_up_proj.dtype
    if dtype not in _KERNEL_DTYPES:
        raise NoMatch(f"experts weights are {dtype}: the kernel takes float16, bfloat16 or float32")
    config = getattr(experts, "config", None)
    if config is None:
        raise NoMatch("the experts module has no config to select its implementation from")
    if getattr(config, "_experts_implementation", None) == IMPL_NAME:
        return f"experts_implementation {IMPL_NAME!r} (selected by the model)"
    experts.config = _ExpertsConfigView(config)
    return f"experts module switched to experts_implementation {IMPL_NAME!r}"


# ---------------------------------------------------------------------------------------------------------
# ModuleList experts: stacked weights, routing replay, the bound forward


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
        weight = _resolve(block, spec.linear)
        for dtype in spec.weight_dtypes:
            weight = weight.to(dtype)
        logits = F.linear(x, weight, _resolve(block, spec.linear_bias) if spec.linear_bias else None)
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
        bias = _resolve(block, spec.correction_bias)
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
    from ..kernels.fused_moe import fused_experts

    plan: _ModuleListPlan = self.__dict__[PLAN_ATTR]
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


def _apply_module_list(module: nn.Module, match: MoEMatch) -> str:
    if isinstance(module.__dict__.get(PLAN_ATTR), _ModuleListPlan):
        return "forward bound to this block (already)"
    if "forward" in module.__dict__:
        raise NoMatch("the block instance already has its own forward")
    param = next(module.parameters())
    if param.device.type == "meta":
        raise NoMatch("meta weights: the fused forward cannot be checked")
    if param.dtype not in _KERNEL_DTYPES:
        raise NoMatch(f"weights are {param.dtype}: the kernel takes float16, bfloat16 or float32")
    plan = _ModuleListPlan(module, match)
    object.__setattr__(module, PLAN_ATTR, plan)
    module.forward = types.MethodType(_fused_module_list_forward, module)
    problem = _check_against_original(module, plan)
    if problem:
        del module.__dict__["forward"]
        del module.__dict__[PLAN_ATTR]
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
