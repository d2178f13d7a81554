"""Host (Python) time of an eager fused decode step, with every Triton launch replaced by a no-op.

An eager fused decode step of the DeepSeek-V2-Lite shape is host-bound on an H200 (issue 14: ~61.6 ms per step at
B=16 L=1024, ~1,500 launches).  This measures the host work of our own wrappers without a GPU: the model is the
``deepseek-v2-lite-tiny`` preset stretched to 27 layers, a ``PagedLatentCache`` is prefilled with the torch
backend, then decode steps run with ``MLA_FUSER_BACKEND=triton`` and ``TRITON_INTERPRET=1`` (every op takes its
Triton wrapper path on CPU tensors) while every kernel launch is a no-op that only counts itself.

The mock lives here, never in the library: every launched kernel is a ``dispatch.LazyJit`` (``kernel[grid](...)``
or ``kernel.get()[grid](...)`` / ``kernel.get().warmup(...)``, as ``fused_moe.launch`` does), so ``LazyJit.get`` is
wrapped to run as it does (the interpreter-mode lookup included) and hand back a fake kernel whose launcher only
counts.  Triton's interpreter is watched as well: a run that reaches it fails.

Numbers are CPU host numbers (this machine's CPU, torch CPU tensors), not GPU ones: what matters is their
before/after ratio and the per-wrapper microseconds.

``--device cuda`` measures the same on a GPU with real launches (no mock, no interpreter): the tiny model's GPU work
is far shorter than its host work, so steps and wrapper calls timed back to back (one sync at the end) measure the
host, Triton's launcher included; issue 14's target is one eager ``mla_decode`` call <= 40 us.

    python benchmarks/bench_host_overhead.py --out benchmarks/results/host_overhead_cpu.json [--before OLD.json]
    python benchmarks/bench_host_overhead.py --device cuda --out benchmarks/results/host_overhead_gpu.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import platform
import pstats
import time

import torch

LAUNCHES: collections.Counter = collections.Counter()
WARMUPS: collections.Counter = collections.Counter()
INTERPRETER_CALLS: collections.Counter = collections.Counter()


class _FakeKernel:
    """What a mocked ``LazyJit.get()`` returns: ``[grid]`` gives a launcher that counts and does nothing."""

    def __init__(self, name: str):
        self.name = name

        def launch(*args, **kwargs):
            LAUNCHES[name] += 1

        self._launch = launch

    def __getitem__(self, grid):
        return self._launch

    def warmup(self, *args, **kwargs):
        WARMUPS[self.name] += 1


def install_mock():
    """Every Triton launch becomes a counting no-op; Triton's interpreter counts any call that still reaches it."""
    from triton.runtime import interpreter

    from mla_fuser.kernels import dispatch

    real_get = dispatch.LazyJit.get
    fakes: dict = {}

    def get(self):
        real = real_get(self)  # (the real lookup's host cost stays in the measurement)
        fake = fakes.get(id(real))
        if fake is None or fake[0] is not real:
            fake = fakes[id(real)] = (real, _FakeKernel(self.__name__))
        return fake[1]

    dispatch.LazyJit.get = get

    def watch(cls, attr):
        original = getattr(cls, attr)

        def watched(*args, **kwargs):
            INTERPRETER_CALLS[f"{cls.__name__}.{attr}"] += 1
            return original(*args, **kwargs)

        setattr(cls, attr, watched)

    for cls, attr in ((interpreter.InterpretedFunction, "run"), (interpreter.InterpretedFunction, "__getitem__"),
                      (interpreter.InterpretedFunction, "warmup"), (interpreter.GridExecutor, "__call__")):
        if hasattr(cls, attr):
            watch(cls, attr)


