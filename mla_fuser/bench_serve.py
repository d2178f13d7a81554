"""``mla-fuser bench --serve``: a ragged workload served by a fused model through Transformers' continuous batching,
beside the same model's length-sorted static batches and the native model's, in one run.

The workload is seeded and synthetic, ShareGPT-like: N requests, prompt lengths uniform in a range (default
[32, 1024]), output lengths uniform in another (default [32, 512]), all submitted at once, fixed lengths (each
request's own ``max_new_tokens``, no end token).  Reported: output tokens/s, TTFT and TPOT p50/p99 (continuous
batching), peak GPU memory, and continuous batching over the fused static batches.  A subset of the requests may run
as static batches (``static_requests``, ``native_requests``): the JSON says which (``subset_of_workload``).
``benchmarks/bench_serving.py`` builds its A/Bs and its HTTP runs on these pieces.
"""

from __future__ import annotations

import contextlib
import time

import torch


def workload(n, seed, prompt_range, output_range, vocab, words=None):
    """Prompt token ids and output lengths; with ``words`` (token ids) prompts draw from those ids only."""
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(n):
        length = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=gen))
        if words is None:
            prompts.append(torch.randint(3, vocab, (length,), generator=gen).tolist())
        else:
            prompts.append([words[i] for i in torch.randint(0, len(words), (length,), generator=gen).tolist()])
        outputs.append(int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=gen)))
    return prompts, outputs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values, q):
    """The ``q``-th percentile of ``values`` (nearest rank), None for none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_summary(ids, results, wall):
    """One timed run's figures: requests, failures, lengths, output tokens/s, TTFT and TPOT (p50/p99, every TPOT)."""
    failed = [r for r in results.values() if r.error]
    tokens = sum(len(r.generated_tokens) for r in results.values() if not r.error)
    ttft, tpot = [], []
    for r in results.values():
        stamps = r.timestamps or []
        if stamps:
            ttft.append(stamps[0] - r.created_time)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {
        "requests": len(ids), "finished": len(results), "failed": len(failed),
        "wrong_lengths": sum(len(r.generated_tokens) != ids[k] for k, r in results.items() if not r.error),
        "output_tokens": tokens, "wall_s": wall, "output_tok_per_s": tokens / wall,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tpot_ms": {"p50": percentile([t * 1e3 for t in tpot], 50), "p99": percentile([t * 1e3 for t in tpot], 99)},
        "tpot_ms_all": sorted(round(t * 1e3, 3) for t in tpot),
    }


def run_cb(model, prompts, outputs, max_memory_percent, num_blocks=None, cuda_graph=None, max_batch_tokens=None,
           warmup=None, timed_context=contextlib.nullcontext, concurrency=None, repeats=1, engine_extra=None):
    """One manager serves ``warmup`` (``(prompts, outputs)``, untimed: kernel compiles and the engine's graph captures
    of the step sizes it meets) and then the timed workload, as a server that has been up a while would;
    ``timed_context()`` is entered around the timed part only (a profiler).  ``concurrency``: at most that many
    requests in flight (the next one is added when one finishes), as HTTP clients send them; None: all at once.
    ``repeats``: the timed workload served that many times by the same manager; the run of median throughput is
    reported, every run's headline figures under ``repeat_runs`` (runs of one setting differ by ~15%).
    ``engine_extra``: further ``ContinuousBatchingConfig`` fields."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max(outputs + (warmup[1] if warmup else [])), do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_memory_percent=max_memory_percent, num_blocks=num_blocks,
                                  use_cuda_graph=cuda_graph, max_batch_tokens=max_batch_tokens, **(engine_extra or {}))
    captures = []
    if torch.cuda.is_available():  # count the engine's graph captures (each new padded step size is one)
        begin = torch.cuda.CUDAGraph.capture_begin
        torch.cuda.CUDAGraph.capture_begin = lambda self, *a, **k: captures.append(1) or begin(self, *a, **k)
    device = model.get_input_embeddings().weight.device
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()

    def serve(prompts, outputs):
        queue = list(zip(prompts, outputs))[::-1]
        ids, results, deadline = {}, {}, time.monotonic() + 3600

        def add(count):
            for _ in range(min(count, len(queue))):
                p, n = queue.pop()
                ids[manager.add_request(p, max_new_tokens=n, record_timestamps=True)] = n

        add(concurrency or len(queue))
        while len(results) < len(prompts) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1.0)
            if result is not None:
                results[result.request_id] = result
                add(1)
        return ids, results

    warm, runs = {}, []
    try:
        if warmup:
            sync(device)
            start = time.perf_counter()
            ids, results = serve(*warmup)
            sync(device)
            warm = {"warmup_requests": len(ids), "warmup_failed": sum(1 for r in results.values() if r.error),
                    "warmup_wall_s": time.perf_counter() - start, "warmup_graph_captures": len(captures)}
        for _ in range(max(1, repeats)):
            captures.clear()
            with timed_context():
                sync(device)
                start = time.perf_counter()
                ids, results = serve(prompts, outputs)
                sync(device)
                wall = time.perf_counter() - start
            runs.append(dict(run_summary(ids, results, wall), graph_captures=len(captures)))
    finally:
        manager.stop(block=True, timeout=60)
        if torch.cuda.is_available():
            torch.cuda.CUDAGraph.capture_begin = begin
    median = sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2]
    out = dict(median, concurrency=concurrency or "all at once",
               cuda_graph=str(manager.continuous_batching_config.use_cuda_graph),
               num_blocks=manager.continuous_batching_config.num_blocks,
               page_size=manager.continuous_batching_config.page_size, **warm)
    if len(runs) > 1:
        out["repeat_runs"] = [{k: r[k] for k in ("output_tok_per_s", "ttft_s", "tpot_ms", "graph_captures", "failed")}
                              for r in runs]
    return out


def run_static(model, prompts, outputs, batch):
    """Length-sorted static batches, left-padded; only each request's own output tokens count."""
    device = model.get_input_embeddings().weight.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    useful = 0
    sync(device)
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        rows = order[b:b + batch]
        longest = max(len(prompts[i]) for i in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, longest - len(prompts[i]):] = 1
        new = max(outputs[i] for i in rows)
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        useful += sum(outputs[i] for i in rows)
    sync(device)
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "batch": batch, "output_tokens": useful, "wall_s": wall,
            "output_tok_per_s": useful / wall}


