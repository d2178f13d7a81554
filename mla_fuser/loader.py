"""Drop-in loaders: the Hugging Face auto classes, then ``fuse``.  Every keyword passes through."""

from __future__ import annotations

import transformers

from .fusion import ATTENTION_NAME, fuse


def _finish(model, attn_implementation):
    if attn_implementation == ATTENTION_NAME:
        fuse(model)
    else:
        from .fusers.base import FusionReport

        report = FusionReport(notes=[f"attn_implementation={attn_implementation!r}: not fused"])
        object.__setattr__(model, "fusion_report", report)
    return model


class _AutoWrapper:
    _hf_class = None

    @classmethod
    def from_pretrained(cls, *args, attn_implementation=ATTENTION_NAME, **kwargs):
        model = cls._hf_class.from_pretrained(*args, attn_implementation=attn_implementation, **kwargs)
        return _finish(model, attn_implementation)

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
