"""libcst rewriting of an MLA module's forward source, compiled in the module's globals, bound to one instance.

Four edits, each only when nothing is in doubt (otherwise ``RewriteError`` with the reason, and the module
is left exactly as it was):

(a) the two projections of the hidden states, ``self.<q_a>(x)`` (q-LoRA's down-projection, or without q-LoRA
    the query projection ``self.<q_proj>(x)``) and ``self.<kv_a>(x)`` (one call each, same plain-name input, not
    reassigned in between), become one stacked GEMM ``self._mla_fuser_down(x)`` whose two outputs are bound to
    fresh names before the first statement that needs either;
(b) the K/V expansion method, found by signature (``self`` + 2 arguments, body uses the KV up-projection,
    every ``return`` a 2-tuple), has its single call in ``forward`` replaced by the tuple of its arguments,
    so the compressed latent (``kv_c_normed``, ``k_pe``) reaches the attention interface.  The names it
    assigned may afterwards only be passed to calls or asked for ``.shape[0]``/``.shape[2]``/``.shape[-2]``
    (batch and sequence, equal for latent and expanded tensors);
(c) every call ``a, b = f(a, b, *tables)`` (a plain function given positional arguments, its two results bound back
    to the two names it took: the shape of a rotary call) becomes ``self._mla_fuser_rotary(f, a, b, *tables)``,
    which runs the rotary kernel once ``f``'s first run showed which rotary it computes, and ``f`` itself
    otherwise (``rotary_call``);
(d) where the rotated query ``a`` of such a call has one later use, ``torch.cat((n, a), dim=-1)`` (the MLA query
    joined), the call goes through ``.before_join`` and the cat becomes ``self._mla_fuser_rotary.join(torch.cat,
    (n, a), dim=-1)``: the rotary launch also writes the joined query, and ``join`` returns it where it provably
    equals the cat (else it runs the cat), one launch less per layer (``RotaryCall.join``).

The new function is compiled with the original module's globals as ``__globals__`` (definitions land in a
scratch namespace, nothing is added to the transformers module) and bound to the *instance*; the class and
other instances are untouched.  The stacked weight is built once and the original projection weights become
views into it, so memory is not doubled and ``state_dict()`` keeps the original keys (see ``StackedLinear``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import linecache
import sys
import textwrap
import types

import libcst as cst
import torch
from torch import nn

from .compat import ATTENTION_NAME, attention_implementation, tensor_parallel_hooked
from .graph import is_plain_linear
from .kernels.fp8 import block_fp8_layout, block_fp8_linear
from .kernels.fp8.format import SCALE_NAME
from .kernels.skinny_linear import skinny_linear
from .rotary_call import ROTARY_ATTR, RotaryCall


class RewriteError(Exception):
    """The forward could not be rewritten with certainty; the message says why."""


STACKED_ATTR = "_mla_fuser_down"
SOURCE_ATTR = "_mla_fuser_source"


# ---------------------------------------------------------------------------------------------------------
# stacked down-projection


try:  # tensor parallelism shards parameters as DTensors
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None


def _is_dtensor(t) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


class StackedLinear:
    """Both projections of the hidden states (query side and KV down-projection) as one GEMM, sharing storage with
    the original linears.

    Deliberately not an ``nn.Module``: it holds no parameters of its own (so ``state_dict``, ``.to()``,
    ``save_pretrained`` only ever see the original weights).  The stacked weight is one tensor; the
    originals' ``.data`` are views into it.  When something replaces the originals' storage (a device or
    dtype move, a checkpoint load that swaps parameters), the aliasing check at the next call notices and
    re-stacks once; in-place loads (``load_state_dict``) write through the views directly.

    ``owner``/``names``: where the rewritten forward's module holds the two projections.  Each call takes what is
    there *now*: a projection replaced since (PEFT's ``get_peft_model`` puts a LoRA layer around it, ``unload``
    puts it back) is noticed by identity, and anything but two plain linears (``graph.is_plain_linear``) is
    called as itself, so adapters always run; two plain linears are (re-)stacked.

    Under ``torch.compile`` the two projections are always called as themselves: a compiled graph is replayed
    without re-running this Python, so the aliasing check could not notice a dtype move or an assigning load made
    after compilation, and a stored stack would silently be stale.  Correctness over the one-GEMM saving.

    Multi-device: the two linears are called as themselves (hooks and all, no stacking) whenever the stacked GEMM
    would bypass something their own forward does: weights on ``meta`` (accelerate offload: the module's hook
    loads them per call; stacking them would also keep a copy of offloaded weights alive), weights on another
    device than the input (a ``device_map`` hook moves it), DTensor weights (a tensor-parallel plan that shards
    them), or a tensor-parallel style hooked on them while gradients are recorded (its backward collectives).
    """

    def __init__(self, first: nn.Module, second: nn.Module, owner: nn.Module | None = None,
                 names: tuple[str, str] | None = None):
        self.first, self.second = first, second
        self.owner, self.names = owner, names
        self.weight = None
        self.bias = None
        self.fp8_scale = self.fp8_block = None  # FP8 (issue 15): the stacked block scales, when stacked
        self.restack()

    def _current(self) -> tuple[nn.Module, nn.Module]:
        if self.owner is None:
            return self.first, self.second
        a, b = self.names
        children = self.owner._modules  # (direct children, the usual case, without get_submodule's walk)
        return (children[a] if a in children else self.owner.get_submodule(a),
                children[b] if b in children else self.owner.get_submodule(b))

    def _aliased(self) -> bool:
        w = self.weight
        if w is None:
            return False
        a, b = self.first.weight, self.second.weight
        return (
            a.device == w.device and a.dtype == w.dtype and b.device == w.device and b.dtype == w.dtype
            and a.data_ptr() == w.data_ptr()
            and b.data_ptr() == w.data_ptr() + self.sizes[0] * w.shape[1] * w.element_size()
            and (self.bias is None or (self.first.bias.data_ptr() == self.bias.data_ptr()))
            and (self.fp8_scale is None or _fp8_scales_aliased(self.first, self.second, self.fp8_scale))
        )

    def _direct(self, x: torch.Tensor) -> bool:
        """Whether to run the two linears as themselves instead of the stacked GEMM (see the class doc)."""
        for lin in (self.first, self.second):
            w = lin.weight
            if w.device.type == "meta" or w.device != x.device or _is_dtensor(w) or _is_dtensor(lin.bias):
                return True
            if tensor_parallel_hooked(lin) and torch.is_grad_enabled():
                return True  # a Transformers tensor-parallel style wraps its forward (backward all-reduces)
        return False

    @torch.no_grad()
    def restack(self) -> None:
        a, b = self.first, self.second
        self.weight = self.bias = self.fp8_scale = self.fp8_block = None
        if not (is_plain_linear(a) and is_plain_linear(b)):
            return
        if a.weight.device.type == "meta" or b.weight.device.type == "meta" or _is_dtensor(a.weight) \
                or _is_dtensor(b.weight) or a.weight.device != b.weight.device:
            return
        if fp8_stacking_problem(a, b) is not None:
            return  # (not stackable: each is called as itself, through its own FP8 forward)
        self.sizes = [a.out_features, b.out_features]
        self._stack_fp8_scales(a, b)
        weight = torch.cat([a.weight.detach(), b.weight.detach()], dim=0)
        a.weight.data = weight[: self.sizes[0]]
        b.weight.data = weight[self.sizes[0]:]
        self.weight = weight
        if a.bias is not None or b.bias is not None:
            zeros = lambda lin: torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)  # noqa: E731
            bias = torch.cat([
                a.bias.detach() if a.bias is not None else zeros(a),
                b.bias.detach() if b.bias is not None else zeros(b),
            ])
            if a.bias is not None:
                a.bias.data = bias[: self.sizes[0]]
            if b.bias is not None:
                b.bias.data = bias[self.sizes[0]:]
            self.bias = bias

    @torch.no_grad()
    def _stack_fp8_scales(self, a: nn.Module, b: nn.Module) -> None:
        """FP8 (issue 15): block scales stacked like the weights (block rows stay aligned: ``fp8_stacking_problem``),
        the originals' scales becoming views of the stack."""
        layout = block_fp8_layout(a)
        if layout is None:
            return
        scales = [getattr(lin, SCALE_NAME) for lin in (a, b)]
        stacked = torch.cat([t.detach() for t in scales], dim=0)
        rows = scales[0].shape[0]
        scales[0].data, scales[1].data = stacked[:rows], stacked[rows:]
        self.fp8_scale, self.fp8_block = stacked, layout.block

    def __call__(self, x: torch.Tensor):
        first, second = self._current()
        weight = self.weight
        if (weight is not None and first is self.first and second is self.second and self.fp8_scale is None
                and not torch.is_grad_enabled() and x.device == weight.device and is_plain_linear(first)
                and is_plain_linear(second) and not torch.compiler.is_compiling() and self._aliased()):
            # the common inference call, decided in a few checks (it runs at every layer of an eager step): the
            # originals are still the views of the stack on the input's device, so none of ``_direct``'s cases
            # (meta, another device, DTensor; tensor-parallel hooks only matter while gradients are recorded) holds
            # (a captured decode step's few rows take the skinny GEMM: kernels.skinny_linear)
            return tuple(skinny_linear(x, weight, self.bias).split(self.sizes, dim=-1))
        if torch.compiler.is_compiling() or not (is_plain_linear(first) and is_plain_linear(second)):
            return first(x), second(x)
        if first is not self.first or second is not self.second:  # replaced since stacked: drop the stale stack
            self.first, self.second = first, second
            self.weight = self.bias = None
        if self._direct(x):
            if self.weight is not None and not self._aliased():
                self.weight = self.bias = None  # the originals were replaced (e.g. offloaded): hold no stale copy
            return first(x), second(x)
        if not self._aliased():
            self.restack()
        if self.weight is None:  # weights that cannot be stacked
            return first(x), second(x)
        weight = self.weight
        if self.fp8_scale is not None:  # FP8 (issue 15): one block-FP8 GEMM over the stacked weight and scales
            if torch.is_grad_enabled() and x.requires_grad:
                return first(x), second(x)
            out = block_fp8_linear(x, weight, self.fp8_scale, self.fp8_block, self.bias)
            return tuple(out.split(self.sizes, dim=-1))
        if first.weight.requires_grad and torch.is_grad_enabled():
            # training: gradients must reach the original parameters, so use them (a cat, not a view)
            weight = torch.cat([first.weight, second.weight])
        out = nn.functional.linear(x, weight, self.bias)
        return tuple(out.split(self.sizes, dim=-1))

    def __deepcopy__(self, memo):
        import copy

        # the owner is usually being copied already (its ``__dict__`` holds this object): ``memo`` has its copy
        return StackedLinear(copy.deepcopy(self.first, memo), copy.deepcopy(self.second, memo),
                             copy.deepcopy(self.owner, memo), self.names)