def plot(result: dict, path: str, title: str) -> None:
    """Throughput bars of every path the result holds and the TPOT CDF of continuous batching, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in ("fused_cb", "fused_http", "fused_static", "native_static") if k in result]
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    bars.bar(names, [result[k]["output_tok_per_s"] for k in names])
    bars.set_ylabel("output tokens/s")
    bars.set_title(title)
    tpot = result["fused_cb"]["tpot_ms_all"]
    cdf.plot(tpot, [(i + 1) / len(tpot) for i in range(len(tpot))])
    cdf.set_xlabel("TPOT (ms), fused + continuous batching")
    cdf.set_ylabel("share of requests")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def static_run(result: dict, key: str, model, prompts, outputs, requests: int, batch: int) -> None:
    """The first ``requests`` of the workload as ``model``'s length-sorted static batches, into ``result[key]``
    (marked when they are a subset); with the fused model's run (``fused_static``) beside continuous batching's, their
    ratio ``cb_over_fused_static``."""
    result[key] = run_static(model, prompts[:requests], outputs[:requests], batch)
    result[key]["subset_of_workload"] = requests < len(prompts)
    if key == "fused_static" and "fused_cb" in result:
        result["cb_over_fused_static"] = result["fused_cb"]["output_tok_per_s"] / result[key]["output_tok_per_s"]


def serve_benchmark(load_fused, load_native, name: str, requests=1000, prompt_range=(32, 1024),
                    output_range=(32, 512), static_requests=None, static_batch=64, native_requests=64, native_batch=32,
                    max_memory_percent=0.8, max_batch_tokens=None, warmup=32, seed=0) -> dict:
    """The benchmark of ``mla-fuser bench --serve``: ``load_fused()`` builds the fused model, which serves the whole
    workload through continuous batching (after ``warmup`` of its requests, untimed), then its static batches
    (``static_requests`` of them, None: all); the native model of ``load_native()`` is built only after the fused one
    is let go, for its static batches (``native_requests``, 0: none)."""
    import gc

    import transformers

    fused = load_fused()
    device = fused.get_input_embeddings().weight.device
    vocab = fused.get_input_embeddings().weight.shape[0]
    prompts, outputs = workload(requests, seed, prompt_range, output_range, vocab)
    result = {"model": name, "device": str(device), "requests": requests, "prompt_range": list(prompt_range),
              "output_range": list(output_range), "transformers": transformers.__version__, "torch": torch.__version__}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    warm = (prompts[:warmup], outputs[:warmup]) if warmup else None
    result["fused_cb"] = run_cb(fused, prompts, outputs, max_memory_percent, max_batch_tokens=max_batch_tokens,
                                warmup=warm)
    result["fused_cb"]["max_batch_tokens"] = max_batch_tokens or "engine default"
    result["fused_cb"]["max_memory_percent"] = max_memory_percent
    if device.type == "cuda":
        result["fused_cb"]["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["fused_cb"]["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    static_requests = requests if static_requests is None else static_requests
    if static_requests:
        static_run(result, "fused_static", fused, prompts, outputs, static_requests, static_batch)
    del fused
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if native_requests:
        static_run(result, "native_static", load_native(), prompts, outputs, native_requests, native_batch)
    return result
