"""Where a continuous-batching run of a fused model spends its time: torch.profiler over a short serving run
(the generation loop runs in the engine's thread; the profiler records every thread), tables by CUDA and CPU time.
The same manager serves the workload once first (``--warmup``: that many of its requests), unprofiled, so kernel
compiles and the engine's graph captures stay out of the profile (a server's steady state).

    python benchmarks/profile_serving.py --requests 192 --out profile_serving.txt
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_serving import run_cb, workload  # noqa: E402
from mla_fuser.presets import build_preset  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v2-lite")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 96])
    p.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per engine step (engine default 8192)")
    p.add_argument("--warmup", type=int, default=None,
                   help="requests of the workload served first, unprofiled (default: all of it)")
    p.add_argument("--out", default="profile_serving.txt")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_preset(args.preset, dtype=dtype, device=args.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts, outputs = workload(args.requests, 0, [32, 1024], args.output_range, vocab)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    prof = torch.profiler.profile(activities=activities)
    warm = args.warmup if args.warmup is not None else len(prompts)
    summary = run_cb(model, prompts, outputs, 0.8, warmup=(prompts[:warm], outputs[:warm]) if warm else None,
                     timed_context=lambda: prof,
                     max_batch_tokens=args.max_batch_tokens)
    table = prof.key_averages()
    with open(args.out, "w") as fh:
        fh.write(f"{summary}\n\n")
        if args.device == "cuda":
            fh.write(table.table(sort_by="cuda_time_total", row_limit=30) + "\n\n")
        fh.write(table.table(sort_by="cpu_time_total", row_limit=40) + "\n")
    print(summary)


if __name__ == "__main__":
    main()