def stacked_query_projection(match) -> str:
    """The query-side projection of the hidden states stacked with the KV down-projection: q-LoRA's
    down-projection, or (no q-LoRA) the query projection itself, whose GEMM then also covers ``kv_a`` (one weight
    read and one launch fewer per layer and step)."""
    return match.q_a_proj if match.q_a_proj is not None else match.q_proj


def fp8_stacking_problem(first: nn.Module, second: nn.Module) -> str | None:
    """Why two down-projections cannot share one block-FP8 GEMM, or None (also None when neither is FP8).

    Stacking concatenates the weights along the output rows and the block scales likewise, so every block of the
    second projection must start on a block boundary of the stack: the first's output rows must be a whole number of
    blocks, and both must use the same block size (a per-tensor scale cannot be shared)."""
    layouts = block_fp8_layout(first), block_fp8_layout(second)
    if layouts == (None, None):
        return None
    a, b = layouts
    if a is None or b is None:
        return "one down-projection is block-FP8 and the other is not"
    if a.per_tensor or b.per_tensor:
        return "per-tensor FP8 scales cannot be shared by a stacked GEMM"
    if a.block != b.block:
        return f"block sizes differ ({a.block} vs {b.block})"
    if a.out_features % a.block_n:
        return (f"the first down-projection's {a.out_features} output rows are not a whole number of "
                f"{a.block_n}-row scale blocks: the stacked blocks would not align")
    return None


