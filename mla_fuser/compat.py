"""Transformers touch points: the names we register and the version-dependent or private attributes we read.

Low layer: imports nothing from the package.  Code elsewhere asks these helpers instead of reading Transformers'
private names itself, so a rename between releases is mended here once.
"""

from __future__ import annotations

# the attention implementation we register in Transformers' AttentionInterface / AttentionMaskInterface
ATTENTION_NAME = "vllm_mla"


def attention_implementation(module) -> str | None:
    """The attention implementation ``module``'s config names now (``set_attn_implementation`` and assignments to
    ``config._attn_implementation`` change it at run time), or None when the module has no config."""
    config = getattr(module, "config", None)
    return None if config is None else getattr(config, "_attn_implementation", None)
