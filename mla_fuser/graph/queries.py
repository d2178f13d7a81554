"""Structural questions about a traced graph: which nodes are projections, where data flows.

Matchers find roles by these alone (never by names): a projection is a linear child (or an adapter layer around
one), data flow follows ``node.users`` / inputs, and re-views, casts and splits keep a tensor's identity
(``source_through_shape_ops``).  Searches stop at attention calls, so "nearest" never crosses from one side of
the attention to the other.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from .attention import is_attention_node
from .tracer import TracedModule

# ops that only move or re-view data: data flow "through" them keeps the same tensor identity for our purposes
SHAPE_OPS_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "to", "float", "half", "bfloat16", "type",
    "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "split", "chunk", "narrow", "clone", "type_as",
}
SHAPE_OPS_FUNCTIONS = {
    torch.split, torch.chunk, torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.unsqueeze,
    torch.squeeze, torch.narrow, operator.getitem,
}


def is_linear(module: nn.Module | None, adapters: bool = False) -> bool:
    """A linear projection: ``nn.Linear`` or a subclass (quantised/parallel linears subclass it too).

    ``adapters=True`` also accepts an adapter layer around one (``base_linear``).  Only for a family whose fused
    code calls such a projection as itself (MLA): a family that reads the weights would drop the adapters."""
    return base_linear(module) is not None if adapters else isinstance(module, nn.Linear)


def base_linear(module: nn.Module | None) -> nn.Linear | None:
    """The ``nn.Linear`` that ``module`` is, or wraps as ``base_layer`` (PEFT's adapter layers keep the original
    linear there and add their low-rank terms around it; its in/out features are the wrapper's); else None."""
    while module is not None and not isinstance(module, nn.Linear):
        module = getattr(module, "base_layer", None)
    return module


def is_plain_linear(module: nn.Module | None) -> bool:
    """An ``nn.Linear`` that wraps nothing: its ``weight`` (and bias) is all it computes with, so fused code may
    read them instead of calling it.  An adapter layer (``base_linear``) adds terms its base weight does not hold."""
    if type(module) is nn.Linear and "base_layer" not in module._modules and "base_layer" not in module.__dict__:
        return True  # (the common case, answered without a failing attribute lookup: it runs at every attention call)
    return isinstance(module, nn.Linear) and getattr(module, "base_layer", None) is None


def is_shape_op(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in SHAPE_OPS_METHODS
    if node.op == "call_function":
        return node.target in SHAPE_OPS_FUNCTIONS
    return False


def meta_val(node: fx.Node):
    return node.meta.get("val", None)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def source_through_shape_ops(node: fx.Node) -> fx.Node:
    """Follow the first tensor input back through view/split/getitem/cast ops to the producing op."""
    seen = set()
    while is_shape_op(node) and node not in seen:
        seen.add(node)
        inputs = _input_nodes(node)
        if not inputs:
            break
        node = inputs[0]
    return node


def nearest_downstream(traced: TracedModule, start: fx.Node, predicate, stop=None) -> list[fx.Node]:
    """Nodes matching ``predicate`` reachable from ``start`` along users without passing through another
    match, the attention call, the output, or a node where ``stop`` holds (attention computed inline); the first
    layer of matches (breadth first)."""
    return _nearest(list(start.users), predicate, lambda n: list(n.users),
                    lambda n: n.op == "output" or (stop is not None and stop(n)))


def nearest_upstream(traced: TracedModule, start: fx.Node, predicate) -> list[fx.Node]:
    """Nodes matching ``predicate`` reachable backwards from ``start`` without passing the attention call."""
    return _nearest(_input_nodes(start), predicate, _input_nodes, lambda n: False)


def _nearest(frontier: list[fx.Node], predicate, step, stop) -> list[fx.Node]:
    """Breadth-first from ``frontier`` along ``step`` (users or inputs): the first layer of nodes where
    ``predicate`` holds, never passing a match, the attention call or a node where ``stop`` holds."""
    found, seen = [], set()
    while frontier:
        nxt = []
        for node in frontier:
            if node in seen:
                continue
            seen.add(node)
            if is_attention_node(node) or stop(node):
                continue
            if predicate(node):
                found.append(node)
                continue
            nxt.extend(step(node))
        if found:
            return found
        frontier = nxt
    return found


def reaches(start: fx.Node, target: fx.Node, stop=None, through_writes: bool = False) -> bool:
    """True when data flows from ``start`` to ``target`` (optionally not through nodes where ``stop``).

    ``through_writes``: an item write ``t[i] = v`` (``operator.setitem``, which has no users) also carries ``v``
    into ``t`` and the readers of ``t`` after the write, as modeling code that fills ``new_empty`` buffers
    does."""
    frontier, seen = [start], set()
    while frontier:
        node = frontier.pop()
        if node is target:
            return True
        if node in seen:
            continue
        seen.add(node)
        if node is not start and stop is not None and stop(node):
            continue
        frontier.extend(node.users)
        written = _writes_into(node) if through_writes else None
        if written is not None:
            if written is target:
                return True
            frontier.extend(u for u in written.users if u > node)
    return False


def _writes_into(node: fx.Node) -> fx.Node | None:
    """The tensor an item write ``t[i] = v`` writes into, or None for any other node."""
    written = node.args[0] if node.op == "call_function" and node.target is operator.setitem else None
    return written if isinstance(written, fx.Node) else None


def linear_feeding_output(traced: TracedModule, adapters: bool = False) -> fx.Node | None:
    """The single linear nearest to the forward's output (the output projection), or None (``adapters``: as in
    ``is_linear``)."""
    out = traced.output
    lin = nearest_upstream(traced, out, lambda n: is_linear(traced.submodule(n), adapters))
    lin = list(dict.fromkeys(lin))
    return lin[0] if len(lin) == 1 else None