def _fp8_scales_aliased(first: nn.Module, second: nn.Module, stacked: torch.Tensor) -> bool:
    a, b = getattr(first, SCALE_NAME, None), getattr(second, SCALE_NAME, None)
    return (a is not None and b is not None and a.data_ptr() == stacked.data_ptr()
            and b.data_ptr() == stacked.data_ptr() + a.numel() * stacked.element_size())


# ---------------------------------------------------------------------------------------------------------
# source helpers


def _defining_class(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    raise RewriteError(f"{cls.__name__} has no {name}")


def _function_source(fn) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise RewriteError(f"source of {getattr(fn, '__qualname__', fn)} is unreadable: {exc}") from exc


def _self_attr_call(node: cst.CSTNode, attr: str | None = None) -> bool:
    """``self.<attr>(...)`` (attr None: any attribute)."""
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and isinstance(node.func.value, cst.Name)
        and node.func.value.value == "self"
        and (attr is None or node.func.attr.value == attr)
    )


class _Collect(cst.CSTVisitor):
    def __init__(self, predicate):
        self.predicate = predicate
        self.found: list[cst.CSTNode] = []

    def visit_Call(self, node: cst.Call):
        if self.predicate(node):
            self.found.append(node)


def _find_calls(tree: cst.CSTNode, predicate) -> list[cst.Call]:
    visitor = _Collect(predicate)
    tree.visit(visitor)
    return visitor.found


