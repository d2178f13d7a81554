"""Model-level benchmark behind ``mla-fuser bench``: native ``sdpa`` vs fused ``vllm_mla``.

For each (batch, context): prefill time of a random prompt, then decode ms/step and tokens/s over
``steps`` greedy steps with Transformers' DynamicCache, peak memory over the weights (CUDA only), and
whether the greedy tokens of both paths agree.  Results are a JSON-able dict.
"""

from __future__ import annotations

import gc
import platform
import time

import torch

from .plans import model_state
from .presets import load_for_cli


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compiled_forward(model, mode: str, backend: str):
    """``model.forward`` under torch.compile, built once per model (reused by warm-up and timed runs)."""
    cached = getattr(model, "_mla_fuser_bench_compiled", None)
    if cached is None:
        kwargs = {"backend": backend} if backend != "inductor" else {"mode": mode}
        cached = torch.compile(model.forward, **kwargs)
        object.__setattr__(model, "_mla_fuser_bench_compiled", cached)
    return cached


def _decode_run(model, ids, steps, compile_mode=None, compile_backend="inductor", cuda_graph=False):
    """Prefill ``ids`` then ``steps`` greedy decode steps.  With ``compile_mode`` the decode step runs under
    torch.compile over a static cache (paged for fused models, Transformers' StaticCache for native ones) with
    explicit position ids, the setting in which a decode step can be captured in a CUDA graph.

    With ``cuda_graph`` a fused model's decode step is captured by :class:`mla_fuser.DecodeGraph` over a static
    paged cache; its first two steps (eager warm-up, capture) run before the clock starts, so the time is that of
    ``steps`` replays.  Models without paged layers (native) run eagerly as usual."""
    from transformers import DynamicCache, StaticCache

    from .cache import PagedLatentCache, paged_layer_indices
    from .compat import cache_keyword

    key = cache_keyword(model)
    device = ids.device
    batch, context = ids.shape
    max_len = context + steps + 16 + (2 if cuda_graph else 0)
    paged = bool(paged_layer_indices(model))
    cuda_graph = cuda_graph and paged
    if paged:  # what generate() of a fused model uses
        if compile_mode or cuda_graph:
            cache = PagedLatentCache.static_for(model, batch, max_len)
        else:
            cache = PagedLatentCache(model, max_cache_tokens=batch * (context + steps + 128))
    elif compile_mode:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        cache = DynamicCache(config=model.config)
    if cuda_graph:
        from .runtime import DecodeGraph

        graph = DecodeGraph(model, cache)

        def step_fn(input_ids, position_ids, **_):
            return graph(input_ids, position_ids).unsqueeze(1)
    else:
        step_fn = _compiled_forward(model, compile_mode, compile_backend) if compile_mode else model.forward
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
        _sync(device)
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token]
        prefill_peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def step(i, token):
            position = torch.full((batch, 1), context + i, device=device, dtype=torch.long)
            logits = step_fn(input_ids=token, position_ids=position, use_cache=True, **{key: cache})
            logits = logits if isinstance(logits, torch.Tensor) else logits.logits
            return logits[:, -1:].argmax(-1)

        untimed = 2 if cuda_graph else 0  # eager warm-up step and the capture
        for i in range(untimed):
            token = step(i, token)
            tokens.append(token)
        _sync(device)
        t0 = time.perf_counter()
        for i in range(untimed, untimed + steps):
            token = step(i, token)
            tokens.append(token)
        _sync(device)
        decode = time.perf_counter() - t0
    decode_peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    del cache, out, step_fn
    gc.collect()
    return prefill, decode / steps, torch.cat(tokens, dim=1), (prefill_peak, decode_peak)


