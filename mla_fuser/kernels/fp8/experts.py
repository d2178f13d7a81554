"""Block-FP8 expert stacks: the format read off an experts module's tensors (never its class name), and quantising
a stack the same way.

Transformers' FP8 experts (what ``replace_with_fp8_linear`` puts at ``*.experts`` of an FP8 checkpoint) hold
``gate_up_proj`` e4m3 ``[E, 2I, H]`` with ``gate_up_proj_scale_inv`` fp32 ``[E, rows, ceil(H/bk)]`` and
``down_proj`` e4m3 ``[E, H, I]`` with ``down_proj_scale_inv`` fp32 ``[E, ceil(H/bn), ceil(I/bk)]``: one scale per
expert and ``bn x bk`` block.  The gate/up stack comes in one of two row layouts of its scales:

* **halves** (``rows == 2 * ceil(I/bn)``): gate and up quantised separately, as DeepSeek's checkpoints store them
  (``gate_proj`` / ``up_proj`` per expert, concatenated by Transformers' loader) and as Transformers' allocation
  keeps room for (its ``min_sf_out=2`` floor); the up half's scales start at row ``rows // 2``;
* **whole** (``rows == ceil(2I/bn)`` and not the above): the concatenated ``[2I, H]`` quantised as one matrix.

The two agree whenever ``bn`` divides ``I`` (DeepSeek-V2-Lite 1408 and V3 2048 with 128-row blocks).  A per-tensor
experts module (``block_size`` None: scales ``[E, 2, 1]`` / ``[E, 1, 1]``) is the halves layout with blocks as large
as the matrices.  Declined, with the reason: float8 stacks without scales, scale grids that fit no block size,
UE8M0 or non-fp32 scales, packed FP4 or ``float8_e5m2`` weights, biases, transposed stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .format import DEFAULT_BLOCK, _FLOAT8_DTYPES, _FP4_DTYPES, dtype_problem, own_tensor
from .quant import quantize_block_fp8

STACKS = ("gate_up_proj", "down_proj")
SCALE_SUFFIX = "_scale_inv"
# what a block-FP8 experts module may hold besides its stacks and their scales (static activation scheme)
_STATIC_SCALES = ("gate_up_proj_activation_scale", "down_proj_activation_scale")


@dataclass(frozen=True)
class FP8ExpertsLayout:
    """How one experts module's FP8 stacks are quantised: ``[E, 2I, H]`` / ``[E, H, I]`` e4m3, one fp32 scale per
    expert and ``block_n x block_k`` block of each matrix, the gate/up scales in ``halves`` or ``whole`` rows."""

    num_experts: int
    hidden: int
    inter: int
    gate_up_block: tuple[int, int]
    down_block: tuple[int, int]
    halves: bool
    per_tensor: bool = False
    static_activation_scale: bool = False

    @property
    def up_scale_base(self) -> int:
        """First scale row of the up half (halves layout), else 0."""
        return -(-self.inter // self.gate_up_block[0]) if self.halves else 0

    @property
    def up_row_shift(self) -> int:
        """What the up half's row index is offset by before dividing by the block rows (whole layout: ``I``)."""
        return 0 if self.halves else self.inter

    def describe(self) -> str:
        if self.per_tensor:
            blocks = "per-expert scales (per-tensor, gate and up apart)"
        else:
            bn, bk = self.gate_up_block
            blocks = f"{bn}x{bk} block scales per expert ({'gate and up apart' if self.halves else 'gate_up whole'})"
        return f"FP8 e4m3 experts [{self.num_experts}, {2 * self.inter}, {self.hidden}], {blocks}"


def holds_fp8_experts(module: nn.Module) -> bool:
    """Cheap pre-filter: a 3-D float8 ``gate_up_proj``/``down_proj`` of its own, or a ``*_proj_scale_inv`` (so a
    quantised stack we cannot run is seen and declined with its reason)."""
    for name in STACKS:
        value = own_tensor(module, name)
        if isinstance(value, torch.Tensor) and value.ndim == 3 and (value.dtype in _FLOAT8_DTYPES
                                                                    or value.dtype in _FP4_DTYPES):
            return True
        if own_tensor(module, name + SCALE_SUFFIX) is not None:
            return True
    return False


