"""torch.fx tracing of one module's forward, with meta-tensor shapes.

Why a custom tracer: Hugging Face forwards read shapes (``hidden_states.shape[:-1]``, ``*x.shape[:-1]``)
and unpack tuples; plain symbolic tracing fails on those.  ``MetaTracer`` attaches a meta tensor (shape and
dtype, no data) to every node it creates, computed by running the op on meta inputs, so shape queries get
concrete answers.  The graph is used for *analysis only* (finding roles and data flow); it is never run.

Rules of the trace:
* every child module is a leaf (one ``call_module`` node; its output shape comes from running the child
  with meta copies of its parameters);
* the attention-interface call is one opaque node (``attention.py``);
* an item write ``t[i] = v`` is one ``operator.setitem`` node (plain fx proxies refuse item assignment);
* inputs: the first forward argument is the hidden states (a meta tensor); arguments annotated as a
  transformers ``Cache`` and other arguments without a tensor annotation are passed concretely (their
  default); tensor-like arguments are "wildcards" whose meta value is a 0-d tensor, which broadcasts through
  element-wise code (rotary embeddings) without inventing a shape;
* with real example inputs (``fuse`` captures them with a 3-token forward) every op whose inputs all have real
  values is also run for real, and the node's meta value is taken from that result: data-dependent children
  (a DSA indexer's boolean indexing / ``nonzero``) then still get concrete output shapes.  Control flow is never
  specialised on those values (``bool()`` of a proxy still fails), the example tensors are private copies, and
  attributes fx adds to the root while tracing (``_tensor_constant<i>``) are removed afterwards.
"""

from __future__ import annotations

import bisect
import dis
import inspect
import operator
import threading
import typing
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from . import values as nested
from .attention import (
    _opaque_attention, attention_traced_opaquely, is_attention_node, opaque_attention_meta, register_tracing_interface,
)

# fx tracing patches ``nn.Module.__call__`` / ``__getattr__`` and module globals for the whole process while it
# runs, and torch keeps one current patcher: two traces in two threads interleave their patches (one leaves the
# other's behind for good) or fail outright.  Every trace, and every ``fuse`` (which traces and fills caches shared
# by the process), holds this lock; re-entrant because a trace may trace a child (RMSNorm by computation).
TRACE_LOCK = threading.RLock()


class TraceError(RuntimeError):
    """The module's forward could not be traced; the reason is the message."""


# "no real value" (``None`` is a real result of some ops)
_NO_REAL = object()


class MetaProxy(fx.Proxy):
    """A proxy that answers shape/dtype queries from the meta tensor attached to its node."""

    @property
    def meta(self):
        return self.node.meta.get("val", None)

    def __getattr__(self, name):
        meta = self.node.meta.get("val", None)
        if isinstance(meta, torch.Tensor):
            if name in ("shape", "dtype", "ndim"):
                return getattr(meta, name)
            if name == "device":
                return meta.device
            if name in ("size", "dim", "numel", "is_complex", "is_floating_point", "element_size"):
                return getattr(meta, name)
        return super().__getattr__(name)

    def __len__(self):
        meta = self.meta
        if isinstance(meta, (torch.Tensor, tuple, list)):
            return len(meta)
        raise TraceError("len() of a value of unknown shape")

    def __iter__(self):
        meta = self.meta
        if isinstance(meta, (tuple, list)):
            return iter([self[i] for i in range(len(meta))])
        if isinstance(meta, torch.Tensor) and meta.ndim > 0:
            return iter([self[i] for i in range(meta.shape[0])])
        # unknown length: only ``a, b = proxy`` can be traced (the caller's bytecode says how many)
        caller = inspect.currentframe().f_back
        instructions = list(dis.get_instructions(caller.f_code))
        index = bisect.bisect_left(instructions, caller.f_lasti, key=lambda ins: ins.offset)
        if index < len(instructions) and instructions[index].opname == "UNPACK_SEQUENCE":
            return iter([self[i] for i in range(instructions[index].argval)])
        raise TraceError("iteration over a value of unknown length")

    def __setitem__(self, index, value):
        # an item write (``buf[..., :n] = part``: modeling code fills ``new_empty`` buffers so) is one
        # ``operator.setitem`` node, which plain fx proxies refuse; ``queries.reaches`` can follow it
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    def __bool__(self):
        raise TraceError("data-dependent control flow (bool() of a traced tensor)")

    def __index__(self):
        raise TraceError("data-dependent integer (index of a traced tensor)")


