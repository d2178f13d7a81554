"""One figure of the block-FP8 measurements, drawn from the JSON the GPU runs wrote (no GPU needed).

Panels: (1) the linear GEMM's speed-up over bf16 ``torch.mm`` by token count on each shape (``fp8_gemm.json``, the
path ``block_fp8_linear`` picks), with the one-token GEMV of ``fp8_gemm_decode.json`` marked; (2) the weight-read
bandwidth at 1-16 tokens as a fraction of the copy bandwidth measured in the same run, against the 0.75 target;
(3) one V2-Lite MoE layer's experts, FP8 and bf16, by token count (``fp8_experts_decode.json``); (4) whole-model
``generate`` medians per decode step, bf16 against FP8 weights with and without the FP8 latent cache
(``model_bench_v2lite_fp8.json``), with the targets.  Every figure is GPU time from CUDA-graph replay.

    python benchmarks/plot_fp8.py                       # benchmarks/results/*.json -> benchmarks/results/fp8.png
    python benchmarks/plot_fp8.py --results DIR --out fp8.png
"""

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_FRAC_OF_COPY = 0.75
TARGET_MS = {(1, 512): 1.0, (16, 4096): 6.5}  # whole-model decode targets (ms per step), FP8 weights


def _load(results: str, name: str) -> dict:
    with open(os.path.join(results, name)) as fh:
        return json.load(fh)


def plot(results: str, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"plot_fp8.py needs matplotlib (pip install 'mla-fuser[plot]'): {exc}")
    gemm, decode = _load(results, "fp8_gemm.json"), _load(results, "fp8_gemm_decode.json")
    experts, model = _load(results, "fp8_experts_decode.json"), _load(results, "model_bench_v2lite_fp8.json")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))

    ax = axes[0][0]
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])  # 12 shapes: no colour twice
    for shape in dict.fromkeys(r["shape"] for r in gemm["rows"]):
        rows = [r for r in gemm["rows"] if r["shape"] == shape and "auto_speedup_vs_bf16" in r]
        line, = ax.plot([r["tokens"] for r in rows], [r["auto_speedup_vs_bf16"] for r in rows], "o-", label=shape,
                        markersize=3)
        one = [r for r in decode["rows"] if r["shape"] == shape and r["tokens"] == 1 and "gemv_speedup_vs_bf16" in r]
        if one:
            ax.plot([1], [one[0]["gemv_speedup_vs_bf16"]], "*", color=line.get_color(), markersize=10)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="tokens", ylabel="speed-up over bf16 torch.mm",
           title="block-FP8 linear (stars: one-token GEMV, fp8_gemm_decode.json)")
    ax.legend(fontsize=6, ncol=2)

    ax = axes[0][1]
    small = [r for r in gemm["rows"] if r["tokens"] <= 16 and "auto_frac_of_copy" in r]
    for tokens in sorted({r["tokens"] for r in small}):
        rows = [r for r in small if r["tokens"] == tokens]
        ax.plot(range(len(rows)), [r["auto_frac_of_copy"] for r in rows], "o", label=f"{tokens} tokens")
    gemv = [r for r in decode["rows"] if r["tokens"] == 1 and "gemv_frac_of_copy" in r]
    names = [r["shape"] for r in small if r["tokens"] == min(x["tokens"] for x in small)]
    ax.plot([names.index(r["shape"]) for r in gemv if r["shape"] in names],
            [r["gemv_frac_of_copy"] for r in gemv if r["shape"] in names], "*", markersize=10, label="1 token, GEMV")
    ax.axhline(TARGET_FRAC_OF_COPY, color="red", ls="--", lw=0.8, label="target")
    ax.set_xticks(range(len(names)), names, rotation=60, fontsize=6)
    ax.set(ylabel="weight bytes / time, fraction of copy bandwidth", title="decode-size GEMM bandwidth")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    rows = experts["rows"]
    tokens = [r["tokens"] for r in rows]
    for label, key in (("bf16 fused_experts", "bf16_ms"), ("FP8", "fp8_ms"), ("FP8 without the GEMVs", "fp8_gemms_ms")):
        pts = [(r["tokens"], r[key] * 1e3) for r in rows if r.get(key)]
        ax.plot(*zip(*pts), "o-", label=label)
    ax.set(xscale="log", xticks=tokens, xlabel="tokens", ylabel="us per MoE layer",
           title="V2-Lite experts (64 x 2048 x 1408, top-6)")
    ax.set_xticklabels(tokens)
    ax.legend(fontsize=7)

    ax = axes[1][1]
    kinds = (("fused_unquantized", "bf16"), ("fused_default_cache", "FP8 weights"), ("fused", "FP8 weights + cache"))
    width = 0.25
    for i, run in enumerate(model["runs"]):
        for j, (key, label) in enumerate(kinds):
            ax.bar(i + (j - 1) * width, run["median_step_ms"][key], width, label=label if i == 0 else None,
                   color=f"C{j}")
        target = TARGET_MS.get((run["batch"], run["context"]))
        if target:
            ax.plot([i - 1.5 * width, i + 1.5 * width], [target, target], "r--", lw=1,
                    label="target (FP8)" if i == 0 else None)
    ax.set_xticks(range(len(model["runs"])), [f"B={r['batch']} L={r['context']}" for r in model["runs"]])
    ax.set(ylabel="ms per decode step (generate, median)", title="DeepSeek-V2-Lite shape, graphed generate")
    ax.legend(fontsize=7)

    fig.suptitle(f"block-FP8 on {model['device']} (Transformers {model.get('transformers', '?')})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fp8.png"))
    args = p.parse_args()
    plot(args.results, args.out)


if __name__ == "__main__":
    main()
