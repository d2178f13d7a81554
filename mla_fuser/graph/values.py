"""Nested values of a traced call: meta copies, real copies, and the questions the tracer asks about them.

An op's arguments are nested lists, tuples, dicts and slices of proxies and constants.  The tracer replaces the
proxies by their meta (or real) values and asks whether anything in there is unknown, a wildcard, or a tensor.
The walks use ``torch.utils._pytree`` with an explicit ``is_leaf`` for what each walk must not enter, because
pytree's notion of a container is wider than ours:

* a namedtuple is passed through whole by the walks that *rebuild* a value (it is a structured argument such as
  ``position_embeddings``' container, not a list of operands), but looked into by the walks that only *ask*;
* ``torch.Size`` is a leaf (pytree would rebuild it as a plain tuple);
* only plain containers are entered: a transformers ``Cache`` (which some versions register with pytree) stays
  one value, never a bag of tensors;
* a slice is not a pytree container, yet ``x[:, :n]`` with a proxy ``n`` must see ``n``'s value: the rebuilding
  walks map a slice's fields themselves;
* a dict argument is looked into (``F.op(x, **{...})``), except by ``has_tensor`` (a dict forward argument is
  passed concretely) and ``meta_representable`` (an op returning a dict keeps its meta-run value).  A dict or
  list subclass pytree knows (``OrderedDict``, fx's immutable containers) is rebuilt as itself; one it does not
  know is one value.

An argument that is literally ``None`` (``x[:, None]``, ``beta=None``) is a known value, distinct from a node
whose value is unknown (``UNKNOWN``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_all, tree_any, tree_map


class _Unknown:
    """Marks an input whose meta value is unknown (distinct from a literal ``None`` argument)."""

    def __repr__(self):
        return "<unknown>"


UNKNOWN = _Unknown()


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _leaf_unless(*containers: type, namedtuples: bool):
    """An ``is_leaf`` that enters only ``containers`` (and namedtuples only when ``namedtuples``)."""

    def is_leaf(value) -> bool:
        if isinstance(value, torch.Size) or not isinstance(value, containers):
            return True
        return _is_namedtuple(value) and not namedtuples

    return is_leaf


# rebuilding walks keep namedtuples whole; asking walks look into them
_REBUILD = _leaf_unless(list, tuple, dict, namedtuples=False)
_ASK = _leaf_unless(list, tuple, dict, namedtuples=True)


def _rebuild(fn, value):
    """``value`` with ``fn`` applied to every leaf, slices' fields included (see the module docstring)."""

    def leaf(v):
        if isinstance(v, slice):
            return slice(_rebuild(fn, v.start), _rebuild(fn, v.stop), _rebuild(fn, v.step))
        return fn(v)

    return tree_map(leaf, value, is_leaf=lambda v: isinstance(v, slice) or _REBUILD(v))


def meta_of(value):
    """Replace proxies (and nodes) by their meta values, ``UNKNOWN`` when a node has none."""

    def one(v):
        node = v.node if isinstance(v, fx.Proxy) else v
        if not isinstance(node, fx.Node):
            return v
        val = node.meta.get("val", None)
        return UNKNOWN if val is None else val

    return _rebuild(one, value)


class NoReal(Exception):
    """A proxy inside the arguments has no real value."""


def real_of(value, real: dict):
    """Replace proxies by their real values from ``real`` (node -> value); raise ``NoReal`` when one has none."""

    def one(v):
        if not isinstance(v, fx.Proxy):
            return v
        if v.node not in real:
            raise NoReal
        return real[v.node]

    return _rebuild(one, value)


def contains_unknown(meta_args) -> bool:
    return tree_any(lambda v: v is UNKNOWN, meta_args, is_leaf=_ASK)


def wildcard() -> torch.Tensor:
    """The meta value of an input of unknown shape: 0-d, so it broadcasts through element-wise code."""
    return torch.empty((), device="meta")


def has_wildcard(meta_args) -> bool:
    def is_wildcard(v):
        return isinstance(v, torch.Tensor) and v.ndim == 0 and v.device.type == "meta"

    return tree_any(is_wildcard, meta_args, is_leaf=_ASK)


def meta_representable(value) -> bool:
    """Values whose meta copy is meaningful: tensors (not meta ones), and plain lists/tuples of them/None/numbers.

    A dict or namedtuple is not (the op's result is then taken from the meta run instead)."""

    def one(v):
        if isinstance(v, torch.Tensor):
            return v.device.type != "meta"
        return v is None or isinstance(v, (bool, int, float, torch.dtype, torch.device, torch.Size))

    return tree_all(one, value, is_leaf=_leaf_unless(list, tuple, namedtuples=False))


def to_meta(value):
    """Meta copies (shape and dtype only) of the tensors inside a nested value; other values unchanged."""
    return tree_map(lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, value,
                    is_leaf=_REBUILD)


def all_real(value) -> bool:
    """No meta tensor inside ``value``."""
    return tree_all(lambda v: not isinstance(v, torch.Tensor) or v.device.type != "meta", value, is_leaf=_ASK)


def detached_clone(value):
    """Private copies of the example tensors (the traced forward may write into its inputs in place)."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value, is_leaf=_REBUILD)


def has_tensor(value) -> bool:
    """A tensor inside lists/tuples (a dict argument is passed concretely, whatever it holds)."""
    return tree_any(lambda v: isinstance(v, torch.Tensor), value, is_leaf=_leaf_unless(list, tuple, namedtuples=True))
