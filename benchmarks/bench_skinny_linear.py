"""The dense linears of a decode step at few rows, as cuBLAS runs them, against the weight-read floor.

A graphed decode step of the DeepSeek-V2-Lite shape runs two cuBLAS GEMMs per layer on its critical path (the
stacked q + kv down-projection and ``o_proj``) and three in the shared experts, all with 1-16 rows: each reads a
whole weight matrix for a handful of output rows, so its floor is the weight's bytes at the GPU's read bandwidth.
This times ``torch.nn.functional.linear`` (and with ``--triton`` our ``kernels.skinny_linear`` at a few tile configs,
checked against it) by CUDA-graph replay (one replay runs the linear over several weight
copies in turn, so the weights come from HBM, not L2) at each (rows, in, out), beside a large copy's bandwidth, to
see which of them leave time on the table before anything replaces them.

    python benchmarks/bench_skinny_linear.py --out benchmarks/results/skinny_linear.json
    python benchmarks/bench_skinny_linear.py --dry-run          # CPU: the flow only, numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

# (name, in_features, out_features) of DeepSeek-V2-Lite's per-layer dense linears (bf16)
SHAPES = [
    ("q_kv_stacked", 2048, 3072 + 576),
    ("o_proj", 2048, 2048),
    ("shared_gate_up", 2048, 2 * 2816),
    ("shared_down", 2816, 2048),
    ("dense_gate_up", 2048, 2 * 10944),
    ("dense_down", 10944, 2048),
]


# (block_n, block_k, num_warps, num_stages) tried with --triton; the first is the kernel's default
TRITON_CONFIGS = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 4), (16, 256, 2, 4), (16, 512, 4, 4), (32, 256, 4, 4),
                  (32, 128, 4, 4), (64, 128, 4, 4), (16, 256, 4, 6)]


def _graph_ms(fn, replays: int) -> float:
    """Median ms of one replay of a graph holding ``fn`` once (after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _triton_rows(x, weights, outs, nbytes, bw, replays):
    from mla_fuser.kernels.skinny_linear import SkinnyConfig, skinny_linear_triton

    rows = []
    want = torch.nn.functional.linear(x, weights[0]).double()
    for cfg in TRITON_CONFIGS:
        config = SkinnyConfig(*cfg)
        row = {"config": list(cfg)}
        try:
            got = skinny_linear_triton(x, weights[0], None, config).double()
            row["max_rel_diff_vs_cublas"] = ((got - want).abs().max() / want.abs().max()).item()

            def run():
                for i, w in enumerate(weights):
                    outs[i] = skinny_linear_triton(x, w, None, config)

            ms = _graph_ms(run, replays) / len(weights)
            row.update(us=ms * 1e3, weight_GBps=nbytes / ms / 1e6, x_floor=ms * 1e3 / (nbytes / bw / 1e3))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is recorded
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    return rows


# absorbed MLA's per-head products at DeepSeek-V2-Lite's shape (16 heads, nope 128, rank 512, v 128), as
# attention_interfaces.paged runs them: (name, heads, K, N, weight contiguous along N)
BMM_SHAPES = [("w_uk", 16, 128, 512, True), ("w_uv", 16, 512, 128, False)]
BMM_CONFIGS = [None, (64, 128, 4, 2), (32, 128, 4, 2), (16, 128, 4, 2), (16, 256, 4, 4), (16, 512, 4, 2),
               (128, 128, 4, 2)]


def bmm_cases(rows_list, copies: int, bw: float, replays: int) -> list[dict]:
    """``torch.bmm`` against ``kernels.skinny_linear.skinny_bmm_triton`` (its own tile pick first, then
    ``BMM_CONFIGS``) by graph replay, weights cycled past L2, queries laid out as the decode path has them."""
    from mla_fuser.kernels.skinny_linear import SkinnyConfig, skinny_bmm_triton

    cases = []
    for name, heads, k, n, n_contiguous in BMM_SHAPES:
        if n_contiguous:  # [H, K, N] with N contiguous (W_UK is stored [H, nope, rank])
            weights = [torch.randn(heads, k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        else:  # a transposed view of [H, N, K] (W_UV is stored [H, v, rank] and used as its transpose)
            weights = [torch.randn(heads, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                       for _ in range(copies)]
        nbytes = heads * k * n * 2
        for rows in rows_list:
            if rows > 16:
                continue
            x = torch.randn(rows, heads, k, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
            want = torch.bmm(x, weights[0]).double()
            outs = [None] * copies

            def run_cublas():
                for i, w in enumerate(weights):
                    outs[i] = torch.bmm(x, w)

            us = _graph_ms(run_cublas, replays) / copies * 1e3
            case = {"name": name, "heads": heads, "in": k, "out": n, "rows": rows, "us": us,
                    "floor_us": nbytes / bw / 1e3, "triton": []}
            for cfg in BMM_CONFIGS:
                config = None if cfg is None else SkinnyConfig(*cfg)
                row = {"config": "default" if cfg is None else list(cfg)}
                try:
                    got = skinny_bmm_triton(x, weights[0], None, config).double()
                    row["max_rel_diff_vs_cublas"] = ((got - want).abs().max() / want.abs().max()).item()

                    def run():
                        for i, w in enumerate(weights):
                            outs[i] = skinny_bmm_triton(x, w, None, config)

                    row["us"] = _graph_ms(run, replays) / copies * 1e3
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is recorded
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                case["triton"].append(row)
            best = min((r for r in case["triton"] if "us" in r), key=lambda r: r["us"], default={})
            print(f"{name:15s} {heads} x {k}->{n} rows {rows:3d}: bmm {us:6.2f} us, floor {case['floor_us']:5.2f}; "
                  f"skinny default {case['triton'][0].get('us', float('nan')):6.2f}, best {best.get('config')} "
                  f"{best.get('us', float('nan')):6.2f} us", flush=True)
            cases.append(case)
        weights = outs = None
        torch.cuda.empty_cache()
    return cases


def copy_gbps(replays: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _graph_ms(lambda: dst.copy_(src), replays)
    return 2 * src.numel() / ms / 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--copies", type=int, default=8, help="weight copies cycled per replay (past L2)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/skinny_linear.json")
    p.add_argument("--triton", action="store_true", help="also time kernels.skinny_linear at TRITON_CONFIGS")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    result = {"what": "F.linear (cuBLAS) at few rows, CUDA-graph replay, weights cycled past L2", "cases": []}
    if args.dry_run or not torch.cuda.is_available():
        for name, k, n in SHAPES[:1]:
            x, w = torch.randn(2, k), torch.randn(n, k)
            began = time.perf_counter()
            torch.nn.functional.linear(x, w)
            result["cases"].append({"name": name, "rows": 2, "us_cpu": (time.perf_counter() - began) * 1e6})
        print(json.dumps(result))
        return
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    result["copy_GBps"] = bw = copy_gbps(args.replays)
    print(f"{result['device']}: copy {bw:.0f} GB/s (read + write)")
    for name, k, n in SHAPES:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.copies)]
        nbytes = n * k * 2
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            outs = [None] * len(weights)

            def run():
                for i, w in enumerate(weights):
                    outs[i] = torch.nn.functional.linear(x, w)

            ms = _graph_ms(run, args.replays) / len(weights)
            case = {"name": name, "in": k, "out": n, "rows": rows, "us": ms * 1e3,
                    "weight_GBps": nbytes / ms / 1e6, "floor_us": nbytes / bw / 1e3}
            case["x_floor"] = case["us"] / case["floor_us"]
            result["cases"].append(case)
            print(f"{name:15s} {k:6d}->{n:6d} rows {rows:3d}: {case['us']:7.2f} us  {case['weight_GBps']:6.0f} GB/s  "
                  f"floor {case['floor_us']:6.2f} us ({case['x_floor']:.2f}x)", flush=True)
            if args.triton and rows <= 16:
                case["triton"] = _triton_rows(x, weights, outs, nbytes, bw, args.replays)
                best = min((r for r in case["triton"] if "us" in r), key=lambda r: r["us"], default=None)
                if best:
                    print(f"{'':15s} triton best {best['config']}: {best['us']:7.2f} us ({best['x_floor']:.2f}x floor, "
                          f"{case['us'] / best['us']:.2f}x faster than cuBLAS); default "
                          f"{case['triton'][0].get('us', float('nan')):.2f} us", flush=True)
        weights = outs = None  # (freed before the next shape's copies are made)
        torch.cuda.empty_cache()
    if args.triton:
        result["bmm_cases"] = bmm_cases(rows_list, args.copies, bw, args.replays)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
