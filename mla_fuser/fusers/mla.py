"""Multi-head latent attention: recognised by structure, fused by rewriting the instance's forward.

Roles come from the traced graph, never from names:
* every ``rmsnorm(linear(hidden_states))`` chain with a single nearest linear downstream of its norm (the
  up-projection); the KV chain is the one whose up-projection feeds the attention call's key/value and not its
  query (its down-projection is as wide as the norm or wider: ``kv_lora_rank + rope``, equal without RoPE), the
  q-LoRA chain the one whose up-projection feeds the query (equal widths).  A norm on the rotary part alone
  (no up-projection after it) is no chain;
* ``q_b_proj`` / ``kv_b_proj`` are those up-projections;
* ``o_proj`` is the linear feeding the output; ``q_proj`` (no q-LoRA) is the linear on the hidden states
  whose output reaches the attention call's query;
* head count and head dims are read off the query and value shapes at the attention call.

``apply`` rewrites the forward (``rewrite.py``): one stacked GEMM for both down-projections, and the K/V
expansion call replaced by its arguments, so the latent reaches the ``vllm_mla`` attention interface, which
runs absorbed MLA with ``W_UK``/``W_UV`` taken as views of ``kv_b_proj.weight``.

A projection may be an adapter layer around a linear (PEFT LoRA keeps the original as ``base_layer``), put there
before or after fusion: it matches as its base linear, and fused code never reads the weights of anything but a
plain linear: the down-projections are then called as themselves (not stacked) and K/V expanded by calling
``kv_b_proj`` (not absorbed), so the adapters always run exactly as in the native forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from .. import graph as g
from .base import Fuser, FusionRow, NoMatch, common_input_width


@dataclass(frozen=True)
class MLAMatch:
    """Roles (submodule names, None when absent) and the sizes read from the graph."""

    q_proj: str | None
    q_a_proj: str | None
    q_a_layernorm: str | None
    q_b_proj: str | None
    kv_a_proj: str
    kv_a_layernorm: str
    kv_b_proj: str
    o_proj: str
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None

    @property
    def has_q_lora(self) -> bool:
        return self.q_a_proj is not None


@dataclass
class MLAPlan:
    """What the ``vllm_mla`` interface needs at run time for one fused instance."""

    match: MLAMatch

    def kv_b(self, module: nn.Module) -> nn.Module:
        """The KV up-projection as it is *now*: a plain linear, or whatever replaced or wrapped it since (PEFT)."""
        return module.get_submodule(self.match.kv_b_proj)


PLAN_ATTR = "_mla_fuser_plan"


def _single(nodes, what: str):
    targets = list(dict.fromkeys(n.target for n in nodes))
    if len(targets) != 1:
        raise NoMatch(f"expected one {what}, found {len(targets)}: {targets}")
    return nodes[0]


class MLAFuser(Fuser):
    name = "mla"

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> MLAMatch:
        linears = [c for c in module.children() if _is_projection(c)]
        if len(linears) < 3:
            raise NoMatch("fewer than three linear children")
        if not any(g.rmsnorm_width(c) for c in module.children()):
            raise NoMatch("no RMSNorm child")
        hidden_size = None if example_inputs is not None else common_input_width(module)
        if example_inputs is None and hidden_size is None:
            raise NoMatch("hidden size ambiguous")
        traced = cls.trace(module, example_inputs, hidden_size)
        return _match_traced(traced)


def _match_traced(traced: g.TracedModule) -> MLAMatch:
    sub = traced.submodule
    for target, nodes in traced.nodes_by_module.items():
        if len(nodes) > 1:
            raise NoMatch(f"submodule {target!r} is called {len(nodes)} times")
    linear_nodes = [n for n in traced.graph.nodes if _is_projection(sub(n))]
    norm_nodes = [n for n in traced.graph.nodes if n.op == "call_module" and g.rmsnorm_width(sub(n))]

    attention = traced.attention_nodes()
    if len(attention) != 1:
        raise NoMatch(
            f"expected exactly one KV chain rmsnorm(linear(x)) feeding one attention call, found "
            f"{len(attention)} attention calls"
        )
    attn = attention[0]
    if attn.target is not g._opaque_attention:
        raise NoMatch("attention is computed inline (scaled_dot_product_attention), not through the attention interface")
    if len(attn.args) < 3:
        raise NoMatch("the attention call does not take query, key and value")
    query_node, key_node, value_node = attn.args[:3]

    def feeds(node, target) -> bool:
        return isinstance(target, fx.Node) and (node is target or g.reaches(node, target))

    chains = []  # (linear node, norm node, up-projection node, feeds query, feeds key/value)
    for norm in norm_nodes:
        if not norm.args or not hasattr(norm.args[0], "op"):
            continue
        src = g.source_through_shape_ops(norm.args[0])
        if not (src in linear_nodes and src.args and g.source_through_shape_ops(src.args[0]) is traced.hidden):
            continue
        if _out_features(sub(src)) < g.rmsnorm_width(sub(norm)):
            continue
        ups = g.nearest_downstream(traced, norm, lambda n: _is_projection(sub(n)))
        if len({n.target for n in ups}) != 1:
            continue  # not a down-projection / norm / up-projection chain (e.g. a norm on the rotary part)
        up = ups[0]
        chains.append((src, norm, up, feeds(up, query_node), feeds(up, key_node) or feeds(up, value_node)))
    # The KV chain's up-projection feeds key/value (never the query); the q-LoRA chain's feeds the query.
    # Widths only confirm it: the KV down-projection also carries the shared rotary part (equal widths when
    # the architecture has no RoPE), the q-LoRA one is exactly as wide as its norm.
    kv_chains = [(lin, nrm, up) for lin, nrm, up, to_q, to_kv in chains if to_kv and not to_q]
    q_chains = [
        (lin, nrm, up) for lin, nrm, up, to_q, to_kv in chains
        if to_q and not to_kv and _out_features(sub(lin)) == g.rmsnorm_width(sub(nrm))
    ]
    if len(kv_chains) != 1:
        raise NoMatch(
            f"expected exactly one KV chain rmsnorm(linear(x)) whose up-projection feeds key/value, "
            f"found {len(kv_chains)}"
        )
    if len(q_chains) > 1:
        raise NoMatch(f"more than one query chain rmsnorm(linear(x)) ({len(q_chains)})")

    kv_a, kv_norm, kv_b = kv_chains[0]
    q_a = q_norm = q_b = q_proj = None
    if q_chains:
        q_a, q_norm, q_b = q_chains[0]
    else:
        on_hidden = [
            n for n in linear_nodes
            if n is not kv_a and n.args and g.source_through_shape_ops(n.args[0]) is traced.hidden
            and (n is query_node or g.reaches(n, query_node, stop=lambda m: _is_projection(sub(m))))
        ]
        q_proj = _single(on_hidden, "query projection on the hidden states")
    o_proj = g.linear_feeding_output(traced, adapters=True)
    if o_proj is None or not g.reaches(attn, o_proj):
        raise NoMatch("no single output projection fed by the attention call")

    query, value = g.meta_val(attn.args[0]), g.meta_val(attn.args[2])
    if getattr(query, "ndim", 0) != 4 or getattr(value, "ndim", 0) != 4:
        raise NoMatch("query/value shapes at the attention call are unknown")
    num_heads, qk_head_dim, v_head_dim = int(query.shape[1]), int(query.shape[3]), int(value.shape[3])
    rank = g.rmsnorm_width(sub(kv_norm))
    rope = _out_features(sub(kv_a)) - rank
    nope = qk_head_dim - rope
    kv_b_mod = g.base_linear(sub(kv_b))
    if kv_b_mod.in_features != rank:
        raise NoMatch(f"KV up-projection takes {kv_b_mod.in_features} features, the latent has {rank}")
    # the rows this process holds: all of them, or (tensor parallelism, a DTensor sharded by head) the local heads,
    # which is also what the query shows at the attention call
    kv_b_rows = _local_rows(kv_b_mod)
    if kv_b_rows != num_heads * (nope + v_head_dim) or nope < 0:
        raise NoMatch(
            f"KV up-projection width {kv_b_rows} != heads {num_heads} x (nope {nope} + v {v_head_dim})"
        )
    if int(value.shape[1]) != num_heads:
        raise NoMatch("value heads differ from query heads")
    return MLAMatch(
        q_proj=q_proj.target if q_proj is not None else None,
        q_a_proj=q_a.target if q_a is not None else None,
        q_a_layernorm=q_norm.target if q_norm is not None else None,
        q_b_proj=q_b.target if q_b is not None else None,
        kv_a_proj=kv_a.target,
        kv_a_layernorm=kv_norm.target,
        kv_b_proj=kv_b.target,
        o_proj=o_proj.target,
        num_heads=num_heads,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head_dim,
        kv_lora_rank=rank,
        q_lora_rank=_out_features(sub(q_a)) if q_a is not None else None,
    )


def _is_projection(module: nn.Module | None) -> bool:
    """A linear, or an adapter layer (PEFT LoRA) around one: the fused forward calls these projections as
    themselves whenever they are not plain linears (see ``StackedLinear`` and ``vllm_mla``), so adapters count."""
    return g.is_linear(module, adapters=True)


def _out_features(module: nn.Module) -> int:
    """Output width of a projection (an adapter layer's is its base linear's)."""
    return g.base_linear(module).out_features


def _local_rows(linear: nn.Module) -> int:
    """Output rows of ``linear``'s weight this process holds: a DTensor's local shard under tensor parallelism
    (sharded by whole heads), else ``out_features``."""
    to_local = getattr(linear.weight, "to_local", None)
    return int(to_local().shape[0]) if callable(to_local) else int(linear.out_features)


def _wrapped(module: nn.Module, *roles: str | None) -> list[str]:
    """The roles whose projection is not a plain linear (an adapter layer around one): fused code calls those."""
    return [r for r in roles if r is not None and not g.is_plain_linear(module.get_submodule(r))]


def apply_mla(module: nn.Module, match: MLAMatch, qualname: str) -> FusionRow:
    """Rewrite this instance's forward; on any doubt leave it untouched and return a fallback row."""
    from ..rewrite import RewriteError, rewrite_mla_forward

    row = FusionRow(qualname, type(module).__name__, "mla", "fallback")
    try:
        rewrite_mla_forward(module, match)
    except RewriteError as exc:
        row.reason = f"rewrite declined: {exc}"
        return row
    setattr(module, PLAN_ATTR, MLAPlan(match))
    row.status = "fused"
    down, kv_b = _wrapped(module, match.q_a_proj, match.kv_a_proj), _wrapped(module, match.kv_b_proj)
    row.reason = f"{match.num_heads} heads, latent {match.kv_lora_rank}+{match.qk_rope_head_dim}"
    if not match.has_q_lora:
        row.reason += ", no q-LoRA"
    else:
        row.reason += f", q-LoRA {match.q_lora_rank}" + ("" if down else " stacked with KV down-projection")
    if down:
        row.reason += f"; adapters on {', '.join(down)}: called as themselves, not stacked"
    if kv_b:
        row.reason += f"; adapters on {kv_b[0]}: K/V expanded through it, not absorbed"
    return row
