"""Multi-head latent attention: recognised by structure, fused by rewriting the instance's forward.

Roles come from the traced graph, never from names:
* where attention happens (``_find_attention``): the attention-interface call if there is one (the only kind a
  rewrite can redirect), else ``F.scaled_dot_product_attention`` called directly, else a softmax between two
  matmuls computed inline (modeling files shipped with checkpoints for ``trust_remote_code``).  Each gives the
  query, key and value operands and the node the attention output flows from;
* every ``rmsnorm(linear(hidden_states))`` chain with a single nearest linear downstream of its norm (the
  up-projection, searched without crossing the attention); the KV chain is the one whose up-projection feeds
  key/value and not the query (its down-projection is as wide as the norm or wider: ``kv_lora_rank + rope``,
  equal without RoPE), the q-LoRA chain the one whose up-projection feeds the query (equal widths).  A norm on
  the rotary part alone (no up-projection after it) is no chain;
* ``q_b_proj`` / ``kv_b_proj`` are those up-projections;
* ``o_proj`` is the linear feeding the output; ``q_proj`` (no q-LoRA) is the linear on the hidden states
  whose output reaches the query;
* head count and head dims are read off the query and value shapes at the attention (``[B, H, S, D]``); the
  rotary width is the KV down-projection's width beyond the latent.

Telling query from key/value with attention computed inline: the softmax normalises the scores over their last
axis, which indexes the keys.  So in the score matmul ``scores = A @ B`` (the one matmul upstream of the softmax)
``A``'s rows are the queries and ``B``'s columns the keys: ``A`` is the query, ``B`` the key (transposed); in the
output matmul ``out = P @ V`` (the one downstream) the probabilities ``P`` (reached from the softmax) are
contracted over that key axis against the rows of ``V``, the value (not reached from the softmax).  A projection
"feeds the query" when data flows from it to ``A``, "feeds key/value" when it flows to ``B`` or ``V``: the KV
up-projection's output reaches ``B`` and ``V`` but never ``A`` (the scores it helps make are downstream of
``A``), the q-LoRA up-projection's reaches ``A`` only.  For ``scaled_dot_product_attention`` and the interface,
the operands are its ``query``, ``key`` and ``value`` arguments and the same rule applies.

Only a module whose attention goes through the interface is fused (head sizes are then always known: the match
declines otherwise).  A module that matches with attention computed inline is reported (``apply_mla``) and left
untouched: there is no call to point at ``vllm_mla``.  Its head sizes are ``None`` where the graph does not show
them.

``apply`` rewrites the forward (``rewrite.py``): one stacked GEMM for both projections of the hidden states (the
q-LoRA down-projection, or the query projection without q-LoRA, with the KV down-projection), and the K/V
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
from ..fx_ops import arg, op_name
from ..plans import set_plan
from .base import Fuser, FusionRow, NoMatch, common_input_width
from .linear import bind_skinny_forward

INTERFACE = "interface"
SDPA = "scaled_dot_product_attention"
INLINE = "matmul/softmax"


@dataclass(frozen=True)
class MLAMatch:
    """Roles (submodule names, None when absent) and the sizes read from the graph.

    ``attention`` says how the module computes attention (``INTERFACE``, ``SDPA`` or ``INLINE``); only an
    interface match is ``rewritable``, and only then are the head sizes sure to be known (else None where the
    graph does not show them)."""

    q_proj: str | None
    q_a_proj: str | None
    q_a_layernorm: str | None
    q_b_proj: str | None
    kv_a_proj: str
    kv_a_layernorm: str
    kv_b_proj: str
    o_proj: str
    num_heads: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int
    v_head_dim: int | None
    kv_lora_rank: int
    q_lora_rank: int | None
    attention: str = INTERFACE

    @property
    def has_q_lora(self) -> bool:
        return self.q_a_proj is not None

    @property
    def rewritable(self) -> bool:
        return self.attention == INTERFACE


@dataclass
class MLAPlan:
    """What the ``vllm_mla`` interface needs at run time for one fused instance."""

    match: MLAMatch

    def __post_init__(self):
        # run-time code reads the head sizes of fused modules only, and those attend through the interface
        m = self.match
        assert m.rewritable and None not in (m.num_heads, m.qk_nope_head_dim, m.v_head_dim), m

    def kv_b(self, module: nn.Module) -> nn.Module:
        """The KV up-projection as it is *now*: a plain linear, or whatever replaced or wrapped it since (PEFT)."""
        child = module._modules.get(self.match.kv_b_proj)  # a direct child (read at every attention call)
        return child if child is not None else module.get_submodule(self.match.kv_b_proj)


@dataclass(frozen=True)
class _Attention:
    """Where the graph computes attention: its operands, the node its output flows from, how (``INTERFACE``...),
    and the nodes a search for up-projections must not cross (the inline matmuls; calls stop searches anyway)."""

    query: object
    key: object
    value: object
    output: fx.Node
    kind: str
    stops: frozenset = frozenset()


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


def _find_attention(traced: g.TracedModule) -> _Attention:
    """The one attention of the forward: the interface call, a direct ``scaled_dot_product_attention`` call, or
    (neither being there) a softmax between two matmuls (see the module docstring)."""
    calls = traced.attention_nodes()
    if not calls:
        inline = _inline_attention(traced)
        if len(inline) != 1:
            raise NoMatch(
                f"expected exactly one KV chain rmsnorm(linear(x)) feeding one attention (an attention call, or a "
                f"softmax between two matmuls), found {len(inline)} softmax-between-matmuls and no attention call"
            )
        return inline[0]
    if len(calls) != 1:
        raise NoMatch(
            f"expected exactly one KV chain rmsnorm(linear(x)) feeding one attention call, found "
            f"{len(calls)} attention calls"
        )
    call = calls[0]
    if not g.is_interface_attention(call):
        return _Attention(arg(call, 0, "query"), arg(call, 1, "key"), arg(call, 2, "value"), call, SDPA)
    if len(call.args) < 3:
        raise NoMatch("the attention call does not take query, key and value")
    return _Attention(*call.args[:3], call, INTERFACE)


def _inline_attention(traced: g.TracedModule) -> list[_Attention]:
    """Every softmax with exactly one matmul upstream (``query @ key^T``) and one downstream whose first operand
    it reaches and whose second it does not (``probabilities @ value``)."""
    found = []
    for soft in traced.graph.nodes:
        if not (op_name(soft) == "softmax" or isinstance(traced.submodule(soft), nn.Softmax)):
            continue
        scores = g.nearest_upstream(traced, soft, _is_matmul)
        mixes = g.nearest_downstream(traced, soft, _is_matmul)
        if len(scores) != 1 or len(mixes) != 1:
            continue
        (query, key), (probs, value) = scores[0].args[:2], mixes[0].args[:2]
        if g.reaches(soft, probs) and not (isinstance(value, fx.Node) and g.reaches(soft, value)):
            found.append(_Attention(query, key, value, mixes[0], INLINE, frozenset((scores[0], mixes[0]))))
    return found


def _is_matmul(node: fx.Node) -> bool:
    """A matrix product of two operands (``@``, ``torch.matmul``, ``Tensor.matmul``, ``bmm``)."""
    return node.op in ("call_function", "call_method") and op_name(node) in ("matmul", "bmm") and len(node.args) >= 2


def _match_traced(traced: g.TracedModule) -> MLAMatch:
    sub = traced.submodule
    for target, nodes in traced.nodes_by_module.items():
        if len(nodes) > 1:
            raise NoMatch(f"submodule {target!r} is called {len(nodes)} times")
    linear_nodes = [n for n in traced.graph.nodes if _is_projection(sub(n))]
    norm_nodes = [n for n in traced.graph.nodes if n.op == "call_module" and g.rmsnorm_width(sub(n))]
    attn = _find_attention(traced)
    query_node, key_node, value_node = attn.query, attn.key, attn.value
    # item writes into ``new_empty`` buffers (how remote DeepSeek code builds query and key) carry data only for
    # inline attention: an interface match keeps the data-flow model its rewrite relies on
    writes = attn.kind != INTERFACE

    def feeds(node, target) -> bool:
        return isinstance(target, fx.Node) and (node is target or g.reaches(node, target, through_writes=writes))

    chains = []  # (linear node, norm node, up-projection node, feeds query, feeds key/value)
    for norm in norm_nodes:
        if not norm.args or not hasattr(norm.args[0], "op"):
            continue
        src = g.source_through_shape_ops(norm.args[0])
        if not (src in linear_nodes and src.args and g.source_through_shape_ops(src.args[0]) is traced.hidden):
            continue
        if _out_features(sub(src)) < g.rmsnorm_width(sub(norm)):
            continue
        ups = g.nearest_downstream(traced, norm, lambda n: _is_projection(sub(n)), stop=lambda n: n in attn.stops)
        if len({n.target for n in ups}) != 1:
            continue  # not a down-projection / norm / up-projection chain (e.g. a norm on the rotary part)
        up = ups[0]
        to_key, to_value = feeds(up, key_node), feeds(up, value_node)
        # through the interface an up-projection feeding key or value is enough (the head sizes, always known
        # there, check the rest); without it they may be unknown: it must feed both, as MLA's KV expansion does
        to_kv = (to_key or to_value) if attn.kind == INTERFACE else (to_key and to_value)
        chains.append((src, norm, up, feeds(up, query_node), to_kv))
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
            and (n is query_node or g.reaches(n, query_node, lambda m: _is_projection(sub(m)), through_writes=writes))
        ]
        q_proj = _single(on_hidden, "query projection on the hidden states")
    o_proj = g.linear_feeding_output(traced, adapters=True)
    if o_proj is None or not g.reaches(attn.output, o_proj):
        raise NoMatch("no single output projection fed by the attention call")

    query, value = g.meta_val(query_node), g.meta_val(value_node)
    shapes_known = getattr(query, "ndim", 0) == 4 and getattr(value, "ndim", 0) == 4
    if not shapes_known and attn.kind == INTERFACE:
        raise NoMatch("query/value shapes at the attention call are unknown")
    rank = g.rmsnorm_width(sub(kv_norm))
    rope = _out_features(sub(kv_a)) - rank
    kv_b_mod = g.base_linear(sub(kv_b))
    if kv_b_mod.in_features != rank:
        raise NoMatch(f"KV up-projection takes {kv_b_mod.in_features} features, the latent has {rank}")
    num_heads = nope = v_head_dim = None
    if shapes_known:
        num_heads, v_head_dim = int(query.shape[1]), int(value.shape[3])
        nope = int(query.shape[3]) - rope
        # the rows this process holds: all of them, or (tensor parallelism, a DTensor sharded by head) the local
        # heads, which is also what the query shows at the attention call
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
        attention=attn.kind,
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
    from ..kernels.fp8 import block_fp8_layout
    from ..rewrite import RewriteError, fp8_stacking_problem, rewrite_mla_forward, stacked_query_projection

    row = FusionRow(qualname, type(module).__name__, "mla", "fallback")
    if not match.rewritable:
        row.reason = (f"MLA by structure, but attention is computed inline ({match.attention}), not through the "
                      "attention interface: nothing to rewrite")
        return row
    plan = MLAPlan(match)
    try:
        rewrite_mla_forward(module, match)
    except RewriteError as exc:
        row.reason = f"rewrite declined: {exc}"
        return row
    set_plan(module, "mla", plan)
    row.status = "fused"
    bind_skinny_forward(module.get_submodule(match.o_proj))  # (decode-size rows on kernels.skinny_linear)
    q_first = stacked_query_projection(match)
    down, kv_b = _wrapped(module, q_first, match.kv_a_proj), _wrapped(module, match.kv_b_proj)
    row.reason = f"{match.num_heads} heads, latent {match.kv_lora_rank}+{match.qk_rope_head_dim}"
    # FP8 (issue 15): block-FP8 projections stack only when their scale blocks stay aligned
    fp8_problem = None if down else fp8_stacking_problem(*(module.get_submodule(n) for n in (q_first, match.kv_a_proj)))
    stacked = "" if down else (f" not stacked ({fp8_problem}): each projection runs its own block-FP8 GEMM"
                               if fp8_problem else " stacked with KV down-projection")
    row.reason += (f", q-LoRA {match.q_lora_rank}" if match.has_q_lora else ", no q-LoRA: query projection") + stacked
    if not kv_b and block_fp8_layout(module.get_submodule(match.kv_b_proj)) is not None:  # FP8 (issue 15)
        row.reason += ("; block-FP8 kv_b_proj: W_UK/W_UV dequantised once (at the first absorbed call, kept while "
                       "the weight is) for absorbed attention, the expansion runs the block-FP8 GEMM")
    if down:
        row.reason += f"; adapters on {', '.join(down)}: called as themselves, not stacked"
    if kv_b:
        row.reason += f"; adapters on {kv_b[0]}: K/V expanded through it, not absorbed"
    return row
