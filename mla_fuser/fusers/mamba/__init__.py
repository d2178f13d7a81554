"""Mamba-1 and Mamba-2 mixers: recognised by structure, fused by binding a new forward to the instance.

The package, bottom up (each module imports only those above it):

* ``specs``: the match records (``MambaMatch``, ``MambaPlan``);
* ``trace``: the pre-filter's helpers and the meta trace of the mixer's forward, with its kernel entry points
  as opaque nodes;
* ``analysis``: the roles (projections, conv, scan, norms, parameters, padding mask) read off the traced graph
  by data flow into the conv and scan calls; anything left over declines;
* ``forward``: the forward bound to one instance, the kernel ops table (``KERNELS``, dispatching; ``REFERENCE``,
  their torch twins) and the cache-state handling through the Cache API;
* ``match``: ``MambaFuser``, which ties the above together and probes the fused forward against the original.

Never by class, attribute or parameter names; the class and transformers' module functions are never touched.
Kernels dispatch per call (``MLA_FUSER_BACKEND``, ``kernels/dispatch.py``).  ``KERNELS`` is read from
``forward`` at every call: patch it there (``mla_fuser.fusers.mamba.forward.KERNELS``), not on this package.
"""

from .forward import REFERENCE, mixer_forward
from .match import MambaFuser
from .specs import MambaMatch, MambaPlan

__all__ = ["REFERENCE", "MambaFuser", "MambaMatch", "MambaPlan", "mixer_forward"]
