"""Embedded model presets: configs built in code, random weights from a seed, no download.

``deepseek-v2-lite-tiny`` (the default) has the DeepSeek-V2-Lite architecture — no q-LoRA, a 576-style
``[kv_lora_rank | rope]`` latent, MoE with shared experts, first layer dense — scaled down to run in
seconds on a CPU.  ``deepseek-v2-lite`` is the real shape (15.7B parameters) for GPU benchmarks.
"""

from __future__ import annotations

import torch

PRESETS = {
    "deepseek-v2-lite-tiny": dict(
        arch="deepseek_v2", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=None,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, vocab_size=1024, max_position_embeddings=4096,
    ),
    "deepseek-v2-qlora-tiny": dict(
        arch="deepseek_v2", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, vocab_size=1024, max_position_embeddings=4096,
    ),
    "deepseek-v3-tiny": dict(
        arch="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, vocab_size=1024,
        max_position_embeddings=4096,
    ),
    "deepseek-v2-lite": dict(
        arch="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, vocab_size=102400, max_position_embeddings=163840,
    ),
}
DEFAULT_PRESET = "deepseek-v2-lite-tiny"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def preset_config(name: str = DEFAULT_PRESET, **overrides):
    """The transformers config of a preset (``overrides`` replace fields)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[name])
    arch = kwargs.pop("arch")
    kwargs.update(overrides)
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config as Config
    else:
        from transformers import DeepseekV3Config as Config
    return Config(**kwargs)


def build_preset(name: str = DEFAULT_PRESET, *, seed: int = 0, attn_implementation: str = "vllm_mla",
                 dtype=torch.float32, device=None, fuse: bool = True):
    """Build a preset model with seeded random weights (fused unless ``fuse=False`` or not ``vllm_mla``)."""
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn_implementation, "dtype": dtype}
    if device is not None:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.eval()
    if fuse and attn_implementation == "vllm_mla":
        from .fusion import fuse as fuse_model

        fuse_model(model)
    return model


def load_for_cli(args, attn_implementation: str):
    """(model, name) from the command line's model arguments (``--model`` or ``--preset``, ``--dtype`` as a
    ``DTYPES`` name, ``--device``, ``--seed``): a local checkpoint through the package's drop-in loader (fused when
    ``attn_implementation`` is ``vllm_mla``), or a preset with seeded weights.

    It lives here, not in ``cli``, because ``bench`` takes the same arguments and must not import ``cli``."""
    dtype = DTYPES[args.dtype]
    if args.model:
        from .loader import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn_implementation, dtype=dtype,
                                                     device_map=args.device)
        return model, args.model
    model = build_preset(args.preset, seed=args.seed, attn_implementation=attn_implementation, dtype=dtype,
                         device=args.device)
    return model, args.preset
