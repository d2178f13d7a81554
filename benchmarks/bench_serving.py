"""Serving a ragged workload: fused + Transformers' continuous batching vs fused and native static batches (the
pieces live in ``mla_fuser.bench_serve``, which ``mla-fuser bench --serve`` runs; this script adds HTTP and A/Bs).

A seeded synthetic ShareGPT-like workload: N requests, prompt lengths uniform in [32, 1024], output lengths uniform
in [32, 512], all submitted at once, fixed lengths (per-request ``max_new_tokens``, EOS ignored).  In one run:
* fused + CB (``init_continuous_batching``: the engine's scheduler over latent pages);
* fused, length-sorted static batches through ``generate`` (each batch decodes as long as its longest request;
  only each request's own tokens count);
* native (sdpa) static batches, on a subset when ``--native-requests`` is smaller (the JSON says which).
Output tokens/s, TTFT and TPOT p50/p99 (CB), peak GPU memory; JSON (+ PNG with ``--plot``).

``--http`` also sends the same workload through ``mla-fuser serve``'s HTTP server (Transformers' own server, built
with ``mla_fuser.serve.app.build_app`` on the same fused model in this process, continuous batching with the same
engine config) from a separate client process, ``--http-concurrency`` streaming ``/v1/completions`` requests at a time;
its output tokens/s, TTFT and TPOT p50/p99 (measured by the client) sit beside the in-process figures.  The prompts are
then text made of whole-word tokens of the preset's built-in tokenizer, so the server tokenizes each back to exactly
the ids the in-process run gets; each request asks for its output length with EOS ignored.  The clients keep only
``--http-concurrency`` requests in flight, a lighter load than all 1000 at once, so ``--in-process-concurrency`` (same
number) also serves the workload in process under that cap: ``http_over_in_process_same_concurrency`` is then what
HTTP itself costs, beside ``http_over_in_process`` (against all at once).

    python benchmarks/bench_serving.py --out benchmarks/results/serving.json          # H200: the issue's workload
    python benchmarks/bench_serving.py --http --out benchmarks/results/serving_http.json  # + through HTTP
    python benchmarks/bench_serving.py --warmup 300 --repeats 3 --out serving.json      # median of 3 timed runs
    python benchmarks/bench_serving.py --dry-run [--http]                             # CPU: tiny preset, 12 requests

A/Bs in one process (runs in different processes or on different hosts do not compare: the H200 hosts' Python speed
alone moves throughput by up to 1.5x): ``--ab-engine 'max_requests_per_batch=256;max_requests_per_batch=512'`` serves
the workload once per engine setting; ``--ab-constant mla_fuser.kernels.moe_router:ROW_BLOCK_MIN_ROWS=1000000000``
serves it with one of our module constants as it is and changed, alternating for ``--ab-rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mla_fuser import bench_serve  # noqa: E402
from mla_fuser.bench_serve import percentile as _pct, workload  # noqa: E402
from mla_fuser.presets import build_preset  # noqa: E402


def text_workload(tokenizer, prompts):
    """``(texts, ids)``: each prompt of whole-word ids (``Ġword`` tokens) as text, and the ids the server's tokenizer
    makes of that text (BOS + the same words), which the in-process run then uses too."""
    texts = [tokenizer.decode(p) for p in prompts]
    return texts, [tokenizer(t)["input_ids"] for t in texts]


def word_ids(tokenizer):
    """Ids of the tokens that are one space-led lowercase word: text of them tokenizes back to the same ids."""
    return sorted(i for token, i in tokenizer.get_vocab().items()
                  if token.startswith("\u0120") and len(token) > 1 and token[1:].isalpha() and token[1:].islower())


# Further ContinuousBatchingConfig fields for every engine of the run (``--max-requests-per-batch``)
ENGINE_EXTRA: dict = {}


def run_cb(*args, **kwargs):
    """``mla_fuser.bench_serve.run_cb`` (the workload through one manager) with this run's further engine fields."""
    return bench_serve.run_cb(*args, engine_extra=ENGINE_EXTRA, **kwargs)


# what a row of an in-process A/B keeps of its run
AB_FIGURES = ("output_tok_per_s", "ttft_s", "tpot_ms", "graph_captures", "failed", "wrong_lengths", "wall_s")


def ab_row(run: dict, **label) -> dict:
    """One A/B row: ``label`` (what the arm set), then the run's ``AB_FIGURES``."""
    return {**label, **{k: run[k] for k in AB_FIGURES}}


