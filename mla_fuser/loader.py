"""Drop-in loaders: the Hugging Face auto classes, then ``fuse``.  Every keyword passes through."""

from __future__ import annotations

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


class _AutoWrapper:
    _hf_class = None

    @classmethod
    def from_pretrained(cls, *args, attn_implementation=ATTENTION_NAME, **kwargs):
        # FP8 on demand (issue 15): Transformers refuses FineGrainedFP8Config without a GPU/XPU; our kernels run on
        # a CPU, so there we load the checkpoint as it is and quantise it ourselves (``fusers.fp8_quantize``)
        from .fusers.fp8_quantize import is_fine_grained_fp8, quantize_linears_to_fp8, transformers_quantizes_here

        fp8_config = kwargs.get("quantization_config")
        if not (is_fine_grained_fp8(fp8_config) and not transformers_quantizes_here()):
            fp8_config = None
        if fp8_config is not None:
            kwargs.pop("quantization_config")
        model = cls._hf_class.from_pretrained(*args, attn_implementation=attn_implementation, **kwargs)
        notes = quantize_linears_to_fp8(model, fp8_config) if fp8_config is not None else []
        return _finish(model, attn_implementation, notes)

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
