"""Small questions about torch.fx nodes that every graph reader of the fusers asks.

The MoE, norm and Mamba fusers (and ``graph.py``'s RMSNorm check) read traced graphs op by op.  They need one
name per op whatever spelling the forward used (``a / b`` is ``operator.truediv``, ``torch.div`` or
``Tensor.div``), an argument by position or keyword, the dtype a node's meta value has, and which nodes
are casts or re-views.  Those live here, once.

Imports nothing from the package, so any module (``graph.py`` included) may use it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

# spellings of one op whose function name is not the op's name (everything else is named by ``__name__``)
_ALIASES = {operator.truediv: "div", torch.greater: "gt"}

# methods that cast one tensor to another dtype
CAST_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})

# methods that re-view or re-lay out one tensor, value for value (``graph.SHAPE_OPS_METHODS`` is wider: it also
# passes casts and splits, for data flow that only asks where a tensor came from)
VIEW_METHODS = frozenset({"view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous", "expand", "permute",
                          "transpose", "expand_as", "view_as", "reshape_as"})


def op_name(node: fx.Node) -> str:
    """What a call computes: the method name, or the function's (``operator.truediv`` and ``torch.div`` are
    both ``"div"``); a node that calls nothing is named by its kind (``"placeholder"``, ``"call_module"``...)."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return _ALIASES.get(node.target, getattr(node.target, "__name__", str(node.target)))
    return node.op


def arg(node: fx.Node, index: int, name: str, default=None):
    """The call's argument at position ``index``, else its keyword ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def describe(node: fx.Node) -> str:
    """``op(arg, ..., key=value)`` with nodes by name: how a reason names the node it stopped at."""

    def show(a):
        return a.name if isinstance(a, fx.Node) else repr(a)

    args = ", ".join([show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()])
    target = node.target if node.op in ("call_module", "get_attr") else op_name(node)
    return f"{target}({args})"


def is_number(value) -> bool:
    """An int or float constant (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def meta_dtype(value) -> torch.dtype | None:
    """The dtype of a node's meta value; None for a non-tensor value or a constant."""
    val = value.meta.get("val", None) if isinstance(value, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def attr_of(root, target: str):
    """The object a dotted ``get_attr`` target names under ``root`` (raises ``AttributeError`` when none)."""
    return operator.attrgetter(target)(root)


def computes_rmsnorm(graph: fx.Graph, weighted: bool) -> bool:
    """Whether a traced norm computes ``x * rsqrt(mean(x**2) + eps)``, by its ops: a mean, a square (``pow(x, 2)``,
    ``square`` or ``x * x``), ``rsqrt`` or ``sqrt``, and nothing that subtracts a mean (LayerNorm).

    ``weighted``: an RMSNorm with a weight (``graph.rmsnorm_width``): the graph must read a tensor attribute, and a
    call of ``F.rms_norm`` is the whole computation.  Unweighted: a parameter-free norm (Falcon-Mamba's dt/B/C
    norms), the explicit ops only.
    """
    calls = [n for n in graph.nodes if n.op in ("call_method", "call_function")]
    if weighted and any(n.target is F.rms_norm for n in calls):
        return True
    names = {op_name(n) for n in calls}
    squares = any(
        (op_name(n) == "pow" and len(n.args) > 1 and n.args[1] == 2) or op_name(n) == "square"
        or (op_name(n) == "mul" and len(n.args) == 2 and n.args[0] is n.args[1])
        for n in calls
    )
    reads_weight = any(n.op == "get_attr" for n in graph.nodes)
    return ("mean" in names and squares and bool(names & {"rsqrt", "sqrt"}) and not names & {"sub", "var", "layer_norm"}
            and (reads_weight or not weighted))