def parse_engine_settings(text: str) -> list[dict]:
    """``--ab-engine``'s settings: ``'a=1,b=2;a=3'`` -> ``[{'a': 1, 'b': 2}, {'a': 3}]`` (integer fields only)."""
    settings = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        setting = {}
        for item in filter(None, (i.strip() for i in part.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"--ab-engine: {item!r} is not FIELD=INTEGER")
            setting[key.strip()] = int(value)
        settings.append(setting)
    if not settings:
        raise ValueError("--ab-engine: no setting given")
    return settings


def engine_ab(model, prompts, outputs, args, graphs, warmup, device):
    """The whole workload served once per ``--ab-engine`` setting (each over this run's ``ENGINE_EXTRA`` and
    ``--max-batch-tokens``), in order, by one model: throughput, TTFT, TPOT and peak memory per setting."""
    rows, base = [], dict(ENGINE_EXTRA)
    for setting in parse_engine_settings(args.ab_engine):  # (fields checked by main)
        extra = dict(base, **setting)
        max_batch_tokens = extra.pop("max_batch_tokens", args.max_batch_tokens)
        ENGINE_EXTRA.clear()
        ENGINE_EXTRA.update(extra)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            run = run_cb(model, prompts, outputs, args.max_memory_percent, args.num_blocks, graphs, max_batch_tokens,
                         warmup)
        finally:
            ENGINE_EXTRA.clear()
            ENGINE_EXTRA.update(base)
        row = ab_row(run, setting=setting, num_blocks=run["num_blocks"])
        if device.type == "cuda":
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def parse_constant(text: str):
    """``--ab-constant``'s ``MODULE:NAME=INTEGER`` -> (module, name, value); the module must be ours and hold NAME."""
    import importlib

    target, sep, value = text.partition("=")
    module_name, colon, name = target.partition(":")
    if not (sep and colon and module_name.startswith("mla_fuser") and value.strip().lstrip("-").isdigit()):
        raise ValueError(f"--ab-constant: {text!r} is not MODULE:NAME=INTEGER with a module of mla_fuser")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"--ab-constant: {module_name} has no {name}")
    return module, name, int(value)


def constant_ab(model, prompts, outputs, args, graphs, warmup):
    """The workload served with ``--ab-constant``'s constant as it is (A) and set (B), A then B for each of
    ``--ab-rounds`` rounds, one engine per run; the constant is put back after each B."""
    module, name, value = parse_constant(args.ab_constant)
    original, rows = getattr(module, name), []
    for round_ in range(args.ab_rounds):
        for arm in ("A", "B"):
            if arm == "B":
                setattr(module, name, value)
            try:
                run = run_cb(model, prompts, outputs, args.max_memory_percent, args.num_blocks, graphs,
                             args.max_batch_tokens, warmup)
            finally:
                setattr(module, name, original)
            row = ab_row(run, round=round_, arm=arm, **{name: original if arm == "A" else value})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"constant": args.ab_constant, "runs": rows}


# ---- through HTTP: the server in this process (a thread), the clients in another process ----------------------------


