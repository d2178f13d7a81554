"""Sweep the fused MoE decode GEMVs' tiles, each GEMV on its own, bf16 and block-FP8, and suggest the tile tables.

At one to four tokens the small path of ``fused_experts`` / ``fused_experts_fp8`` is two launches:
``moe_up_gemv_kernel`` (gate/up projection + activation; for bf16 it replaces the small path's GEMM1) and
``moe_down_gemv_kernel`` (down projection + routing weights + combine). Both are bound by the bytes of expert weights
they read, so their tiles decide how much of the copy bandwidth they reach. This script times every tile of ``GRID``
for each kernel, dtype and token count on one
DeepSeek-V2-Lite MoE layer (64 experts, hidden 2048, intermediate 1408, top-6) and, with ``--shapes v2lite,v3``, a
DeepSeek-V3-shaped one (hidden 7168, intermediate 2048, top-8): random routings, each call another one, in one CUDA
graph; beside the bf16 GEMM1 the up GEMV may replace; every tile's output checked against the first one's (the same
products, another summation order).

Output (``--out``, JSON): every record, the best tile per (shape, kernel, dtype, tokens), and ``tables``: per shape,
dtype and token bucket the tile with the least worst-case regret over the bucket's token counts, the bf16 up GEMV
marked ``beats_gemm1`` where it is faster than the GEMM at every one of them.  ``--table`` writes them as the shipped
table (``mla_fuser/kernels/tuned/moe_decode_gemv.json``, read by ``fused_moe.gemv_tiles``: a row per shape's hidden
size, the bf16 ``gemv1`` only where it beat the GEMM); ``--records`` chooses again from an earlier run's JSON without
a GPU.  The full grid at V3's size takes long to compile, so the table comes from two runs: the full grid on V2-Lite,
then (``--candidates``) its ``--top`` tiles per case on both shapes.  ``--jobs`` worker processes compile every tile
first (Triton's on-disk cache), which is most of the time.  ``--dry-run``: tiny shapes on CPU under the interpreter.

    python benchmarks/tune_moe_gemv.py --out benchmarks/results/moe_decode_gemv_sweep.json
    python benchmarks/tune_moe_gemv.py --shapes v2lite,v3 --candidates benchmarks/results/moe_decode_gemv_sweep.json \
        --out benchmarks/results/moe_decode_gemv_tables.json --table mla_fuser/kernels/tuned/moe_decode_gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp8_gemm import (EXPERTS, ROUTINGS, TINY_EXPERTS, expert_layer, make_timers,  # noqa: E402
                            random_routes)

GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        for bn, bk, w, st in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8), (1, 2, 3))]
DRY_GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2) for bn, bk in ((8, 16), (16, 32))]
KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
TOKENS = (1, 2, 4)
BUCKETS = {1: (1,), 2: (2,), 4: (3, 4)}  # table bucket -> the token counts it serves (3 is timed as 4's nearest)
V3 = dict(num_experts=32, hidden=7168, inter=2048, topk=8)  # (32 of V3's 256 experts: the per-expert shape counts)
OLD_DEFAULT = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)  # both GEMVs' tile before this sweep


def tile_of(record) -> tuple:
    """A record's tile as a hashable tuple."""
    return tuple(record[k] for k in KEYS)


