"""The attention call as one opaque node of a traced graph.

While a module is traced its config is pointed at a tracing-only implementation registered in Transformers'
``AttentionInterface`` (``TRACE_ATTENTION_NAME``), which records a single ``call_function`` node with
``(query, key, value, attention_mask)`` as arguments and a meta output of the shape the interface returns.  The
previous implementation is restored in a ``finally`` block, even when tracing fails.  ``F.scaled_dot_product_attention``
called directly is recorded as a single node too (torch never traces into it) and also counts as an attention
call, but only the interface's node is one a rewrite can redirect to another implementation.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from .. import compat

TRACE_ATTENTION_NAME = "mla_fuser_trace"


def _opaque_attention(query, key, value, attention_mask, **kwargs):  # pragma: no cover - never executed
    """Stand-in target of the attention-call node; the graph is analysed, never run."""
    raise RuntimeError("mla_fuser tracing placeholder must not be executed")


def opaque_attention_meta(query, key, value, attention_mask=None, **kwargs):
    """The interface's output for meta inputs: ``([B, S, H, Dv], None)``."""
    if not (isinstance(query, torch.Tensor) and isinstance(value, torch.Tensor)):
        return None
    batch, heads, q_len, _ = query.shape
    out = torch.empty(batch, q_len, heads, value.shape[-1], device="meta", dtype=query.dtype)
    return (out, None)


def _tracing_attention_interface(module, query, key, value, attention_mask, **kwargs):
    """Registered under ``TRACE_ATTENTION_NAME``: emits one opaque node when called with proxies."""
    if isinstance(query, fx.Proxy):
        tracer = query.tracer
        kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, nn.Module)}
        out = tracer.create_proxy("call_function", _opaque_attention, (query, key, value, attention_mask), kwargs)
        return out[0], None
    raise RuntimeError(f"the '{TRACE_ATTENTION_NAME}' attention implementation exists only for tracing")


def register_tracing_interface() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TRACE_ATTENTION_NAME, _tracing_attention_interface)


def attention_traced_opaquely(module: nn.Module):
    """Point the module's config at the tracing-only interface; restore it whatever happens."""
    return compat.attention_implementation_set(getattr(module, "config", None), TRACE_ATTENTION_NAME)


def is_interface_attention(node: fx.Node) -> bool:
    """The attention-interface call (the node a rewrite can point at another implementation)."""
    return node.op == "call_function" and node.target is _opaque_attention


def is_attention_node(node: fx.Node) -> bool:
    """An attention call: the interface's, or ``F.scaled_dot_product_attention`` called directly."""
    return is_interface_attention(node) or (
        node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention
    )
