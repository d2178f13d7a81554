"""Tiny-config recipes for the 7 Mamba-family architectures (copied from the project's shared recipe file).

Each entry: module under ``transformers.models``, config class, model class, config kwargs.  The configs are
small enough that a CPU forward takes milliseconds, and each still exercises the real mixer code path
(Mamba-1: in/x/dt/out projections and depthwise conv; Mamba-2: grouped heads and gated RMSNorm; hybrids:
attention and MoE layers next to the mixers).
"""

from __future__ import annotations

import importlib

import torch

ARCHS = {
    "mamba": {
        "module": "mamba", "config": "MambaConfig", "model": "MambaForCausalLM",
        "kwargs": {"hidden_size": 64, "state_size": 8, "num_hidden_layers": 2, "vocab_size": 200,
                   "intermediate_size": 128, "time_step_rank": 8},
    },
    "falcon_mamba": {
        "module": "falcon_mamba", "config": "FalconMambaConfig", "model": "FalconMambaForCausalLM",
        "kwargs": {"hidden_size": 64, "state_size": 8, "num_hidden_layers": 2, "vocab_size": 200,
                   "intermediate_size": 128, "time_step_rank": 8},
    },
    "mamba2": {
        "module": "mamba2", "config": "Mamba2Config", "model": "Mamba2ForCausalLM",
        "kwargs": {"hidden_size": 64, "state_size": 8, "num_hidden_layers": 2, "vocab_size": 200,
                   "num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2, "chunk_size": 16},
    },
    "jamba": {
        "module": "jamba", "config": "JambaConfig", "model": "JambaForCausalLM",
        "kwargs": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 200, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "mamba_d_state": 8, "mamba_expand": 2,
                   "mamba_dt_rank": 8, "num_experts": 2, "num_experts_per_tok": 1, "attn_layer_period": 2,
                   "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    },
    "bamba": {
        "module": "bamba", "config": "BambaConfig", "model": "BambaForCausalLM",
        "kwargs": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 200, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "mamba_d_state": 8, "mamba_n_heads": 8,
                   "mamba_d_head": 16, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_chunk_size": 16,
                   "attn_layer_indices": [1]},
    },
    "nemotron_h": {
        "module": "nemotron_h", "config": "NemotronHConfig", "model": "NemotronHForCausalLM",
        "kwargs": {"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 200, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "ssm_state_size": 8, "mamba_num_heads": 8,
                   "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 16, "hybrid_override_pattern": "M*-",
                   "head_dim": 16},
    },
    "zamba2": {
        "module": "zamba2", "config": "Zamba2Config", "model": "Zamba2ForCausalLM",
        "kwargs": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 200, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "intermediate_size": 128, "mamba_d_state": 8, "mamba_headdim": 16,
                   "mamba_ngroups": 1, "mamba_expand": 2, "chunk_size": 16, "n_mamba_heads": 8,
                   "layers_block_type": ["mamba", "hybrid"], "num_mem_blocks": 1, "attention_head_dim": 16,
                   "use_mem_rope": False},
    },
}


def make_config(arch: str, **overrides):
    """The tiny config of ``arch`` (the recipe's kwargs, then ``overrides``)."""
    recipe = ARCHS[arch]
    module = importlib.import_module(f"transformers.models.{recipe['module']}")
    return getattr(module, recipe["config"])(**{**recipe["kwargs"], **overrides})


def make_model(arch: str, seed: int = 0, attn: str | None = None, **overrides):
    """A tiny causal LM of ``arch`` with seeded random weights, float32, eval mode."""
    recipe = ARCHS[arch]
    module = importlib.import_module(f"transformers.models.{recipe['module']}")
    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(module, recipe["model"])._from_config(config, attn_implementation=attn)
    return model.float().eval()
