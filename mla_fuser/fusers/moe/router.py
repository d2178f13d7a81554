"""Router analysis: an abstract interpreter over the block's (inlined) graph that gives every node a role.

Roles: hidden states, router logits, scores, group mask, top-k ids, routing weights, expert outputs,
shared-expert output, ... each only when the node's op and its inputs' roles form a known step; anything else
is "unaccounted", with the reason, and ``MoEFuser`` declines a block whose output depends on one.  What the
routing steps record (casts, dtypes, constants, the order of the post-selection steps) becomes a ``RouterSpec``
(``router_spec``), which ``stacking.route`` replays.

The routes understood: one linear on the block input (an ``nn.Linear`` child or ``F.linear`` on a 2-D
parameter) -> softmax or sigmoid -> optional correction bias (a 1-D tensor added to the scores) -> optional
group-limited selection (group score = max or sum of the top-n, top groups, masked fill) -> top-k -> weights
(top-k values or the scores gathered at the ids) -> renormalisation / scaling / casts.  The experts: a
decorated experts module called as ``experts(x, ids, weights)``, or a dispatch loop over the ids (one-hot /
where / index_add_) calling the ModuleList's items.  Shared experts: an MLP child on the block input,
optionally multiplied by ``sigmoid(linear(x))`` with a 1-wide linear, added to the routed output.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx

from ... import graph as g
from ...fx_ops import CAST_METHODS, VIEW_METHODS, arg, attr_of, describe, is_number, meta_dtype, op_name
from ..base import NoMatch
from .specs import MLPSpec, RouterSpec

_CAST_METHOD_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                       "double": torch.float64}
# roles that shape ops carry through unchanged; routing values only through re-views keeping the last dim
_ROUTER_KINDS = {"logits", "scores", "choice", "masked", "ids", "weights"}
_REVIEWS = {"view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze"}
_SHAPE_TRANSPARENT = {"routed", "shared", "sgate", "out", "eout", "contrib", "aux", "tok", "wsel", "gmask", "nmask",
                      "sgate_logit"}


def shape_of(node):
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


class Sym:
    """The role of one traced value: ``kind`` plus what was learnt on the way (``info``)."""

    __slots__ = ("kind", "info")

    def __init__(self, kind: str, **info):
        self.kind, self.info = kind, info

    def but(self, kind: str | None = None, **changes) -> "Sym":
        return Sym(kind or self.kind, **{**self.info, **changes})

    def __repr__(self):
        return f"<{self.kind}>"


class _Unaccounted(Sym):
    def __init__(self, why: str):
        super().__init__("unknown", why=why)


class Interpreter:
    """Gives every node of the (inlined) block graph a role, or ``unknown`` with the reason."""

    def __init__(self, traced: g.TracedModule, experts_target: str, experts_kind: str, items: set[str],
                 shared_specs: dict[str, MLPSpec]):
        self.traced = traced
        self.module = traced.module
        self.experts_target = experts_target
        self.experts_kind = experts_kind
        self.items = items
        self.shared_specs = shared_specs
        self.syms: dict[fx.Node, Sym] = {}
        self.fresh: Sym | None = None  # what was accumulated into tensors built inside the forward
        self.input_shape = shape_of(traced.hidden)

    # -- helpers
    def sym(self, a) -> Sym:
        if isinstance(a, fx.Node):
            return self.syms.get(a, _Unaccounted(f"{a.name} has no role"))
        return Sym("const", value=a)

    def hidden_flat(self, node) -> bool | None:
        shape = shape_of(node)
        if shape is None or self.input_shape is None:
            return None
        if tuple(shape) == tuple(self.input_shape):
            return False
        if len(shape) == 2 and shape[-1] == self.input_shape[-1]:
            return True
        return None

    def _cast_dtype(self, node):
        dtype = meta_dtype(node)
        if dtype is not None:
            return dtype
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

    def step(self, node: fx.Node) -> Sym:
        if node.op == "placeholder":
            if node is self.traced.hidden:
                return Sym("hidden", flat=False, casts=())
            return _Unaccounted(f"extra input {node.target!r}")
        if node.op == "get_attr":
            try:
                value = attr_of(self.module, node.target)
            except AttributeError:
                # fx stores a tensor the forward built from constants (``torch.zeros(shape)``) as a
                # ``_tensor_constant`` attribute, which ``trace_module`` removes again: fresh, not state.  fx
                # emits one get_attr per use, and ops on it without traced inputs (``out.reshape(b, s, h)``)
                # run at trace time and give another constant, so they are all taken as one accumulator
                # (the ModuleList path checks the fused forward against the original before binding it).
                return self.fresh or Sym("acc", fresh=True)
            if not isinstance(value, torch.Tensor):
                return _Unaccounted(f"attribute {node.target!r}")
            return Sym("param", target=node.target, ndim=value.ndim, numel=value.numel(), casts=())
        if node.op == "call_module":
            return self.call_module(node)
        name = op_name(node)
        if name in VIEW_METHODS:
            return self.shape_op(node)
        if name in CAST_METHODS:
            return self.cast(node)
        handler = getattr(self, f"op_{name.rstrip('_')}", None)
        if handler is not None:
            result = handler(node, name)
            if result is not None:
                return result
        ins = [self.sym(a) for a in node.all_input_nodes]
        if ins and all(s.kind in ("ids", "aux") for s in ins) and not name.endswith("_"):
            return Sym("aux")  # bookkeeping on the routing ids (one_hot, where, permute, ...)
        return _Unaccounted(f"{describe(node)} on {[s.kind for s in ins]}")

    # -- modules
    def call_module(self, node: fx.Node) -> Sym:
        mod = self.module.get_submodule(node.target)
        ins = [self.sym(a) for a in node.args]
        if node.target == self.experts_target and self.experts_kind == "interface":
            return self.call_experts(node)
        if node.target in self.items:
            if len(ins) == 1 and not node.kwargs and ins[0].kind == "tok":
                return Sym("eout", item=node.target)
            return _Unaccounted(f"expert {node.target!r} called on something else than selected tokens")
        if g.is_linear(mod):
            if len(ins) != 1 or node.kwargs or ins[0].kind != "hidden":
                source = describe(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else "?"
                return _Unaccounted(f"linear {node.target!r} on a computed input: {source}")
            x = ins[0]
            if mod.out_features == 1:
                return Sym("sgate_logit", gate=node.target, flat=x.info["flat"])
            return Sym("logits", router=dict(
                linear=node.target, linear_is_module=True, linear_bias=None, input_flat=x.info["flat"],
                input_dtypes=x.info["casts"], weight_dtypes=(), router_dtype=meta_dtype(node),
            ))
        if node.target in self.shared_specs:
            if len(ins) == 1 and not node.kwargs and ins[0].kind == "hidden" and not ins[0].info["casts"]:
                return Sym("shared", parts=((node.target, None, ins[0].info["flat"], None),))
            return _Unaccounted(f"MLP {node.target!r} on a computed input")
        return _Unaccounted(f"call of {node.target!r}")

    def call_experts(self, node: fx.Node) -> Sym:
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
        return Sym("routed", router=w.info["router"], topk=w.info["topk"], items=())

    # -- shape ops and casts
    def shape_op(self, node: fx.Node) -> Sym:
        src = self.sym(node.args[0])
        if src.kind == "hidden":
            flat = self.hidden_flat(node)
            if flat is None:
                return _Unaccounted(f"hidden states reshaped to {shape_of(node)}")
            return src.but(flat=flat)
        if src.kind in ("scores", "choice") and op_name(node) in ("view", "reshape"):
            # [T, E] -> [T, groups, E / groups] (when the scores' width is known, it must split exactly)
            shape, before = shape_of(node), shape_of(node.args[0])
            if shape is not None and len(shape) == 3 and (before is None or before[-1] == shape[1] * shape[2]):
                return Sym("grouped", router=src.info["router"], source=src, n_group=shape[1])
        if src.kind in _ROUTER_KINDS:
            # routing values may only be re-viewed with the experts dimension kept last (softmax, top-k and
            # gather are taken over the last dimension)
            before, after = shape_of(node.args[0]), shape_of(node)
            if op_name(node) not in _REVIEWS or (before and after and before[-1] != after[-1]):
                if src.kind == "ids":
                    return Sym("aux")  # flattened ids: bookkeeping of a dispatch loop, no longer "the ids"
                return _Unaccounted(f"{describe(node)} on {src.kind}")
            return src
        if src.kind in _SHAPE_TRANSPARENT:
            return src
        return _Unaccounted(f"{describe(node)} on {src.kind}")

    def cast(self, node: fx.Node) -> Sym:
        src = self.sym(node.args[0])
        dtype = self._cast_dtype(node)
        if dtype is None:
            return _Unaccounted(f"cast with unknown dtype: {describe(node)}")
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
        x, w = self.sym(arg(node, 0, "input")), self.sym(arg(node, 1, "weight"))
        b = self.sym(arg(node, 2, "bias"))
        if x.kind != "hidden":
            return _Unaccounted(f"router input is not the block input but {describe(node.args[0])}")
        if w.kind != "param" or w.info["ndim"] != 2 or (b.kind not in ("param", "const") or
                                                          (b.kind == "const" and b.info["value"] is not None)):
            return _Unaccounted(f"linear with a computed weight: {describe(node)}")
        return Sym("logits", router=dict(
            linear=w.info["target"], linear_is_module=False,
            linear_bias=b.info["target"] if b.kind == "param" else None, input_flat=x.info["flat"],
            input_dtypes=x.info["casts"], weight_dtypes=w.info["casts"], router_dtype=meta_dtype(node),
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
        if not self._last_dim(node, arg(node, 1, "dim")):
            return _Unaccounted("softmax not over the experts dimension")
        dtype = node.kwargs.get("dtype", next((a for a in node.args[2:] if isinstance(a, torch.dtype)), None))
        return Sym("scores", router={**src.info["router"], "scoring": "softmax", "softmax_dtype": dtype})

    def op_sigmoid(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "logits":
            return Sym("scores", router={**src.info["router"], "scoring": "sigmoid", "softmax_dtype": None})
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
            return Sym("choice", router=router, scores=scores)
        if kinds == {"wsum", "const"}:
            wsum, eps = (a, b) if a.kind == "wsum" else (b, a)
            if is_number(eps.info["value"]) and wsum.info["eps"] is None:
                return wsum.but(eps=eps.info["value"])
        if kinds == {"routed", "shared"} or kinds == {"out", "shared"}:
            base, shared = (a, b) if a.kind != "shared" else (b, a)
            parts = base.info.get("parts", ()) + shared.info["parts"]
            return Sym("out", router=base.info["router"], items=base.info["items"], parts=parts)
        return _Unaccounted(f"{describe(node)}: add of {a.kind} and {b.kind}")

    def op_getitem(self, node, name):
        src, index = self.sym(node.args[0]), node.args[1]
        if src.kind == "topk" and index in (0, 1):
            return self._topk_part(src, index)
        group_part = self._group_part(src, index)
        if group_part is not None:
            return group_part
        if src.kind == "where":
            return Sym("aux")
        idx_nodes = [a for a in (index if isinstance(index, (tuple, list)) else (index,)) if isinstance(a, fx.Node)]
        idx_syms = [self.sym(a) for a in idx_nodes]
        if src.kind in ("ids", "aux") and all(s.kind in ("ids", "aux") for s in idx_syms):
            return Sym("aux")
        if idx_syms and all(s.kind in ("ids", "aux") for s in idx_syms):
            if src.kind == "hidden" and not src.info["casts"]:
                return Sym("tok")
            if src.kind == "weights":
                return Sym("wsel", weights=src)
        return _Unaccounted(f"indexing of {src.kind}: {describe(node)}")

    def op_getattr(self, node, name):
        src, attr = self.sym(node.args[0]), node.args[1]
        index = {"values": 0, "indices": 1}.get(attr)
        if index is None:
            return _Unaccounted(f"attribute {attr!r} of {src.kind}")
        if src.kind == "topk":
            return self._topk_part(src, index)
        return self._group_part(src, index) or _Unaccounted(f"attribute {attr!r} of {src.kind}")

    @staticmethod
    def _group_part(src: Sym, index) -> Sym | None:
        """Element ``index`` (0 values, 1 indices) of a group-limited selection step, or None."""
        if src.kind == "gtopk" and index == 0:
            return Sym("gtopvals", group=src.info["group"])
        if src.kind == "gsel" and index == 1:
            return Sym("gidx", group=src.info["group"])
        if src.kind == "gmax" and index == 0:
            return Sym("gscore", group={**src.info["group"], "scoring": "max", "topn": None})
        return None

    def _topk_part(self, src: Sym, index: int) -> Sym:
        router = src.info["router"]
        if index == 1:
            return Sym("ids", topk=src, router=router)
        return Sym("weights", topk=src, router={**router, "weights_from": "values", "steps": ()})

    def op_topk(self, node, name):
        src = self.sym(node.args[0])
        k = arg(node, 1, "k")
        dim, largest = arg(node, 2, "dim", -1), arg(node, 3, "largest", True)
        is_sorted = arg(node, 4, "sorted", True)
        if not isinstance(k, int) or largest is not True or not isinstance(is_sorted, bool):
            return _Unaccounted(f"top-k with non-constant or smallest selection: {describe(node)}")
        if not self._last_dim(node, dim):
            return _Unaccounted("top-k not over the experts dimension")
        if src.kind in ("scores", "choice", "masked"):
            router = {**src.info["router"], "top_k": k, "sorted": is_sorted, "select_from": src.kind}
            return Sym("topk", router=router)
        if src.kind == "grouped":
            return Sym("gtopk", group=dict(source=src.info["source"], n_group=src.info["n_group"], topn=k))
        if src.kind == "gscore":
            return Sym("gsel", group={**src.info["group"], "topk_group": k, "sorted": is_sorted})
        return _Unaccounted(f"top-k over a value that does not depend on the router scores ({src.kind})")

    def op_max(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "grouped" and arg(node, 1, "dim") == -1 and not arg(node, 2, "keepdim", False):
            return Sym("gmax", group=dict(source=src.info["source"], n_group=src.info["n_group"]))
        return None

    def op_amax(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "grouped" and arg(node, 1, "dim") == -1 and not arg(node, 2, "keepdim", False):
            return Sym("gscore", group=dict(source=src.info["source"], n_group=src.info["n_group"],
                                             scoring="max", topn=None))
        return None

    def op_sum(self, node, name):
        src = self.sym(node.args[0])
        dim, keepdim = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
        if src.kind == "gtopvals" and dim == -1 and not keepdim:
            return Sym("gscore", group={**src.info["group"], "scoring": "topn_sum"})
        if src.kind == "weights" and dim == -1 and keepdim:
            return Sym("wsum", weights=src, eps=None)
        return None

    def op_zeros_like(self, node, name):
        src = self.sym(node.args[0])
        if src.kind == "gscore":
            return Sym("gmask", group=src.info["group"], filled=False)
        if src.kind == "hidden":
            return Sym("acc")
        return None

    def op_scatter(self, node, name):
        target, dim, index = self.sym(node.args[0]), arg(node, 1, "dim"), self.sym(arg(node, 2, "index"))
        value = arg(node, 3, "value", arg(node, 3, "src"))
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
        src, mask, value = self.sym(node.args[0]), self.sym(arg(node, 1, "mask")), arg(node, 2, "value")
        if name.endswith("_") or src.kind not in ("scores", "choice") or mask.kind != "nmask" or not is_number(value):
            return _Unaccounted(f"masked fill of {src.kind} with {mask.kind}")
        group = dict(mask.info["group"])
        if group.pop("source") is not src:
            return _Unaccounted("group mask computed from other scores than the ones it masks")
        return Sym("masked", router={**src.info["router"], "group": {**group, "fill": float(value)}})

    def op_gather(self, node, name):
        src, dim, index = self.sym(node.args[0]), arg(node, 1, "dim"), self.sym(arg(node, 2, "index"))
        if src.kind in ("scores", "choice") and dim in (1, -1) and index.kind == "ids":
            router = {**index.info["router"], "weights_from": src.kind, "steps": ()}
            return Sym("weights", topk=index.info["topk"], router=router)
        return _Unaccounted(f"gather from {src.kind} at {index.kind}")

    def _weight_step(self, w: Sym, step) -> Sym:
        router = {**w.info["router"], "steps": w.info["router"]["steps"] + (step,)}
        return w.but(router=router)

    def op_div(self, node, name):
        a, b = self.sym(node.args[0]), self.sym(node.args[1])
        if a.kind == "weights" and b.kind == "wsum" and b.info["weights"].info["topk"] is a.info["topk"]:
            if b.info["weights"].info["router"]["steps"] != a.info["router"]["steps"]:
                return _Unaccounted("renormalisation by the sum of other weights")
            return self._weight_step(a, ("renorm", b.info["eps"]))
        if a.kind == "weights" and b.kind == "const" and is_number(b.info["value"]):
            return self._weight_step(a, ("div", b.info["value"]))
        return _Unaccounted(f"{describe(node)}: division of {a.kind} by {b.kind}")

    def op_mul(self, node, name):
        if len(node.args) != 2:
            return None
        a, b = self.sym(node.args[0]), self.sym(node.args[1])
        kinds = {a.kind, b.kind}
        if kinds == {"weights", "const"}:
            w, c = (a, b) if a.kind == "weights" else (b, a)
            if is_number(c.info["value"]):
                return self._weight_step(w, ("scale", c.info["value"]))
        if kinds == {"sgate", "shared"}:
            gate, shared = (a, b) if a.kind == "sgate" else (b, a)
            (mlp, old_gate, flat, _), = shared.info["parts"]
            if old_gate is None:
                return shared.but(parts=((mlp, gate.info["gate"], flat, gate.info["flat"]),))
        if kinds == {"eout", "wsel"}:
            eout, wsel = (a, b) if a.kind == "eout" else (b, a)
            return Sym("contrib", item=eout.info["item"], weights=wsel.info["weights"])
        return _Unaccounted(f"{describe(node)}: product of {a.kind} and {b.kind}")

    # -- ModuleList dispatch
    def op_one_hot(self, node, name):
        return Sym("aux") if self.sym(node.args[0]).kind == "ids" else None

    def op_where(self, node, name):
        if len(node.args) == 1 and not node.kwargs and self.sym(node.args[0]).kind in ("ids", "aux"):
            return Sym("where")
        return None

    def op_zeros(self, node, name):
        if all(not isinstance(a, fx.Node) for a in node.args):
            return Sym("acc")
        return None

    def op_index_add(self, node, name):
        acc, dim, index, src = (self.sym(node.args[0]), arg(node, 1, "dim"), self.sym(arg(node, 2, "index")),
                                self.sym(arg(node, 3, "source")))
        if acc.kind not in ("acc", "routed") or dim != 0 or index.kind != "aux" or src.kind != "contrib":
            return _Unaccounted(f"index_add of {src.kind} into {acc.kind}")
        w = src.info["weights"]
        if acc.kind == "routed" and acc.info["topk"] is not w.info["topk"]:
            return _Unaccounted("experts weighted by different routings")
        items = (acc.info["items"] if acc.kind == "routed" else ()) + (src.info["item"],)
        routed = Sym("routed", router=w.info["router"], topk=w.info["topk"], items=items)
        if name.endswith("_"):
            self.syms[node.args[0]] = routed
            if node.args[0].op == "get_attr":
                self.fresh = routed.but(fresh=True)
        return routed


def router_spec(r: dict) -> RouterSpec:
    """The ``RouterSpec`` of the routing recorded on the output's role (``Sym.info["router"]``)."""
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
