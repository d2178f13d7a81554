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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kwarg(model) -> str:
    """Transformers renamed ``past_key_values`` to ``cache`` in 5.2x; use whichever this version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _compiled_forward(model, mode: str, backend: str):
    """``model.forward`` under torch.compile, built once per model (reused by warm-up and timed runs)."""
    cached = getattr(model, "_mla_fuser_bench_compiled", None)
    if cached is None:
        kwargs = {"backend": backend} if backend != "inductor" else {"mode": mode}
        cached = torch.compile(model.forward, **kwargs)
        object.__setattr__(model, "_mla_fuser_bench_compiled", cached)
    return cached


def _decode_run(model, ids, steps, compile_mode=None, compile_backend="inductor"):
    """Prefill ``ids`` then ``steps`` greedy decode steps.  With ``compile_mode`` the decode step runs under
    torch.compile over a static cache (paged for fused models, Transformers' StaticCache for native ones) with
    explicit position ids, the setting in which a decode step can be captured in a CUDA graph."""
    from transformers import DynamicCache, StaticCache

    from .cache import PagedLatentCache, paged_layer_indices

    key = _cache_kwarg(model)
    device = ids.device
    batch, context = ids.shape
    max_len = context + steps + 16
    if paged_layer_indices(model):  # what generate() of a fused model uses
        if compile_mode:
            cache = PagedLatentCache(model, static=True, max_seq_len=max_len,
                                     max_cache_tokens=batch * (max_len + 64))
        else:
            cache = PagedLatentCache(model, max_cache_tokens=batch * (context + steps + 128))
    elif compile_mode:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    else:
        cache = DynamicCache(config=model.config)
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
        t0 = time.perf_counter()
        for i in range(steps):
            position = torch.full((batch, 1), context + i, device=device, dtype=torch.long)
            out = step_fn(input_ids=token, position_ids=position, use_cache=True, **{key: cache})
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        _sync(device)
        decode = time.perf_counter() - t0
    decode_peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    del cache, out
    gc.collect()
    return prefill, decode / steps, torch.cat(tokens, dim=1), (prefill_peak, decode_peak)


def run_model_bench(args) -> dict:
    from .cli import _load

    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    fused, name = _load(args, "vllm_mla")
    device = fused.get_input_embeddings().weight.device
    native = None
    if not args.skip_native:
        native, _ = _load(args, "sdpa", fuse=False)
    vocab = fused.get_input_embeddings().weight.shape[0]
    result = {
        "model": name, "dtype": args.dtype, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu", "torch": torch.__version__, "steps": args.steps,
        "fused_modules": len(fused.fusion_report.fused()), "runs": [],
        "compile_mode": args.compile_mode, "compile_backend": args.compile_backend,
    }
    import transformers

    result["transformers"] = transformers.__version__
    for batch, context in shapes:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, vocab, (batch, context), generator=gen).to(device)
        row = {"batch": batch, "context": context}
        # warm-up on the same shapes, so one-time costs (Triton compiles per kernel variant) are not timed
        compiled = dict(compile_mode=args.compile_mode, compile_backend=args.compile_backend)
        _decode_run(fused, ids, 2, **compiled)
        prefill, step, tokens, peak = _decode_run(fused, ids, args.steps, **compiled)
        row["fused"] = {"prefill_s": prefill, "ms_per_step": step * 1e3, "tok_per_s": batch / step,
                        "prefill_peak_over_weights_bytes": peak[0], "decode_peak_over_weights_bytes": peak[1]}
        if native is not None:
            _decode_run(native, ids, 2, **compiled)
            n_prefill, n_step, n_tokens, n_peak = _decode_run(native, ids, args.steps, **compiled)
            row["native"] = {"prefill_s": n_prefill, "ms_per_step": n_step * 1e3, "tok_per_s": batch / n_step,
                             "prefill_peak_over_weights_bytes": n_peak[0], "decode_peak_over_weights_bytes": n_peak[1]}
            row["greedy_tokens_equal"] = bool(torch.equal(tokens, n_tokens))
            row["greedy_tokens_agreement"] = float((tokens == n_tokens).float().mean())
            row["speedup"] = n_step / step
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
