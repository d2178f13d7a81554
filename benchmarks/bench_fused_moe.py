"""Benchmark the fused MoE experts kernel (``mla_fuser.kernels.fused_moe``) on a GPU.

Setting: one DeepSeek-V2-Lite MoE layer -- H=2048, E=64 routed experts, top-K=6, I=1408, bf16 -- at
T in {1, 16, 64, 512, 8192} tokens, routed by the reference router (softmax, greedy top-6, scaling 1.0,
no renormalisation, as DeepSeek-V2-Lite) from random hidden states and a random router weight.

Reported per T (median of ``triton.testing.do_bench``, which flushes L2 between runs, so the 1.1 GB of
expert weights never sit in the 60 MB L2):
* ``fused_experts`` (path auto) and each forced path (small-batch / aligned); with ``--cuda-graph`` also
  CUDA-graph replays (what a decode loop under graphs sees: no Python/launch overhead);
* the same plus routing (router GEMM in fp32 + ``route_topk_ref``), and routing alone;
* Transformers' own experts implementations on the same weights (``DeepseekV2Experts`` built standalone
  from a small ``DeepseekV2Config``, switching ``config._experts_implementation`` between
  ``grouped_mm``, ``batched_mm`` and ``eager``; ``batched_mm`` gathers one weight copy per (token, k)
  pair and is skipped where that would exceed ``--batched-mm-max-gb``);
* bytes of the distinct experts' weights touched and the achieved weight-read bandwidth (GB/s) --
  the figure of merit at 1-64 tokens -- against the device copy bandwidth measured in the same run
  (a large ``copy_``, bytes read + written), and TFLOP/s (6*T*K*H*I flops);
* correctness: max |fused - ref| / max |ref| against ``fused_experts_ref`` (fp32) for every path, and
  Transformers' grouped_mm against the same reference for comparison;
* the targets from the project brief (ms) and whether the auto path meets them.

``--sweep`` times a grid of tile configs (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) for each GEMM
of each path separately, picks the best per token count (aligned: best BLOCK_M for GEMM1+GEMM2+align
together), re-times the whole op with them, and writes them to ``--configs-out`` in the format
``MLA_FUSER_MOE_CONFIGS`` loads -- one GPU call tunes everything.

Suggested GPU calls (each well inside 10 minutes on an H200; the sweep compiles its configs in threads):
``python benchmarks/bench_fused_moe.py --cuda-graph`` (~1.5 min), then
``python benchmarks/bench_fused_moe.py --tokens 1,4,16,64 --hf-impls '' --sweep --out A.json --configs-out A_cfg.json``
and the same with ``--tokens 512,8192`` (B.json, B_cfg.json); merge the two tables of ``{path: {T: configs}}``
into one file and point ``MLA_FUSER_MOE_CONFIGS`` at it.

``--dry-run`` runs the whole flow (sweep included, if asked) on CPU under Triton's interpreter with tiny
shapes in seconds, to check the script; its numbers mean nothing and it writes to a temp dir.
"""

import argparse
import functools
import itertools
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGETS_MS = {1: 0.10, 16: 0.35, 64: 0.45, 512: 0.7, 8192: 2.3}
DSV2_LITE = dict(H=2048, E=64, K=6, I=1408)
TINY = dict(H=32, E=6, K=2, I=16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,64,512,8192", help="comma list of token counts")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--paths", default="auto,small,aligned", help="fused paths to time (auto, small, aligned)")
    p.add_argument("--hf-impls", default="grouped_mm,batched_mm,eager", help="Transformers experts impls ('' = none)")
    p.add_argument("--batched-mm-max-gb", type=float, default=16.0, help="skip batched_mm above this gather size")
    p.add_argument("--cuda-graph", action="store_true", help="also time CUDA-graph replays of fused_experts")
    p.add_argument("--sweep", action="store_true", help="time a tile-config grid per GEMM and path")
    p.add_argument("--sweep-tokens", default=None, help="comma list of T to sweep (default: all --tokens)")
    p.add_argument("--sweep-max-configs", type=int, default=0, help="cap configs per (T, path, GEMM); 0 = all")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--sweep-rep", type=int, default=25, help="do_bench repetition time in the sweep, ms")
    p.add_argument("--no-precompile", action="store_true", help="sweep: compile configs one by one, not in threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/fused_moe.json; dry run: temp dir)")
    p.add_argument("--configs-out", default=None, help="best configs JSON (default: next to --out)")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    args = p.parse_args(argv)
    results_dir = tempfile.gettempdir() if args.dry_run else os.path.join(ROOT, "benchmarks", "results")
    if args.out is None:
        args.out = os.path.join(results_dir, "fused_moe_dryrun.json" if args.dry_run else "fused_moe.json")
    if args.configs_out is None:
        args.configs_out = os.path.join(os.path.dirname(args.out) or ".", "fused_moe_configs.json")
        if args.dry_run:
            args.configs_out = os.path.join(results_dir, "fused_moe_configs_dryrun.json")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.dry_run:
        args.tokens = [t for t in args.tokens if t <= 16] or [1]
        args.tokens = sorted(set(args.tokens) | {1, 4})
    args.sweep_tokens = [int(t) for t in args.sweep_tokens.split(",") if t] if args.sweep_tokens else args.tokens
    args.paths = [s for s in args.paths.split(",") if s]
    args.hf_impls = [s for s in args.hf_impls.split(",") if s]
    return args


