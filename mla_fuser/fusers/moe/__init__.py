"""Mixture-of-experts blocks: recognised by structure, experts run by the fused kernel.

The package, bottom up (each module imports only those above it):

* ``specs``: the match records (``RouterSpec``, ``MLPSpec``, ``SharedExpert``, ``MoEMatch``);
* ``mlp``: MLPs recognised by tracing them (shared experts, ModuleList items) and activations by what they
  compute;
* ``inline``: the router child's trace spliced into the block's graph;
* ``router``: the abstract interpreter that gives every node of that graph a role and reads the routing off it;
* ``experts``: the ``"mla_fuser"`` implementation registered in Transformers' ``ExpertsInterface`` (on import of
  this package) and the per-block switch of decorated experts to it, which survives ``generate``'s decode swap;
* ``stacking``: ModuleList experts: stacked weights, the routing replayed (``route``), a forward bound to the
  block;
* ``shared_overlap``: hooks that run a block's shared experts on a second CUDA stream in captured steps;
* ``match``: ``MoEFuser``, which ties the above together.

The kernel backend follows ``MLA_FUSER_BACKEND`` (``kernels.dispatch``), read at every call.
"""

from .experts import (
    IMPL_NAME,
    interface_experts_dispatcher,
    keep_fused_experts,
    mla_fuser_experts_forward,
    register_experts_implementation,
)
from .match import MoEFuser
from .mlp import activation_name, fingerprint, mlp_spec
from .specs import MLPSpec, MoEMatch, RouterSpec, SharedExpert
from .stacking import StackedExperts, route

__all__ = [
    "IMPL_NAME", "MLPSpec", "MoEFuser", "MoEMatch", "RouterSpec", "SharedExpert", "StackedExperts",
    "activation_name", "fingerprint", "interface_experts_dispatcher", "keep_fused_experts", "mla_fuser_experts_forward",
    "mlp_spec", "register_experts_implementation", "route",
]
