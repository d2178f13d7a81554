"""The kernels of one graphed decode step of a fused DeepSeek-V2-Lite-shaped model, as the GPU runs them.

A B=1 graphed step is GPU-bound on ~1,600 small kernels (``profile_host.py --generate``: the bare replay loop
is within 7% of ``generate``), so the way to a faster step is fewer and shorter kernels.  This replays the step
from its CUDA graph under torch.profiler and reports, per step: the kernel count, the summed kernel time, the
span from first kernel start to last kernel end (the gaps between kernels are the difference), the kernels by
total time, and the ordered kernels of one middle (MoE) layer, so that fusion candidates can be read off.

    python benchmarks/profile_decode_step.py --shapes 1x512,1x32768,16x4096 --out profile_decode_step.json
    python benchmarks/profile_decode_step.py --dry-run        # CPU: tiny preset, the replay is eager there
    python benchmarks/profile_decode_step.py --fp8-weights --fp8-cache --shapes 1x512   # the block-FP8 model's step
"""

import argparse
import collections
import importlib
import json
import os

import time

import torch


def _kernel_events(prof):
    from torch.autograd import DeviceType

    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def _short(name: str) -> str:
    return name if len(name) <= 100 else name[:97] + "..."


def _rotary_recipes(model) -> list:
    """What the rewritten rotary calls found at their first run (``rotary_call``): the recipe each kind of call runs
    on, or None where it runs the modeling code's own ops."""
    from mla_fuser.rotary_call import ROTARY_ATTR

    found = set()
    for module in model.modules():
        call = module.__dict__.get(ROTARY_ATTR)
        if call is not None:
            found.update(str(v) for v in call.verdicts.values())
    return sorted(found)


def _router_verdicts(model) -> list:
    """Whether each bound router child took the selection kernel at its first run (``router_binding``)."""
    from mla_fuser.plans import plan_of

    return sorted({str(v) for m in model.modules() if plan_of(m, "router") is not None
                   for v in plan_of(m, "router").verdicts.values()})


def union_us(events) -> float:
    """Time at least one kernel ran (overlapping kernels of several streams counted once)."""
    total, end = 0.0, None
    for e in events:  # (sorted by start)
        s, t = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            total += t - s
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


