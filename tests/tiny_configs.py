"""Tiny-config recipes for the 17 MLA architectures (copied from the project's shared recipe file).

Each entry: module under ``transformers.models``, config class, model class, config kwargs.  ``COMMON`` kwargs
apply first (keys a config class does not accept are skipped), then the entry's own, then per-test overrides.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect

import torch

COMMON = {'hidden_size': 128,
 'intermediate_size': 256,
 'moe_intermediate_size': 64,
 'num_hidden_layers': 2,
 'num_layers': 1,
 'num_attention_heads': 4,
 'num_key_value_heads': 4,
 'kv_lora_rank': 32,
 'q_lora_rank': 48,
 'qk_nope_head_dim': 16,
 'qk_rope_head_dim': 8,
 'v_head_dim': 16,
 'vocab_size': 200,
 'n_routed_experts': 4,
 'num_experts': 4,
 'num_local_experts': 4,
 'num_experts_per_tok': 2,
 'n_group': 1,
 'topk_group': 1,
 'index_topk': 4,
 'index_head_dim': 16,
 'index_n_heads': 2,
 'first_k_dense_replace': 1,
 'max_position_embeddings': 256,
 'pad_token_id': 0,
 'bos_token_id': 1,
 'eos_token_id': 2,
 'linear_head_dim': 16,
 'linear_num_heads': 4,
 'moe_topk': 2,
 'zero_expert_num': 0,
 'expert_ffn_hidden_size': 64,
 'ffn_hidden_size': 256,
 'index_kpool': 2,
 'hc_mult': 1}

ARCHS = {'deepseek_v2': {'module': 'deepseek_v2',
                 'config': 'DeepseekV2Config',
                 'model': 'DeepseekV2ForCausalLM',
                 'kwargs': {}},
 'deepseek_v3': {'module': 'deepseek_v3',
                 'config': 'DeepseekV3Config',
                 'model': 'DeepseekV3ForCausalLM',
                 'kwargs': {}},
 'deepseek_v32': {'module': 'deepseek_v32',
                  'config': 'DeepseekV32Config',
                  'model': 'DeepseekV32ForCausalLM',
                  'kwargs': {}},
 'glm4_moe_lite': {'module': 'glm4_moe_lite',
                   'config': 'Glm4MoeLiteConfig',
                   'model': 'Glm4MoeLiteForCausalLM',
                   'kwargs': {}},
 'glm_moe_dsa': {'module': 'glm_moe_dsa',
                 'config': 'GlmMoeDsaConfig',
                 'model': 'GlmMoeDsaForCausalLM',
                 'kwargs': {}},
 'glm5_next': {'module': 'glm5_next',
               'config': 'Glm5NextTextConfig',
               'model': 'Glm5NextTextModel',
               'kwargs': {'qk_rope_head_dim': 0, 'layer_types': ['full_attention', 'linear_attention']}},
 'kimi_linear': {'module': 'kimi_linear',
                 'config': 'KimiLinearConfig',
                 'model': 'KimiLinearForCausalLM',
                 'kwargs': {'layer_types': ['linear_attention', 'full_attention']}},
 'longcat_flash': {'module': 'longcat_flash',
                   'config': 'LongcatFlashConfig',
                   'model': 'LongcatFlashForCausalLM',
                   'kwargs': {'head_dim': 8}},
 'minicpm3': {'module': 'minicpm3', 'config': 'MiniCPM3Config', 'model': 'MiniCPM3ForCausalLM', 'kwargs': {}},
 'mistral4': {'module': 'mistral4', 'config': 'Mistral4Config', 'model': 'Mistral4ForCausalLM', 'kwargs': {}},
 'mistral_large4': {'module': 'mistral_large4',
                    'config': 'MistralLarge4TextConfig',
                    'model': 'MistralLarge4TextModel',
                    'kwargs': {}},
 'youtu': {'module': 'youtu', 'config': 'YoutuConfig', 'model': 'YoutuForCausalLM', 'kwargs': {}},
 'axk1': {'module': 'axk1', 'config': 'AXK1Config', 'model': 'AXK1ForCausalLM', 'kwargs': {}},
 'axk2': {'module': 'axk2', 'config': 'AXK2Config', 'model': 'AXK2ForCausalLM', 'kwargs': {}},
 'bailing_hybrid': {'module': 'bailing_hybrid',
                    'config': 'BailingHybridConfig',
                    'model': 'BailingHybridForCausalLM',
                    'kwargs': {'layer_types': ['linear_attention', 'full_attention']}},
 'dots3_note': {'module': 'dots3_note',
                'config': 'Dots3NoteTextConfig',
                'model': 'Dots3NoteForCausalLM',
                'kwargs': {}},
 'hy_v4': {'module': 'hy_v4', 'config': 'HYV4Config', 'model': 'HYV4ForCausalLM', 'kwargs': {}}}


def _accepted_keys(cfg_cls) -> set[str]:
    """Keyword names the config accepts: dataclass fields, ``__init__`` parameters and the attribute map.

    Probing an instance with ``hasattr`` is not enough: heterogeneous (per-layer) configs raise on global reads
    of per-layer attributes, and some configs expose extra settable attributes only as properties, so the probe
    is used where it works and the declared names everywhere.
    """
    keys = set(getattr(cfg_cls, "attribute_map", {}) or {})
    if dataclasses.is_dataclass(cfg_cls):
        keys |= {f.name for f in dataclasses.fields(cfg_cls)}
    keys |= {n for n, p in inspect.signature(cfg_cls.__init__).parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    try:
        probe = cfg_cls()
    except Exception:
        return keys
    for k in COMMON:
        try:
            if hasattr(probe, k):
                keys.add(k)
        except Exception:  # a per-layer attribute: it exists
            keys.add(k)
    return keys


def available(arch: str) -> bool:
    """Whether the installed Transformers ships this architecture (5.17 lacks a few that 5.2x added)."""
    return importlib.util.find_spec(f"transformers.models.{ARCHS[arch]['module']}") is not None


def classes(arch: str):
    entry = ARCHS[arch]
    module = importlib.import_module(f"transformers.models.{entry['module']}")
    return getattr(module, entry["config"]), getattr(module, entry["model"])


def make_config(arch: str, **overrides):
    cfg_cls, _ = classes(arch)
    accepted = _accepted_keys(cfg_cls)
    kwargs = {k: v for k, v in COMMON.items() if k in accepted}
    kwargs.update(ARCHS[arch]["kwargs"])
    kwargs.update(overrides)
    return cfg_cls(**kwargs)


def native_attention(arch: str) -> str:
    """``sdpa`` where the model class supports it, else ``eager``."""
    _, model_cls = classes(arch)
    return "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"


def build(arch: str, attn: str | None = None, seed: int = 0, **overrides):
    """A float32 model in eval mode, with weights drawn after ``torch.manual_seed(seed)``."""
    _, model_cls = classes(arch)
    config = make_config(arch, **overrides)
    config._attn_implementation = attn or native_attention(arch)
    torch.manual_seed(seed)
    return model_cls(config).eval()
