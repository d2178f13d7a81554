"""Where the host time of a continuous-batching run goes: cProfile inside the engine's generation thread, plus the
wall time of every model forward (synchronised) with its token count, so a step's cost can be split into the
model's forward and the engine's own bookkeeping.

    python benchmarks/profile_serving_host.py --requests 256 --out profile_serving_host.txt
    python benchmarks/profile_serving_host.py --dry-run          # tiny preset on CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_serving import workload  # noqa: E402
from mla_fuser.presets import build_preset  # noqa: E402


class _step_timer:
    """Times every engine step on the device, synchronised before and after: the engine's ``ModelRunner.compute_batch``
    (the forward, eager or replayed from the engine's CUDA graph, with logits processing and sampling) where the
    installed Transformers has it (a profiling tool's class-level wrap, undone at the end), else the model's forward
    (eager steps only).  Never synchronises inside a capture."""

    def __init__(self, model, steps, cuda):
        try:
            from transformers.generation.continuous_batching.model_runner import ModelRunner
        except ImportError:
            ModelRunner = None
        self.owner, self.name = (ModelRunner, "compute_batch") if ModelRunner is not None else (model, "forward")
        self.where = f"{getattr(self.owner, '__name__', type(self.owner).__name__)}.{self.name}"
        inner = getattr(self.owner, self.name)

        def sync():
            if cuda and not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()

        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            result = inner(*a, **k)
            sync()
            data = k.get("batch_data") or (a[-1] if a and isinstance(a[-1], dict) else k)
            ids = data.get("input_ids") if isinstance(data, dict) else None
            steps.append((int(ids.shape[-1]) if ids is not None else -1, time.perf_counter() - t0))
            return result

        self.inner = inner
        setattr(self.owner, self.name, timed)

    def undo(self):
        if isinstance(self.owner, type):
            setattr(self.owner, self.name, self.inner)
        else:
            self.owner.__dict__.pop(self.name, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-range", type=int, nargs=2, default=[32, 1024])
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 128])
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--cuda-graph", action="store_true", help="ask the engine for its CUDA graphs")
    p.add_argument("--out", default="profile_serving_host.txt")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    preset = "deepseek-v2-lite" if cuda else "deepseek-v2-lite-tiny"
    model = build_preset(preset, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts, outputs = workload(args.requests, 0, args.prompt_range, args.output_range, vocab)
    steps = []
    timed_step = _step_timer(model, steps, cuda)
    gen = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_memory_percent=0.8, max_batch_tokens=args.max_batch_tokens,
                                  use_cuda_graph=True if args.cuda_graph else None)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    profiler = cProfile.Profile()
    loop = manager._run_generation_loop

    def profiled_loop(*a, **k):
        profiler.enable()
        try:
            return loop(*a, **k)
        finally:
            profiler.disable()

    manager._run_generation_loop = profiled_loop
    manager.start()
    start = time.perf_counter()
    for prompt, n in zip(prompts, outputs):
        manager.add_request(prompt, max_new_tokens=n)
    done, failed, deadline = 0, 0, time.monotonic() + 900
    while done < len(prompts) and time.monotonic() < deadline:
        result = manager.get_result(timeout=1.0)
        if result is not None:
            done += 1
            failed += bool(result.error)
    wall = time.perf_counter() - start
    manager.stop(block=True, timeout=60)
    timed_step.undo()
    resolved = manager.continuous_batching_config
    forward_s = sum(t for _, t in steps)
    lines = [f"{preset} on {device}: {done}/{len(prompts)} requests ({failed} failed), {sum(outputs)} output tokens "
             f"in {wall:.2f} s ({sum(outputs) / wall:.0f} tok/s)",
             f"engine: max_batch_tokens={getattr(manager.batch_processor, 'cache', None) and manager.batch_processor.cache.max_batch_tokens if getattr(manager, 'batch_processor', None) else '?'} "
             f"max_requests_per_batch={resolved.max_requests_per_batch} num_blocks={resolved.num_blocks} "
             f"page_size={resolved.page_size} async={resolved.use_async_batching} cuda_graph={resolved.use_cuda_graph}",
             f"steps timed at {timed_step.where}: {len(steps)}, {forward_s:.2f} s in them "
             f"({forward_s / max(wall, 1e-9):.0%} of wall; each synchronised, so async batching overlaps nothing)"]
    buckets = {}
    for tokens, t in steps:
        key = 1 << max(0, (tokens - 1).bit_length()) if tokens > 0 else 0
        n, s = buckets.get(key, (0, 0.0))
        buckets[key] = (n + 1, s + t)
    for key in sorted(buckets):
        n, s = buckets[key]
        lines.append(f"  tokens <= {key:5d}: {n:5d} steps, mean {s / n * 1e3:8.2f} ms")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    report = "\n".join(lines) + "\n\n" + text.getvalue()
    with open(args.out, "w") as fh:
        fh.write(report)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