class _Names(cst.CSTVisitor):
    def __init__(self):
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name):
        self.names.add(node.value)


def _names_in(tree: cst.CSTNode) -> set[str]:
    v = _Names()
    tree.visit(v)
    return v.names


def _contains(tree: cst.CSTNode, target: cst.CSTNode) -> bool:
    found = []

    class V(cst.CSTVisitor):
        def on_visit(self, node):
            if node is target:
                found.append(True)
            return not found

    tree.visit(V())
    return bool(found)


def _assigned_names(stmt: cst.CSTNode) -> set[str]:
    names = set()

    class V(cst.CSTVisitor):
        def visit_AssignTarget(self, node):
            names.update(_names_in(node.target))

        def visit_AugAssign(self, node):
            names.update(_names_in(node.target))

        def visit_AnnAssign(self, node):
            names.update(_names_in(node.target))

        def visit_For(self, node):
            names.update(_names_in(node.target))

        def visit_NamedExpr(self, node):
            names.update(_names_in(node.target))

    stmt.visit(V())
    return names


def _expansion_method(cls: type, kv_b: str) -> str:
    """Name of the method that expands the latent: self + 2 args, uses ``self.<kv_b>``, returns pairs."""
    candidates = []
    seen = set()
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for name, fn in klass.__dict__.items():
            if name in seen or name == "forward" or not inspect.isfunction(fn):
                continue
            seen.add(name)
            params = list(inspect.signature(fn).parameters.values())
            if len(params) != 3 or any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
                continue
            try:
                tree = cst.parse_module(_function_source(fn))
            except (RewriteError, cst.ParserSyntaxError):
                continue
            uses_kv_b = any(
                isinstance(n, cst.Attribute) and isinstance(n.value, cst.Name) and n.value.value == "self"
                and n.attr.value == kv_b
                for n in _walk(tree)
            )
            returns = [n for n in _walk(tree) if isinstance(n, cst.Return)]
            pairs = returns and all(isinstance(r.value, cst.Tuple) and len(r.value.elements) == 2 for r in returns)
            if uses_kv_b and pairs:
                candidates.append(name)
    if len(candidates) != 1:
        raise RewriteError(f"expected one K/V expansion method by signature, found {candidates}")
    return candidates[0]


