"""Block-FP8 linear layers, recognised by what they hold and run on our own block-FP8 GEMM.

A module is taken over when its own tensors are a ``float8_e4m3fn`` ``weight [out, in]`` with fp32 per-block
``weight_scale_inv`` (``kernels.fp8.format``: Transformers' ``FP8Linear`` or anything shaped like it; never its
class name).  Its instance forward becomes ``kernels.fp8.block_fp8_linear`` on those tensors; the module, its
parameters and ``state_dict()`` stay exactly as loaded (keys, float8 dtype, scales).  Why at all: Transformers'
``FP8Linear.forward`` fetches a kernel from the Hugging Face Hub at its first call (``kernels`` package or
DeepGEMM), which fails without Hub access, and has no CPU path.

Run before every other fuser (``fuse_fp8_linears`` from ``fusion.fuse``): the capture forward that the MLA and MoE
fusers trace with calls every linear.  Declined modules (UE8M0 or FP4 scales, missing or misshapen scales) keep
their own forward and get a ``fallback`` row saying why.

Block-FP8 expert stacks (an experts module holding float8 ``gate_up_proj``/``down_proj`` with per-expert block
scales, ``kernels.fp8.experts``) are switched here too, to the ``"mla_fuser"`` experts implementation
(``fusers.moe.experts``: ``fused_experts_fp8``), for the same reason: the capture forward calls them, and
Transformers' FP8 experts implementations fetch a Hub kernel.  Their row (``fuser`` "fp8") says what was taken over
or why not; the MoE fuser's row for the block around them follows as for any experts module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.fp8 import BlockFP8Layout, block_fp8_linear, explain_block_fp8, holds_quantized_weight
from ..kernels.fp8.experts import holds_fp8_experts
from ..kernels.fp8.format import FP8_DTYPE, PLAN_ATTR, SCALE_NAME
from .base import FusionRow, NoMatch, bind_instance_forward
from .moe.experts import explain_fp8_experts_module, interface_experts_dispatcher, switch_experts

NAME = "fp8"
# (the report row says where it runs; the README's FP8 section says how: Triton on GPU, weight-only below
# ``FP8_TENSOR_CORE_MIN_TOKENS`` tokens and FP8 tensor cores from there, the torch reference on CPU)
KERNEL = "mla-fuser's block-FP8 GEMM (no Hub kernel)"


@dataclass(frozen=True)
class FP8LinearPlan:
    """What the fused forward needs: the layout, and the forward it replaced (run when the weight is no longer
    FP8, e.g. after a dequantising ``.to()``); ``compute_dtype``: the model's dtype around it, into which code that
    reads the weight instead of calling the module (absorbed MLA) dequantises it.  (``plans.KINDS`` has no "fp8"
    kind: the plan lives under ``kernels.fp8.format.PLAN_ATTR``, set the same way.)"""

    layout: BlockFP8Layout
    original: object
    compute_dtype: torch.dtype


def fp8_plan(module: nn.Module) -> FP8LinearPlan | None:
    return module.__dict__.get(PLAN_ATTR)


def _fused_forward(self, input: torch.Tensor) -> torch.Tensor:
    plan = self.__dict__[PLAN_ATTR]
    weight = self._parameters.get("weight")
    if weight is None or weight.dtype != FP8_DTYPE:
        return plan.original(input)
    scale = self._parameters.get(SCALE_NAME)
    if scale is None:
        scale = self._buffers[SCALE_NAME]
    return block_fp8_linear(input, weight, scale, plan.layout.block, self._parameters.get("bias"))


class FP8LinearFuser:
    """``is_candidate`` / ``explain`` / ``apply`` as the other fusers; structure only, no trace needed."""

    name = NAME

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        return holds_quantized_weight(module)

    @staticmethod
    def explain(module: nn.Module, example_inputs=None) -> tuple[BlockFP8Layout | None, str]:
        return explain_block_fp8(module)

    @staticmethod
    def apply(module: nn.Module, layout: BlockFP8Layout, qualname: str,
              compute_dtype: torch.dtype | None = None) -> FusionRow:
        row = FusionRow(qualname, type(module).__name__, NAME, "fallback")
        if fp8_plan(module) is not None:
            row.status, row.reason = "fused", "already fused"
            return row
        dtype = compute_dtype or _own_float_dtype(module) or torch.get_default_dtype()
        original, why_not = bind_instance_forward(module, _fused_forward)
        if original is None:
            row.reason = why_not
            return row
        object.__setattr__(module, PLAN_ATTR, FP8LinearPlan(layout, original, dtype))
        row.status = "fused"
        row.reason = f"{layout.describe()}: {KERNEL}"
        if layout.static_activation_scale:
            row.reason += "; static activation_scale unused (activations stay unquantised on the weight-only path)"
        return row


def _own_float_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of the module's bias (the compute dtype where there is one)."""
    bias = module._parameters.get("bias")
    return bias.dtype if bias is not None and bias.is_floating_point() else None


def model_compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its input embeddings' (never FP8 in the checkpoints we run), else its first
    floating-point parameter that is wider than one byte."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.element_size() > 1:
        return weight.dtype
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() > 1:
            return p.dtype
    return torch.get_default_dtype()


def fuse_fp8_linears(model: nn.Module) -> list[FusionRow]:
    """Take over every block-FP8 linear and FP8 experts module of ``model``; one row per module that holds a
    quantised weight or expert stack."""
    rows = []
    dtype = None
    for name, module in model.named_modules():
        if name and holds_fp8_experts(module):
            rows.append(fuse_fp8_experts(module, name))
            continue
        if not name or not FP8LinearFuser.is_candidate(module):
            continue
        layout, reason = FP8LinearFuser.explain(module)
        if layout is None:
            rows.append(FusionRow(name, type(module).__name__, NAME, "fallback",
                                  f"{reason}; the module keeps its own forward"))
        else:
            dtype = dtype or model_compute_dtype(model)
            rows.append(FP8LinearFuser.apply(module, layout, name, dtype))
    return rows


def fuse_fp8_experts(module: nn.Module, qualname: str) -> FusionRow:
    """Switch one experts module with FP8 stacks to the ``"mla_fuser"`` implementation (``fused_experts_fp8``), or
    say why it keeps its own (a decorated module only: the implementation is chosen through its registry)."""
    row = FusionRow(qualname, type(module).__name__, NAME, "fallback")
    layout, reason = explain_fp8_experts_module(module)
    if layout is None:
        row.reason = f"{reason}; the experts keep their own forward"
        return row
    if interface_experts_dispatcher(module) is None:
        row.reason = "FP8 experts not dispatched through an experts interface (@use_experts_implementation)"
        return row
    try:
        how = switch_experts(module)
    except NoMatch as exc:
        row.reason = str(exc)
        return row
    row.status = "fused"
    row.reason = f"{layout.describe()}: mla-fuser's fused MoE kernel, weight-only FP8 (no Hub kernel); {how}"
    if layout.static_activation_scale:
        row.reason += "; static activation scales unused (activations stay unquantised)"
    return row
