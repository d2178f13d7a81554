"""Block-FP8 quantisation and dequantisation in torch: the reference every FP8 kernel is checked against.

* weights: ``quantize_block_fp8(w, block)`` gives ``(weight e4m3 [N, K], weight_scale_inv fp32 [N/bn, K/bk])`` with
  one scale per block (max-abs / 448, as DeepSeek's and Transformers' quantisers do; partial edge blocks when the
  block does not divide the dims); ``dequantize_block_fp8`` inverts it (exactly, in fp32: e4m3 values times an fp32
  scale need no rounding beyond the product's);
* activations (the FP8 tensor-core path): ``quantize_token_groups_ref`` gives e4m3 values and one fp32 scale per
  token and ``group`` consecutive features (dynamic, max-abs / 448).
"""

from __future__ import annotations

import torch
from torch import nn

from .format import FP8_DTYPE, FP8_MAX, PLAN_ATTR, block_fp8_layout, block_fp8_tensors, explain_block_fp8

# a block or token group of zeros keeps a finite scale (and zeros)
_TINY_SCALE = 1e-12


def _expand_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """Per-element scales ``[N, K]`` from per-block ones (a per-tensor scale broadcasts)."""
    if block is None:
        return scale.reshape(()).expand(shape)
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [N, K]`` e4m3 times its block scales, computed in fp32, returned as ``dtype``."""
    full = weight.to(torch.float32) * _expand_scales(scale.to(torch.float32), tuple(weight.shape), block)
    return full.to(dtype)


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] | None = (128, 128)):
    """``(e4m3 weight [N, K], fp32 weight_scale_inv)``: per ``block`` (rows, cols) max-abs scaling, edge blocks
    partial; ``block=None`` gives one per-tensor scale (a 0-d tensor)."""
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    if block is None:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=_TINY_SCALE)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())
    bn, bk = block
    grid_n, grid_k = -(-rows // bn), -(-cols // bk)
    padded = w.new_zeros(grid_n * bn, grid_k * bk)
    padded[:rows, :cols] = w
    tiles = padded.view(grid_n, bn, grid_k, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(grid_n * bn, grid_k * bk)[:rows, :cols].contiguous(), scale.contiguous()


def quantize_token_groups_ref(x: torch.Tensor, group: int):
    """``x [M, K]`` → ``(e4m3 [M, K], fp32 scales [M, ceil(K/group)])``: one max-abs scale per token and group of
    ``group`` consecutive features (the last group may be partial)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = x.new_zeros(rows, groups * group, dtype=torch.float32)
    padded[:, :cols] = x.to(torch.float32)
    tiles = padded.view(rows, groups, group)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp(min=_TINY_SCALE)
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, groups * group)[:, :cols].contiguous(), scale.contiguous()


def dequantize_token_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`quantize_token_groups_ref`, in fp32."""
    return q.to(torch.float32) * scale.repeat_interleave(group, 1)[:, : q.shape[1]]


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the model computes in around this FP8 linear, as the FP8 fuser recorded it (the dtype weights are
    dequantised into when code reads them instead of calling the module); the default dtype otherwise."""
    plan = module.__dict__.get(PLAN_ATTR)
    return getattr(plan, "compute_dtype", None) or torch.get_default_dtype()


def dequantized_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as code that reads it needs it: a block-FP8 linear's weight (``weight`` is its own, or a local
    view of it) dequantised into ``compute_dtype``, anything else unchanged.  A new tensor each call: callers
    cache it (``vllm_mla.with_absorbed_weights``, keyed by the weight's storage)."""
    if weight.dtype != FP8_DTYPE:
        return weight
    layout = block_fp8_layout(module)
    if layout is None:
        raise RuntimeError(f"{type(module).__name__} holds a float8 weight we cannot dequantise: "
                           f"{explain_block_fp8(module)[1]}")
    return dequantize_block_fp8(weight, block_fp8_tensors(module)[1], layout.block, compute_dtype(module))