# ----------------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------------


def make_timer(device, warmup, rep):
    import torch

    if device == "cuda":
        import triton.testing

        def timer(fn, rep_ms=None):
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms or rep, return_mode="median"))

        return timer

    def cpu_timer(fn, rep_ms=None):  # dry run: one warm call + one timed call is enough to exercise the flow
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    del torch
    return cpu_timer


def cuda_graph_timer(fn, timer):
    """Capture ``fn`` in a CUDA graph (after warm-up on a side stream) and time its replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay)


def spin_up(fm, shape, gate_up, down, router, dtype, device, seconds=1.0):
    """Un-timed warm-up before the first measurement: compile the decode kernels and keep host and GPU busy
    for a while (a first H200 run timed the very first case at 2.4x the same code timed right after)."""
    import torch

    hidden = make_hidden(1, shape, dtype, device, 0)
    weights, ids = route(fm, hidden, router, shape["K"])
    end = time.perf_counter() + (seconds if device == "cuda" else 0.0)
    fm.fused_experts(hidden, gate_up, down, ids, weights)
    while time.perf_counter() < end:
        for _ in range(20):
            fm.fused_experts(hidden, gate_up, down, ids, weights)
        if device == "cuda":
            torch.cuda.synchronize()


def copy_bandwidth(device, timer, nbytes):
    """GB/s of a device-to-device ``copy_`` counting bytes read + written."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------------------------------
# problem, Transformers reference modules
# ----------------------------------------------------------------------------------------------------------------------


def make_weights(shape, dtype, device, seed):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    H, E, I = shape["H"], shape["E"], shape["I"]
    gate_up = (torch.randn(E, 2 * I, H, device=device, generator=g) * 0.02).to(dtype)
    down = (torch.randn(E, H, I, device=device, generator=g) * 0.02).to(dtype)
    router = torch.randn(E, H, device=device, generator=g) * 0.05
    return gate_up, down, router


def make_hidden(num_tokens, shape, dtype, device, seed):
    import torch

    g = torch.Generator(device=device).manual_seed(seed + 1000 + num_tokens)
    return torch.randn(num_tokens, shape["H"], device=device, generator=g).to(dtype)


def route(fm, hidden, router, k):
    """DeepSeek-V2-Lite routing: fp32 router GEMM, softmax, greedy top-k, scaling 1.0, no renorm."""
    logits = hidden.float() @ router.t()
    return fm.route_topk_ref(logits, k, scoring="softmax", renormalize=False, scaling=1.0)


def build_hf_experts(shape, gate_up, down):
    """``DeepseekV2Experts`` wrapping our weight tensors (no copy); its forward dispatches through the
    ``ExpertsInterface`` on ``config._experts_implementation``."""
    import torch
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts

    cfg = DeepseekV2Config(
        hidden_size=shape["H"],
        moe_intermediate_size=shape["I"],
        n_routed_experts=shape["E"],
        num_experts_per_tok=shape["K"],
        hidden_act="silu",
        num_hidden_layers=1,
    )
    with torch.device("meta"):
        experts = DeepseekV2Experts(cfg)
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return experts, cfg


# ----------------------------------------------------------------------------------------------------------------------
# sweep
# ----------------------------------------------------------------------------------------------------------------------


