"""Benchmark the block-FP8 GEMM (``mla_fuser.kernels.fp8``) against bf16 ``torch.mm`` on a GPU, in one run.

Shapes: the linears of DeepSeek-V2-Lite (hidden 2048, no q-LoRA) and DeepSeek-V3 (hidden 7168, q-LoRA 1536), as
``(N, K)`` of ``y[T, N] = x[T, K] @ W[N, K]^T``, at T in {1, 16, 64, 512, 8192} tokens; weights quantised per
128x128 block (random normal 0.02).  For each (shape, T), median of ``triton.testing.do_bench``:
* ``bf16_mm``: ``torch.mm(x, W_bf16.T)``;
* ``weight_only``: the weight-only Triton kernel (activations unquantised, split-K by heuristic);
* ``fp8_tc``: activation quantisation + the FP8 tensor-core kernel (on GPUs with compute capability >= 8.9);
* ``auto``: what ``block_fp8_linear`` picks at that T;
plus the weight-read bandwidth of each (weight bytes / time: the figure of merit at 1-16 tokens, target >= 75% of
the copy bandwidth), TFLOP/s (2*T*N*K), the speed-up over bf16 (target at 8192 tokens: >= 1.5x), and the error of
each against ``block_fp8_linear_ref`` (fp32) as max|out - ref| / max|ref|.  The device copy bandwidth (a large
``copy_``, bytes read + written) is measured in the same run.  A failing variant is recorded with its error and the
run goes on.

GPU: ``python benchmarks/bench_fp8_gemm.py --out benchmarks/results/fp8_gemm.json`` (a few minutes on an H200).
CPU check of the whole flow: ``python benchmarks/bench_fp8_gemm.py --dry-run`` (tiny shapes under Triton's
interpreter; its numbers mean nothing; writes to a temp dir unless ``--out`` is given).
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # name: (N, K)
    "v2lite.q_proj": (3072, 2048), "v2lite.kv_a_proj": (576, 2048), "v2lite.kv_b_proj": (4096, 512),
    "v2lite.o_proj": (2048, 2048), "v2lite.mlp.gate_up": (21888, 2048), "v2lite.mlp.down": (2048, 10944),
    "v3.q_a+kv_a": (2112, 7168), "v3.q_b_proj": (24576, 1536), "v3.kv_b_proj": (32768, 512),
    "v3.o_proj": (7168, 16384), "v3.mlp.gate_up": (36864, 7168), "v3.mlp.down": (7168, 18432),
}
TINY_SHAPES = {"tiny.a": (40, 128), "tiny.b": (96, 64)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,64,512,8192")
    p.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/results/fp8_gemm.json; temp dir on --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        # set before torch/triton import: the interpreter flag is read when kernels are wrapped (this is a script,
        # not the library, so setting the process environment here is its own business)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    import torch
    import triton
    from mla_fuser.kernels.fp8 import block_fp8_linear, block_fp8_linear_ref, quantize_block_fp8
    from mla_fuser.kernels.fp8 import linear as fp8_linear

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on a CPU")
    tokens = [1, 3] if args.dry_run else [int(t) for t in args.tokens.split(",")]
    shapes = TINY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    block = (32, 64) if args.dry_run else (128, 128)

    def bench(fn):
        if args.dry_run:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "block": block,
              "tensor_core_min_tokens": fp8_linear.FP8_TENSOR_CORE_MIN_TOKENS, "dry_run": args.dry_run, "rows": []}
    if device == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src))
        result["copy_GBps"] = 2 * src.numel() / ms / 1e6
        del src, dst
        print(f"copy bandwidth {result['copy_GBps']:.0f} GB/s", flush=True)
    has_tc = device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, generator=gen) * 0.02
        wq, ws = quantize_block_fp8(w, block)
        w_bf16 = w.to(torch.bfloat16)
        del w
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            ref = block_fp8_linear_ref(x, wq, ws, *block).float()
            variants = {"bf16_mm": lambda: torch.mm(x, w_bf16.T),
                        "weight_only": lambda: fp8_linear.w8_linear_triton(x, wq, ws, None, *block),
                        "auto": lambda: block_fp8_linear(x, wq, ws, block)}
            if has_tc:
                variants["fp8_tc"] = lambda: fp8_linear.fp8_linear_triton(x, wq, ws, None, *block)
            row = {"shape": name, "N": n, "K": k, "tokens": t,
                   "auto_path": fp8_linear.choose_path(t, x, *block)}
            for label, fn in variants.items():
                try:
                    out = fn().float()
                    row[f"{label}_rel_err"] = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                    ms = bench(fn)
                    weight_bytes = n * k * (2 if label == "bf16_mm" else 1)
                    row[f"{label}_ms"] = ms
                    row[f"{label}_weight_GBps"] = weight_bytes / ms / 1e6
                    row[f"{label}_TFLOPs"] = 2 * t * n * k / ms / 1e9
                except Exception as exc:  # record and go on: one run on the GPU must give every other number
                    row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                    traceback.print_exc()
            for label in ("weight_only", "fp8_tc", "auto"):
                if f"{label}_ms" in row and "bf16_mm_ms" in row:
                    row[f"{label}_speedup_vs_bf16"] = row["bf16_mm_ms"] / row[f"{label}_ms"]
                if "copy_GBps" in result and f"{label}_weight_GBps" in row:
                    row[f"{label}_frac_of_copy"] = row[f"{label}_weight_GBps"] / result["copy_GBps"]
            result["rows"].append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            del x, ref
        del wq, ws, w_bf16
        if device == "cuda":
            torch.cuda.empty_cache()
    out = args.out or (os.path.join(tempfile.mkdtemp(), "fp8_gemm.json") if args.dry_run
                       else os.path.join(ROOT, "benchmarks", "results", "fp8_gemm.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
