"""Native Transformers (sdpa) vs mla-fuser on the same weights: equal tokens, speed, cache memory.

    python examples/compare_native_vs_fused.py                  # embedded default on CPU
    python examples/compare_native_vs_fused.py --device cuda --dtype bfloat16 --preset deepseek-v2-lite
"""

import argparse
import time

import torch
from transformers import DynamicCache

from mla_fuser.presets import DEFAULT_PRESET, PRESETS, build_preset

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
parser.add_argument("--dtype", default="float32")
parser.add_argument("--device", default=None)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--prompt-len", type=int, default=64)
parser.add_argument("--new-tokens", type=int, default=24)
args = parser.parse_args()
dtype = getattr(torch, args.dtype)

native = build_preset(args.preset, attn_implementation="sdpa", dtype=dtype, device=args.device)
fused = build_preset(args.preset, attn_implementation="vllm_mla", dtype=dtype, device=args.device)
device = fused.get_input_embeddings().weight.device
ids = torch.randint(3, fused.config.vocab_size, (args.batch, args.prompt_len),
                    generator=torch.Generator().manual_seed(0)).to(device)


def run(model):
    cache = DynamicCache(config=model.config)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    start = time.perf_counter()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=args.new_tokens,
                         min_new_tokens=args.new_tokens, do_sample=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                      for t in (layer.keys, layer.values) if t is not None)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return out, elapsed, cache_bytes, peak


n_out, n_time, n_cache, n_peak = run(native)
f_out, f_time, f_cache, f_peak = run(fused)
tokens = args.batch * args.new_tokens
print(fused.fusion_report)
print(f"native: {tokens / n_time:8.1f} tok/s  cache {n_cache / 2**20:7.2f} MiB  peak {n_peak}")
print(f"fused : {tokens / f_time:8.1f} tok/s  cache {f_cache / 2**20:7.2f} MiB  peak {f_peak}")
print("equal tokens:", torch.equal(n_out, f_out))