class MetaTracer(fx.Tracer):
    """fx tracer with every child module a leaf and meta-tensor shapes on every node."""

    def __init__(self, root: nn.Module, opaque_functions=()):
        super().__init__()
        self.root_module = root
        self._owned_modules = {id(m) for m in root.modules()}
        # functions recorded as single call nodes (not traced into) wherever the forward calls them by a
        # global name, e.g. a modeling file's kernel entry points
        self._autowrap_function_ids.update(id(f) for f in opaque_functions)
        self.placeholder_meta: dict[str, object] = {}
        # real example values of the placeholders (when the trace has real example inputs): every node whose
        # inputs all have real values is also run for real, and its meta value is taken from that result
        self.placeholder_real: dict[str, object] = {}
        self._real: dict[fx.Node, object] = {}
        self._meta_params: dict[int, dict[str, torch.Tensor]] = {}
        self._computing_meta = False

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # a child run for real (or on meta copies) reads its own parameters plainly, never as graph nodes
        if self._computing_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        # ``*args`` / ``**kwargs`` of the forward become empty containers, not proxies: HF forwards pass
        # ``**kwargs`` straight on (to the attention call), which fx cannot expand from a proxy.
        root_fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        args = list(args)
        for i, arg in enumerate(args):
            if isinstance(arg, fx.Proxy) and arg.node.op == "placeholder" and str(arg.node.target).startswith("*"):
                empty = {} if str(arg.node.target).startswith("**") else ()
                self.graph.erase_node(arg.node)
                args[i] = empty
        return root_fn, args

    def call_module(self, m, forward, args, kwargs):
        # While a leaf's meta output is computed, fx's patched ``Module.__call__`` is still active: run the
        # module plainly instead of recording it a second time.
        if self._computing_meta:
            return forward(*args, **kwargs)
        if id(m) not in self._owned_modules:
            # a module created inside the forward (e.g. ``ACT2FN["silu"](x)``): not a child, trace through it
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return MetaProxy(node, self)

    def _meta_state(self, mod: nn.Module) -> dict[str, torch.Tensor]:
        key = id(mod)
        if key not in self._meta_params:
            state = {}
            for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
                state[name] = torch.empty_like(t, device="meta")
            self._meta_params[key] = state
        return self._meta_params[key]

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        # fx names nodes after the target's ``__name__``, which a callable object (a ``kernels`` function module)
        # lacks: after its class then
        if name is None and kind == "call_function" and not hasattr(target, "__name__"):
            name = type(target).__name__.lower()
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        self._computing_meta = True
        try:
            real = self._compute_real(kind, target, args, kwargs)
            if real is not _NO_REAL and nested.meta_representable(real):
                self._real[node] = real
                node.meta["val"] = nested.to_meta(real)
                return proxy
            node.meta["val"] = self._compute_meta(kind, target, args, kwargs)
        except Exception:
            # An op on a wildcard input (a 0-d stand-in for an input of unknown shape) that 0-d cannot
            # satisfy (``unsqueeze(1)``, indexing) stays a wildcard; anything else becomes unknown.
            node.meta["val"] = nested.wildcard() if nested.has_wildcard(nested.meta_of((args, kwargs))) else None
        finally:
            self._computing_meta = False
        return proxy

    def _compute_real(self, kind, target, args, kwargs):
        """The op run on real example values (``_NO_REAL`` when an input has none or the op fails).

        Real values make data-dependent children (a DSA indexer's boolean indexing, ``nonzero``) yield the
        shapes that meta tensors cannot.  Only ever run on a few example tokens; the graph is still only
        analysed, and control flow is never specialised on these values (``bool()`` of a proxy still fails).
        """
        if not self.placeholder_real:
            return _NO_REAL
        if kind == "placeholder":
            return self.placeholder_real.get(target, _NO_REAL)
        if kind == "output" or (kind == "call_function" and target is _opaque_attention):
            return _NO_REAL
        if kind == "get_attr":
            obj = self.root_module
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj.detach().clone() if isinstance(obj, torch.Tensor) else _NO_REAL
        try:
            real_args, real_kwargs = nested.real_of(args, self._real), nested.real_of(kwargs, self._real)
        except nested.NoReal:
            return _NO_REAL
        try:
            with torch.no_grad():
                if kind == "call_module":
                    return self.root_module.get_submodule(target)(*real_args, **real_kwargs)
                if kind == "call_method":
                    self_obj, *rest = real_args
                    return getattr(self_obj, target)(*rest, **real_kwargs)
                if kind == "call_function":
                    return target(*real_args, **real_kwargs)
        except Exception:
            return _NO_REAL
        return _NO_REAL

    def _compute_meta(self, kind, target, args, kwargs):
        if kind == "placeholder":
            return self.placeholder_meta.get(target, None)
        if kind == "output":
            return None
        if kind == "get_attr":
            obj = self.root_module
            for part in target.split("."):
                obj = getattr(obj, part)
            return torch.empty_like(obj, device="meta") if isinstance(obj, torch.Tensor) else obj
        meta_args, meta_kwargs = nested.meta_of(args), nested.meta_of(kwargs)
        if kind == "call_function" and target is _opaque_attention:
            return opaque_attention_meta(*meta_args, **meta_kwargs)
        if kind == "call_function" and target is operator.getitem and isinstance(meta_args[0], (tuple, list)):
            return meta_args[0][meta_args[1]]
        if nested.contains_unknown(list(meta_args)) or nested.contains_unknown(meta_kwargs):
            return None
        with torch.no_grad():
            if kind == "call_module":
                mod = self.root_module.get_submodule(target)
                return torch.func.functional_call(mod, self._meta_state(mod), tuple(meta_args), meta_kwargs)
            if kind == "call_method":
                self_obj, *rest = meta_args
                return getattr(self_obj, target)(*rest, **meta_kwargs)
            if kind == "call_function":
                return target(*meta_args, **meta_kwargs)
        return None


