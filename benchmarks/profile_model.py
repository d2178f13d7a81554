"""Where the time of a DeepSeek-V2-Lite-shaped model goes: torch.profiler over prefill and one decode step,
fused (``vllm_mla`` + fused MoE) and native (``sdpa``), bf16 on the GPU.

For each case: wall time, the summed GPU kernel time, the number of kernels, and the top operators by GPU time and
by host (self CPU) time.  Decode runs eagerly here (one step): its summed kernel time is what a CUDA-graph replay
(``mla_fuser.DecodeGraph``) pays at best, so the gap between the two says how much is launch/host overhead.

    python benchmarks/profile_model.py --out profile.json        # CPU: --dry-run (tiny preset)
"""

import argparse
import json
import os
import time

import torch


def _table(prof, sort_by, rows=15):
    out = []
    for evt in sorted(prof.key_averages(), key=lambda e: getattr(e, sort_by), reverse=True)[:rows]:
        out.append({"name": evt.key[:90], "calls": evt.count,
                    "self_device_ms": getattr(evt, "self_device_time_total", 0) / 1e3,
                    "self_cpu_ms": evt.self_cpu_time_total / 1e3})
    return out


def _kernels(prof):
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(events), sum(e.device_time for e in events) / 1e3


def profile(fn, device):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()  # warm-up: kernel compiles, workspaces
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    wall = (time.perf_counter() - t0) * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        fn()
        sync()
    n, gpu_ms = _kernels(prof) if device.type == "cuda" else (0, 0.0)
    return {"wall_ms": wall, "kernels": n, "kernel_ms": gpu_ms,
            "top_by_device": _table(prof, "self_device_time_total") if device.type == "cuda" else [],
            "top_by_host": _table(prof, "self_cpu_time_total")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", default="1x512,1x32768")
    p.add_argument("--decode", default="1x512,16x4096")
    p.add_argument("--out", default="profile_model.json")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.presets import build_preset

    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    preset, dtype = ("deepseek-v2-lite-tiny", torch.float32) if args.dry_run else ("deepseek-v2-lite", torch.bfloat16)
    if args.dry_run:
        args.prefill, args.decode = "1x32", "2x32"
    shapes = lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",")]  # noqa: E731
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": preset,
              "prefill": [], "decode": []}
    for name, attn, fuse in (("fused", "vllm_mla", True), ("native", "sdpa", False)):
        model = build_preset(preset, seed=0, attn_implementation=attn, dtype=dtype, device=str(device), fuse=fuse)
        vocab = model.get_input_embeddings().weight.shape[0]
        key = cache_keyword(model)
        with torch.no_grad():
            for batch, length in shapes(args.prefill):
                ids = torch.randint(3, vocab, (batch, length), device=device)
                row = profile(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)
                result["prefill"].append({"model": name, "batch": batch, "context": length, **row})
                print(name, "prefill", batch, length, row["wall_ms"], row["kernel_ms"], flush=True)
            for batch, length in shapes(args.decode):
                ids = torch.randint(3, vocab, (batch, length), device=device)
                if fuse:
                    cache = PagedLatentCache(model, max_cache_tokens=batch * (length + 64))
                else:
                    from transformers import DynamicCache

                    cache = DynamicCache(config=model.config)
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
                token = ids[:, -1:]

                def step():
                    model(input_ids=token, use_cache=True, **{key: cache})
                    cache.crop(-1)  # keep the context length fixed across the repeated step

                row = profile(step, device)
                result["decode"].append({"model": name, "batch": batch, "context": length, **row})
                print(name, "decode", batch, length, row["wall_ms"], row["kernel_ms"], row["kernels"], flush=True)
                del cache
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