def _scale_problem(name: str, scale) -> str:
    if scale is None:
        return f"float8 {name} without {name}{SCALE_SUFFIX}: the scales are missing"
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None) or scale.dtype == torch.uint8:
        return f"UE8M0 scales ({scale.dtype}) for {name}: only fp32 block scales are supported"
    if scale.dtype != torch.float32:
        return f"{name}{SCALE_SUFFIX} is {scale.dtype}: only fp32 block scales are supported"
    if scale.ndim != 3:
        return f"{name}{SCALE_SUFFIX} of shape {tuple(scale.shape)}: expected one grid per expert [E, rows, cols]"
    return ""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _candidate_blocks(declared, down_grid, gate_grid, hidden: int):
    """The block sizes to try: the declared ``block_size``, else DeepSeek's 128x128, else what divides the hidden
    size exactly into the down stack's rows (``bn``) and the gate/up stack's columns (``bk``): the hidden size is a
    whole number of blocks in every checkpoint we know, the intermediate size not always."""
    if declared is not None:
        try:
            return [tuple(int(b) for b in declared)]
        except (TypeError, ValueError):
            return []
    blocks = [DEFAULT_BLOCK]
    rows, cols = down_grid[0], gate_grid[1]
    if rows and cols and hidden % rows == 0 and hidden % cols == 0:
        blocks.append((hidden // rows, hidden // cols))
    return blocks


def explain_fp8_experts(module: nn.Module) -> tuple[FP8ExpertsLayout | None, str]:
    """``(layout, "")`` when ``module`` holds block-FP8 expert stacks we can run, else ``(None, reason)``."""
    gate_up, down = own_tensor(module, "gate_up_proj"), own_tensor(module, "down_proj")
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None, "no gate_up_proj / down_proj stacks (experts without gate are not supported)"
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        problem = dtype_problem(name, w, "experts", " (both stacks)")
        if problem:
            return None, problem
        if w.ndim != 3:
            return None, f"{name} has {w.ndim} dims: not an expert stack"
    if getattr(module, "is_transposed", False):
        return None, "transposed FP8 expert stacks are not supported"
    if getattr(module, "has_bias", False) or own_tensor(module, "gate_up_proj_bias") is not None:
        return None, "FP8 experts with biases are not supported"
    num, two_inter, hidden = (int(s) for s in gate_up.shape)
    inter = two_inter // 2
    if two_inter % 2 or tuple(down.shape) != (num, hidden, inter):
        return None, f"FP8 stacks {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit [E,2I,H] / [E,H,I]"
    gs, ds = own_tensor(module, "gate_up_proj" + SCALE_SUFFIX), own_tensor(module, "down_proj" + SCALE_SUFFIX)
    problem = _scale_problem("gate_up_proj", gs) or _scale_problem("down_proj", ds)
    if problem:
        return None, problem
    if gs.shape[0] != num or ds.shape[0] != num:
        return None, f"scale grids for {gs.shape[0]} / {ds.shape[0]} experts, the stacks hold {num}"
    static = all(own_tensor(module, n) is not None for n in _STATIC_SCALES)
    gate_grid, down_grid = tuple(gs.shape[1:]), tuple(ds.shape[1:])
    declared = getattr(module, "block_size", None)
    if declared is None and gate_grid == (2, 1) and down_grid == (1, 1):
        return FP8ExpertsLayout(num, hidden, inter, (inter, hidden), (hidden, inter), True, True, static), ""
    for bn, bk in _candidate_blocks(declared, down_grid, gate_grid, hidden):
        if bn <= 0 or bk <= 0 or down_grid != (_cdiv(hidden, bn), _cdiv(inter, bk)):
            continue
        if gate_grid[1] != _cdiv(hidden, bk):
            continue
        if gate_grid[0] == 2 * _cdiv(inter, bn):
            return FP8ExpertsLayout(num, hidden, inter, (bn, bk), (bn, bk), True, False, static), ""
        if gate_grid[0] == _cdiv(two_inter, bn):
            return FP8ExpertsLayout(num, hidden, inter, (bn, bk), (bn, bk), False, False, static), ""
    which = f"block_size {tuple(declared)}" if declared is not None else "no block size we can tell"
    return None, (f"scale grids {gate_grid} / {down_grid} do not fit stacks [{num}, {two_inter}, {hidden}] / "
                  f"[{num}, {hidden}, {inter}] ({which})")


def fp8_expert_tensors(module: nn.Module):
    """``(gate_up, gate_up_scale_inv, down, down_scale_inv)`` as the module holds them now."""
    return (own_tensor(module, "gate_up_proj"), own_tensor(module, "gate_up_proj" + SCALE_SUFFIX),
            own_tensor(module, "down_proj"), own_tensor(module, "down_proj" + SCALE_SUFFIX))


def quantize_expert_stack(weight: torch.Tensor, block: tuple[int, int] | None, rows: int | None = None):
    """``weight [E, N, K]`` -> ``(e4m3 [E, N, K], fp32 scales [E, rows, cols])``, each expert quantised per block.

    ``rows`` picks the gate/up layout the caller's scale tensor has room for: ``2 * ceil(N/2 / bn)`` rows quantise the
    two halves apart (``halves``; the same scales as whole when ``bn`` divides ``N/2``), None or anything else the
    matrix whole (down stacks).  ``block`` None: one scale per expert, or per half with ``rows == 2``."""
    num, n, _ = weight.shape
    bn = block[0] if block is not None else n // 2
    halves = rows is not None and n % 2 == 0 and rows == 2 * _cdiv(n // 2, bn)
    parts = (weight[:, : n // 2], weight[:, n // 2:]) if halves else (weight,)
    qs, ss = [], []
    for part in parts:
        per_expert = [quantize_block_fp8(part[e], block) for e in range(num)]
        qs.append(torch.stack([q for q, _ in per_expert]))
        ss.append(torch.stack([s.reshape(1, 1) if s.ndim == 0 else s for _, s in per_expert]))
    return torch.cat(qs, 1).contiguous(), torch.cat(ss, 1).contiguous()