def _annotation_mentions(annotation, names: tuple[str, ...]) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return any(n in text for n in names)


def is_cache_annotation(annotation) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    try:
        from transformers.cache_utils import Cache

        for arg in typing.get_args(annotation) or (annotation,):
            if isinstance(arg, type) and issubclass(arg, Cache):
                return True
    except Exception:
        pass
    return _annotation_mentions(annotation, ("Cache",))


def is_tensor_annotation(annotation) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    return _annotation_mentions(annotation, ("Tensor",))


@dataclass
class TracedModule:
    """A traced forward: the graph, the root module and the hidden-states placeholder."""

    module: nn.Module
    graph: fx.Graph
    hidden: fx.Node
    hidden_size: int
    nodes_by_module: dict[str, list[fx.Node]] = field(default_factory=dict)

    def submodule(self, node: fx.Node) -> nn.Module | None:
        if node.op != "call_module":
            return None
        return self.module.get_submodule(node.target)

    @property
    def output(self) -> fx.Node:
        return next(n for n in self.graph.nodes if n.op == "output")

    def attention_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if is_attention_node(n)]


def _undecorated_view(module: nn.Module) -> nn.Module:
    """The same module seen through a subclass whose ``forward`` is the class's undecorated function.

    fx cannot trace through ``*args, **kwargs`` wrappers (e.g. keyword-deprecation decorators).  The view
    shares the instance ``__dict__`` (same children, parameters and attributes); nothing is mutated.
    """
    cls = type(module)
    forward = inspect.unwrap(cls.forward)
    if forward is cls.forward:
        return module
    view_cls = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    view = object.__new__(view_cls)
    object.__setattr__(view, "__dict__", module.__dict__)
    return view