def build_model(layers: int, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    from mla_fuser.fusion import fuse
    from mla_fuser.presets import preset_config

    config = preset_config("deepseek-v2-lite-tiny", num_hidden_layers=layers)
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, attn_implementation="vllm_mla", dtype=dtype).to(device).eval()
    fuse(model)
    return model


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def per_step(fn, steps: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / steps


def best_of(fn, steps: int, repeats: int) -> float:
    return min(per_step(fn, steps) for _ in range(repeats))


def wrapper_costs(repeats: int, calls: int, device: str = "cpu", profile: bool = True) -> dict:
    """Each wrapper alone on DeepSeek-V2-Lite's decode shapes (bf16, B=16, L=1024, page 64; launches mocked on CPU,
    real on CUDA, where the weights are random instead of uninitialised; ``profile``: cProfile's split on CUDA)."""
    from mla_fuser.kernels.fused_moe import fused_experts
    from mla_fuser.kernels.mla_decode import mla_decode
    from mla_fuser.kernels.paged_cache_ops import paged_append
    from mla_fuser.kernels.rms_norm import rms_norm

    bf16 = torch.bfloat16
    B, H, rank, rope, L, page = 16, 16, 512, 64, 1024, 64
    pages_per_seq = L // page
    on = dict(dtype=bf16, device=device)
    fill = torch.empty if device == "cpu" else torch.randn  # (CPU: never touched, launches are no-ops)
    kv_pages = fill(B * pages_per_seq + 1, page, rank + rope, **on)
    table = torch.arange(B * pages_per_seq, dtype=torch.int32, device=device).reshape(B, pages_per_seq)
    lens = torch.full((B,), L - 1, dtype=torch.int32, device=device)
    q = torch.randn(B, H, rank + rope, **on)
    kv_c, k_pe = torch.randn(B, 1, rank, **on), torch.randn(B, 1, rope, **on)
    E, hidden, inter, topk = 64, 2048, 1408, 6
    gate_up = fill(E, 2 * inter, hidden, **on) * (0.02 if device != "cpu" else 1)
    down = fill(E, hidden, inter, **on) * (0.02 if device != "cpu" else 1)
    x = torch.randn(B, hidden, **on)
    ids = torch.randint(0, E, (B, topk), device=device)
    weights = torch.rand(B, topk, device=device)
    norm_w = torch.ones(hidden, **on)
    x3 = x.unsqueeze(1)
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm

    module_norm = DeepseekV2RMSNorm(hidden).to(**on)  # (Transformers' own module, unfused: its seven torch ops)

    cases = {
        "mla_decode": lambda: mla_decode(q, kv_pages, table, lens, 0.1, rank),
        "fused_experts": lambda: fused_experts(x, gate_up, down, ids, weights),
        "rms_norm": lambda: rms_norm(x3, norm_w, 1e-6),
        "rms_norm_module_ops": lambda: module_norm(x3),  # (what an eager CUDA call of few rows ran instead)
        "rms_norm_1row": lambda: rms_norm(x3[:1], norm_w, 1e-6),
        "rms_norm_module_ops_1row": lambda: module_norm(x3[:1]),
        "paged_append": lambda: paged_append(kv_pages, table, lens, kv_c, k_pe),
    }
    out = {}
    for name, fn in cases.items():
        before = sum(LAUNCHES.values())
        fn()
        launches = sum(LAUNCHES.values()) - before
        out[name] = {"us_per_call": round(best_of(fn, calls, repeats) * 1e6, 2)}
        if device == "cpu":
            out[name]["launches_per_call"] = launches
        elif profile:  # where a call's host time goes (cProfile's own time: inflated, but the shares hold)
            out[name]["profile"] = profile_rows(lambda: [fn() for _ in range(calls)], calls, keep=8, every_file=True)
    return out


def profile_rows(fn, per: int, keep: int, every_file: bool = False) -> list:
    """cProfile's functions by own time, per call of ``fn`` divided by ``per``; ours only unless ``every_file``."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    _sync()
    profiler.disable()
    return top_rows(pstats.Stats(profiler), per, keep, every_file)


def top_rows(stats, per: int, keep: int, every_file: bool = False) -> list:
    """A profile's ``keep`` functions of most own time (ours only unless ``every_file``), per step of ``per``."""
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
        if every_file or "mla_fuser" in file:
            where = file.split("mla_fuser/")[-1] if "mla_fuser" in file else "/".join(file.split("/")[-2:])
            rows.append({"function": f"{where}:{line}({func})", "calls_per_step": nc / per,
                         "own_us_per_step": round(tt / per * 1e6, 1), "cum_us_per_step": round(ct / per * 1e6, 1)})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:keep]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: launches mocked (Triton's interpreter lookup, no kernel runs); cuda: real launches")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/host_overhead_<device>.json)")
    p.add_argument("--before", help="a JSON this script wrote for an earlier tree: its headline numbers are kept "
                                    "under 'before' for comparison")
    args = p.parse_args()
    args.out = args.out or f"benchmarks/results/host_overhead_{args.device}.json"
    torch.set_num_threads(args.threads)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (this process only, before triton is imported)
        install_mock()
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword

    model = build_model(args.layers, args.device)
    key = cache_keyword(model)
    B = args.batch
    total_steps = 3 + 3 * args.repeats * args.steps + 2 * args.steps + 2  # (CUDA: the A/Bs below add two rounds)
    cache = PagedLatentCache(model, max_cache_tokens=B * (args.prompt + total_steps + 64))
    ids = torch.randint(3, model.config.vocab_size, (B, args.prompt), device=args.device)
    if not gpu:
        os.environ["MLA_FUSER_BACKEND"] = "torch"
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
    if not gpu:
        os.environ["MLA_FUSER_BACKEND"] = "triton"
    token = torch.randint(3, model.config.vocab_size, (B, 1), device=args.device)
    state = {"len": args.prompt}

    def step():
        state["len"] += 1
        mask = torch.ones(B, state["len"], dtype=torch.long, device=args.device)
        with torch.no_grad():
            model(input_ids=token, attention_mask=mask, use_cache=True, **{key: cache})

    for _ in range(3):  # warm-up: first launches, lru caches
        step()
    LAUNCHES.clear()
    step()
    launches = dict(sorted(LAUNCHES.items()))
    ms = best_of(step, args.steps, args.repeats) * 1e3

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    own = {"mla_fuser": 0.0, "torch builtins (tensor ops: real CPU compute here)": 0.0, "other Python": 0.0}
    for (file, _, func), (_, _, tt, _, _) in stats.stats.items():
        kind = ("mla_fuser" if "mla_fuser" in file else
                "torch builtins (tensor ops: real CPU compute here)" if file == "~" and "torch" in func else "other Python")
        own[kind] += tt
    profiled_ms = {k: round(v / args.steps * 1e3, 3) for k, v in own.items()}
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)

    wrappers = wrapper_costs(args.repeats, 200, args.device)
    assert not INTERPRETER_CALLS, f"Triton's interpreter ran: {dict(INTERPRETER_CALLS)}"
    import transformers

    result = {
        "what": "host (Python) time of an eager fused decode step, every Triton launch mocked as a no-op",
        "note": "CPU host numbers (torch CPU tensors, MLA_FUSER_BACKEND=triton, TRITON_INTERPRET=1, launches "
                "no-ops): not GPU times; compare before/after on the same machine",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "threads": args.threads},
        "model": {"preset": "deepseek-v2-lite-tiny", "num_hidden_layers": args.layers, "batch": B,
                  "prompt": args.prompt, "dtype": "float32"},
        "ms_per_step": round(ms, 3),
        "launches_per_step": sum(launches.values()),
        "launches_per_step_by_kernel": launches,
        "interpreter_calls": dict(INTERPRETER_CALLS),
        "wrappers_us_per_call": wrappers,
        "wrappers_shape": "DeepSeek-V2-Lite decode: bf16, B=16, H=16, latent 512+64, L=1024, page 64; experts 64 x "
                          "(2048 -> 1408), top-6",
        "profiled_own_ms_per_step": profiled_ms,
        "profiled_own_ms_note": "own time by where it is spent, under cProfile (inflated by the profiler; "
                                "'mla_fuser' is the Python this project runs per step)",
        "profile_top_mla_fuser_own_time": top_rows(stats, args.steps, 40),
    }
    if gpu:  # real launches: nothing mocked or counted; where the host time goes, Triton's launcher included
        import triton

        result.update(
            what="host time of an eager fused decode step with real launches on a GPU (the tiny model's GPU work is "
                 "shorter than its host work, so back-to-back steps measure the host)",
            note=f"{torch.cuda.get_device_name()}, triton {triton.__version__}; wrapper calls timed back to back, one "
                 "sync at the end; profiles are cProfile own time (inflated by the profiler)",
            model=dict(result["model"], dtype="bfloat16"),
            profile_top_every_file=profile_rows(lambda: [step() for _ in range(args.steps)], args.steps, keep=30,
                                                every_file=True))
        for k in ("launches_per_step", "launches_per_step_by_kernel", "interpreter_calls"):
            result.pop(k)
        # the same through Triton's own JITFunction.run on every launch (kernels.direct_launch off), same process
        os.environ["MLA_FUSER_DIRECT_LAUNCH"] = "0"
        result["through_triton_run"] = {
            "ms_per_step": round(best_of(step, args.steps, args.repeats) * 1e3, 3),
            "wrappers_us_per_call": {k: v["us_per_call"] for k, v in
                                     wrapper_costs(args.repeats, 200, args.device, profile=False).items()},
            "note": "MLA_FUSER_DIRECT_LAUNCH=0: every launch through JITFunction.run; the headline figures above "
                    "launch directly (kernels.direct_launch)"}
        del os.environ["MLA_FUSER_DIRECT_LAUNCH"]
        # fused RMSNorms of few rows on their kernel in eager steps too (fusers.norm runs the module's own ops below
        # EAGER_MIN_ROWS rows in an eager CUDA call; the benchmark moves that threshold, in this process only)
        from mla_fuser.fusers import norm as norm_fuser

        rows_before, norm_fuser.EAGER_MIN_ROWS = norm_fuser.EAGER_MIN_ROWS, 0
        result["norms_on_kernel"] = {"ms_per_step": round(best_of(step, args.steps, args.repeats) * 1e3, 3),
                                     "note": f"fusers.norm.EAGER_MIN_ROWS 0 instead of {rows_before}: every eager "
                                             "CUDA norm call on the Triton kernel (launched directly)"}
        norm_fuser.EAGER_MIN_ROWS = rows_before
    if args.before:
        with open(args.before) as fh:
            earlier = json.load(fh)
        result["before"] = {k: earlier.get(k) for k in ("ms_per_step", "launches_per_step", "wrappers_us_per_call",
                                                        "profiled_own_ms_per_step")}
    print(text.getvalue()[:5000])
    print(json.dumps({k: result.get(k) for k in ("ms_per_step", "launches_per_step", "launches_per_step_by_kernel",
                                                 "wrappers_us_per_call", "interpreter_calls", "profiled_own_ms_per_step")},
                     indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