def _walk(tree: cst.CSTNode):
    out = []

    class V(cst.CSTVisitor):
        def on_visit(self, node):
            out.append(node)
            return True

    tree.visit(V())
    return out


# ---------------------------------------------------------------------------------------------------------
# the rewrite


class _Replace(cst.CSTTransformer):
    def __init__(self, mapping: dict[int, cst.CSTNode]):
        self.mapping = mapping

    def on_leave(self, original, updated):
        return self.mapping.get(id(original), updated)


def _fresh(name: str, taken: set[str]) -> str:
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate


def _top_statement_index(body: list[cst.CSTNode], node: cst.CSTNode) -> int:
    for i, stmt in enumerate(body):
        if _contains(stmt, node):
            return i
    raise RewriteError("call not found in the function body")


def build_rewritten_source(module: nn.Module, match) -> tuple[str, str, type]:
    """Return ``(original_source, new_source, defining_class)`` of the rewritten forward."""
    cls = type(module)
    owner = _defining_class(cls, "forward")
    forward = owner.__dict__["forward"]
    if inspect.unwrap(forward).__code__.co_freevars:
        raise RewriteError("forward is a closure (e.g. zero-argument super()); cannot recompile it")
    source = _function_source(forward)
    try:
        tree = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise RewriteError(f"forward source does not parse: {exc}") from exc
    funcs = [s for s in tree.body if isinstance(s, cst.FunctionDef)]
    if len(funcs) != 1:
        raise RewriteError("forward source is not a single function definition")
    func = funcs[0]
    if not isinstance(func.body, cst.IndentedBlock):
        raise RewriteError("forward body is a one-liner")
    body = list(func.body.body)
    taken = _names_in(tree)
    replacements: dict[int, cst.CSTNode] = {}
    inserts: dict[int, list[cst.BaseStatement]] = {}

    # (b) bypass the K/V expansion
    expand = _expansion_method(cls, match.kv_b_proj)
    calls = _find_calls(func, lambda c: _self_attr_call(c, expand))
    if len(calls) != 1:
        raise RewriteError(f"expected one call of self.{expand}, found {len(calls)}")
    call = calls[0]
    if len(call.args) != 2 or any(a.keyword is not None or a.star for a in call.args):
        raise RewriteError(f"self.{expand} is not called with two positional arguments")
    replacements[id(call)] = cst.Tuple(elements=[cst.Element(call.args[0].value), cst.Element(call.args[1].value)])
    index = _top_statement_index(body, call)
    stmt = body[index]
    targets = _expansion_targets(stmt, call)
    _check_later_uses(body[index + 1:], targets)

    # (a) stack the two projections of the hidden states: the query's first one (q-LoRA's down-projection, or the
    # whole query projection without q-LoRA) and the KV down-projection
    q_first = stacked_query_projection(match)
    q_calls = _find_calls(func, lambda c: _self_attr_call(c, q_first))
    kv_calls = _find_calls(func, lambda c: _self_attr_call(c, match.kv_a_proj))
    if len(q_calls) != 1 or len(kv_calls) != 1:
        raise RewriteError(
            f"expected one call each of self.{q_first} and self.{match.kv_a_proj}, "
            f"found {len(q_calls)} and {len(kv_calls)}"
        )
    qc, kc = q_calls[0], kv_calls[0]
    for c in (qc, kc):
        if len(c.args) != 1 or c.args[0].keyword is not None or c.args[0].star:
            raise RewriteError("a projection of the hidden states is not called with one positional argument")
    x_q, x_kv = qc.args[0].value, kc.args[0].value
    if not (isinstance(x_q, cst.Name) and isinstance(x_kv, cst.Name) and x_q.value == x_kv.value):
        raise RewriteError("the query and KV projections do not take the same plain variable")
    first = min(_top_statement_index(body, qc), _top_statement_index(body, kc))
    last = max(_top_statement_index(body, qc), _top_statement_index(body, kc))
    for s in body[first:last + 1]:
        if x_q.value in _assigned_names(s):
            raise RewriteError(f"{x_q.value} is reassigned between the query and KV projections")
    q_name, kv_name = _fresh("_mla_q_latent", taken), _fresh("_mla_kv_latent", taken)
    stacked = cst.parse_statement(f"{q_name}, {kv_name} = self.{STACKED_ATTR}({x_q.value})\n")
    inserts.setdefault(first, []).append(stacked)
    replacements[id(qc)] = cst.Name(q_name)
    replacements[id(kc)] = cst.Name(kv_name)

    # (c) rotary calls ``a, b = f(a, b, *tables)`` go through ``self._mla_fuser_rotary(f, a, b, *tables)``; (d) where
    # ``a``'s one later use is ``torch.cat((n, a), dim=-1)``, through ``.before_join`` and that cat through ``.join``
    rotary_calls = _rotary_calls(func)
    for call in rotary_calls:
        cat = _joining_cat(body, call, rotary_calls)
        method = f"self.{ROTARY_ATTR}" if cat is None else f"self.{ROTARY_ATTR}.before_join"
        replacements[id(call)] = call.with_changes(
            func=cst.parse_expression(method), args=[cst.Arg(call.func), *call.args])
        if cat is not None:
            replacements[id(cat)] = cat.with_changes(
                func=cst.parse_expression(f"self.{ROTARY_ATTR}.join"), args=[cst.Arg(cat.func), *cat.args])

    new_func = func.visit(_Replace(replacements))
    new_body = list(new_func.body.body)
    for idx in sorted(inserts, reverse=True):
        new_body[idx:idx] = inserts[idx]
    new_func = new_func.with_changes(body=new_func.body.with_changes(body=new_body))
    new_source = tree.with_changes(body=[new_func if s is func else s for s in tree.body]).code
    return source, new_source, owner