def _generate_run(model, ids, steps, warm_tokens=8, cache_dtype=None):
    """Transformers' own ``generate`` (greedy): ms/step from two calls that differ by ``steps`` new tokens, so the
    prefill (and, for a fused model on CUDA, the eager first step and the capture of the graphed decode) cancel; when
    that difference is not positive (fewer steps than the machine's jitter covers), the median gap between steady
    steps instead.
    ``cache_dtype``: each call gets its own static ``PagedLatentCache`` of that dtype (the FP8 latent cache).
    Returns (prefill_s, s/step, tokens of the longer call, (None, decode peak bytes over weights))."""
    from transformers import LogitsProcessor, LogitsProcessorList

    device = ids.device
    stamps = []

    class Stamp(LogitsProcessor):  # generate syncs on every step (its stop check), so these are step times
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, logits_processor=LogitsProcessorList([Stamp()]))

    def timed(n):
        extra = {}
        if cache_dtype is not None:
            from .cache import PagedLatentCache
            from .compat import cache_keyword

            extra[cache_keyword(model)] = PagedLatentCache.static_for(model, ids.shape[0], ids.shape[1] + n + 1,
                                                                      dtype=cache_dtype)
        stamps.clear()
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw, **extra)
        _sync(device)
        return time.perf_counter() - t0, out

    with torch.no_grad():
        timed(warm_tokens)  # kernel compiles
        short, _ = timed(warm_tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        long, out = timed(warm_tokens + steps)
        peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
        gaps = sorted(b - a for a, b in zip(stamps[3:], stamps[4:]))  # steady steps (after warm-up and capture)
        median_step = gaps[len(gaps) // 2] if gaps else None
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        _sync(device)
        prefill = time.perf_counter() - t0
    step = (long - short) / steps
    if step <= 0:  # the two calls differ by less than their jitter (few steps, a busy machine): the steady median
        step = median_step if median_step else long / (warm_tokens + steps)
    return prefill, step, out[:, ids.shape[1]:], (None, peak), median_step


def _timing(prefill: float, step: float, batch: int, peak=None) -> dict:
    """One path's row: prefill seconds, decode ms/step and tokens/s (and peak bytes over the weights, when given)."""
    row = {"prefill_s": prefill, "ms_per_step": step * 1e3, "tok_per_s": batch / step}
    if peak is not None:
        row.update(prefill_peak_over_weights_bytes=peak[0], decode_peak_over_weights_bytes=peak[1])
    return row


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (FP8 weights count one byte, their scales four)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_model_bench(args) -> dict:
    """The benchmark of ``mla-fuser bench``; ``args`` are its parsed arguments (``shapes``: (batch, context) pairs).

    ``--fp8-weights``: the fused model's linears and expert stacks are quantised to block FP8 on load, and the same
    model fused without quantisation runs in the same process as ``fused_unquantized`` (native stays unquantised:
    Transformers' FP8 modules need a kernel from the Hub).  ``--fp8-cache``: the fused ``generate`` calls run over a
    static float8 ``PagedLatentCache``, and the same model over its default cache runs beside it as
    ``fused_default_cache``."""
    fp8_weights, fp8_cache = getattr(args, "fp8_weights", False), getattr(args, "fp8_cache", False)
    if fp8_cache and not getattr(args, "generate", False):
        raise ValueError("--fp8-cache times generate() over a float8 PagedLatentCache: add --generate")
    fused, name = load_for_cli(args, "vllm_mla", fp8_weights=fp8_weights)
    device = fused.get_input_embeddings().weight.device
    unquantized = load_for_cli(args, "vllm_mla")[0] if fp8_weights else None
    native = None
    if not args.skip_native:
        native, _ = load_for_cli(args, "sdpa")
    vocab = fused.get_input_embeddings().weight.shape[0]
    result = {
        "model": name, "dtype": args.dtype, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu", "torch": torch.__version__, "steps": args.steps,
        "fused_modules": len(fused.fusion_report.fused()), "runs": [],
        "compile_mode": args.compile_mode, "compile_backend": args.compile_backend,
        "cuda_graph": bool(getattr(args, "cuda_graph", False)),
        "loop": "transformers generate" if getattr(args, "generate", False) else "manual decode loop",
        "native_decode": "eager, DynamicCache" if not args.compile_mode else f"torch.compile {args.compile_mode}",
        "fp8_weights": fp8_weights, "fp8_cache": fp8_cache,
        "weight_bytes": {"fused": weight_bytes(fused)},
    }
    if unquantized is not None:
        result["weight_bytes"]["fused_unquantized"] = weight_bytes(unquantized)
        result["weight_bytes_ratio"] = result["weight_bytes"]["fused"] / result["weight_bytes"]["fused_unquantized"]
    cache_dtype = torch.float8_e4m3fn if fp8_cache else None
    import transformers

    result["transformers"] = transformers.__version__
    for batch, context in args.shapes:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, vocab, (batch, context), generator=gen).to(device)
        row = {"batch": batch, "context": context}
        # warm-up on the same shapes, so one-time costs (Triton compiles per kernel variant) are not timed
        compiled = dict(compile_mode=args.compile_mode, compile_backend=args.compile_backend)
        graphed = dict(compiled, cuda_graph=getattr(args, "cuda_graph", False))
        medians = {}
        if getattr(args, "generate", False):
            def run(model, dtype=None, label="fused"):
                *measured, median = _generate_run(model, ids, args.steps, cache_dtype=dtype)
                if median is not None:
                    medians[label] = median * 1e3
                return measured
        else:
            def run(model, label=None):
                _decode_run(model, ids, 2, **graphed)
                return _decode_run(model, ids, args.steps, **graphed)
        prefill, step, tokens, peak = run(fused, cache_dtype) if getattr(args, "generate", False) else run(fused)
        if cache_dtype is not None:  # the same fused model over its default cache, for the cache's own speed-up
            c_prefill, c_step, _, _ = run(fused, label="fused_default_cache")
            row["fused_default_cache"] = _timing(c_prefill, c_step, batch)
            row["speedup_of_fp8_cache"] = c_step / step
        if unquantized is not None:
            u_prefill, u_step, u_tokens, _ = run(unquantized, label="fused_unquantized")
            row["fused_unquantized"] = _timing(u_prefill, u_step, batch)
            row["speedup_vs_unquantized"] = u_step / step
            common = min(tokens.shape[1], u_tokens.shape[1])
            row["greedy_tokens_agreement_vs_unquantized"] = float((tokens[:, :common] == u_tokens[:, :common])
                                                                  .float().mean())
        if getattr(args, "generate", False):
            state = model_state(fused)
            row["fused_graphed_steps"], row["fused_graph_captures"] = state.graphed_steps, state.graph_captures
        row["fused"] = _timing(prefill, step, batch, peak)
        if native is not None:
            if getattr(args, "generate", False):
                n_prefill, n_step, n_tokens, n_peak = run(native, label="native")
            else:
                _decode_run(native, ids, 2, **compiled)
                n_prefill, n_step, n_tokens, n_peak = _decode_run(native, ids, args.steps, **compiled)
            row["native"] = _timing(n_prefill, n_step, batch, n_peak)
            common = min(tokens.shape[1], n_tokens.shape[1])  # a captured run decodes two untimed steps more
            tokens, n_tokens = tokens[:, :common], n_tokens[:, :common]
            row["greedy_tokens_equal"] = bool(torch.equal(tokens, n_tokens))
            row["greedy_tokens_agreement"] = float((tokens == n_tokens).float().mean())
            diverged = (tokens != n_tokens).any(0).nonzero()
            row["greedy_first_divergence"] = int(diverged[0]) if len(diverged) else None
            row["speedup"] = n_step / step
        if medians:
            row["median_step_ms"] = medians
        result["runs"].append(row)
        print(row, flush=True)
    if getattr(args, "plot", None):
        _plot(result, args.plot)
    return result


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise SystemExit(f"--plot needs matplotlib (pip install 'mla-fuser[plot]'): {exc}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({r["batch"] for r in result["runs"]}):
        runs = sorted((r for r in result["runs"] if r["batch"] == batch), key=lambda r: r["context"])
        ctx = [r["context"] for r in runs]
        ax.plot(ctx, [r["fused"]["ms_per_step"] for r in runs], "o-", label=f"fused B={batch}")
        if all("native" in r for r in runs):
            ax.plot(ctx, [r["native"]["ms_per_step"] for r in runs], "s--", label=f"native B={batch}")
    ax.set_xlabel("context length")
    ax.set_ylabel("ms / decode step")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{result['model']} ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