def sweep_grid(path, num_tokens, shape, dry_run):
    """Config candidates per GEMM.  Small path: BLOCK_M=16 (one tile per expert at decode sizes), vary the
    tile width/depth and pipelining.  Aligned: BLOCK_M around the mean pairs per expert."""
    if path == "gemv2":  # the small path's down+combine GEMV (no BLOCK_M): a plain list
        if dry_run:
            return [dict(BLOCK_N=8, BLOCK_K=8, num_warps=4, num_stages=2)]
        return [
            dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
            for n, k, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 2))
            if 2048 <= n * k <= 8192
        ]
    if dry_run:
        base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
        return {16: [base, dict(base, BLOCK_N=32)]}
    if path == "small":
        grid = [
            dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, GROUP_M=1, num_warps=w, num_stages=s)
            for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
            if n * k <= 16384
        ]
        grid += [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=4)]
        return {16: grid}
    avg = num_tokens * shape["K"] / shape["E"]
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= 2 * max(avg, 8) and bm >= min(avg, 64) / 2] or [64]
    out = {}
    # prefill-sized batches (hundreds of pairs per expert) are compute-bound: wider N tiles and larger groups
    wide = avg > 256
    widths, groups = ((64, 128, 256), (8, 16)) if wide else ((64, 128), (8,))
    for bm in block_ms:
        if wide and bm < 64:
            continue
        out[bm] = [
            dict(BLOCK_M=bm, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)
            for n, k, g, w, s in itertools.product(widths, (64, 128), groups, (4, 8), (3, 4))
            # tiles whose shared memory cannot fit are skipped (configs that still do not fit fail and are recorded)
            if not (bm == 128 and n == 128 and k == 128) and not (n == 256 and (k == 128 or w == 4))
        ]
    return out


def precompile(jobs, log):
    """Run ``jobs`` (callables that compile a kernel without launching it) in threads: ptxas runs as a subprocess
    and much of Triton's MLIR pipeline releases the GIL, so a large sweep fits in one GPU call.  Failures are left
    for the timed loop to record.  (``bench_fp8_gemm.py``'s sweep uses it too.)"""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()

    def one(job):
        try:
            job()
            return True
        except Exception:
            return False

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        ok = sum(pool.map(one, jobs))
    log(f"  precompiled {ok}/{len(jobs)} kernels in {time.perf_counter() - t0:.1f} s")