def _rotary_calls(func: cst.FunctionDef) -> list[cst.Call]:
    """Calls of the form ``a, b = f(a, b, *rest)``: a plain function (a name, not an attribute: no module state)
    given positional arguments only, whose two results are bound back to the two names it was given.  Only the
    shape of the call is read here; what ``f`` computes is checked at its first run (``rotary_call``), and ``f``
    runs itself whenever that check did not find a rotary recipe."""
    found = []
    for node in _walk(func):
        if not (isinstance(node, cst.Assign) and len(node.targets) == 1 and isinstance(node.value, cst.Call)):
            continue
        target, call = node.targets[0].target, node.value
        if not (isinstance(target, cst.Tuple) and len(target.elements) == 2 and isinstance(call.func, cst.Name)):
            continue
        names = [e.value.value if isinstance(e.value, cst.Name) else None for e in target.elements]
        args = call.args
        if len(args) < 3 or any(a.keyword is not None or a.star for a in args) or None in names:
            continue
        if [a.value.value if isinstance(a.value, cst.Name) else None for a in args[:2]] == names:
            found.append(call)
    return found


def _is_torch_cat(node: cst.CSTNode) -> bool:
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "cat"
            and isinstance(node.func.value, cst.Name) and node.func.value.value == "torch")


def _references(stmt: cst.CSTNode, name: str) -> list[cst.Name]:
    """The ``Name`` nodes of ``stmt`` that read or write the variable ``name`` (not attribute names, keywords or
    parameters)."""
    skip: set[int] = set()
    for node in _walk(stmt):
        if isinstance(node, cst.Attribute):
            skip.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            skip.add(id(node.keyword))
        elif isinstance(node, cst.Param):
            skip.add(id(node.name))
    return [n for n in _walk(stmt) if isinstance(n, cst.Name) and n.value == name and id(n) not in skip]


