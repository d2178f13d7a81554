"""Multi-head latent attention: recognised by structure, fused by rewriting the instance's forward.

Roles come from the traced graph, never from names:
* every ``rmsnorm(linear(hidden_states))`` chain; the KV chain is the one whose linear is wider than its norm
  (``kv_lora_rank + rope`` vs ``kv_lora_rank``), a chain of equal widths is the q-LoRA down-projection;
* ``q_b_proj`` / ``kv_b_proj`` are the nearest linears downstream of the two norms;
* ``o_proj`` is the linear feeding the output; ``q_proj`` (no q-LoRA) is the linear on the hidden states
  whose output reaches the attention call's query;
* head count and head dims are read off the query and value shapes at the attention call.

``apply`` rewrites the forward (``rewrite.py``): one stacked GEMM for both down-projections, and the K/V
expansion call replaced by its arguments, so the latent reaches the ``vllm_mla`` attention interface, which
runs absorbed MLA with ``W_UK``/``W_UV`` taken as views of ``kv_b_proj.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def kv_b(self, module: nn.Module) -> nn.Linear:
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
        linears = [c for c in module.children() if isinstance(c, nn.Linear)]
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
    linear_nodes = [n for n in traced.graph.nodes if g.is_linear(sub(n))]
    norm_nodes = [n for n in traced.graph.nodes if n.op == "call_module" and g.rmsnorm_width(sub(n))]

    chains = []  # (linear node, norm node)
    for norm in norm_nodes:
        if not norm.args or not hasattr(norm.args[0], "op"):
            continue
        src = g.source_through_shape_ops(norm.args[0])
        if src in linear_nodes and src.args and g.source_through_shape_ops(src.args[0]) is traced.hidden:
            chains.append((src, norm))
    kv_chains = [(lin, nrm) for lin, nrm in chains if sub(lin).out_features > g.rmsnorm_width(sub(nrm))]
    q_chains = [(lin, nrm) for lin, nrm in chains if sub(lin).out_features == g.rmsnorm_width(sub(nrm))]
    if len(kv_chains) != 1:
        raise NoMatch(f"expected exactly one KV chain rmsnorm(linear(x)) with a wider linear, found {len(kv_chains)}")
    if len(q_chains) > 1:
        raise NoMatch(f"more than one equal-width rmsnorm(linear(x)) chain ({len(q_chains)})")

    attention = traced.attention_nodes()
    if len(attention) != 1:
        raise NoMatch(f"expected one attention call, found {len(attention)}")
    attn = attention[0]
    if attn.target is not g._opaque_attention:
        raise NoMatch("attention is computed inline (scaled_dot_product_attention), not through the attention interface")

    kv_a, kv_norm = kv_chains[0]
    kv_b = _single(g.nearest_downstream(traced, kv_norm, lambda n: g.is_linear(sub(n))), "linear after the KV norm")
    if not g.reaches(kv_b, attn):
        raise NoMatch("the KV up-projection does not feed the attention call")
    q_a = q_norm = q_b = q_proj = None
    query_node = attn.args[0]
    if q_chains:
        q_a, q_norm = q_chains[0]
        q_b = _single(g.nearest_downstream(traced, q_norm, lambda n: g.is_linear(sub(n))), "linear after the q norm")
        if not g.reaches(q_b, query_node) and q_b is not query_node:
            raise NoMatch("the q up-projection does not feed the query")
    else:
        on_hidden = [
            n for n in linear_nodes
            if n is not kv_a and n.args and g.source_through_shape_ops(n.args[0]) is traced.hidden
            and (n is query_node or g.reaches(n, query_node, stop=lambda m: g.is_linear(sub(m))))
        ]
        q_proj = _single(on_hidden, "query projection on the hidden states")
    o_proj = g.linear_feeding_output(traced)
    if o_proj is None or not g.reaches(attn, o_proj):
        raise NoMatch("no single output projection fed by the attention call")

    query, value = g.meta_val(attn.args[0]), g.meta_val(attn.args[2])
    if getattr(query, "ndim", 0) != 4 or getattr(value, "ndim", 0) != 4:
        raise NoMatch("query/value shapes at the attention call are unknown")
    num_heads, qk_head_dim, v_head_dim = int(query.shape[1]), int(query.shape[3]), int(value.shape[3])
    rank = g.rmsnorm_width(sub(kv_norm))
    rope = sub(kv_a).out_features - rank
    nope = qk_head_dim - rope
    kv_b_mod = sub(kv_b)
    if kv_b_mod.in_features != rank:
        raise NoMatch(f"KV up-projection takes {kv_b_mod.in_features} features, the latent has {rank}")
    if kv_b_mod.out_features != num_heads * (nope + v_head_dim) or nope < 0:
        raise NoMatch(
            f"KV up-projection width {kv_b_mod.out_features} != heads {num_heads} x (nope {nope} + v {v_head_dim})"
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
        q_lora_rank=sub(q_a).out_features if q_a is not None else None,
    )


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
    row.reason = (
        f"{match.num_heads} heads, latent {match.kv_lora_rank}+{match.qk_rope_head_dim}"
        + (f", q-LoRA {match.q_lora_rank} stacked with KV down-projection" if match.has_q_lora else ", no q-LoRA")
    )
    return row
