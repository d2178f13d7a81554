"""Attention functions registered in Transformers' registries on import (no monkey-patching)."""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compat import ATTENTION_NAME
from .vllm_mla import fused_mla_attention, padded_attention, vllm_mla_attention


def register() -> None:
    """Register ``vllm_mla``: the attention function, and (at class level, so every model sees it) the
    SDPA-style boolean mask; without the mask registration custom names receive no mask at all."""
    AttentionInterface.register(ATTENTION_NAME, vllm_mla_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


register()

__all__ = ["ATTENTION_NAME", "fused_mla_attention", "padded_attention", "register", "vllm_mla_attention"]
