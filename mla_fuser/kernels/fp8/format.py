"""The block-FP8 weight format, read off a module's parameters (never its class name).

DeepSeek-V3-style checkpoints (``quant_method "fp8"``, ``fmt "e4m3"``) store each quantised linear as a
``float8_e4m3fn`` ``weight [N, K]`` plus an fp32 ``weight_scale_inv [ceil(N/bn), ceil(K/bk)]``: element ``(n, k)``
is worth ``weight[n, k] * weight_scale_inv[n // bn, k // bk]``.  Transformers' ``FP8Linear`` holds exactly that
(and its block size as ``block_size``); a per-tensor variant keeps a single scale.  This module says whether a
module holds such a weight (``explain_block_fp8``: the layout, or the reason it is not one we can run) so that the
fuser, the stacked MLA down-projection and the absorbed attention all agree on one definition.

Scale formats we decline, with the reason: UE8M0 (power-of-two exponents as ``float8_e8m0fnu`` or raw bytes, as
DeepSeek-V3.2/V4 and MXFP8 checkpoints ship), packed FP4 weights, ``float8_e5m2`` weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_NAME = "weight_scale_inv"
# where ``fusers.fp8`` keeps its plan on a module it took over (named here: layers below the fusers read the
# compute dtype it recorded, ``quant.compute_dtype``)
PLAN_ATTR = "_mla_fuser_fp8_plan"
# the DeepSeek convention, tried first when a module does not say its block size
DEFAULT_BLOCK = (128, 128)
# what a block-FP8 linear may hold besides its weight and scale (``activation_scale``: static activation scheme)
_KNOWN_PARAMS = {"weight", SCALE_NAME, "bias", "activation_scale"}

_FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                  "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_FP4_DTYPES = tuple(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


@dataclass(frozen=True)
class BlockFP8Layout:
    """How one module's FP8 weight is quantised: ``[out_features, in_features]`` e4m3 values, one fp32 scale per
    ``block_n x block_k`` block (``None``: one scale for the whole tensor)."""

    out_features: int
    in_features: int
    block_n: int | None
    block_k: int | None
    static_activation_scale: bool = False

    @property
    def per_tensor(self) -> bool:
        return self.block_n is None

    @property
    def block(self) -> tuple[int, int] | None:
        return None if self.per_tensor else (self.block_n, self.block_k)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        if self.per_tensor:
            return ()
        return (-(-self.out_features // self.block_n), -(-self.in_features // self.block_k))

    def describe(self) -> str:
        blocks = "per-tensor scale" if self.per_tensor else f"{self.block_n}x{self.block_k} block scales"
        return f"FP8 e4m3 [{self.out_features}, {self.in_features}], {blocks}"


def holds_quantized_weight(module: nn.Module) -> bool:
    """Cheap pre-filter: a leaf with its own ``weight`` in a float8 dtype, or its own ``weight_scale_inv`` (so a
    quantised weight we cannot run, such as packed FP4, is seen and declined with its reason)."""
    if next(module.children(), None) is not None:
        return False
    weight = module._parameters.get("weight", module._buffers.get("weight"))
    if isinstance(weight, torch.Tensor) and weight.dtype in _FLOAT8_DTYPES:
        return True
    return SCALE_NAME in module._parameters or SCALE_NAME in module._buffers


def own_tensor(module: nn.Module, name: str):
    """The module's own parameter or buffer ``name`` (None if it holds neither)."""
    value = module._parameters.get(name)
    return value if value is not None else module._buffers.get(name)


def dtype_problem(name: str, tensor: torch.Tensor, what: str, unquantised_note: str = "") -> str:
    """Why ``tensor`` (called ``name``) is not an e4m3 tensor we run ("" when it is); ``what`` names what we run
    ("weights", "experts") in the message, ``unquantised_note`` ends the message for a plain float dtype."""
    if tensor.dtype in _FP4_DTYPES or tensor.dtype in (torch.int8, torch.uint8):
        return f"{name} is {tensor.dtype} (packed FP4 or integer): only float8_e4m3fn {what} are supported"
    if tensor.dtype != FP8_DTYPE:
        return f"{name} is {tensor.dtype}: only float8_e4m3fn {what} are supported{unquantised_note}"
    return ""