def trace_module(module: nn.Module, hidden_size: int | None = None, seq_len: int = 3, dtype=torch.float32,
                 example_inputs: tuple[tuple, dict] | None = None) -> TracedModule:
    """Trace ``module.forward``.

    With ``example_inputs`` (the ``(args, kwargs)`` of one real call, e.g. captured by a forward pre-hook)
    every tensor input gets a meta value of its real shape and everything else is passed concretely.
    Without them the first argument is a meta hidden-states tensor ``[1, seq_len, hidden_size]`` and the
    other inputs are inferred from annotations (see the module docstring).
    """
    register_tracing_interface()
    try:
        signature = inspect.signature(inspect.unwrap(type(module).forward))
    except (TypeError, ValueError) as exc:
        raise TraceError(f"forward has no readable signature: {exc}") from exc
    params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    params = params[1:] if params and params[0].name == "self" else params
    if not params:
        raise TraceError("forward takes no input")
    tracer = MetaTracer(module)
    concrete_args = {}
    if example_inputs is not None:
        args, kwargs = example_inputs
        bound = {p.name: a for p, a in zip(params, args)}
        bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
        # keyword arguments outside the signature land in ``**kwargs``, which is traced as empty: HF passes
        # them on to the attention call, which is opaque anyway
        if params[0].name not in bound or not isinstance(bound[params[0].name], torch.Tensor):
            raise TraceError("the first forward argument is not a tensor")
        hidden_size = int(bound[params[0].name].shape[-1])
        for p in params:
            value = bound.get(p.name, p.default)
            if value is inspect.Parameter.empty:
                raise TraceError(f"no value for forward argument {p.name!r}")
            if nested.has_tensor(value):
                tracer.placeholder_meta[p.name] = nested.to_meta(value)
                if nested.all_real(value):
                    tracer.placeholder_real[p.name] = nested.detached_clone(value)
            else:
                concrete_args[p.name] = value
        return run_trace(module, tracer, concrete_args, params[0].name, hidden_size)
    if hidden_size is None:
        raise TraceError("hidden size unknown and no example inputs")
    tracer.placeholder_meta[params[0].name] = torch.empty(1, seq_len, hidden_size, device="meta", dtype=dtype)
    for p in params[1:]:
        if is_cache_annotation(p.annotation):
            concrete_args[p.name] = None
        elif is_tensor_annotation(p.annotation):
            tracer.placeholder_meta[p.name] = nested.wildcard()
        elif p.default is not inspect.Parameter.empty:
            concrete_args[p.name] = p.default
        else:
            tracer.placeholder_meta[p.name] = nested.wildcard()
    return run_trace(module, tracer, concrete_args, params[0].name, hidden_size)


def run_trace(module, tracer, concrete_args, hidden_name, hidden_size) -> TracedModule:
    """Trace ``module`` with a prepared ``tracer`` (placeholder values set) and wrap the graph; the module is
    left exactly as it was (attention implementation restored, fx constants removed)."""
    attrs_before = set(module.__dict__)
    try:
        with TRACE_LOCK, attention_traced_opaquely(module), warnings.catch_warnings():
            # fx warns that it cannot guard concrete container arguments (a dict of shared KV states): the
            # graph is analysed, never run, so specialisation on them is harmless
            warnings.filterwarnings("ignore", message="Was not able to add assertion", category=UserWarning)
            graph = tracer.trace(_undecorated_view(module), concrete_args=concrete_args)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        tracer._real.clear()  # real example values were only needed while tracing
        tracer.placeholder_real.clear()
        # fx stores tensors created inside the forward (``torch.zeros(...)``) as ``_tensor_constant<i>``
        # attributes of the root; the graph is never run, so leave the module exactly as it was
        for name in set(module.__dict__) - attrs_before:
            del module.__dict__[name]
    hidden = next((n for n in graph.nodes if n.op == "placeholder" and n.target == hidden_name), None)
    if hidden is None:
        raise TraceError("hidden-states input not found in the traced graph")
    traced = TracedModule(module, graph, hidden, hidden_size)
    for n in graph.nodes:
        if n.op == "call_module":
            traced.nodes_by_module.setdefault(n.target, []).append(n)
    return traced