def _joining_cat(body: list[cst.CSTNode], call: cst.Call, rotary_calls: list[cst.Call]) -> cst.Call | None:
    """The ``torch.cat((n, a), dim=-1)`` call (a 2-sequence, ``a`` second, the last dim) that is the only use of
    the rotated query ``a`` of rotary call ``call`` before ``a`` is assigned again; None when there is no such single
    use.  Within the top-level statement that holds ``call`` (an ``if`` choosing between two rotaries, say) ``a`` may
    only appear in rotary calls' assignments (``rotary_calls``: ``_rotary_calls``); uses are counted from the next
    statement on.  What ``RotaryCall.join`` then returns is checked when it runs."""
    index = next((i for i, stmt in enumerate(body) if any(node is call for node in _walk(stmt))), None)
    if index is None:
        return None
    assigns = {id(node.value): node for node in _walk(body[index])
               if isinstance(node, cst.Assign) and any(node.value is c for c in rotary_calls)}
    name = assigns[id(call)].targets[0].target.elements[0].value.value
    allowed = {id(n) for a in assigns.values() if a.targets[0].target.elements[0].value.value == name
               for n in _references(a, name)}
    if any(id(n) not in allowed for n in _references(body[index], name)):
        return None
    uses: list[cst.Name] = []
    cats: dict[int, cst.Call] = {}
    for stmt in body[index + 1:]:
        for node in _walk(stmt):
            if _is_torch_cat(node) and node.args and isinstance(node.args[0].value, (cst.Tuple, cst.List)):
                elements = node.args[0].value.elements
                if (len(elements) == 2 and all(type(e) is cst.Element for e in elements)  # (no *starred)
                        and isinstance(elements[1].value, cst.Name)):
                    cats[id(elements[1].value)] = node
        uses += _references(stmt, name)
        if name in _assigned_names(stmt):
            break
    if len(uses) != 1 or id(uses[0]) not in cats:
        return None
    cat = cats[id(uses[0])]
    dims = list(cat.args[1:])
    if len(dims) != 1 or dims[0].star or (dims[0].keyword is not None and dims[0].keyword.value != "dim"):
        return None
    dim = dims[0].value
    if not (isinstance(dim, cst.UnaryOperation) and isinstance(dim.operator, cst.Minus)
            and isinstance(dim.expression, cst.Integer) and dim.expression.value == "1"):
        return None
    return cat


def _expansion_targets(stmt: cst.CSTNode, call: cst.Call) -> list[str]:
    inner = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
    if not (isinstance(inner, (cst.Assign, cst.AnnAssign)) and inner.value is call):
        raise RewriteError("the K/V expansion result is not directly assigned")
    target = inner.targets[0].target if isinstance(inner, cst.Assign) else inner.target
    if isinstance(inner, cst.Assign) and len(inner.targets) != 1:
        raise RewriteError("chained assignment of the K/V expansion")
    if not (isinstance(target, cst.Tuple) and len(target.elements) == 2
            and all(isinstance(e.value, cst.Name) for e in target.elements)):
        raise RewriteError("the K/V expansion is not unpacked into two names")
    return [e.value.value for e in target.elements]


_ALLOWED_SHAPE_INDEX = {"0", "2", "-2"}


