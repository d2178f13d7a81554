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

``--experts`` runs the block-FP8 experts instead (``fused_experts_fp8``, :mod:`mla_fuser.kernels.fused_moe`): the
grouped GEMMs of one MoE layer at DeepSeek-V2-Lite's expert shapes (64 experts, hidden 2048, moe_intermediate 1408,
top-6 of random router scores), T in {1, 16, 64, 512, 8192} tokens, 128x128 block scales per expert, against bf16
``fused_experts`` on the same weights in the same run: median ms, the speed-up, the bytes of the experts the tokens
picked over the time (``*_weight_GBps``, and as a fraction of the copy bandwidth), and the error against
``fused_experts_fp8_ref`` (fp32 on the dequantised weights).  JSON: ``benchmarks/results/fp8_experts.json``.

GPU: ``python benchmarks/bench_fp8_gemm.py --out benchmarks/results/fp8_gemm.json`` (a few minutes on an H200);
``python benchmarks/bench_fp8_gemm.py --experts --out benchmarks/results/fp8_experts.json``.
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
    p.add_argument("--experts", action="store_true", help="FP8 vs bf16 fused MoE experts at V2-Lite shapes instead")
    return p.parse_args(argv)


EXPERTS = dict(num_experts=64, hidden=2048, inter=1408, topk=6)  # DeepSeek-V2-Lite's routed experts
TINY_EXPERTS = dict(num_experts=8, hidden=64, inter=40, topk=2)


def bench_experts(args, bench, result, device, tokens):
    """The ``--experts`` section: FP8 vs bf16 fused experts of one MoE layer, one row per token count."""
    import torch
    from mla_fuser.kernels.fp8.experts import quantize_expert_stack
    from mla_fuser.kernels.fused_moe import (fused_experts, fused_experts_fp8, fused_experts_fp8_ref,
                                             fused_experts_fp8_triton, fused_experts_triton)
    from mla_fuser.kernels.fused_moe.launch import _choose_path

    shape = TINY_EXPERTS if args.dry_run else EXPERTS
    e, h, i, k = shape["num_experts"], shape["hidden"], shape["inter"], shape["topk"]
    block = (16, 16) if args.dry_run else (128, 128)
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02
    down = torch.randn(e, h, i, device=device, generator=gen) * 0.02
    q1, s1 = quantize_expert_stack(gate_up, block, rows=2 * -(-i // block[0]))
    q2, s2 = quantize_expert_stack(down, block)
    gate_up, down = gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    layout = dict(gate_up_block=block, down_block=block, up_scale_base=s1.shape[1] // 2, up_row_shift=0)
    result.update(experts_shape=shape, experts_block=block, rows=[])
    per_expert = {"bf16": 3 * h * i * 2, "fp8": 3 * h * i + 4 * (s1[0].numel() + s2[0].numel())}
    for t in tokens:
        x = (torch.randn(t, h, device=device, generator=gen)).to(torch.bfloat16)
        scores = torch.rand(t, e, device=device, generator=gen)
        weights, ids = scores.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        picked = int(torch.unique(ids).numel())
        ref = fused_experts_fp8_ref(x, q1, s1, q2, s2, ids, weights, **layout).float()
        # the ops as a model calls them (Triton on CUDA); the dry run calls the Triton launchers themselves
        bf16_op = fused_experts_triton if args.dry_run else fused_experts
        fp8_op = fused_experts_fp8_triton if args.dry_run else fused_experts_fp8
        variants = {"bf16": lambda: bf16_op(x, gate_up, down, ids, weights),
                    "fp8": lambda: fp8_op(x, q1, s1, q2, s2, ids, weights, **layout)}
        row = {"tokens": t, "experts_picked": picked, "path": _choose_path("auto", t, t * k)}
        for label, fn in variants.items():
            try:
                out = fn().float()
                row[f"{label}_rel_err_vs_fp8_ref"] = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                ms = bench(fn)
                row[f"{label}_ms"] = ms
                row[f"{label}_weight_GBps"] = picked * per_expert[label] / ms / 1e6
                row[f"{label}_TFLOPs"] = 2 * t * k * 3 * h * i / ms / 1e9
                if "copy_GBps" in result:
                    row[f"{label}_frac_of_copy"] = row[f"{label}_weight_GBps"] / result["copy_GBps"]
            except Exception as exc:  # record and go on
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
        if "fp8_ms" in row and "bf16_ms" in row:
            row["fp8_speedup_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
        result["rows"].append(row)
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
    return result


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
    if args.experts:
        shapes = {}  # the experts section only
        bench_experts(args, bench, result, device, [1, 5] if args.dry_run else tokens)
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
    stem = "fp8_experts.json" if args.experts else "fp8_gemm.json"
    out = args.out or (os.path.join(tempfile.mkdtemp(), stem) if args.dry_run
                       else os.path.join(ROOT, "benchmarks", "results", stem))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