async def _stream_completion(port, body, deadline):
    """One streaming POST /v1/completions over a raw connection (no client library between the clock and the
    socket): (status, first text time, last text time, completion tokens, error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    first = last = usage = error = None
    try:
        status = int((await asyncio.wait_for(reader.readline(), deadline - time.monotonic())).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        buffer = b""
        while time.monotonic() < deadline:
            if headers.get("transfer-encoding") == "chunked":
                size = int((await reader.readline()).split(b";")[0], 16)
                piece = await reader.readexactly(size + 2) if size else b""
                piece = piece[:-2]
            else:
                piece = await reader.read(65536)
            if not piece:
                break
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk or status != 200:
                    error = chunk.get("error") or chunk.get("detail") or chunk
                    continue
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):  # (5.25's usage chunk has no choices)
                    first, last = first or now, now
                usage = chunk.get("usage") or usage
    finally:
        writer.close()
    return status, first, last, (usage or {}).get("completion_tokens", 0), error


async def _client_run(port, requests, concurrency, timeout):
    """Every request streamed, ``concurrency`` at a time (each client takes the next request when one ends)."""
    deadline = time.monotonic() + timeout
    pending = list(enumerate(requests))[::-1]
    results = [None] * len(requests)

    async def client():
        while pending and time.monotonic() < deadline:
            i, body = pending.pop()
            sent = time.perf_counter()
            try:
                status, first, last, tokens, error = await _stream_completion(port, body, deadline)
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                status, first, last, tokens, error = None, None, None, 0, repr(exc)  # (counted as failed)
            results[i] = {"sent": sent, "first": first, "last": last, "end": time.perf_counter(), "status": status,
                          "tokens": tokens, "wanted": body["max_tokens"], "error": error}

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(requests)))))
    return start, results


def http_client_main(port, path, concurrency, timeout):
    """The client process: requests from a JSON file, one JSON line of per-request timings on stdout."""
    with open(path) as fh:
        requests = json.load(fh)
    start, results = asyncio.run(_client_run(port, requests, concurrency, timeout))
    print(json.dumps({"start": start, "results": results}))


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send(port, texts, outputs, concurrency, timeout, workdir, name="bench"):
    """Run the client process over ``texts``; its parsed output."""
    bodies = [{"model": name, "prompt": t, "max_tokens": n, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True},  # (5.25 sends usage only when asked; 5.24 ignores it)
               "generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
              for t, n in zip(texts, outputs)]
    path = os.path.join(workdir, f"http_requests_{os.getpid()}.json")
    with open(path, "w") as fh:
        json.dump(bodies, fh)
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--http-client", str(port), path,
                               "--http-concurrency", str(concurrency)], capture_output=True, text=True,
                              timeout=timeout + 60, check=True)
    finally:
        os.remove(path)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _server_app(model, tokenizer, cb_config, model_args, interval):
    """``(app, served name, shutdown)``: up to Transformers 5.24 the server in this process over ``model``
    (``mla_fuser.serve.app``); from 5.25 its API server here and an engine process of its own, where our loader loads
    and fuses the model of ``model_args`` again (``mla_fuser.serve.engine``), as ``mla-fuser serve`` does."""
    from mla_fuser.compat import serving_in_engine_processes

    if serving_in_engine_processes():
        from mla_fuser.serve import SWITCH_INTERVAL_S
        from mla_fuser.serve.engine import build_app

        name = model_args["preset"]
        app, manager = build_app(name, model_args, continuous_batching=True, cb_config=cb_config,
                                 switch_interval=interval or SWITCH_INTERVAL_S)
        return app, name, manager.shutdown
    from mla_fuser.serve.app import build_app

    app, state = build_app(model, tokenizer, "bench", continuous_batching=True, cb_config=cb_config)
    return app, "bench", state.shutdown


def run_http(model, tokenizer, texts, outputs, cb_config, concurrency, warmup, timeout=3600, workdir="/tmp",
             model_args=None, interval=None):
    """The workload through Transformers' server on ``model`` (``_server_app``): client-side output tokens/s,
    TTFT (send -> first text) and TPOT ((last text - first text) / (tokens - 1)) p50/p99."""
    import uvicorn

    app, name, shutdown = _server_app(model, tokenizer, cb_config, model_args or {}, interval)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="bench-http-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)
        if warmup:
            _send(port, texts[:warmup], outputs[:warmup], concurrency, timeout, workdir, name)
        run = _send(port, texts, outputs, concurrency, timeout, workdir, name)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        shutdown()
    results = [r for r in run["results"] if r is not None]
    ok = [r for r in results if r["status"] == 200 and r["error"] is None]
    wall = max(r["end"] for r in results) - run["start"]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok if r["first"] is not None]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) * 1e3 for r in ok
            if r["first"] is not None and r["tokens"] > 1]
    return {
        "requests": len(texts), "finished": len(results), "failed": len(results) - len(ok),
        "wrong_lengths": sum(r["tokens"] != r["wanted"] for r in ok), "concurrency": concurrency,
        "output_tokens": tokens, "wall_s": wall, "output_tok_per_s": tokens / wall,
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "tpot_ms": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
        "errors": sorted({str(r["error"] or r["status"]) for r in results if r not in ok})[:5],
    }


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v2-lite")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--prompt-range", type=int, nargs=2, default=[32, 1024])
    p.add_argument("--output-range", type=int, nargs=2, default=[32, 512])
    p.add_argument("--static-batch", type=int, default=64)
    p.add_argument("--static-requests", type=int, default=None, help="subset for fused static batches (default all; 0: skip)")
    p.add_argument("--native-requests", type=int, default=64, help="subset for native static batches (0: skip)")
    p.add_argument("--native-batch", type=int, default=32)
    p.add_argument("--max-memory-percent", type=float, default=0.8)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=32,
                   help="requests of the workload served first, untimed, by the same manager (kernel compiles, the "
                        "engine's graph captures); the workload's size: every step size the timed run meets")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per engine step (engine default 8192)")
    p.add_argument("--repeats", type=int, default=1,
                   help="in-process runs: serve the timed workload this many times on the same manager (the median "
                        "run is reported, every run under repeat_runs)")
    p.add_argument("--max-requests-per-batch", type=int, default=None,
                   help="the engine's max_requests_per_batch (requests a step may hold; engine default: no cap)")
    p.add_argument("--cb-read", choices=["pages", "gather"], default=None,
                   help="how continuous-batching steps read the latent: in place from the pages, or gathered first")
    p.add_argument("--split-rows-group", type=int, default=None,
                   help="tokens per program of a request's prefill chunk in the split-row kernel (1: one per token)")
    p.add_argument("--no-cuda-graph", action="store_true", help="continuous batching without the engine's graphs")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny preset on CPU, a dozen short requests")
    p.add_argument("--http", action="store_true",
                   help="also send the workload through the HTTP server (mla-fuser serve's) by concurrent clients")
    p.add_argument("--http-concurrency", type=int, default=256, help="requests in flight at once through HTTP")
    p.add_argument("--in-process-concurrency", type=int, default=None,
                   help="also serve the workload in process with at most this many requests in flight (the HTTP "
                        "clients' load: the same-load baseline of --http)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this process (seconds; Python's default 0.005): how long the engine "
                        "thread may wait for the GIL while the server thread holds it")
    p.add_argument("--ab-switch-intervals", default=None,
                   help="comma list of switch intervals (s): before everything else, serve the workload in process "
                        "under --in-process-concurrency once per value, alternating, in this one process (an A/B)")
    p.add_argument("--ab-engine", default=None,
                   help="';'-separated engine settings, each a comma list of ContinuousBatchingConfig fields "
                        "(e.g. 'max_requests_per_batch=256;max_requests_per_batch=512,max_batch_tokens=4096'): before "
                        "everything else, serve the whole workload once per setting in this one process (an A/B)")
    p.add_argument("--ab-constant", default=None, metavar="MODULE:NAME=INTEGER",
                   help="before everything else, serve the workload with a module constant of ours as it is (A) and "
                        "set to INTEGER (B), alternating for --ab-rounds rounds, in this one process (an A/B)")
    p.add_argument("--ab-rounds", type=int, default=2)
    p.add_argument("--http-client", nargs=2, metavar=("PORT", "REQUESTS_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.http_client:  # (the client process of --http)
        return http_client_main(int(args.http_client[0]), args.http_client[1], args.http_concurrency, 3600)
    if args.dry_run:
        args.preset, args.device, args.dtype = "deepseek-v2-lite-tiny", "cpu", "fp32"
        args.requests, args.prompt_range, args.output_range = 12, [4, 40], [2, 12]
        args.static_batch, args.native_requests, args.native_batch, args.num_blocks = 4, 4, 4, 64
    if args.ab_constant:
        try:
            parse_constant(args.ab_constant)
        except (ValueError, ImportError) as exc:
            p.error(str(exc))
    if args.ab_engine:
        from transformers import ContinuousBatchingConfig

        try:
            settings = parse_engine_settings(args.ab_engine)
        except ValueError as exc:
            p.error(str(exc))
        fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
        unknown = sorted({k for setting in settings for k in setting if k not in fields})
        if unknown:
            p.error(f"--ab-engine: this Transformers' ContinuousBatchingConfig has no {', '.join(unknown)}")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.max_requests_per_batch is not None:
        from transformers import ContinuousBatchingConfig

        if "max_requests_per_batch" not in getattr(ContinuousBatchingConfig, "__dataclass_fields__", {}):
            p.error("this Transformers' ContinuousBatchingConfig has no max_requests_per_batch")
        ENGINE_EXTRA["max_requests_per_batch"] = args.max_requests_per_batch
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    fused = build_preset(args.preset, dtype=dtype, device=args.device)
    device = fused.get_input_embeddings().weight.device
    vocab = fused.get_input_embeddings().weight.shape[0]
    tokenizer = texts = None
    if args.http:  # one workload for both paths: text of whole-word tokens, and the ids the server makes of it
        from mla_fuser.presets import preset_tokenizer

        tokenizer = preset_tokenizer(args.preset)
        words, outputs = workload(args.requests, args.seed, [n - 1 for n in args.prompt_range], args.output_range,
                                  vocab, word_ids(tokenizer))
        texts, prompts = text_workload(tokenizer, words)
    else:
        prompts, outputs = workload(args.requests, args.seed, args.prompt_range, args.output_range, vocab)
    result = {"preset": args.preset, "dtype": args.dtype, "device": str(device), "requests": args.requests,
              "prompt_range": args.prompt_range, "output_range": args.output_range,
              "switch_interval_s": sys.getswitchinterval(), "engine_extra": dict(ENGINE_EXTRA)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    import transformers

    result["transformers"], result["torch"] = transformers.__version__, torch.__version__
    graphs = False if args.no_cuda_graph else None
    if args.split_rows_group is not None:
        from mla_fuser.kernels import mla_decode_split

        mla_decode_split.GROUP_TOKENS = result["split_rows_group"] = args.split_rows_group
    if args.cb_read is not None:
        from mla_fuser.runtime import continuous_batching

        continuous_batching.READ_PAGES_IN_PLACE = args.cb_read == "pages"
        result["cb_read"] = args.cb_read
    warmup = (prompts[:args.warmup], outputs[:args.warmup]) if args.warmup else None
    if args.ab_switch_intervals:
        from mla_fuser.serve import switch_interval

        result["switch_interval_ab"] = []
        for value in (float(v) for v in args.ab_switch_intervals.split(",")):
            with switch_interval(value):
                run = run_cb(fused, prompts, outputs, args.max_memory_percent, args.num_blocks, graphs,
                             args.max_batch_tokens, warmup, concurrency=args.in_process_concurrency)
            row = ab_row(run, switch_interval_s=value)
            result["switch_interval_ab"].append(row)
            print(json.dumps(row), flush=True)
    if args.ab_constant:
        result["constant_ab"] = constant_ab(fused, prompts, outputs, args, graphs, warmup)
    if args.ab_engine:
        result["engine_ab"] = engine_ab(fused, prompts, outputs, args, graphs, warmup, device)
    result["fused_cb"] = run_cb(fused, prompts, outputs, args.max_memory_percent, args.num_blocks, graphs,
                                args.max_batch_tokens, warmup, repeats=args.repeats)
    result["fused_cb"]["max_batch_tokens"] = args.max_batch_tokens or "engine default (8192)"
    if device.type == "cuda":
        result["fused_cb"]["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["fused_cb"]["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    print(json.dumps({k: v for k, v in result["fused_cb"].items() if k != "tpot_ms_all"}), flush=True)
    if args.in_process_concurrency:
        result["fused_cb_capped"] = run_cb(fused, prompts, outputs, args.max_memory_percent, args.num_blocks, graphs,
                                           args.max_batch_tokens, warmup, concurrency=args.in_process_concurrency,
                                           repeats=args.repeats)
        print(json.dumps({k: v for k, v in result["fused_cb_capped"].items() if k != "tpot_ms_all"}), flush=True)
    if args.http:
        from transformers import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(max_memory_percent=args.max_memory_percent, num_blocks=args.num_blocks,
                                      use_cuda_graph=graphs, max_batch_tokens=args.max_batch_tokens, **ENGINE_EXTRA)
        model_args = dict(model=None, preset=args.preset, dtype=args.dtype, device=args.device, seed=0)
        result["fused_http"] = run_http(fused, tokenizer, texts, outputs, cb, args.http_concurrency, args.warmup,
                                        model_args=model_args, interval=args.switch_interval)
        result["http_over_in_process"] = (result["fused_http"]["output_tok_per_s"]
                                          / result["fused_cb"]["output_tok_per_s"])
        if result.get("fused_cb_capped", {}).get("concurrency") == args.http_concurrency:  # the same offered load
            result["http_over_in_process_same_concurrency"] = (result["fused_http"]["output_tok_per_s"]
                                                               / result["fused_cb_capped"]["output_tok_per_s"])
        print(json.dumps(result["fused_http"]), flush=True)
        print(json.dumps({k: v for k, v in result.items() if k.startswith("http_over")}), flush=True)
    n_static = args.requests if args.static_requests is None else args.static_requests
    if n_static:
        bench_serve.static_run(result, "fused_static", fused, prompts, outputs, n_static, args.static_batch)
        print(json.dumps(result["fused_static"]), flush=True)
    if args.native_requests:
        del fused
        native = build_preset(args.preset, dtype=dtype, device=args.device, attn_implementation="sdpa", fuse=False)
        bench_serve.static_run(result, "native_static", native, prompts, outputs, args.native_requests,
                               args.native_batch)
        print(json.dumps(result["native_static"]), flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    if args.plot:
        bench_serve.plot(result, args.plot, f"{args.preset}, {args.requests} requests")

if __name__ == "__main__":
    main()
