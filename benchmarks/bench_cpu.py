"""CPU speed of a fused model against native Transformers, fused and native in the same run (median of runs).

Cases (``--cases``, default all four):

* ``cli``: ``mla-fuser generate --check`` itself (README command 1: the default preset ``deepseek-v2-lite-tiny``,
  fp32, CPU), run as a subprocess; the fused and native tokens/s it prints (each model's median of 3 calls, the
  models alternating, after an untimed call of each just like them), and their ratio; ``cli_no_warmup`` the same
  with ``--no-warmup`` (each model's first call timed once, the fused model's first in the process).
* ``readme``: the same job in this process (same preset, seed, prompt and 32 new tokens as the CLI): the first
  ``generate`` after building each model and the median of five warm calls after it, fused and native
  alternating.  Runs alternate which model makes the first call of the process: whichever does pays the process's
  first runs of its ops, so the first-call ratio is kept per order (``first_call_ratio_fused_first`` /
  ``_native_first``) as well as over all runs.
* ``v2lite_4k``: the ``deepseek-v2-lite`` preset's config with ``num_hidden_layers=2`` (one dense layer, one MoE
  layer of 64 experts top-6; fp32, seeded random weights), batch 1, a 4096-token prompt, ``--new-tokens`` greedy
  tokens through ``generate``: prefill time and decode ms/step (median of the gaps between decode steps, stamped by
  a logits processor), fused vs native.

Each case runs ``--runs`` times; the JSON (``--out``) keeps every run and the medians.  Threads:
``torch.set_num_threads`` with the cores this process may use (``--threads`` to override).

    python benchmarks/bench_cpu.py --out benchmarks/results/cpu_speed.json [--baseline earlier.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

TINY_PROMPT, TINY_NEW = 16, 32  # the CLI's defaults (--prompt-len, --max-new-tokens)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
# cli: the README command itself


def run_cli(threads: int, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "mla_fuser.cli", "generate", "--check", *extra], capture_output=True,
                          text=True, env=env, check=False)
    found = {name: float(v) for name, v in (
        ("fused", re.search(r"([\d.]+) tokens/s \(fused", proc.stdout).group(1)),
        ("native", re.search(r"native sdpa: .* ([\d.]+) tokens/s", proc.stdout).group(1)),
    )}
    return {"fused_tok_per_s": found["fused"], "native_tok_per_s": found["native"],
            "ratio": found["fused"] / found["native"], "tokens_equal": "EQUALS" in proc.stdout,
            "returncode": proc.returncode}


# ---------------------------------------------------------------------------------------------------------------
# readme: the same job in process


def run_readme(first: str = "fused", warm_calls: int = 5) -> dict:
    """Both models built as the CLI builds them; each one's first ``generate`` (``first``'s the first of the
    process), then ``warm_calls`` more of each, alternating fused and native so that drifts of a shared machine hit
    both."""
    from mla_fuser.presets import DEFAULT_PRESET, build_preset

    order = (("fused", "vllm_mla"), ("native", "sdpa"))
    models = {name: build_preset(DEFAULT_PRESET, seed=0, attn_implementation=attn)
              for name, attn in (order if first == "fused" else order[::-1])}
    vocab = models["fused"].get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (1, TINY_PROMPT), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in models}
    outs = {}

    def call(name):
        t0 = time.perf_counter()
        with torch.no_grad():
            outs[name] = models[name].generate(ids, max_new_tokens=TINY_NEW, min_new_tokens=TINY_NEW, do_sample=False)
        times[name].append(time.perf_counter() - t0)

    for _ in range(1 + warm_calls):
        for name in models:
            call(name)
    row = {name: {"first_call_tok_per_s": TINY_NEW / t[0], "warm_tok_per_s": TINY_NEW / statistics.median(t[1:])}
           for name, t in times.items()}
    row["first_call_ratio"] = row["fused"]["first_call_tok_per_s"] / row["native"]["first_call_tok_per_s"]
    row["warm_ratio"] = row["fused"]["warm_tok_per_s"] / row["native"]["warm_tok_per_s"]
    row["tokens_equal"] = bool(torch.equal(outs["fused"], outs["native"]))
    row["first"] = first
    return row


# ---------------------------------------------------------------------------------------------------------------
# v2lite_4k: a 2-layer DeepSeek-V2-Lite-shaped model at 4k context


def build_v2lite(layers: int, attn: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from mla_fuser.fusion import fuse
    from mla_fuser.presets import preset_config

    config = preset_config("deepseek-v2-lite", num_hidden_layers=layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    if attn == "vllm_mla":
        fuse(model)
    return model


def stamped_generate(model, ids, new_tokens: int):
    """``generate`` with a logits processor stamping each step: (prefill s, per-step decode seconds, output)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([Stamp()]))
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], out


