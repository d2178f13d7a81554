"""Where one decode step of a ``generate()`` mode goes, fused model only: torch.profiler and cProfile over the
steps of one call (the modes and their inputs are ``bench_generate_modes.py``'s).

Per mode it records ms per step (between logits-processor calls, as the modes benchmark measures), GPU kernel time
per step, kernel launches outside CUDA graphs and graph launches per step, host syncs per step (device-to-host copies
and stream/device synchronisations), the top kernels and host ops, and cProfile's Python functions by own time.
The question it answers: what a beam or eager step adds over the graphed greedy one.

    python benchmarks/profile_generate_mode.py --modes greedy,beam4 --out profile_generate_modes.json
    python benchmarks/profile_generate_mode.py --dry-run            # tiny preset on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_generate_modes import SKIPPED_STEPS, build, mode_call, timed_generate  # noqa: E402
from profile_decode_step import union_us  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_mode(mode, model, args, device, sync):
    ids, kw, context, cache, keyword = mode_call(mode, model, True, args.batch, args.prompt, device)
    steps = args.steps
    with context(), torch.no_grad():
        timed_generate(model, ids, kw, 8, cache, keyword, sync)  # compiles and captures happen here
        _, gaps = timed_generate(model, ids, kw, steps, cache, keyword, sync)
        steady = sorted(gaps[SKIPPED_STEPS:] or gaps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            timed_generate(model, ids, kw, steps, cache, keyword, sync)
        profiler = cProfile.Profile()
        profiler.enable()
        timed_generate(model, ids, kw, steps, cache, keyword, sync)
        profiler.disable()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in events if e.device_type != torch.autograd.DeviceType.CUDA]
    d2h = sum(1 for e in events if e.name == "aten::_local_scalar_dense" or e.name == "aten::item")
    row = {
        "ms_per_step_median": steady[len(steady) // 2] * 1e3,
        "steps_profiled": steps,
        "gpu_kernel_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_launches_outside_graphs_per_step": sum(n == "cudaLaunchKernel" or n == "cuLaunchKernel"
                                                        for n in names) / steps,
        "graph_launches_per_step": sum(n == "cudaGraphLaunch" for n in names) / steps,
        "host_syncs_per_step": sum(n in SYNC_OPS for n in names) / steps,
        "scalar_reads_per_step": d2h / steps,
    }
    if device.type == "cuda":
        row["decode_window"] = decode_window(kernels, model.config.num_hidden_layers)
    table = prof.key_averages()
    text = io.StringIO()
    text.write(f"== {mode}: {json.dumps(row)}\n")
    if device.type == "cuda":
        text.write(table.table(sort_by="cuda_time_total", row_limit=25) + "\n")
    text.write(table.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(30)
    return row, text.getvalue()


def decode_window(kernels, layers: int, keep: int = 40) -> dict:
    """The GPU's time line from the first decode attention kernel on (the prefill left out): per step its span, the
    time the GPU was busy (kernel intervals merged) and idle, and the kernels by name with their count and time per
    step, so that what a mode adds around the captured step (beam search's own ops, the gaps while the host works)
    stands apart from the graph's kernels (those counted ``layers`` times or once per step)."""
    first = min((e.time_range.start for e in kernels if "mla_decode_stage1" in e.name), default=None)
    if first is None:
        return {}
    window = sorted((e for e in kernels if e.time_range.start >= first), key=lambda e: e.time_range.start)
    steps = sum("mla_decode_stage1" in e.name for e in window) / layers
    busy = union_us(window)
    span = max(e.time_range.end for e in window) - first
    by_name: dict = {}
    for e in window:
        count, total = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, total + e.device_time)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:keep]
    return {
        "steps": steps, "span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
        "idle_us_per_step": (span - busy) / steps,
        "by_name": [{"name": n[:100], "per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in rows],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v2-lite")
    p.add_argument("--modes", default="greedy,beam4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", default="profile_generate_modes.json")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run or not torch.cuda.is_available():
        args.preset, device, dtype = "deepseek-v2-lite-tiny", torch.device("cpu"), torch.float32
        args.batch, args.prompt, args.steps = 2, 24, 12
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    _, model = build(args.preset, None, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result, texts = {"preset": args.preset, "device": str(device), "batch": args.batch, "prompt": args.prompt}, []
    for mode in args.modes.split(","):
        row, text = profile_mode(mode, model, args, device, sync)
        result[mode] = row
        texts.append(text)
        print(text[:6000], flush=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as fh:
        fh.write("\n".join(texts))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
