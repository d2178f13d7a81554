"""Embedded model presets: configs built in code, random weights from a seed, no download.

``deepseek-v2-lite-tiny`` (the default) has the DeepSeek-V2-Lite architecture — no q-LoRA, a 576-style
``[kv_lora_rank | rope]`` latent, MoE with shared experts, first layer dense — scaled down to run in
seconds on a CPU.  ``deepseek-v2-lite`` is the real shape (15.7B parameters) for GPU benchmarks.

Every preset also has a tokenizer built in code (:func:`preset_tokenizer`): byte-level, exactly the preset's
``vocab_size`` ids, a chat template, so a server can talk text to a preset with no download.
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
# Presets of a real model's size, for GPUs: the command line builds them only where ``--device`` says where (left
# out, the default CPU would build the 15.7B parameters in the default fp32, ~63 GB, and decode for hours).
FULL_SIZE_PRESETS = {"deepseek-v2-lite": "the real DeepSeek-V2-Lite shape, 15.7B parameters"}
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


FP8_BLOCK = (128, 128)  # DeepSeek's checkpoints' weight block


def fp8_on_demand_config():
    """Transformers' own ``FineGrainedFP8Config`` as DeepSeek's checkpoints set it (e4m3, 128x128 blocks)."""
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(weight_block_size=list(FP8_BLOCK))


def load_for_cli(args, attn_implementation: str, fp8_weights: bool = False):
    """(model, name) from the command line's model arguments (``--model`` or ``--preset``, ``--dtype`` as a
    ``DTYPES`` name, ``--device``, ``--seed``): a local checkpoint through the package's drop-in loader (fused when
    ``attn_implementation`` is ``vllm_mla``), or a preset with seeded weights.  ``fp8_weights``: the linears and
    expert stacks quantised to block FP8 on load (``fp8_on_demand_config``), before fusion.

    It lives here, not in ``cli``, because ``bench`` takes the same arguments and must not import ``cli``."""
    dtype = DTYPES[args.dtype]
    if args.model:
        from .loader import AutoModelForCausalLM

        extra = {"quantization_config": fp8_on_demand_config()} if fp8_weights else {}
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn_implementation, dtype=dtype,
                                                     device_map=args.device, **extra)
        return model, args.model
    model = build_preset(args.preset, seed=args.seed, attn_implementation=attn_implementation, dtype=dtype,
                         device=args.device, fuse=not fp8_weights)
    if fp8_weights:
        from .fusers.fp8_quantize import quantize_linears_to_fp8

        notes = quantize_linears_to_fp8(model, fp8_on_demand_config())
        if attn_implementation == "vllm_mla":
            from .fusion import fuse as fuse_model

            fuse_model(model).notes.extend(notes)
    return model, args.preset


# ---- tokenizer built in code -------------------------------------------------------------------------------------
# Why in code: a server speaks text, and a preset has no checkpoint to bring a tokenizer.  Byte-level, so any text
# encodes; the ids above the 256 bytes are letter sequences (merges), so every id the model can emit decodes to text.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"  # English frequency order: the first merges are the likeliest pairs


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (index = byte value): the alphabet of byte-level BPE."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = {}, 0
    for b in range(256):
        if b in kept:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _merges(count: int, space: str) -> list[tuple[str, str]]:
    """``count`` BPE merges in a fixed order: space+letter, then letter sequences of growing length, each also with a
    leading space.  A level starts only after the one below is complete, so every merge joins two existing tokens."""
    out, words = [], [""]
    while len(out) < count:
        words = [w + c for w in words for c in _LETTERS]
        for word in words:
            if len(word) > 1:
                out.append((word[:-1], word[-1]))
            out.append((space + word[:-1], word[-1]) if len(word) > 1 else (space, word))
    return out[:count]


def byte_level_tokenizer(vocab_size: int):
    """A Transformers fast tokenizer with exactly ``vocab_size`` ids: the special tokens (ids 0-5: pad, bos, eos and
    the chat roles), the 256 bytes, then letter-sequence merges; BOS is prepended to plain text, the chat template
    writes ``<|bos|><|role|>content<|eos|>...<|assistant|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    fixed = len(SPECIAL_TOKENS) + len(symbols)
    if vocab_size < fixed:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {fixed}, got {vocab_size}")
    merges = _merges(vocab_size - fixed, space=symbols[ord(" ")])
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(symbols) + tuple(a + b for a, b in merges))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token=bos, eos_token="<|eos|>",
                                   chat_template=CHAT_TEMPLATE)


def preset_tokenizer(name: str = DEFAULT_PRESET):
    """The tokenizer of a preset: :func:`byte_level_tokenizer` sized to its ``vocab_size``."""
    return byte_level_tokenizer(preset_config(name).vocab_size)


def use_tokenizer_ids(model, tokenizer) -> None:
    """Point ``model``'s generation config at ``tokenizer``'s pad/bos/eos ids (a preset's config names DeepSeek's,
    outside a tiny vocabulary), so generation stops at the tokenizer's end of turn as a server expects."""
    config = model.generation_config
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
