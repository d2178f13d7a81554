"""FP8 on demand for a bf16 (or fp32) model on a machine without a GPU: ``quantize_linears_to_fp8(model, config)``.

Why here and not in Transformers: ``from_pretrained(..., quantization_config=FineGrainedFP8Config(...))`` refuses
on a CPU-only machine (Transformers 5.17-5.24, ``FineGrainedFP8HfQuantizer.validate_environment``: "No GPU or XPU
found. A GPU or XPU is needed for FP8 quantization."), and a pre-quantized FP8 checkpoint is dequantised there.
Our kernels need neither, so the loader (``loader.py``) loads the checkpoint without the quantization config and
calls this: Transformers' own ``replace_with_fp8_linear`` swaps the linears for ``FP8Linear`` modules (honouring
the config's ``modules_to_not_convert`` plus Transformers' default skips: the output embeddings), and each gets its
loaded weight quantised per block (``kernels.fp8.quantize_block_fp8``; partial edge blocks where the block does not
divide the dims).  The config is recorded on ``model.config`` so ``save_pretrained`` writes a DeepSeek-format FP8
checkpoint (float8 weights, fp32 ``weight_scale_inv``).  Expert stacks (``*.experts``) stay in the model's dtype:
our fused MoE kernel has no FP8 path yet.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8 import quantize_block_fp8

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


def _skipped(model: nn.Module, config) -> list[str]:
    from transformers.quantizers.base import HfQuantizer

    skip = HfQuantizer.get_modules_to_not_convert(model, config.modules_to_not_convert,
                                                  getattr(model, "_keep_in_fp32_modules", None) or None,
                                                  add_default_skips=True)
    experts = [n for n, _ in model.named_modules() if n.endswith("." + EXPERTS_KEPT)]
    return sorted(set(skip) | set(experts))


@torch.no_grad()
def quantize_linears_to_fp8(model: nn.Module, config) -> list[str]:
    """Quantise the model's plain linears to block-FP8 ``FP8Linear`` modules in place; returns report notes."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    if isinstance(config, dict):
        config = FineGrainedFP8Config.from_dict(config)
    block = tuple(config.weight_block_size) if config.weight_block_size is not None else None
    originals = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    replace_with_fp8_linear(model, modules_to_not_convert=_skipped(model, config), quantization_config=config,
                            pre_quantized=False)
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
        converted += 1
    model.config.quantization_config = config
    blocks = "per-tensor" if block is None else f"{block[0]}x{block[1]}"
    notes = [f"FP8 on demand: {converted} linears quantised to float8_e4m3fn with {blocks} scales by mla-fuser "
             "(Transformers' FP8 quantizer needs a GPU or XPU)"]
    if any(n.endswith("." + EXPERTS_KEPT) for n, _ in model.named_modules()):
        notes.append("FP8 on demand: expert stacks keep the model's dtype (no FP8 path in the fused MoE kernel)")
    return notes
