"""Kernels: each op has a torch ``*_ref`` and, where it pays, a Triton implementation.

``dispatch.use_triton`` decides which one runs (CUDA → Triton, CPU → torch, ``MLA_FUSER_BACKEND`` forces one).
"""

from .dispatch import requested_backend, triton_available, use_triton

__all__ = ["requested_backend", "triton_available", "use_triton"]