def runnable(records) -> list:
    """Records of tiles the kernels still take: an earlier run's fp16 tensor-core variant (``"mma"``, measured
    slower on an H200 and removed, ``fp8_experts_variants.json``) is left out."""
    return [r for r in records if not r.get("mma")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--rep", type=int, default=20, help="do_bench rep (ms) per tile")
    p.add_argument("--jobs", type=int, default=12, help="compile worker processes (0: compile while timing)")
    p.add_argument("--shapes", default="v2lite", help="comma list of v2lite, v3")
    p.add_argument("--candidates", default="", help="a previous run's JSON: sweep only its --top tiles per case")
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--table", default="", help="also write the tables as the package's moe_decode_gemv.json format")
    p.add_argument("--records", default="", help="choose from this earlier run's records instead of sweeping")
    p.add_argument("--compile-only", type=int, default=None, help=argparse.SUPPRESS)  # (a worker: its share)
    return p.parse_args(argv)


def launcher(kernel, dtype, layer, shape, x, inter_bufs, out, routes):
    """``fn(cfg) -> call(i)``: one launch of ``kernel`` ("up", "down" or "gemm1") on routing ``i``; ``layer`` as
    ``bench_fp8_gemm.expert_layer`` makes it."""
    from mla_fuser.kernels.fused_moe import configs, launch

    _, block, (gate_up, down), (q1, s1, q2, s2), layout = layer
    e, topk = shape["num_experts"], shape["topk"]

    def make(cfg):
        if kernel == "up":
            if dtype == "bf16":
                return lambda i: launch.launch_up_gemv(x, gate_up, None, inter_bufs[i], routes[i][0], topk, e, 0,
                                                       False, cfg)
            return lambda i: launch.launch_up_gemv(x, q1, None, inter_bufs[i], routes[i][0], topk, e, 0, False, cfg,
                                                   gate_up_scale=s1, gate_up_block=block,
                                                   up_scale_base=layout["up_scale_base"], up_row_shift=0)
        if kernel == "down":
            if dtype == "bf16":
                return lambda i: launch.launch_down_gemv(inter_bufs[i], down, None, out, routes[i][0], routes[i][1],
                                                         topk, e, cfg)
            return lambda i: launch.launch_down_gemv(inter_bufs[i], q2, None, out, routes[i][0], routes[i][1], topk,
                                                     e, cfg, down_scale=s2, down_block=block)
        g1 = cfg or configs.default_config("small", x.shape[0], topk, e)["gemm1"]
        w = gate_up
        return lambda i: launch.launch_gemm(
            a=x, w=w, bias=None, c=inter_bufs[i], flat_ids=routes[i][0], routing=None, align=None,
            num_pairs=routes[i][0].numel(), n_out=shape["inter"], k_dim=shape["hidden"], a_row_div=topk, gated=True,
            interleaved=False, act=0, cfg=g1, num_experts=e)
    return make


def inputs(shape, tokens, count, device, gen):
    import torch

    x = torch.randn(tokens, shape["hidden"], device=device, generator=gen).to(torch.bfloat16)
    # (the launchers take the pairs' ids and weights flat)
    routes = [(ids.reshape(-1).contiguous(), w.reshape(-1).contiguous())
              for ids, w in random_routes(tokens, shape, device, gen, count)]
    inter_bufs = [torch.randn(tokens * shape["topk"], shape["inter"], device=device, generator=gen)
                  .to(torch.bfloat16) for _ in range(count)]
    out = torch.empty(tokens, shape["hidden"], device=device, dtype=torch.bfloat16)
    return x, routes, inter_bufs, out


SHAPES = {"v2lite": EXPERTS, "v3": V3, "tiny": TINY_EXPERTS}


def shapes_of(args):
    if args.dry_run:
        return {"tiny": TINY_EXPERTS}
    return {name: SHAPES[name] for name in args.shapes.split(",")}


def grids(args):
    """``{(kernel, dtype): [tile, ...]}``: the whole ``GRID``, or a previous run's ``--top`` tiles per (kernel,
    dtype, tokens) with ``OLD_DEFAULT``."""
    if args.dry_run:
        return {(k, d): DRY_GRID for k in ("up", "down") for d in ("bf16", "fp8")}
    if not args.candidates:
        return {(k, d): GRID for k in ("up", "down") for d in ("bf16", "fp8")}
    with open(args.candidates) as f:
        records = runnable(json.load(f)["records"])
    out = {}
    for kernel in ("up", "down"):
        for dtype in ("bf16", "fp8"):
            tiles = [tile_of(OLD_DEFAULT)]
            for tokens in TOKENS:
                rows = sorted((r for r in records if (r["kernel"], r["dtype"], r["tokens"]) == (kernel, dtype, tokens)
                               and r["rel_err"] <= 2e-2), key=lambda r: r["ms"])
                tiles += [tile_of(r) for r in rows[:args.top]]
            out[(kernel, dtype)] = [dict(zip(KEYS, t)) for t in dict.fromkeys(tiles)]
    return out


def compile_worker(index, args):
    """Launch this worker's share of the tiles once per shape (compiles land in Triton's on-disk cache)."""
    import torch

    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    tiles = grids(args)
    for shape in shapes_of(args).values():
        # 16 experts: the expert count is a kernel argument specialised only as "a multiple of 16", like 32 and 64
        shape = dict(shape, num_experts=16)
        layer = expert_layer(args, device, gen, shape)
        x, routes, bufs, out = inputs(shape, 1, 1, device, gen)
        jobs = [(k, d, c) for (k, d), grid in tiles.items() for c in grid]
        for kernel, dtype, cfg in jobs[index::args.jobs]:
            launcher(kernel, dtype, layer, shape, x, bufs, out, routes)(cfg)(0)
        torch.cuda.synchronize()
        layer = None
    return 0


def precompile(args):
    start = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--jobs", str(args.jobs), "--shapes", args.shapes, "--top",
           str(args.top)] + (["--candidates", args.candidates] if args.candidates else [])
    procs = [subprocess.Popen(cmd + ["--compile-only", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(args.jobs)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            print(f"compile worker failed ({p.returncode}): {err[-800:]}", flush=True)
    return time.perf_counter() - start


def sweep(args, device, timer):
    import torch

    tiles = grids(args)
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for name, shape in shapes_of(args).items():
        layer = expert_layer(args, device, gen, shape)
        for tokens in TOKENS:
            x, routes, bufs, out = inputs(shape, tokens, ROUTINGS, device, gen)
            for dtype in ("bf16", "fp8"):
                for kernel in ("up", "down"):
                    grid = tiles[(kernel, dtype)]
                    make = launcher(kernel, dtype, layer, shape, x, bufs, out, routes)
                    target = bufs[0] if kernel == "up" else out
                    want = None
                    for cfg in [None] + grid if kernel == "up" and dtype == "bf16" else grid:
                        call = (launcher("gemm1", dtype, layer, shape, x, bufs, out, routes) if cfg is None
                                else make)(cfg)
                        call(0)
                        got = target.float().clone()
                        if want is None:
                            want = got
                        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                        ms = timer(call, ROUTINGS, ROUTINGS, args.rep)
                        records.append(dict(shape=name, kernel="gemm1" if cfg is None else kernel, dtype=dtype,
                                            tokens=tokens, **(cfg or {}), rel_err=err, ms=ms))
                    print(f"{name} tokens {tokens} {dtype} {kernel}: {len(grid)} tiles", flush=True)
        layer = None
    return records


def choose(records):
    """Per (shape, kernel, dtype, bucket): the tile with the least worst-case regret (time / the case's best) over the
    bucket's token counts; tiles whose output strayed from the first tile's (beyond bf16 rounding) are never chosen.
    The bf16 up GEMV is marked ``beats_gemm1`` where it is faster than the GEMM at every such token count."""
    best, by_tile, gemm1 = {}, {}, {}
    records = runnable(records)
    for r in records:
        case = (r["shape"], r["tokens"])
        if r["kernel"] == "gemm1":
            gemm1[case] = r["ms"]
            continue
        if r["rel_err"] > 2e-2:
            continue
        key = (r["kernel"], r["dtype"], case)
        best[key] = min(best.get(key, float("inf")), r["ms"])
        tile = tile_of(r)
        by_tile.setdefault((r["kernel"], r["dtype"], tile), {})[case] = r["ms"]
    shapes = sorted({r["shape"] for r in records})
    chosen = {}
    for (kernel, dtype, tile), times in by_tile.items():
        for shape in shapes:
            for bucket in BUCKETS:
                cases = [(shape, t) for t in TOKENS if t in BUCKETS[bucket] or t == bucket]
                if not all(c in times for c in cases):
                    continue
                regret = max(times[c] / max(best[(kernel, dtype, c)], 1e-12) for c in cases)
                key = (shape, kernel, dtype, bucket)
                if key not in chosen or regret < chosen[key][1]:
                    chosen[key] = (tile, regret, cases)
    tables = {}
    for (shape, kernel, dtype, bucket), (tile, regret, cases) in sorted(chosen.items()):
        cfg = dict(zip(KEYS, tile))
        cfg["worst_vs_best"] = round(regret, 4)
        if (kernel, dtype) == ("up", "bf16"):
            times = by_tile[(kernel, dtype, tile)]
            cfg["beats_gemm1"] = all(times[c] < gemm1[c] for c in cases)
            cfg["vs_gemm1"] = round(max(times[c] / max(gemm1[c], 1e-12) for c in cases), 4)
        entry = tables.setdefault(shape, {}).setdefault(dtype, {}).setdefault(str(bucket), {})
        entry["gemv1" if kernel == "up" else "gemv2"] = cfg
    return {"/".join(map(str, (k, d, *c))): v for (k, d, c), v in best.items()}, tables


def package_table(tables, source):
    """``tables`` as ``mla_fuser/kernels/tuned/moe_decode_gemv.json`` (:mod:`mla_fuser.kernels.fused_moe.gemv_tiles`):
    a row per shape's hidden size; the bf16 ``gemv1`` only where it beat the GEMM."""
    def tile(cfg):
        return {k: cfg[k] for k in KEYS if k in cfg}

    rows = {}
    for shape, dtypes in tables.items():
        hidden = str(SHAPES[shape]["hidden"])
        for dtype, buckets in dtypes.items():
            for bucket, entry in buckets.items():
                out = {"gemv2": tile(entry["gemv2"])}
                up = entry.get("gemv1")
                if up and up.get("beats_gemm1", True):
                    out["gemv1"] = tile(up)
                rows.setdefault(hidden, {}).setdefault(dtype, {})[bucket] = out
    return {"source": source, "hidden": rows}


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported)
        os.environ["MLA_FUSER_BACKEND"] = "triton"
    if args.compile_only is not None:
        return compile_worker(args.compile_only, args)
    if args.records:  # choose again from an earlier run (no GPU needed)
        with open(args.records) as f:
            result = json.load(f)
        result["best_ms"], result["tables"] = choose(result["records"])
        out = args.out or args.records
    else:
        result, out = run(args)
    print(json.dumps(result["tables"], indent=1), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out, flush=True)
    if args.table:
        source = f"benchmarks/tune_moe_gemv.py on {result['device']} ({os.path.basename(out)})"
        with open(args.table, "w") as f:
            json.dump(package_table(result["tables"], source), f, indent=1)
            f.write("\n")
        print("wrote", args.table, flush=True)
    return 0


def run(args):
    import tempfile

    import torch

    device = "cpu" if args.dry_run else "cuda"
    _, graph_ms = make_timers(argparse.Namespace(rep=args.rep), device)
    timer = graph_ms if device == "cuda" else (lambda fn, copies, calls, rep=None: (fn(0), 0.0)[1])
    compile_s = precompile(args) if (args.jobs and not args.dry_run) else 0.0
    start = time.perf_counter()
    records = sweep(args, device, timer)
    best, tables = choose(records)
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  triton=__import__("triton").__version__, dry_run=args.dry_run, compile_s=compile_s,
                  timing="ms: GPU time per launch, CUDA-graph replay of 8 launches with 8 routings",
                  shapes=list(shapes_of(args)), candidates=args.candidates, top=args.top,
                  tiles={f"{k}.{d}": len(g) for (k, d), g in grids(args).items()}, records=records, best_ms=best,
                  tables=tables, sweep_s=time.perf_counter() - start)
    out = args.out or os.path.join(tempfile.gettempdir() if args.dry_run else os.path.join(ROOT, "benchmarks",
                                                                                          "results"),
                                   "moe_decode_gemv_sweep.json")
    return result, out


if __name__ == "__main__":
    sys.exit(main())
