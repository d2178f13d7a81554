"""Traced graphs of single modules, for finding roles by structure; one import path for every fuser.

* ``tracer``: ``MetaTracer`` / ``trace_module`` (torch.fx with a meta tensor on every node) and ``TRACE_LOCK``;
* ``values``: the nested-argument walks the tracer needs (meta and real copies, unknown and wildcard values);
* ``attention``: the attention-interface call recorded as one opaque node;
* ``queries``: structural questions (projections, data flow, nearest matches);
* ``rmsnorm``: RMSNorm recognised by computation.

Everything is re-exported here (``from mla_fuser import graph as g``; ``g.trace_module``...).  Layering: this
package imports only ``fx_ops`` from the rest of ``mla_fuser``, never the fusers, runtime, cache or the
attention interfaces.
"""

from .attention import (
    TRACE_ATTENTION_NAME, _tracing_attention_interface, is_attention_node, is_interface_attention,
    register_tracing_interface,
)
from .queries import (
    SHAPE_OPS_FUNCTIONS, SHAPE_OPS_METHODS, base_linear, is_linear, is_plain_linear, is_shape_op, linear_feeding_output,
    meta_val, nearest_downstream, nearest_upstream, reaches, source_through_shape_ops,
)
from .rmsnorm import rmsnorm_width
from .tracer import (
    TRACE_LOCK, MetaProxy, MetaTracer, TracedModule, TraceError, is_cache_annotation, is_tensor_annotation, run_trace,
    trace_module,
)
from .values import UNKNOWN, to_meta

__all__ = [
    "SHAPE_OPS_FUNCTIONS", "SHAPE_OPS_METHODS", "TRACE_ATTENTION_NAME", "TRACE_LOCK", "UNKNOWN", "MetaProxy",
    "MetaTracer", "TraceError", "TracedModule", "_tracing_attention_interface", "base_linear", "is_attention_node",
    "is_cache_annotation", "is_interface_attention", "is_linear", "is_plain_linear", "is_shape_op",
    "is_tensor_annotation", "linear_feeding_output", "meta_val", "nearest_downstream", "nearest_upstream", "reaches",
    "register_tracing_interface", "rmsnorm_width", "run_trace", "source_through_shape_ops", "to_meta",
    "trace_module",
]