def run_sweep(fm, args, shape, num_tokens, tensors, timer, log):
    """Time each GEMM of each path alone over the grid; returns (records, best {path: {gemm1, gemm2}})."""
    import torch

    hidden, gate_up, down, ids, weights = tensors
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    num_pairs = num_tokens * K
    flat_ids = ids.reshape(-1).contiguous()
    routing = weights.reshape(-1).contiguous()
    act = 0
    records, best = [], {}
    paths = [p for p in ("small", "aligned") if p in args.paths or "auto" in args.paths]
    for path in paths:
        if path == "small" and num_pairs > fm.SMALL_BATCH_MAX_PAIRS:
            continue
        best_total = None
        for block_m, grid in sweep_grid(path, num_tokens, shape, args.dry_run).items():
            align = None
            align_ms = 0.0
            if path == "aligned":
                align = fm.align_tokens_to_experts(flat_ids, E, block_m)
                align_ms = timer(lambda: fm.align_tokens_to_experts(flat_ids, E, block_m), args.sweep_rep)
            inter = torch.empty(num_pairs, I, dtype=gate_up.dtype, device=hidden.device)
            pair_out = torch.empty(num_pairs, H, dtype=gate_up.dtype, device=hidden.device)
            gemm_kw = {
                "gemm1": dict(a=hidden, w=gate_up, bias=None, c=inter, routing=None, n_out=I, k_dim=H, a_row_div=K,
                              gated=True),
                "gemm2": dict(a=inter, w=down, bias=None, c=pair_out, routing=routing, n_out=H, k_dim=I, a_row_div=1,
                              gated=False),
            }  # fmt: skip

            gemms = ["gemm1", "gemm2"]
            grids = {"gemm1": grid, "gemm2": grid}
            if path == "small" and num_tokens <= fm.gemv_down_max_tokens():
                gemms.append("gemv2")
                grids["gemv2"] = sweep_grid("gemv2", num_tokens, shape, args.dry_run)
                out_buf = torch.empty(num_tokens, H, dtype=hidden.dtype, device=hidden.device)
            if args.sweep_max_configs:
                grids = {g: c[: args.sweep_max_configs] for g, c in grids.items()}

            def launch(gemm, cfg, warmup=False):
                if gemm == "gemv2":
                    fm.launch_down_gemv(inter, down, None, out_buf, flat_ids, routing, K, E, cfg, warmup=warmup)
                    return
                fm.launch_gemm(flat_ids=flat_ids, align=align, num_pairs=num_pairs, interleaved=False, act=act,
                               cfg=cfg, num_experts=E, warmup=warmup, **gemm_kw[gemm])  # fmt: skip

            if hidden.is_cuda and not args.no_precompile:
                precompile([functools.partial(launch, g, c, warmup=True) for g in gemms for c in grids[g]], log)
            per_gemm = {}
            for gemm in gemms:
                grid = grids[gemm]
                scored = []
                for cfg in grid:
                    rec = dict(tokens=num_tokens, path=path, gemm=gemm, config=cfg)
                    try:
                        launch(gemm, cfg)  # compiles here unless precompiled
                        rec["ms"] = timer(lambda: launch(gemm, cfg), args.sweep_rep)
                        scored.append((rec["ms"], cfg))
                    except Exception as exc:  # out of shared memory / registers, etc.
                        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    records.append(rec)
                if scored:
                    per_gemm[gemm] = min(scored, key=lambda x: x[0])
                    log(f"  sweep T={num_tokens} {path} BM={block_m} {gemm}: best {per_gemm[gemm][0]:.4f} ms "
                        f"{per_gemm[gemm][1]} ({len(scored)}/{len(grid)} ok)")  # fmt: skip
            if "gemm1" in per_gemm and "gemm2" in per_gemm:
                down_ms = per_gemm["gemv2"][0] if "gemv2" in per_gemm else per_gemm["gemm2"][0]  # what runs at this T
                total = per_gemm["gemm1"][0] + down_ms + align_ms
                if best_total is None or total < best_total:
                    best_total = total
                    best[path] = {g: per_gemm[g][1] for g in per_gemm}
    return records, best


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        # Before anything imports Triton; fused_moe's kernels pick the mode at first launch anyway.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MLA_FUSER_BACKEND"] = "triton"
    sys.path.insert(0, ROOT)
    import torch

    from mla_fuser.kernels import fused_moe as fm

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run on CPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shape = TINY if args.dry_run else DSV2_LITE
    H, E, K, I = shape["H"], shape["E"], shape["K"], shape["I"]
    timer = make_timer(device, args.warmup, args.rep)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        dtype=args.dtype,
        shape=shape,
        dry_run=args.dry_run,
        timer="triton.testing.do_bench median (L2 flushed between runs)" if device == "cuda" else "perf_counter",
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        small_batch_max_tokens=fm.small_batch_max_tokens(),
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except Exception:
        pass

    gate_up, down, router = make_weights(shape, dtype, device, args.seed)
    expert_bytes = (2 * I * H + H * I) * gate_up.element_size()
    copy_gbps = copy_bandwidth(device, timer, (2 << 30) if device == "cuda" else (8 << 20))
    log(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write); one expert = {expert_bytes / 1e6:.1f} MB")

    hf = None
    if args.hf_impls:
        try:
            hf = build_hf_experts(shape, gate_up, down)
        except Exception as exc:
            meta["hf_error"] = f"{type(exc).__name__}: {exc}"
            log(f"Transformers experts unavailable: {meta['hf_error']}")

    results, sweep_records, best_configs = [], [], {}
    spin_up(fm, shape, gate_up, down, router, dtype, device)
    for T in args.tokens:
        hidden = make_hidden(T, shape, dtype, device, args.seed)
        weights, ids = route(fm, hidden, router, K)
        distinct = int(torch.unique(ids).numel())
        weight_bytes = distinct * expert_bytes
        flops = 6 * T * K * H * I
        rec = dict(tokens=T, pairs=T * K, distinct_experts=distinct, weight_bytes=weight_bytes, flops=flops)
        rec["weight_read_floor_ms"] = weight_bytes / (copy_gbps * 1e9) * 1e3  # at the measured copy bandwidth
        ref = fm.fused_experts_ref(hidden, gate_up, down, ids, weights)
        scale = ref.float().abs().max().item() + 1e-12

        def rel_err(out):
            return (out.float() - ref.float()).abs().max().item() / scale

        rec["route_ms"] = timer(lambda: route(fm, hidden, router, K))
        for path in args.paths:
            if path == "small" and T * K > 4 * fm.SMALL_BATCH_MAX_PAIRS:
                continue
            key = f"fused_{path}"
            try:
                fn = lambda p=path: fm.fused_experts(hidden, gate_up, down, ids, weights, path=p)  # noqa: E731
                rec[f"{key}_rel_err"] = rel_err(fn())
                ms = timer(fn)
                rec[f"{key}_ms"] = ms
                rec[f"{key}_weight_GBps"] = weight_bytes / (ms * 1e-3) / 1e9
                rec[f"{key}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
                if path == "auto":

                    def routed(p=path):
                        w, i = route(fm, hidden, router, K)
                        return fm.fused_experts(hidden, gate_up, down, i, w, path=p)

                    rec[f"{key}_with_routing_ms"] = timer(routed)
                if args.cuda_graph and device == "cuda":
                    rec[f"{key}_cudagraph_ms"] = cuda_graph_timer(fn, timer)
                    if path == "auto":
                        rec[f"{key}_with_routing_cudagraph_ms"] = cuda_graph_timer(routed, timer)
            except Exception as exc:
                rec[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if hf is not None:
            experts, cfg = hf
            for impl in args.hf_impls:
                key = f"hf_{impl}"
                if impl == "batched_mm" and T * K * expert_bytes > args.batched_mm_max_gb * 1e9:
                    rec[f"{key}_skipped"] = f"gathers {T * K * expert_bytes / 1e9:.0f} GB of weights"
                    continue
                try:
                    cfg._experts_implementation = impl
                    with torch.no_grad():
                        fn = lambda: experts(hidden, ids, weights.to(hidden.dtype))  # noqa: E731
                        rec[f"{key}_rel_err"] = rel_err(fn())
                        rec[f"{key}_ms"] = timer(fn)
                        if args.cuda_graph and device == "cuda" and impl == "grouped_mm":
                            try:
                                rec[f"{key}_cudagraph_ms"] = cuda_graph_timer(fn, timer)
                            except Exception as exc:
                                rec[f"{key}_cudagraph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                except Exception as exc:
                    rec[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if T in TARGETS_MS and "fused_auto_ms" in rec and not args.dry_run:
            rec["target_ms"] = TARGETS_MS[T]
            rec["meets_target"] = rec["fused_auto_ms"] <= TARGETS_MS[T]
        if args.sweep and T in args.sweep_tokens:
            recs, best = run_sweep(fm, args, shape, T, (hidden, gate_up, down, ids, weights), timer, log)
            sweep_records += recs
            for path, cfgs in best.items():
                best_configs.setdefault(path, {})[str(T)] = cfgs
                fn = lambda p=path, c=cfgs: fm.fused_experts_triton(  # noqa: E731
                    hidden, gate_up, down, ids, weights, path=p, config=c
                )
                rec[f"tuned_{path}_rel_err"] = rel_err(fn())
                rec[f"tuned_{path}_ms"] = timer(fn)
        results.append(rec)
        write_json(args, meta, copy_gbps, expert_bytes, results, sweep_records, best_configs, log=None)
        summary = ", ".join(
            f"{k[:-3]}={v:.4f}" for k, v in rec.items() if k.endswith("_ms") and isinstance(v, float)
        )
        log(f"T={T:5d} distinct={distinct:3d} weights={weight_bytes / 1e6:8.1f} MB | {summary}")
        errs = {k: f"{v:.2e}" for k, v in rec.items() if k.endswith("_rel_err")}
        target = f"  target {rec['target_ms']} ms met: {rec['meets_target']}" if "target_ms" in rec else ""
        log(f"        rel err: {errs}{target}")

    return write_json(args, meta, copy_gbps, expert_bytes, results, sweep_records, best_configs, log=log)


def write_json(args, meta, copy_gbps, expert_bytes, results, sweep_records, best_configs, log):
    """Written after every token count too (log=None), so a crash late in a GPU call keeps what was measured."""
    out = dict(meta=meta, copy_bandwidth_GBps=copy_gbps, expert_bytes=expert_bytes, targets_ms=TARGETS_MS,
               results=results)  # fmt: skip
    if args.sweep:
        out["sweep"] = sweep_records
        out["best_configs"] = best_configs
        # Buckets: each swept T covers token counts up to it (get_moe_config picks the smallest bucket >= T).
        os.makedirs(os.path.dirname(os.path.abspath(args.configs_out)), exist_ok=True)
        with open(args.configs_out, "w") as f:
            json.dump(best_configs, f, indent=1)
        if log:
            log(f"best configs -> {args.configs_out} (use with MLA_FUSER_MOE_CONFIGS={args.configs_out})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if log:
        log(f"results -> {args.out}")
    return out

if __name__ == "__main__":
    main()