def explain_block_fp8(module: nn.Module) -> tuple[BlockFP8Layout | None, str]:
    """``(layout, "")`` when ``module`` is a linear holding a block-FP8 weight we can run, else ``(None, reason)``.

    A linear "by shape": ``in_features``/``out_features`` agree with a 2-D ``weight [out, in]`` (an embedding or a
    3-D expert stack is no linear); nothing else than ``weight``, ``weight_scale_inv``, ``bias`` and
    ``activation_scale`` as its own tensors, no children; not block-diagonal (``n_groups > 1``)."""
    if next(module.children(), None) is not None:
        return None, "has child modules"
    weight, scale = own_tensor(module, "weight"), own_tensor(module, SCALE_NAME)
    if weight is None:
        return None, "no weight"
    problem = dtype_problem("weight", weight, "weights")
    if problem:
        return None, problem
    if weight.ndim != 2:
        return None, f"weight has {weight.ndim} dims: not a linear"
    out_features, in_features = (int(s) for s in weight.shape)
    if getattr(module, "out_features", None) != out_features or getattr(module, "in_features", None) != in_features:
        return None, "in_features/out_features do not describe the weight [out, in]: not a linear"
    if (getattr(module, "n_groups", 1) or 1) > 1:
        return None, f"a grouped (block-diagonal) linear with {module.n_groups} groups"
    extra = [n for n in sorted(set(module._parameters) | set(module._buffers))
             if n not in _KNOWN_PARAMS and own_tensor(module, n) is not None]
    if extra:
        return None, f"holds tensors a block-FP8 linear does not: {extra}"
    if scale is None:
        return None, f"float8 weight without {SCALE_NAME}: the scales are missing"
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None) or scale.dtype == torch.uint8:
        return None, f"UE8M0 scales ({scale.dtype}): only fp32 block scales are supported"
    if scale.dtype != torch.float32:
        return None, f"{SCALE_NAME} is {scale.dtype}: only fp32 block scales are supported"
    bias = own_tensor(module, "bias")
    if bias is not None and tuple(bias.shape) != (out_features,):
        return None, f"bias of shape {tuple(bias.shape)} for {out_features} outputs"
    static = own_tensor(module, "activation_scale") is not None
    if scale.numel() == 1 and getattr(module, "block_size", None) is None:
        return BlockFP8Layout(out_features, in_features, None, None, static), ""
    if scale.ndim != 2:
        return None, f"{SCALE_NAME} of shape {tuple(scale.shape)}: expected one scale per block [N/bn, K/bk]"
    block = _block_size(module, out_features, in_features, tuple(scale.shape))
    if isinstance(block, str):
        return None, block
    return BlockFP8Layout(out_features, in_features, block[0], block[1], static), ""


def _block_size(module, n: int, k: int, grid: tuple[int, int]):
    """The block size, from the module's ``block_size`` when it has one (checked against the scale grid), else the
    DeepSeek 128x128 when the grid fits it, else the exact division of the weight by the grid; a reason when none
    fits."""
    def fits(bn, bk):
        return bn > 0 and bk > 0 and (-(-n // bn), -(-k // bk)) == grid

    declared = getattr(module, "block_size", None)
    if declared is not None:
        try:
            bn, bk = (int(b) for b in declared)
        except (TypeError, ValueError):
            return f"block_size {declared!r} is not two integers"
        if not fits(bn, bk):
            return (f"{SCALE_NAME} of shape {grid} does not fit weight [{n}, {k}] with block_size ({bn}, {bk}): "
                    f"expected {(-(-n // bn), -(-k // bk))}")
        return bn, bk
    if fits(*DEFAULT_BLOCK):
        return DEFAULT_BLOCK
    if grid[0] and grid[1] and n % grid[0] == 0 and k % grid[1] == 0 and fits(n // grid[0], k // grid[1]):
        return n // grid[0], k // grid[1]
    return f"{SCALE_NAME} of shape {grid} fits weight [{n}, {k}] with no block size we can tell (no block_size)"


def block_fp8_layout(module: nn.Module) -> BlockFP8Layout | None:
    """The layout of a block-FP8 linear we can run, or None (anything else, including plain linears)."""
    weight = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    if weight is None or weight.dtype != FP8_DTYPE:
        return None
    return explain_block_fp8(module)[0]


def block_fp8_tensors(module: nn.Module):
    """``(weight, weight_scale_inv, bias)`` of a block-FP8 linear as it holds them now."""
    return own_tensor(module, "weight"), own_tensor(module, SCALE_NAME), own_tensor(module, "bias")

