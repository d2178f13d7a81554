"""``generate()`` ms per decode step for every generation mode, fused and native, in one run (issue 14's table).

Modes (DeepSeek-V2-Lite preset, bf16, CUDA; B x prompt length):

    greedy          B=16 L=1024, graphed (the fast path before issue 14)
    greedy_eager    the same inside ``mla_fuser.runtime.eager_decode()`` (fused only: native's row is
                    ``greedy``'s)
    left_padded     B=16 L=1024, rows of 1024 - 16 i tokens, padded on the left
    right_padded    the same prompts padded on the right (target: <= 1.3x left_padded)
    beam4           B=4 L=1024, 4 beams (target: <= 8 ms/step)
    sample_top_p    B=16 L=1024, top-p 0.9
    dynamic_cache   B=16 L=1024, a DynamicCache passed by the caller (target: <= 1.3x greedy; native's row is
                    ``greedy``'s: its default cache is a DynamicCache)
    chat_turn       B=16 L=1024, a chat's next turn: a DynamicCache passed by the caller already holds the first
                    L - 64 tokens of the prompt (prefilled by a forward before the call, not timed; target as
                    dynamic_cache's)
    static_cache    B=16 L=1024, Transformers' ``StaticCache`` passed by the caller (fused: converted to a static paged
                    cache and filled at the end; its auto-compile off: ``disable_compile=True``, so both are the
                    forwards as they run; compiling native is another benchmark)
    compiled        B=16 L=1024, the forward compiled by the caller as Transformers' docs show it
                    (``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``,
                    ``cache_implementation="static"``): fused, the compiled steps run over a static paged cache (not our
                    graph: ``last_generate_plan(model).reason`` says so); native over its ``StaticCache``.  Compiling
                    falls in the call's first steps and in ``generate_s``, not in the median step; the forward is
                    restored afterwards

A step's time is the median gap between consecutive calls of a logits processor (generate syncs every step on its
stop check), after the first three steps (an eager step that compiles new kernel variants, the capture of a graphed
call); the prefill is not timed, so no warm-up call is needed.  The fused row also records whether the plan was
graphed, its captures and, when not, why.
``greedy_eager`` turns the graphs off with ``eager_decode()`` around its call (no environment variable is written).

    python benchmarks/bench_generate_modes.py                      # H200: ~2-3 minutes with both models
    python benchmarks/bench_generate_modes.py --dry-run            # tiny preset on CPU, seconds

Writes JSON (``--out``), after every mode so a run cut short keeps what it measured, and a PNG (``--png``) when
matplotlib is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch

# in this order (the targets first), so that a run cut short by --budget-s keeps those
MODES = ("greedy", "beam4", "right_padded", "left_padded", "dynamic_cache", "static_cache", "chat_turn",
         "sample_top_p", "greedy_b1", "prompt_lookup", "greedy_eager", "compiled")
# steps not counted: the first (eager: kernel compiles of new variants) and the capture of a graphed call
SKIPPED_STEPS = 3
# a compiled forward: its first decode steps compile (and recompile once positions are seen to change) and record its
# CUDA graphs
SKIPPED_STEPS_COMPILED = 8
# modes whose native call is another mode's (not run twice)
NATIVE_SAME_AS = {"greedy_eager": "greedy", "dynamic_cache": "greedy"}
TARGETS = {"beam4": "<= 8 ms/step", "right_padded": "<= 1.3x left_padded", "dynamic_cache": "<= 1.3x greedy",
           "chat_turn": "<= 1.3x greedy",
           "prompt_lookup": "ms_per_forward (one verification of up to 9 tokens) <= 2x greedy_b1 ms_per_step"}
# prompt lookup: batch 1 (assisted decoding's limit), candidates of up to this many tokens per verification
LOOKUP_TOKENS = 8


def build(preset: str, layers: int | None, device, dtype):
    """(native sdpa, fused) with the same seeded weights."""
    from transformers import AutoModelForCausalLM

    import mla_fuser
    from mla_fuser.presets import preset_config

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    models = []
    for attn in ("sdpa", "vllm_mla"):
        config = preset_config(preset, **overrides)
        torch.manual_seed(0)
        with torch.device(device):
            models.append(AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).eval())
    native, fused = models
    fused.load_state_dict(native.state_dict())
    mla_fuser.fuse(fused)
    return native, fused


def prompts(batch: int, length: int, vocab: int, padding: str | None, device):
    """Random ids ``[batch, length]`` and their mask; padded rows hold ``length - 16 i`` tokens (at least 1/4)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding:
        for row in range(batch):
            pad = min(16 * row, 3 * length // 4)
            if pad:
                mask[row, :pad] = 0
        if padding == "right":
            mask = mask.flip(1)
        ids = ids * mask
    return ids.to(device), mask.to(device)


def mode_call(mode: str, model, fused: bool, batch: int, length: int, device):
    """``(ids, generate kwargs, context of the call, cache factory, cache keyword)`` of one mode for one model (the
    caches are made per call)."""
    from transformers import DynamicCache, StaticCache

    from mla_fuser.compat import cache_keyword

    vocab = model.get_input_embeddings().weight.shape[0]
    padding = {"left_padded": "left", "right_padded": "right"}.get(mode)
    b = 4 if mode == "beam4" else 1 if mode in ("greedy_b1", "prompt_lookup") else batch
    ids, mask = prompts(b, length, vocab, padding, device)
    if mode == "prompt_lookup":  # a prompt of repeated 64-token pieces, so that every lookup finds candidates
        ids = ids[:, :64].repeat(1, length // 64 + 1)[:, :length]
    kw = dict(attention_mask=mask, do_sample=False)
    from mla_fuser.runtime import eager_decode

    context = (eager_decode if mode == "greedy_eager" else (lambda: compiled_forward(model)) if mode == "compiled"
               else contextlib.nullcontext)
    if mode == "beam4":
        kw["num_beams"] = 4
    elif mode == "sample_top_p":
        kw.update(do_sample=True, top_p=0.9)
    elif mode == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = LOOKUP_TOKENS

    def cache(new_tokens):
        if mode == "dynamic_cache":
            return DynamicCache(config=model.config)
        if mode == "chat_turn":  # (the earlier turns: every token but the last 64, held by the caller's cache)
            cut = ids.shape[1] - min(64, ids.shape[1] // 2)
            held = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=ids[:, :cut], attention_mask=None if mask is None else mask[:, :cut], use_cache=True,
                      **{cache_keyword(model): held})
            return held
        if mode == "static_cache":  # (the same user code for both: fused converts it and fills it at the end)
            return StaticCache(config=model.config, max_cache_len=length + new_tokens + 1)
        return None

    if mode == "static_cache":
        kw["disable_compile"] = True
    if mode == "compiled":
        kw["cache_implementation"] = "static"
    return ids, kw, context, cache, cache_keyword(model)


@contextlib.contextmanager
def compiled_forward(model):
    """The caller's habit from Transformers' docs: the instance's forward replaced by its ``torch.compile`` (CUDA
    graphs of its own: ``mode="reduce-overhead"``, no graph breaks: ``fullgraph=True``); restored on exit."""
    had = "forward" in model.__dict__
    original = model.__dict__.get("forward")
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        yield
    finally:
        if had:
            model.forward = original
        else:
            del model.forward


def timed_generate(model, ids, kw, new_tokens, cache, keyword, sync):
    """One generate call; returns (its output, per-step gaps in seconds)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    made = cache(new_tokens)
    extra = {} if made is None else {keyword: made}
    sync()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         logits_processor=LogitsProcessorList([Stamp()]), **kw, **extra)
    sync()
    return out, [b - a for a, b in zip(stamps, stamps[1:])]


def measure(mode, model, fused, args, device, sync):
    from mla_fuser.runtime.generate import last_generate_plan

    ids, kw, context, cache, keyword = mode_call(mode, model, fused, args.batch, args.prompt, device)
    forwards = []
    if mode == "compiled":  # (imported as names of their own: ``import torch._dynamo`` would make torch local here)
        from torch._dynamo import reset as dynamo_reset
        from torch._dynamo.utils import counters

        dynamo_reset()
        counters.clear()
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(time.perf_counter()))
    try:
        with context(), torch.no_grad():
            torch.manual_seed(0)
            t0 = time.perf_counter()
            out, gaps = timed_generate(model, ids, kw, args.steps, cache, keyword, sync)
            total = time.perf_counter() - t0
    finally:
        hook.remove()
    steady = gaps[SKIPPED_STEPS_COMPILED if mode == "compiled" else SKIPPED_STEPS:] or gaps
    row = {"ms_per_step": statistics.median(steady) * 1e3, "ms_per_step_min": min(steady) * 1e3,
           "generate_s": total, "batch_rows": int(ids.shape[0]) * kw.get("num_beams", 1), "forwards": len(forwards)}
    if mode == "prompt_lookup":  # verification forwards: from one forward's start to the next (after warm-up)
        spans = [b - a for a, b in zip(forwards[1:], forwards[2:])][SKIPPED_STEPS:]
        if spans:
            row["ms_per_forward"] = statistics.median(spans) * 1e3
            row["tokens_per_forward"] = args.steps / max(1, len(forwards) - 1)
    if mode == "compiled":  # (graphs dynamo compiled; CUDA-graph recordings inductor skipped, with why in its log)
        row.update(compiled_graphs=counters["stats"]["unique_graphs"],
                   cudagraph_skips=counters["inductor"]["cudagraph_skips"])
    if fused:
        plan = last_generate_plan(model)
        row.update(graphed=plan.graphed, captures=plan.captures, graphed_steps=plan.steps, eager_reason=plan.reason)
    return row, out


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: PNG skipped")
        return
    rows = [r for r in result["rows"] if "fused" in r]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r["fused"]["ms_per_step"] for r in rows], 0.4, label="fused")
    ax.bar([i + 0.2 for i in x], [r.get("native", {}).get("ms_per_step", 0) for r in rows], 0.4, label="native sdpa")
    ax.set_xticks(list(x), [r["mode"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("ms / decode step")
    ax.set_yscale("log")
    ax.set_title(f"generate() modes: {result['preset']} {result['dtype']} ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's (quicker)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24, help="new tokens of the timed call (>= 8 to be graphed)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--skip-native", action="store_true")
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip the remaining modes past this")
    parser.add_argument("--out", default="benchmarks/results/generate_modes.json")
    parser.add_argument("--png", default=None, help="bar chart (default: beside --out when matplotlib is there)")
    parser.add_argument("--dry-run", action="store_true", help="tiny preset, fp32, CPU, small shapes")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.batch, args.prompt, args.steps = "deepseek-v2-lite-tiny", 4, 48, 10
        if args.out == parser.get_default("out"):
            args.out = "/tmp/generate_modes_dry_run.json"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    native, fused = build(args.preset, args.layers, device, dtype)
    import transformers

    result = {"preset": args.preset, "layers": args.layers or fused.config.num_hidden_layers, "dtype": str(dtype),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "batch": args.batch,
              "prompt": args.prompt, "steps": args.steps, "targets": TARGETS, "build_s": time.perf_counter() - start,
              "rows": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for mode in args.modes.split(","):
        if time.perf_counter() - start > args.budget_s:
            result["rows"].append({"mode": mode, "skipped": f"past the {args.budget_s:.0f} s budget"})
            continue
        row = {"mode": mode}
        for name, model in (("fused", fused), ("native", native)):
            if name == "native" and args.skip_native:
                continue
            same = NATIVE_SAME_AS.get(mode) if name == "native" else None
            earlier = next((r for r in result["rows"] if r["mode"] == same and "native" in r), None)
            if earlier is not None:
                row["native"] = dict(earlier["native"], same_as=same)
                continue
            try:
                row[name], out = measure(mode, model, name == "fused", args, device, sync)
                row[f"{name}_tokens"] = out[:, -args.steps:]
            except Exception as exc:  # one mode failing must not lose the others
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        tokens = [row.pop(f"{n}_tokens", None) for n in ("fused", "native")]
        if tokens[0] is not None and tokens[1] is not None and tokens[0].shape == tokens[1].shape:
            row["token_agreement"] = float((tokens[0] == tokens[1]).float().mean())
        key = "ms_per_forward" if mode == "prompt_lookup" else "ms_per_step"  # (its stamps are per candidate)
        if key in row.get("fused", {}) and key in row.get("native", {}):
            row["speedup"] = row["native"][key] / row["fused"][key]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    result["total_s"] = time.perf_counter() - start
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    plot(result, args.png or os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
