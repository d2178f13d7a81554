"""Kernel backend selection shared by every kernel in this package.

Every op in ``mla_fuser.kernels`` has a torch reference (``*_ref``) and, where it pays, a Triton
implementation.  Which one runs is decided here, once per call, from the input tensors and the
``MLA_FUSER_BACKEND`` environment variable (read, never written):

* unset: Triton for CUDA tensors when Triton imports, torch otherwise (CPU);
* ``triton``: always Triton.  On CPU this only works under ``TRITON_INTERPRET=1`` (how the tests run
  the kernels on tiny shapes); without it a clear error is raised instead of a crash deep in Triton;
* ``torch``: always the torch reference.
"""

from __future__ import annotations

import functools
import os

import torch

VALID_BACKENDS = ("triton", "torch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend() -> str | None:
    """The backend forced through ``MLA_FUSER_BACKEND``, or None for automatic choice."""
    value = os.environ.get("MLA_FUSER_BACKEND", "").strip().lower()
    if not value:
        return None
    if value not in VALID_BACKENDS:
        raise ValueError(f"MLA_FUSER_BACKEND={value!r} is not one of {VALID_BACKENDS}")
    return value


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton implementation should run for these inputs."""
    forced = requested_backend()
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if forced == "torch":
        return False
    if forced == "triton":
        if not triton_available():
            raise RuntimeError("MLA_FUSER_BACKEND=triton but Triton is not installed")
        if not on_cuda and not triton_interpreting():
            raise RuntimeError(
                "MLA_FUSER_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)"
            )
        return True
    return on_cuda and triton_available()