def run_v2lite(models: dict, prompt: int, new_tokens: int) -> dict:
    vocab = models["native"].config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    row, outs = {}, {}
    for name in ("fused", "native"):
        prefill, steps, outs[name] = stamped_generate(models[name], ids, new_tokens)
        row[name] = {"prefill_s": prefill, "decode_ms_per_step": statistics.median(steps) * 1e3,
                     "decode_ms_steps": [s * 1e3 for s in steps]}
    row["decode_ratio_fused_over_native"] = row["fused"]["decode_ms_per_step"] / row["native"]["decode_ms_per_step"]
    row["tokens_equal"] = bool(torch.equal(outs["fused"], outs["native"]))
    return row


# ---------------------------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_speed.json"))
    p.add_argument("--cases", default="cli,cli_no_warmup,readme,v2lite_4k")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--label", default=None, help="free text stored with the results (e.g. before / after)")
    p.add_argument("--baseline", default=None,
                   help="a JSON this script wrote earlier (e.g. before a change): stored under 'baseline'")
    args = p.parse_args()
    threads = args.threads or _cores()
    torch.set_num_threads(threads)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    import transformers

    result = {"label": args.label, "device": platform.processor() or platform.machine(), "threads": threads,
              "torch": torch.__version__, "transformers": transformers.__version__, "runs": args.runs,
              "cases": {}}
    for case, extra in (("cli", ()), ("cli_no_warmup", ("--no-warmup",))):
        if case not in cases:
            continue
        runs = []
        for i in range(args.runs):
            runs.append(run_cli(threads, *extra))
            print(case, i, runs[-1], flush=True)
        result["cases"][case] = {
            "command": " ".join(("mla-fuser generate --check", *extra)), "runs": runs,
            "median": {k: _median([r[k] for r in runs]) for k in ("fused_tok_per_s", "native_tok_per_s", "ratio")},
        }
    if "readme" in cases:
        runs = []
        for i in range(args.runs):
            runs.append(run_readme("fused" if i % 2 == 0 else "native"))
            print("readme", i, {k: v for k, v in runs[-1].items()}, flush=True)
        result["cases"]["readme"] = {
            "preset": "deepseek-v2-lite-tiny", "dtype": "float32", "prompt": TINY_PROMPT, "new_tokens": TINY_NEW,
            "runs": runs,
            "median": {
                "fused_first_call_tok_per_s": _median([r["fused"]["first_call_tok_per_s"] for r in runs]),
                "native_first_call_tok_per_s": _median([r["native"]["first_call_tok_per_s"] for r in runs]),
                "first_call_ratio": _median([r["first_call_ratio"] for r in runs]),
                "first_call_ratio_fused_first": _median([r["first_call_ratio"] for r in runs if r["first"] == "fused"]),
                "first_call_ratio_native_first": _median([r["first_call_ratio"] for r in runs
                                                          if r["first"] == "native"]),
                "fused_warm_tok_per_s": _median([r["fused"]["warm_tok_per_s"] for r in runs]),
                "native_warm_tok_per_s": _median([r["native"]["warm_tok_per_s"] for r in runs]),
                "warm_ratio": _median([r["warm_ratio"] for r in runs]),
            },
        }
    if "v2lite_4k" in cases:
        t0 = time.perf_counter()
        models = {"native": build_v2lite(args.layers, "sdpa"), "fused": build_v2lite(args.layers, "vllm_mla")}
        build_s = time.perf_counter() - t0
        runs = []
        for i in range(args.runs):
            runs.append(run_v2lite(models, args.prompt, args.new_tokens))
            print("v2lite_4k", i, {k: (v if not isinstance(v, dict) else {a: b for a, b in v.items()
                                                                            if a != "decode_ms_steps"})
                                   for k, v in runs[-1].items()}, flush=True)
        result["cases"]["v2lite_4k"] = {
            "preset": "deepseek-v2-lite", "num_hidden_layers": args.layers, "dtype": "float32", "batch": 1,
            "prompt": args.prompt, "new_tokens": args.new_tokens, "build_s": build_s, "runs": runs,
            "median": {
                "fused_decode_ms_per_step": _median([r["fused"]["decode_ms_per_step"] for r in runs]),
                "native_decode_ms_per_step": _median([r["native"]["decode_ms_per_step"] for r in runs]),
                "decode_ratio_fused_over_native": _median([r["decode_ratio_fused_over_native"] for r in runs]),
                "fused_prefill_s": _median([r["fused"]["prefill_s"] for r in runs]),
                "native_prefill_s": _median([r["native"]["prefill_s"] for r in runs]),
            },
        }
    if args.baseline:
        with open(args.baseline) as fh:
            result["baseline"] = json.load(fh)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(json.dumps({name: case["median"] for name, case in result["cases"].items()}, indent=2))


if __name__ == "__main__":
    main()
