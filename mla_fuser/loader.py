"""Drop-in loaders: the Hugging Face auto classes, then ``fuse``.  Every keyword passes through."""

from __future__ import annotations

import os

import transformers

from .fusion import ATTENTION_NAME, fuse


def _finish(model, attn_implementation, notes=()):
    if attn_implementation == ATTENTION_NAME:
        fuse(model).notes.extend(notes)
    else:
        from .fusers.base import FusionReport

        report = FusionReport(notes=[f"attn_implementation={attn_implementation!r}: not fused", *notes])
        object.__setattr__(model, "fusion_report", report)
    return model


# from_pretrained keywords that only say where and how to load (anything else may be a config override, which a
# config passed along would send to the model's __init__ instead: then the checkpoint is left to Transformers)
_CONFIG_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
                    "trust_remote_code")  # (the ones reading the config needs too)
_LOADING_KEYWORDS = frozenset(_CONFIG_KEYWORDS) | {
    "dtype", "torch_dtype", "device_map", "low_cpu_mem_usage", "output_loading_info", "use_safetensors", "variant",
    "config"}


def _keep_fp8_checkpoint(args, kwargs) -> tuple[dict | None, list[str]]:
    """For a block-FP8 checkpoint our kernels run, on a machine where Transformers would dequantise it: put a config
    that loads it as it is into ``kwargs`` and return ``(the checkpoint's quantization config, notes)``; else
    ``(None, notes)``, ``kwargs`` untouched."""
    from .fusers.fp8_checkpoint import NOT_FP8, kept_fp8_config, why_not_kept

    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        source = config if config is not None else path
        if not isinstance(source, (str, os.PathLike)):
            return None, []
        try:
            config = transformers.AutoConfig.from_pretrained(
                source, **{k: kwargs[k] for k in _CONFIG_KEYWORDS if k in kwargs})
        except (OSError, ValueError):  # (Transformers' own call says what is wrong with the path)
            return None, []
    why = why_not_kept(getattr(config, "quantization_config", None))
    if why == NOT_FP8:
        return None, []
    if why is None and not set(kwargs) <= _LOADING_KEYWORDS:
        why = f"config overrides given ({', '.join(sorted(set(kwargs) - _LOADING_KEYWORDS))})"
    if why is not None:
        return None, [f"FP8 checkpoint dequantised by Transformers (no GPU): {why}"]
    kwargs["config"], original = kept_fp8_config(config)
    return original, ["FP8 checkpoint kept in FP8 without a GPU (Transformers would dequantise it to bf16): its "
                      "float8 weights and scales run on mla-fuser's kernels"]


class _AutoWrapper:
    _hf_class = None

    @classmethod
    def from_pretrained(cls, *args, attn_implementation=ATTENTION_NAME, **kwargs):
        # FP8 on demand (issue 15): Transformers refuses FineGrainedFP8Config without a GPU/XPU; our kernels run on
        # a CPU, so there we load the checkpoint as it is and quantise it ourselves (``fusers.fp8_quantize``)
        from .fusers.fp8_quantize import is_fine_grained_fp8, quantize_linears_to_fp8, transformers_quantizes_here

        fp8_config = kwargs.get("quantization_config")
        quantizes_here = transformers_quantizes_here()
        if not (is_fine_grained_fp8(fp8_config) and not quantizes_here):
            fp8_config = None
        if fp8_config is not None:
            kwargs.pop("quantization_config")
        # a pre-quantised FP8 checkpoint without a GPU: kept in FP8 (``fusers.fp8_checkpoint``), not dequantised
        kept, notes = None, []
        if attn_implementation == ATTENTION_NAME and "quantization_config" not in kwargs and fp8_config is None \
                and not quantizes_here:
            kept, notes = _keep_fp8_checkpoint(args, kwargs)
        model = cls._hf_class.from_pretrained(*args, attn_implementation=attn_implementation, **kwargs)
        if kept is not None:
            from .fusers.fp8_checkpoint import restore_quantization_config

            restore_quantization_config(model, kept)
        notes += quantize_linears_to_fp8(model, fp8_config) if fp8_config is not None else []
        model = _finish(model, attn_implementation, notes)
        if kept is not None:
            from .fusers.fp8_checkpoint import refuse_untaken

            refuse_untaken(model, getattr(model, "fusion_report", None))
        return model

    @classmethod
    def from_config(cls, config, *args, attn_implementation=ATTENTION_NAME, **kwargs):
        model = cls._hf_class.from_config(config, *args, attn_implementation=attn_implementation, **kwargs)
        return _finish(model, attn_implementation)


class AutoModelForCausalLM(_AutoWrapper):
    """``transformers.AutoModelForCausalLM`` + fusion; returns the Hugging Face model itself."""

    _hf_class = transformers.AutoModelForCausalLM


class AutoModel(_AutoWrapper):
    """``transformers.AutoModel`` + fusion, for base models without an LM head."""

    _hf_class = transformers.AutoModel
