"""Tiles by the Tensor Memory Accelerator: whether a kernel can take an operand through a host tensor descriptor.

Hopper (compute capability 9.0) copies a tile from global to shared memory in one bulk instruction, from a
descriptor that holds the tensor's shape and strides (``cp.async.bulk.tensor``); the kernel then computes no
per-element addresses, which frees the registers a pointer tile's addresses hold.  Triton builds such descriptors on
the host from 3.4 (``triton.tools.tensor_descriptor.TensorDescriptor``); the interpreter runs them too, so the CPU
tests exercise the same kernels.  A descriptor can describe a tensor whose last dimension is contiguous and whose base
and other strides are multiples of 16 bytes, with boxes of at most 256 elements per dimension.

Users: the block-FP8 GEMMs (``fp8.linear``, ``fused_moe.fp8_launch``) and the paged MLA decode
(``mla_decode_tma``).  A kernel decides per call through :func:`tma_ready` and falls back to pointer loads.
"""

from __future__ import annotations

import torch

from .dispatch import capability_major, cuda_index, triton_interpreting

try:  # (Triton 3.4+: tensor descriptors built on the host)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # noqa: BLE001 - no Triton, or an older one: pointer loads only
    _TensorDescriptor = None

__all__ = ["HAS_HOST_TENSOR_DESCRIPTORS", "MAX_BOX", "has_tma", "tma_operand", "tma_ready"]

HAS_HOST_TENSOR_DESCRIPTORS = _TensorDescriptor is not None
MAX_BOX = 256  # elements per box dimension, at most


def has_tma(x: torch.Tensor) -> bool:
    """This Triton builds host tensor descriptors and ``x``'s GPU has a Tensor Memory Accelerator (compute capability
    >= 9.0); on CPU tensors the interpreter stands in."""
    if _TensorDescriptor is None:
        return False
    return capability_major(cuda_index(x)) >= 9 if x.is_cuda else triton_interpreting()


def tma_ready(x: torch.Tensor, *operands: torch.Tensor) -> bool:
    """A kernel can take ``operands``' tiles by TMA: :func:`has_tma` for ``x``, and each operand is contiguous in its
    last dimension with its base and every other stride on 16 bytes (what a descriptor can describe)."""
    if not has_tma(x):
        return False
    return all(t.dim() >= 2 and t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               and t.data_ptr() % 16 == 0 for t in operands)


def tma_operand(t: torch.Tensor, box: list[int], by_tma: bool):
    """What a kernel taking ``t`` gets: with ``by_tma`` (after :func:`tma_ready` said yes), a host tensor descriptor
    of ``t`` read in ``box``-shaped tiles; else ``t`` itself."""
    return _TensorDescriptor.from_tensor(t, box) if by_tma else t