def profile_shape(model, batch: int, length: int, replays: int, device: str, layers: int, cache_dtype=None,
                  trace: str | None = None):
    from torch.profiler import ProfilerActivity, profile

    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.runtime import DecodeGraph

    ids = torch.randint(3, 1000, (batch, length), device=device)
    timed = 30  # (replays timed back to back after the profiled ones: the cache holds them all)
    cache = PagedLatentCache.static_for(model, batch, length + replays + timed + 8, dtype=cache_dtype)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache}).logits[:, -1]
        step = DecodeGraph(model, cache)
        token = logits.argmax(-1, keepdim=True)
        position = length
        for _ in range(3):  # eager first step, capture, one replay
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(timed):  # (replays back to back: the step's own time, host loop included)
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        if device == "cuda":
            torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - began) * 1e3 / timed
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(replays):
                token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
                position += 1
            if device == "cuda":
                torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    events = _kernel_events(prof)
    row = {"batch": batch, "context": length, "replays": replays, "kernels_per_step": len(events) / replays,
           "ms_per_replay": replay_ms,
           "rotary_recipes": _rotary_recipes(model), "router_on_kernel": _router_verdicts(model)}
    if not events:
        return row
    busy = sum(e.time_range.elapsed_us() for e in events) / replays
    span = (events[-1].time_range.end - events[0].time_range.start) / replays
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)
    row.update({
        "kernel_us_per_step": busy, "span_us_per_step": span, "union_busy_us_per_step": union_us(events) / replays,
        "by_name": [{"name": _short(k), "per_step": c / replays, "us_per_step": t / replays} for k, (c, t) in top],
    })
    # one replay's kernels, and those of a middle layer: the step is layers x (a fixed kernel run) plus head/tail
    per_step = len(events) // replays
    first = events[per_step * (replays // 2): per_step * (replays // 2 + 1)]
    period = (len(first) - 4) // layers if layers else 0
    middle = first[len(first) // 2 - period // 2: len(first) // 2 + period // 2 + 1] if period else []
    row["middle_layer_kernels"] = [{"name": _short(e.name), "us": e.time_range.elapsed_us(),
                                    "start_us": e.time_range.start - middle[0].time_range.start} for e in middle]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x512,1x32768,16x4096")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--out", default="profile_decode_step.json")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--fp8-weights", action="store_true",
                   help="linears and expert stacks quantised to block FP8 on load")
    p.add_argument("--fp8-cache", action="store_true", help="a float8 latent cache")
    p.add_argument("--ab-env", default=None, help="a switch of ours (e.g. MLA_FUSER_OVERLAP_SHARED_EXPERTS): every "
                                                   "shape is profiled with it off, then on, in this process")
    p.add_argument("--ab-attr", default=None, help="MODULE:NAME, a boolean module constant of ours read while a "
                                                    "step is captured or replayed (e.g. mla_fuser.runtime.decode_graph:"
                                                    "ONE_LAUNCH_INPUT_COPY): every shape profiled with it False, then "
                                                    "True, in this process")
    p.add_argument("--trace", default=None, help="also write each shape's profile as a Chrome trace (kernels per "
                                                  "stream) to TRACE.BxL.json")
    args = p.parse_args()
    if args.ab_env and args.ab_attr:
        p.error("--ab-env and --ab-attr: one A/B at a time")
    from mla_fuser.presets import load_for_cli

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    preset, dtype = ("deepseek-v2-lite-tiny", torch.float32) if args.dry_run else ("deepseek-v2-lite", torch.bfloat16)
    if args.dry_run:
        args.shapes, args.replays = "1x16", 2
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    model_args = argparse.Namespace(model=None, preset=preset, dtype=names[dtype], device=device, seed=0)
    model = load_for_cli(model_args, "vllm_mla", fp8_weights=args.fp8_weights)[0]
    layers = model.config.num_hidden_layers
    cache_dtype = torch.float8_e4m3fn if args.fp8_cache else None
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "preset": preset,
              "fp8_weights": args.fp8_weights, "fp8_cache": args.fp8_cache, "runs": []}
    settings = [None] if args.ab_env is None and args.ab_attr is None else ["0", "1"]
    for shape, setting in ((shape, setting) for shape in args.shapes.split(",") for setting in settings):
        batch, length = (int(v) for v in shape.split("x"))
        if setting is not None and args.ab_env:
            os.environ[args.ab_env] = setting  # (read when the step is captured)
        elif setting is not None:
            module, name = args.ab_attr.split(":")
            setattr(importlib.import_module(module), name, setting == "1")
        trace = f"{args.trace}.{shape}{'' if setting is None else '.' + setting}.json" if args.trace else None
        row = profile_shape(model, batch, length, args.replays, device, layers, cache_dtype, trace)
        if setting is not None:
            row["env"] = {args.ab_env or args.ab_attr: setting}
        result["runs"].append(row)
        print(f"{shape} {row.get('env', '')}: {row.get('ms_per_replay') or 0:.3f} ms/replay, "
              f"{row['kernels_per_step']:.0f} kernels/step, rotary {row['rotary_recipes']}, "
              f"router kernel {row['router_on_kernel']}, "
              f"busy {row.get('kernel_us_per_step', 0):.0f} us (union {row.get('union_busy_us_per_step', 0):.0f}), "
              f"span {row.get('span_us_per_step', 0):.0f} us")
        for item in row.get("by_name", [])[:25]:
            print(f"   {item['us_per_step']:8.1f} us {item['per_step']:6.1f}x  {item['name']}")
        if device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
