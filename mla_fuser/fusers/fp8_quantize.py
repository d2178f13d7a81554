"""FP8 on demand for a bf16 (or fp32) model on a machine without a GPU: ``quantize_linears_to_fp8(model, config)``.

Why here and not in Transformers: ``from_pretrained(..., quantization_config=FineGrainedFP8Config(...))`` refuses
on a CPU-only machine (Transformers 5.17-5.24, ``FineGrainedFP8HfQuantizer.validate_environment``: "No GPU or XPU
found. A GPU or XPU is needed for FP8 quantization."), and a pre-quantized FP8 checkpoint is dequantised there.
Our kernels need neither, so the loader (``loader.py``) loads the checkpoint without the quantization config and
calls this: Transformers' own ``replace_with_fp8_linear`` swaps the linears for ``FP8Linear`` modules (honouring
the config's ``modules_to_not_convert`` plus Transformers' default skips: the output embeddings), and each gets its
loaded weight quantised per block (``kernels.fp8.quantize_block_fp8``; partial edge blocks where the block does not
divide the dims).  The config is recorded on ``model.config`` so ``save_pretrained`` writes a DeepSeek-format FP8
checkpoint (float8 weights, fp32 ``weight_scale_inv``).

Expert stacks are quantised where Transformers' replacement would (an ``*.experts`` module not in the skips becomes
its FP8 experts module): each expert's ``gate_up_proj`` / ``down_proj`` per block, into the scale grids that module
allocates (gate and up apart, as DeepSeek's checkpoints hold them, when it has room for that:
``kernels.fp8.experts``); they then run on ``fused_experts_fp8``.  Experts we cannot quantise that way (a
``ModuleList`` of per-expert linears, transposed, biased, ungated or interleaved stacks) stay in the model's dtype,
and a report note says which.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8 import quantize_block_fp8
from ..kernels.fp8.experts import quantize_expert_stack
from .moe.experts import interface_experts_dispatcher

EXPERTS_KEPT = "experts"


def is_fine_grained_fp8(config) -> bool:
    """A ``FineGrainedFP8Config`` (or its dict) asking for FP8 weights (not ``dequantize=True``)."""
    if config is None:
        return False
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    dequantize = config.get("dequantize") if isinstance(config, dict) else getattr(config, "dequantize", False)
    return str(getattr(method, "value", method)) == "fp8" and not dequantize


def transformers_quantizes_here() -> bool:
    """Whether Transformers' own FP8 quantizer runs on this machine (it needs CUDA or XPU)."""
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


def _quantizable_experts(module: nn.Module) -> bool:
    """An experts module whose 3-D stacks we can move into Transformers' FP8 experts: decorated, gated, concatenated
    ``[E, 2I, H]`` / ``[E, H, I]`` floating-point stacks without biases (what that module holds, quantised)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (interface_experts_dispatcher(module) is not None and getattr(module, "has_gate", True) is True
            and not getattr(module, "has_bias", False) and not getattr(module, "is_transposed", False)
            and getattr(module, "is_concatenated", True) is not False
            and not getattr(module, "has_post_expert_norm", False)
            and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.ndim == 3 and down.ndim == 3 and gate_up.is_floating_point() and gate_up.element_size() > 1)


def _skipped(model: nn.Module, config) -> tuple[list[str], list[str]]:
    """``(modules Transformers' replacement must skip, experts we keep in the model's dtype)``."""
    from transformers.quantizers.base import HfQuantizer

    skip = HfQuantizer.get_modules_to_not_convert(model, config.modules_to_not_convert,
                                                  getattr(model, "_keep_in_fp32_modules", None) or None,
                                                  add_default_skips=True)
    kept = [n for n, m in model.named_modules() if n.endswith("." + EXPERTS_KEPT) and not _quantizable_experts(m)]
    return sorted(set(skip) | set(kept)), kept


def _fill_experts(new: nn.Module, old: nn.Module, block) -> bool:
    """Quantise ``old``'s stacks into the FP8 experts module ``new`` (False, nothing written, when the shapes it
    allocated are not the stacks')."""
    gate_up, down = old.gate_up_proj, old.down_proj
    gus, ds = getattr(new, "gate_up_proj_scale_inv", None), getattr(new, "down_proj_scale_inv", None)
    if (tuple(getattr(new, "gate_up_proj", torch.empty(0)).shape) != tuple(gate_up.shape) or gus is None
            or ds is None or tuple(getattr(new, "down_proj", torch.empty(0)).shape) != tuple(down.shape)):
        return False
    q1, s1 = quantize_expert_stack(gate_up.detach(), block, rows=gus.shape[1])
    q2, s2 = quantize_expert_stack(down.detach(), block)
    if tuple(s1.shape) != tuple(gus.shape) or tuple(s2.shape) != tuple(ds.shape):
        q1, s1 = quantize_expert_stack(gate_up.detach(), block)  # the whole layout is the one it has room for
        if tuple(s1.shape) != tuple(gus.shape) or tuple(s2.shape) != tuple(ds.shape):
            return False
    for name, value in (("gate_up_proj", q1), ("gate_up_proj_scale_inv", s1), ("down_proj", q2),
                        ("down_proj_scale_inv", s2)):
        setattr(new, name, nn.Parameter(value, requires_grad=False))
    return True


@torch.no_grad()
def quantize_linears_to_fp8(model: nn.Module, config) -> list[str]:
    """Quantise the model's plain linears (and expert stacks) to block-FP8 ``FP8Linear`` (FP8 experts) modules in
    place; returns report notes."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    if isinstance(config, dict):
        config = FineGrainedFP8Config.from_dict(config)
    block = tuple(config.weight_block_size) if config.weight_block_size is not None else None
    originals = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    skip, kept = _skipped(model, config)
    experts = {n: m for n, m in model.named_modules() if n.endswith("." + EXPERTS_KEPT) and n not in kept}
    replace_with_fp8_linear(model, modules_to_not_convert=skip, quantization_config=config, pre_quantized=False)
    converted = 0
    for name, old in originals.items():
        new = model.get_submodule(name)
        if new is old:
            continue
        weight, scale = quantize_block_fp8(old.weight.to(old.weight.device), block)
        new.weight = nn.Parameter(weight, requires_grad=False)
        new.weight_scale_inv = nn.Parameter(scale.to(torch.float32), requires_grad=False)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
        new.to(old.weight.device)  # anything else the replacement allocated (on the default device) joins the weight
        converted += 1
    stacks = 0
    for name, old in experts.items():
        new = model.get_submodule(name)
        if new is old:
            continue
        if _fill_experts(new, old, block):
            new.to(old.gate_up_proj.device)
            stacks += 1
        else:  # Transformers' module does not fit the stacks (its config disagrees): keep the original
            model.set_submodule(name, old)
            kept.append(name)
    model.config.quantization_config = config
    blocks = "per-tensor" if block is None else f"{block[0]}x{block[1]}"
    notes = [f"FP8 on demand: {converted} linears and {stacks} expert stacks quantised to float8_e4m3fn with {blocks} "
             "scales by mla-fuser" + ("" if transformers_quantizes_here() else
                                      " (Transformers' FP8 quantizer needs a GPU or XPU)")]
    if kept:
        notes.append(f"FP8 on demand: {len(kept)} experts modules keep the model's dtype (not decorated gated "
                     f"[E, 2I, H] stacks we can quantise): {', '.join(sorted(kept)[:4])}")
    return notes
