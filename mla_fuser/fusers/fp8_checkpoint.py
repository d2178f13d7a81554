"""A pre-quantised block-FP8 checkpoint (DeepSeek format) loaded on a machine without a GPU stays FP8.

Why: Transformers' FP8 quantizer (``FineGrainedFP8HfQuantizer``) needs a GPU or XPU to run FP8 modules, so on a
CPU-only machine it loads a pre-quantised checkpoint dequantised to bf16 (``validate_environment`` sets
``dequantize``): twice the weight memory, and not the checkpoint's weights any more.  Our kernels run block-FP8
linears and experts on a CPU too (their torch twins), so the loader can keep the checkpoint as it is.

How, through Transformers' own registries (``register_quantization_config`` / ``register_quantizer``): the
checkpoint's quantization config is handed to ``from_pretrained`` under the method name :data:`METHOD`, whose
config and quantizer are Transformers' FP8 ones except that the quantizer does not turn dequantisation on for lack
of a GPU.  Everything else (module replacement, loading the float8 weights and scales, experts conversion) is
Transformers' FP8 loading as on a GPU.  After loading, ``model.config`` gets the checkpoint's own config back, so
``save_pretrained`` writes ``quant_method: "fp8"`` as before.

Only checkpoints our kernels take go this way (:func:`why_not_kept`: e4m3 weights, 2-D block scales in fp32, dynamic
activations); any FP8 module the FP8 fuser then declines would have no forward that runs here (Transformers'
fetches a Hub kernel), so :func:`fp8_modules_not_taken` names them and the loader refuses with a clear error.
"""

from __future__ import annotations

import copy

from torch import nn

from ..kernels.fp8.format import FP8_DTYPE
from .base import FusionReport
from .fp8_quantize import is_fine_grained_fp8

METHOD = "mla_fuser_fp8"
NOT_FP8 = "not an FP8 checkpoint"  # (what why_not_kept says of any other checkpoint)
_REGISTERED: list = []  # (the config and quantizer classes, registered once per process)


def _register() -> None:
    """Register :data:`METHOD`'s config and quantizer with Transformers (once)."""
    if _REGISTERED:
        return
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer,
    )
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    class KeptFP8Config(FineGrainedFP8Config):
        """Transformers' FP8 config under the method name the quantizer below is registered as."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.quant_method = METHOD

    class KeptFP8Quantizer(FineGrainedFP8HfQuantizer):
        """Transformers' FP8 quantizer, loading a pre-quantised checkpoint as it is where no GPU is found (mla-fuser's
        kernels run it); dequantisation stays whatever the config says."""

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                return super().validate_environment(*args, **kwargs)

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(KeptFP8Config)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(KeptFP8Quantizer)
    _REGISTERED.append(True)


def _as_dict(quantization_config) -> dict | None:
    if quantization_config is None:
        return None
    if isinstance(quantization_config, dict):
        return dict(quantization_config)
    return quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else None


def why_not_kept(quantization_config) -> str | None:
    """None when a checkpoint with this quantization config is block-FP8 our kernels run; else why not (including
    "not FP8" for anything else)."""
    qc = _as_dict(quantization_config)
    if qc is None or not is_fine_grained_fp8({**qc, "dequantize": False}):  # (FP8, whatever it asks of dequantising)
        return NOT_FP8
    if qc.get("dequantize"):
        return "the config asks for dequantisation"
    if qc.get("fmt", "e4m3") != "e4m3":
        return f"weights in {qc.get('fmt')!r}, not e4m3"
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return f"weight_block_size {block!r} is not two block sides"
    if qc.get("scale_fmt", "float") not in (None, "float"):
        return f"scale format {qc.get('scale_fmt')!r} (our kernels take fp32 scales)"
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        return f"activation scheme {qc.get('activation_scheme')!r} (our kernels quantise activations dynamically)"
    return None


def kept_fp8_config(config):
    """``(copy of the model config whose quantization config loads through METHOD, the checkpoint's own quantization
    config as a dict)``."""
    _register()
    original = _as_dict(config.quantization_config)
    config = copy.deepcopy(config)
    config.quantization_config = {**original, "quant_method": METHOD}
    return config, original


def restore_quantization_config(model: nn.Module, original: dict) -> None:
    """The checkpoint's own quantization config on the loaded model (``save_pretrained`` writes it)."""
    from transformers import FineGrainedFP8Config

    model.config.quantization_config = FineGrainedFP8Config.from_dict(dict(original))


def fp8_modules_not_taken(model: nn.Module, report: FusionReport | None) -> list[str]:
    """Modules holding float8 tensors of their own that the FP8 fuser did not take over (each would run Transformers'
    forward, which fetches a Hub kernel): ``"name (reason)"`` each."""
    rows = {} if report is None else {r.qualname: r for r in report.rows if r.fuser == "fp8"}
    found = []
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if not any(t is not None and t.dtype == FP8_DTYPE for _, t in own):
            continue
        row = rows.get(name)
        if row is None or row.status != "fused":
            found.append(f"{name} ({row.reason if row is not None else 'not fused'})")
    return found


def refuse_untaken(model: nn.Module, report: FusionReport | None) -> None:
    """Raise when an FP8 module of a checkpoint kept in FP8 has no forward that runs on this machine."""
    untaken = fp8_modules_not_taken(model, report)
    if untaken:
        raise ValueError(
            f"FP8 checkpoint kept in FP8 without a GPU: {len(untaken)} modules our kernels do not take would need "
            f"Transformers' Hub kernel: {'; '.join(untaken[:4])}. Load it with "
            "quantization_config=FineGrainedFP8Config(dequantize=True) for Transformers' bf16 dequantisation")