def _check_later_uses(stmts: list[cst.CSTNode], names: list[str]) -> None:
    """Key/value names may only be call arguments or asked for batch/sequence sizes afterwards."""
    for stmt in stmts:
        if set(names) & _assigned_names(stmt):
            if _find_calls(stmt, lambda c: isinstance(c.func, cst.Attribute) and c.func.attr.value == "update"
                           and any(isinstance(a.value, cst.Name) and a.value.value in names for a in c.args)):
                # (the DSA architectures of Transformers 5.17 cache K/V after expanding them; from 5.18 the latent)
                raise RewriteError("the forward caches the expanded key/value states, not the latent: there is no "
                                   "latent to attend over (this architecture caches its latent from transformers 5.18)")
            raise RewriteError("key/value states are reassigned after the expansion")
        allowed: set[int] = set()
        for node in _walk(stmt):
            if isinstance(node, cst.Call):
                for arg in node.args:
                    if isinstance(arg.value, cst.Name) and arg.value.value in names and not arg.star:
                        allowed.add(id(arg.value))
            if (isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute)
                    and node.value.attr.value == "shape" and isinstance(node.value.value, cst.Name)
                    and node.value.value.value in names and len(node.slice) == 1
                    and isinstance(node.slice[0].slice, cst.Index)):
                idx = cst.Module(body=[]).code_for_node(node.slice[0].slice.value)
                if idx.replace(" ", "") in _ALLOWED_SHAPE_INDEX:
                    allowed.add(id(node.value.value))
        for node in _walk(stmt):
            if isinstance(node, cst.Name) and node.value in names and id(node) not in allowed:
                raise RewriteError(
                    f"{node.value} is used after the expansion other than as a call argument or batch/sequence size"
                )


_COMPILED = 0


def compile_forward(new_source: str, owner: type):
    """Compile the rewritten function with the defining module's globals; return the plain function."""
    global _COMPILED
    globals_ = sys.modules[owner.__module__].__dict__
    _COMPILED += 1
    filename = f"<mla_fuser rewritten {owner.__qualname__}.forward #{_COMPILED}>"
    linecache.cache[filename] = (len(new_source), None, new_source.splitlines(True), filename)
    code = compile(new_source, filename, "exec")
    scratch: dict = {}
    exec(code, globals_, scratch)  # definitions land in ``scratch``; the module's namespace is not touched
    fns = [v for v in scratch.values() if callable(v)]
    if len(fns) != 1:
        raise RewriteError("compiled source defined an unexpected number of callables")
    return fns[0]


def _routed_by_attention_implementation(fused, unfused):
    """The instance forward: the rewritten one while the model's attention implementation is ``vllm_mla``, the
    class's own otherwise.  The rewritten forward hands the latent to whatever function the config names, so after
    ``set_attn_implementation("eager")`` (assisted-decoding tests do this) it must not run: the class's forward
    expands K/V as Transformers does and the chosen function gets what it expects."""

    @functools.wraps(fused)
    def forward(self, *args, **kwargs):
        if attention_implementation(self) not in (None, ATTENTION_NAME):
            return unfused(self, *args, **kwargs)
        return fused(self, *args, **kwargs)

    return forward


def rewrite_mla_forward(module: nn.Module, match) -> str:
    """Rewrite ``module``'s forward in place (instance only); returns the unified diff of the source."""
    original, new_source, owner = build_rewritten_source(module, match)
    fn = compile_forward(new_source, owner)
    names = (stacked_query_projection(match), match.kv_a_proj)
    stacked = StackedLinear(*(module.get_submodule(n) for n in names), owner=module, names=names)
    object.__setattr__(module, STACKED_ATTR, stacked)
    object.__setattr__(module, ROTARY_ATTR, RotaryCall())
    bound = types.MethodType(_routed_by_attention_implementation(fn, type(module).forward), module)
    if getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__:
        # an accelerate hook (``device_map`` dispatch, offload) wraps this instance's forward: replace what it
        # wraps, so the hook keeps running around the fused forward (and ``remove_hook_from_module`` restores it)
        module._old_forward = bound
    else:
        module.forward = bound
    diff = "".join(difflib.unified_diff(
        original.splitlines(True), new_source.splitlines(True),
        fromfile=f"{owner.__qualname__}.forward (transformers)", tofile=f"{owner.__qualname__}.forward (mla-fuser)",
    ))
    object.__setattr__(module, SOURCE_ATTR, diff)
    return diff
