"""Splicing called children into a block's traced graph, so that the router's steps and the block's are one graph.

The block is traced with every child a leaf; ``inline_children`` replaces the calls of the children the caller
does not keep (it keeps the experts, linears and MLPs) by the children's own traces.
"""

from __future__ import annotations

import inspect
import operator

import torch.fx as fx

from ... import graph as g
from ..base import NoMatch


def inline_children(traced: g.TracedModule, keep) -> None:
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
