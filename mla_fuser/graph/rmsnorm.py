"""RMSNorm recognised by what it computes, not by its class or attribute names.

Every family's matcher needs "is this child an RMSNorm, and how wide": MLA's latent and q-LoRA norms, the norm
fuser's targets, Mamba's gated norm.  A module with exactly one 1-D parameter and no children is traced and its
ops are checked (``fx_ops.computes_rmsnorm``); the answer is cached per (class, weight shape).
"""

from __future__ import annotations

import torch
from torch import nn

from ..fx_ops import computes_rmsnorm
from .tracer import TRACE_LOCK, TraceError, trace_module

_RMSNORM_CACHE: dict[tuple, int | None] = {}


def _single_weight(module: nn.Module) -> torch.Tensor | None:
    params = list(module.parameters(recurse=False))
    if len(list(module.children())) or len(params) != 1 or params[0].ndim != 1:
        return None
    return params[0]


def rmsnorm_width(module: nn.Module | None) -> int | None:
    """Width of an RMSNorm-like module, recognised by what it computes, not by its name.

    Accepts ``x * rsqrt(mean(x**2, -1) + eps) * weight`` (any casts, ``x*x`` or ``pow``, ``1/sqrt`` or
    ``rsqrt``, weight or ``1 + weight``), ``F.rms_norm`` and ``nn.RMSNorm``.  Rejects anything that
    subtracts a mean (LayerNorm) or has more than the one 1-D weight.
    """
    if module is None:
        return None
    weight = _single_weight(module)
    if weight is None:
        return None
    key = (type(module), tuple(weight.shape))
    with TRACE_LOCK:
        if key not in _RMSNORM_CACHE:
            width = int(weight.shape[0])
            _RMSNORM_CACHE[key] = width if _computes_rmsnorm(module, width) else None
        return _RMSNORM_CACHE[key]


def _computes_rmsnorm(module: nn.Module, width: int) -> bool:
    if isinstance(module, nn.RMSNorm):
        return True
    try:
        traced = trace_module(module, width)
    except TraceError:
        return False
    return computes_rmsnorm(traced.graph, weighted=True)
