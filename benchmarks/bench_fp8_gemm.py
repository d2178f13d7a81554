"""Benchmark the block-FP8 GEMM (``mla_fuser.kernels.fp8``) against bf16 ``torch.mm`` on a GPU, in one run.

Shapes: the linears of DeepSeek-V2-Lite (hidden 2048, no q-LoRA) and DeepSeek-V3 (hidden 7168, q-LoRA 1536), as
``(N, K)`` of ``y[T, N] = x[T, K] @ W[N, K]^T``, at T in {1, 16, 64, 512, 8192} tokens; weights quantised per
128x128 block (random normal 0.02).  Variants:
* ``bf16_mm``: ``torch.mm(x, W_bf16.T)``;
* ``weight_only``: the weight-only Triton kernel (activations unquantised, tiles and split-K from the table);
* ``gemv``: the decode GEMV (one launch, scales folded into the activations), at T <= ``GEMV_MAX_TOKENS``;
* ``fp8_tc``: activation quantisation + the FP8 tensor-core kernel (on GPUs with compute capability >= 8.9);
* ``auto``: what ``block_fp8_linear`` picks at that T.

Two times per variant, because both matter and they differ by an order of magnitude at decode sizes:
* ``*_ms``: GPU time: ``calls`` calls (up to 20, fewer for slow ones) captured in one CUDA graph, the replay's
  median time (``triton.testing.do_bench``, which flushes L2 before each replay) over ``calls``.  What a decode
  step replayed from a graph pays.  The calls cycle through enough copies of the weight that none is re-read
  from L2 within a replay (a model reads each layer's weights once per step);
* ``*_eager_ms``: one eager call per ``do_bench`` run (L2 flushed before each): host time (Python, allocation,
  launches) whenever it exceeds the GPU time.
The weight-read bandwidth (weight bytes / time: the figure of merit at 1-16 tokens, target >= 75% of the copy
bandwidth), TFLOP/s (2*T*N*K) and the speed-up over bf16 (target at 8192 tokens: >= 1.5x) come from the GPU time,
``*_eager_speedup_vs_bf16`` from the eager times; the error of each against ``block_fp8_linear_ref`` (fp32) is
max|out - ref| / max|ref|.  The device copy bandwidth (a large ``copy_``, bytes read + written) is measured in the
same run.  A failing variant is recorded with its error and the run goes on.

``--sweep`` picks the launch tables of :mod:`mla_fuser.kernels.fp8.linear` (``W8_CONFIGS``, ``TC_CONFIGS``)
instead: for a few shapes (``--sweep-shapes``) and T in ``--sweep-tokens``, the GPU time (as ``*_ms`` above) of
every config of a small grid -- weight-only for T <= 64 (tile, warps, stages, split-K fill, MMA or GEMV), FP8
tensor cores for T >= 64 (tile, warps, stages) -- beside bf16 ``torch.mm``.  It prints and writes the best config
per (shape, T), the best of each path at T = 64 (where the path threshold ``FP8_TENSOR_CORE_MIN_TOKENS`` is
decided), and ``suggested_tables``: per T and path, the config with the best geometric-mean time over the shapes
(with how far it is from each shape's own best), as table rows ready to paste.  Kernels compile in threads
first, so the whole sweep is one GPU call of a few minutes:
``python benchmarks/bench_fp8_gemm.py --sweep --out benchmarks/results/fp8_gemm_sweep.json``.

``--experts`` runs the block-FP8 experts instead (``fused_experts_fp8``, :mod:`mla_fuser.kernels.fused_moe`): the
grouped GEMMs of one MoE layer at DeepSeek-V2-Lite's expert shapes (64 experts, hidden 2048, moe_intermediate 1408,
top-6 of random router scores), T in {1, 4, 16, 64, 512, 8192} tokens (``path`` / ``fp8_path``: what "auto"
picks for bf16 / FP8), 128x128 block scales per expert, against bf16 ``fused_experts`` on the same weights in the same
run (and, at decode sizes, FP8 without its decode GEMVs:
``fp8_gemms``; at every size the GEMMs forced W8A8 with the activations quantised in the GEMM, ``fp8_w8a8``, or
before it, ``fp8_w8a8_prequant``, and weight-only, ``fp8_weight_only``, whichever "auto" picks, ``fp8_act_quant``):
the speed-up, the bytes of the experts the tokens picked over the time (``*_weight_GBps``, and as a
fraction of the copy bandwidth), and the error against ``fused_experts_fp8_ref`` (fp32 on the dequantised weights).
Times: ``*_ms`` GPU time (CUDA-graph replay of ``ROUTINGS`` calls, each with its own random routing, L2 flushed
before each replay), ``*_eager_ms`` one eager call.  JSON: ``benchmarks/results/fp8_experts.json``.

``--gemv-sweep`` times the decode GEMVs' tiles (``GEMV_SWEEP``): the linear's one-token GEMV on V2-Lite and V3 shapes
and the experts' two GEMVs on one V2-Lite layer, at 1 and 4 tokens; it prints the best tile per row and the tile with
the best geometric mean (``fp8_gemv_sweep.json``: the source of ``linear.GEMVConfig`` and of
``fp8_launch.FP8_GEMV_CONFIG``, the experts' GEMV fallback tile; ``tune_moe_gemv.py`` tunes the experts' GEMVs each on
its own, per token count and layer size, for the shipped table). ``--experts-sweep`` times the experts' GEMM tiles
(``EXPERTS_SWEEP``) on one path (``--experts-sweep-path``) at 8 and 16 tokens beside the other path's defaults
(``fp8_experts_sweep_<path>.json``: the source of ``FP8_SMALL_BATCH_MAX_TOKENS`` and ``configs.default_fp8_config``);
with ``--experts-sweep-act-quant`` the W8A8 GEMMs' tiles (``EXPERTS_W8A8_SWEEP``, ``EXPERTS_W8A8_PREFILL_SWEEP`` above
32 pairs per expert, where ``configs.default_w8a8_config`` switches to its prefill tile), at ``--experts-sweep-tokens``;
``fp8_experts_sweep_<path>_w8a8.json``: the source of ``configs.default_w8a8_config``).

GPU: ``python benchmarks/bench_fp8_gemm.py --out benchmarks/results/fp8_gemm.json`` (a few minutes on an H200);
``python benchmarks/bench_fp8_gemm.py --experts --out benchmarks/results/fp8_experts.json``.
CPU check of the whole flow: ``python benchmarks/bench_fp8_gemm.py --dry-run`` (and ``--dry-run --sweep``): tiny
shapes under Triton's interpreter, eager timing only (no CUDA graphs); its numbers mean nothing; writes to a temp
dir unless ``--out`` is given.
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
# V2-Lite's two shared experts, and its q_proj stacked with kv_a_proj (the fused attention's one GEMM); --shapes only
EXTRA_SHAPES = {"v2lite.shared.gate_up": (5632, 2048), "v2lite.shared.down": (2048, 2816),
                "v2lite.q+kv_a": (3648, 2048)}
SWEEP_SHAPES = ("v2lite.q_proj", "v2lite.kv_a_proj", "v3.mlp.gate_up", "v3.mlp.down")
MAX_CALLS_PER_GRAPH = 20
GRAPH_TARGET_MS = 2.0  # calls per graph: enough for about this much GPU time (replay launch cost amortised)
W8_SWEEP_MAX_TOKENS, TC_SWEEP_MIN_TOKENS = 64, 64
# a swept config off the fp32 reference by more than this is broken, not slow (weight-only: bf16 output rounding;
# FP8 tensor cores: activation quantisation too)
MAX_REL_ERR = {"weight_only": 0.02, "fp8_tc": 0.1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,4,16,64,512,8192")
    p.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    p.add_argument("--out", default="",
                   help="JSON file (default benchmarks/results/<section>.json; temp dir on --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    p.add_argument("--experts", action="store_true", help="FP8 vs bf16 fused MoE experts at V2-Lite shapes instead")
    p.add_argument("--sweep", action="store_true", help="time a config grid per (shape, T) and suggest the tables")
    p.add_argument("--experts-sweep", action="store_true",
                   help="time the FP8 experts' GEMM tiles on one path (--experts-sweep-path) at 8 and 16 tokens")
    p.add_argument("--experts-sweep-path", choices=("small", "aligned"), default="small",
                   help="the path whose tiles --experts-sweep times (the other runs with its default tiles)")
    p.add_argument("--experts-sweep-act-quant", action="store_true",
                   help="--experts-sweep times the W8A8 GEMMs' tiles (EXPERTS_W8A8_SWEEP) instead")
    p.add_argument("--experts-sweep-tokens", default="8,16", help="token counts --experts-sweep times")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="time the decode GEMVs' tiles (linear: V2-Lite/V3 shapes; experts: V2-Lite) at T <= 4")
    p.add_argument("--sweep-shapes", default=",".join(SWEEP_SHAPES))
    p.add_argument("--sweep-tokens", default="1,16,64,512,8192")
    p.add_argument("--sweep-rep", type=int, default=20, help="do_bench rep (ms) per swept config")
    return p.parse_args(argv)


EXPERTS = dict(num_experts=64, hidden=2048, inter=1408, topk=6)  # DeepSeek-V2-Lite's routed experts
TINY_EXPERTS = dict(num_experts=8, hidden=64, inter=40, topk=2)


ROUTINGS = 8  # calls per graph in --experts, each with its own routing (a decode step's layers pick other experts)


def expert_layer(args, device, gen, shape=None):
    """One MoE layer of random experts (``shape``, else ``EXPERTS``, ``TINY_EXPERTS`` on a dry run), quantised per
    block: ``(shape, block, (gate_up, down) in bf16, (q1, s1, q2, s2), layout keywords of fused_experts_fp8)``."""
    import torch
    from mla_fuser.kernels.fp8.experts import quantize_expert_stack

    shape = shape or (TINY_EXPERTS if args.dry_run else EXPERTS)
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    block = (16, 32) if args.dry_run else (128, 128)  # (bk 32: the W8A8 GEMMs' smallest group)
    gate_up = torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02
    down = torch.randn(e, h, i, device=device, generator=gen) * 0.02
    q1, s1 = quantize_expert_stack(gate_up, block, rows=2 * -(-i // block[0]))
    q2, s2 = quantize_expert_stack(down, block)
    layout = dict(gate_up_block=block, down_block=block, up_scale_base=s1.shape[1] // 2, up_row_shift=0)
    return shape, block, (gate_up.to(torch.bfloat16), down.to(torch.bfloat16)), (q1, s1, q2, s2), layout


def random_routes(tokens, shape, device, gen, count=ROUTINGS):
    """``count`` routings of ``tokens`` tokens: (ids, weights summing to 1) from random scores, top-k."""
    import torch

    routes = []
    for _ in range(count):
        weights, ids = torch.rand(tokens, shape["num_experts"], device=device, generator=gen).topk(shape["topk"], -1)
        routes.append((ids, weights / weights.sum(-1, keepdim=True)))
    return routes


def bench_experts(args, eager_ms, graph_ms, result, device, tokens):
    """The ``--experts`` section: FP8 vs bf16 fused experts of one MoE layer, one row per token count."""
    import torch
    from mla_fuser.kernels.fused_moe import (fused_experts, fused_experts_fp8, fused_experts_fp8_ref,
                                             fused_experts_fp8_triton, fused_experts_triton)
    from mla_fuser.kernels.fused_moe.fp8_launch import FP8_PREQUANT_MIN_TOKENS, choose_act_quant, choose_fp8_path
    from mla_fuser.kernels.fused_moe.configs import get_moe_config
    from mla_fuser.kernels.fused_moe.launch import _choose_path, gemv_down_max_tokens

    gen = torch.Generator(device=device).manual_seed(0)
    shape, block, (gate_up, down), (q1, s1, q2, s2), layout = expert_layer(args, device, gen)
    h, i, k = shape["hidden"], shape["inter"], shape["topk"]
    result.update(experts_shape=shape, experts_block=block, rows=[])
    per_expert = {"bf16": 3 * h * i * 2, "fp8": 3 * h * i + 4 * (s1[0].numel() + s2[0].numel())}
    for t in tokens:
        x = (torch.randn(t, h, device=device, generator=gen)).to(torch.bfloat16)
        routes = random_routes(t, shape, device, gen)
        ids, weights = routes[0]
        picked = sum(int(torch.unique(r[0]).numel()) for r in routes) / len(routes)
        ref = fused_experts_fp8_ref(x, q1, s1, q2, s2, ids, weights, **layout).float()
        # the ops as a model calls them (Triton on CUDA); the dry run calls the Triton launchers themselves
        bf16_op = fused_experts_triton if args.dry_run else fused_experts
        fp8_op = fused_experts_fp8_triton if args.dry_run else fused_experts_fp8
        variants = {"bf16": lambda i: bf16_op(x, gate_up, down, *routes[i]),
                    "fp8": lambda i: fp8_op(x, q1, s1, q2, s2, *routes[i], **layout)}
        if t <= gemv_down_max_tokens():
            variants["fp8_gemms"] = lambda i: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[i], **layout,
                                                                       decode_gemv=False)
        # the W8A8 GEMMs (activations quantised in the kernel, or by launches of their own before each GEMM) and the
        # weight-only ones, whichever "fp8" picks
        variants["fp8_w8a8"] = lambda i: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[i], **layout,
                                                                  act_quant=True, prequant=False)
        variants["fp8_w8a8_prequant"] = lambda i: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[i], **layout,
                                                                           act_quant=True, prequant=True)
        variants["fp8_weight_only"] = lambda i: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[i], **layout,
                                                                         act_quant=False)
        # the W8A8 GEMMs with their weight tiles by TMA (the same tiles, config key "W_TMA")
        tiles = get_moe_config(choose_fp8_path("auto", t, t * k), t, k, shape["num_experts"], fp8=True, hidden=h,
                               act_quant=True)
        tma = {g: dict(tiles[g], W_TMA=True) for g in ("gemm1", "gemm2")}
        variants["fp8_w8a8_tma"] = lambda i: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[i], **layout,
                                                                      act_quant=True, prequant=False, config=tma)
        variants["fp8_w8a8_prequant_tma"] = lambda i: fused_experts_fp8_triton(
            x, q1, s1, q2, s2, *routes[i], **layout, act_quant=True, prequant=True, config=tma)
        # fp16 activations: the weight-only GEMMs widen e4m3 to the activations' dtype, which for fp16 is one
        # cvt.rn.f16x2.e4m3x2 per two weights, where bf16 adds a cvt.bf16.f16 per weight (what decode-time FP8
        # costs in conversions, not bytes)
        xh = x.half()
        variants["fp8_f16act"] = lambda i: fp8_op(xh, q1, s1, q2, s2, *routes[i], **layout)
        if t <= gemv_down_max_tokens():
            variants["fp8_gemms_f16act"] = lambda i: fused_experts_fp8_triton(xh, q1, s1, q2, s2, *routes[i],
                                                                              **layout, decode_gemv=False)
        row = {"tokens": t, "experts_picked": picked, "path": _choose_path("auto", t, t * k),
               "fp8_path": choose_fp8_path("auto", t, t * k),
               "fp8_act_quant": choose_act_quant(x, t, layout["gate_up_block"], layout["down_block"]),
               "fp8_prequant_min_tokens": FP8_PREQUANT_MIN_TOKENS}
        for label, fn in variants.items():
            try:
                out = fn(0).float()
                row[f"{label}_rel_err_vs_fp8_ref"] = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                row[f"{label}_eager_ms"] = eager_ms(fn)
                ms = row[f"{label}_ms"] = graph_ms(fn, ROUTINGS, ROUTINGS) if device == "cuda" else row[
                    f"{label}_eager_ms"]
                row[f"{label}_weight_GBps"] = picked * per_expert[label.split("_")[0]] / ms / 1e6
                row[f"{label}_TFLOPs"] = 2 * t * k * 3 * h * i / ms / 1e9
                if "copy_GBps" in result:
                    row[f"{label}_frac_of_copy"] = row[f"{label}_weight_GBps"] / result["copy_GBps"]
            except Exception as exc:  # record and go on
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
        for label in ("fp8", "fp8_gemms", "fp8_w8a8", "fp8_w8a8_prequant", "fp8_weight_only", "fp8_f16act",
                      "fp8_gemms_f16act", "fp8_w8a8_tma", "fp8_w8a8_prequant_tma"):
            if f"{label}_ms" in row and "bf16_ms" in row:
                row[f"{label}_speedup_vs_bf16"] = row["bf16_ms"] / row[f"{label}_ms"]
        result["rows"].append(row)
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
    return result


# ----------------------------------------------------------------------------------------------------------------
# timing


def make_timers(args, device):
    """``(eager_ms(fn), graph_ms(fn, copies, calls, rep))``; ``fn(i)`` runs one call on weight copy ``i``."""
    import torch
    import triton

    def eager_ms(fn, rep=None):
        if device == "cpu":  # dry run: one warm call, one timed call
            fn(0)
            start = time.perf_counter()
            fn(0)
            return (time.perf_counter() - start) * 1e3
        return triton.testing.do_bench(lambda: fn(0), warmup=10, rep=rep or args.rep, return_mode="median")

    def graph_ms(fn, copies, calls, rep=None):
        """GPU time per call: ``calls`` calls cycling through ``copies`` weights, captured in one CUDA graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (compiles, allocator pools)
            for i in range(copies):
                fn(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % copies)
        try:
            return triton.testing.do_bench(graph.replay, warmup=5, rep=rep or args.rep, return_mode="median") / calls
        finally:
            del graph

    return eager_ms, graph_ms


def weight_copies(weight_bytes, l2_bytes):
    """Copies of a weight to cycle through in one graph so that none is re-read from L2: all distinct, or enough
    that the bytes read between two reads of one copy are twice the L2."""
    return max(1, min(MAX_CALLS_PER_GRAPH, -(-2 * l2_bytes // weight_bytes)))


def calls_per_graph(eager_ms):
    """Calls per graph: ~``GRAPH_TARGET_MS`` of work (the eager time bounds the GPU time from above)."""
    return max(1, min(MAX_CALLS_PER_GRAPH, int(GRAPH_TARGET_MS / max(eager_ms, 1e-6))))


def quantised_copies(n, k, block, copies, device, gen):
    """``copies`` random weights ``[N, K]`` (normal, 0.02) as ``(fp8, scale, bf16)``; the first is the one checked
    against the reference."""
    import torch
    from mla_fuser.kernels.fp8 import quantize_block_fp8

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=device, generator=gen) * 0.02
        out.append((*quantize_block_fp8(w, block), w.to(torch.bfloat16)))
        del w
    return out


# ----------------------------------------------------------------------------------------------------------------
# sweep


def w8_grid(tokens, dry_run):
    """Weight-only candidates at ``tokens``: MMA tiles (rows padded to 16) and, for 1-4 tokens, GEMV tiles; each
    with split-K fills 0 (none), 1, 2, 4 programs per SM."""
    from mla_fuser.kernels.fp8.linear import W8Config

    if dry_run:
        return [W8Config(16, 16, 16, 4, 2, 0), W8Config(16, 32, 16, 4, 2, 2), W8Config(1, 16, 16, 4, 1, 0, False)]
    grid = []
    block_ms = (16,) if tokens <= 16 else (16, 32, 64)
    widths = (16, 32, 64, 128) if tokens <= 16 else (64, 128)
    for bm in block_ms:
        for bn in widths:
            for warps in (4, 8):
                if warps == 8 and bm * bn < 16 * 64:
                    continue
                for stages in (3, 4, 5) if tokens <= 16 else (3, 4):
                    grid += [W8Config(bm, bn, 128, warps, stages, fill) for fill in (0, 1, 2, 4)]
    if tokens <= 4:
        bm = 1 << (tokens - 1).bit_length()
        for bn in (8, 16, 32):
            for warps in (2, 4):
                for stages in (1, 3):
                    grid += [W8Config(bm, bn, 128, warps, stages, fill, False) for fill in (0, 1, 2, 4)]
    return grid


def tc_grid(tokens, dry_run):
    """FP8 tensor-core candidates at ``tokens``, each with its tiles loaded from pointers and by TMA.  Tiles with more
    than 64 accumulator elements per thread are left out: each K tile's product and the accumulator are both live
    (the scales apply between them), so 128x128 on 4 warps or 128x256 on 8 spill (checked by compiling for sm_90,
    by TMA too)."""
    from mla_fuser.kernels.fp8.linear import TCConfig

    if dry_run:
        return [TCConfig(16, 16, 16, 2, 4, 2), TCConfig(16, 32, 32, 2, 4, 2, tma=True)]
    grid = []
    block_ms = (64,) if tokens <= 64 else (64, 128)
    widths = (64, 128) if tokens <= 512 else (128, 256)
    for bm in block_ms:
        for bn in widths:
            for warps in (4, 8):
                if bm * bn > 64 * 32 * warps:
                    continue
                for stages in (3, 4) if tokens <= 512 else (3, 4, 5):
                    grid += [TCConfig(bm, bn, 128, 8, warps, stages, tma=tma) for tma in (False, True)]
    return grid


def _config_row(max_tokens, config):
    fields = ", ".join(f"{k}={v!r}" for k, v in config._asdict().items())
    return f"({max_tokens}, None, {type(config).__name__}({fields})),"


def suggest_tables(records):
    """Per (path, T): the config with the best geometric-mean time over the shapes (those it ran on all of),
    with its ratio to each shape's best, as table rows."""
    import math

    by_key = {}
    for r in records:
        if "ms" in r:
            by_key.setdefault((r["path"], r["tokens"]), []).append(r)
    tables = {"W8_CONFIGS": [], "TC_CONFIGS": []}  # (rows in token order: the keys sort by path, then T)
    for (path, tokens), recs in sorted(by_key.items()):
        shapes = sorted({r["shape"] for r in recs})
        best = {sh: min(r["ms"] for r in recs if r["shape"] == sh) for sh in shapes}
        per_config = {}
        for r in recs:
            per_config.setdefault(r["config_obj"], {})[r["shape"]] = r["ms"] / best[r["shape"]]
        complete = {c: v for c, v in per_config.items() if len(v) == len(shapes)}
        if not complete:
            continue
        config, ratios = min(complete.items(), key=lambda kv: sum(math.log(x) for x in kv[1].values()))
        geo = math.exp(sum(math.log(x) for x in ratios.values()) / len(ratios))
        worst = max(ratios, key=ratios.get)
        note = f"T={tokens}: {geo:.3f}x the per-shape bests (geo-mean), worst {ratios[worst]:.3f}x on {worst}"
        table = "W8_CONFIGS" if path == "weight_only" else "TC_CONFIGS"
        tables[table].append(dict(tokens=tokens, config=config._asdict(), geo_mean_vs_best=geo, vs_best=ratios,
                                  note=note, row=_config_row(tokens, config)))
    if tables["TC_CONFIGS"]:  # the largest T's config serves every larger T
        last = tables["TC_CONFIGS"][-1]
        last["row"] = last["row"].replace(f"({last['tokens']}, None, ", "(None, None, ", 1)
    return tables


def run_sweep(args, result, device, eager_ms, graph_ms, log):
    """The ``--sweep`` section: every config of the grids per (shape, T), the bests, the suggested tables."""
    import torch
    from mla_fuser.kernels.dispatch import cdiv
    from mla_fuser.kernels.fp8 import block_fp8_linear_ref
    from mla_fuser.kernels.fp8 import linear as fp8_linear

    dry = args.dry_run
    names = list(TINY_SHAPES) if dry else [s for s in args.sweep_shapes.split(",") if s]
    tokens = [1, 3] if dry else [int(t) for t in args.sweep_tokens.split(",")]
    block = (32, 64) if dry else (128, 128)
    has_tc = dry or torch.cuda.get_device_capability() >= (8, 9)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) if device == "cuda" else 0
    gen = torch.Generator(device=device).manual_seed(0)
    dev_index = torch.cuda.current_device() if device == "cuda" else None

    def paths(t):
        out = []
        if dry or t <= W8_SWEEP_MAX_TOKENS:
            out += [("weight_only", cfg) for cfg in w8_grid(t, dry)]
        if has_tc and (dry or t >= TC_SWEEP_MIN_TOKENS):
            out += [("fp8_tc", cfg) for cfg in tc_grid(t, dry)]
        return out

    def call(path, cfg, x, wq, ws, warmup=False):
        if path == "weight_only":
            return fp8_linear.w8_linear_triton(x, wq, ws, None, *block, config=cfg, warmup=warmup)
        return fp8_linear.fp8_linear_triton(x, wq, ws, None, *block, config=cfg, warmup=warmup)

    all_shapes = TINY_SHAPES if dry else SHAPES
    if device == "cuda":  # every kernel of the grid, compiled once per specialisation, in threads
        jobs = {}
        for name in names:
            n, k = all_shapes[name]
            # (what a launch specialises on besides the constexprs: ints equal to 1 or divisible by 16)
            spec = (n % 16 == 0, k % 16 == 0, cdiv(k, block[1]) % 16 == 0)
            wq = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)  # (values do not matter to a compile)
            ws = torch.ones(cdiv(n, block[0]), cdiv(k, block[1]), device=device)
            for t in tokens:
                x = torch.empty(t, k, dtype=torch.bfloat16, device=device)
                for p, c in paths(t):
                    key = (spec, t == 1, p, c)
                    if p == "weight_only":  # fills differ only in the split count: 1 or not is what compiles
                        plan = fp8_linear.w8_plan(t, n, k, *block, x.dtype, False, False, dev_index, c)
                        key = (spec, t == 1, p, c._replace(fill=0), plan.splits > 1)
                    jobs.setdefault(key, lambda p=p, c=c, x=x, wq=wq, ws=ws: call(p, c, x, wq, ws, warmup=True))
        from bench_fused_moe import precompile  # (the same thread pool as the fused-MoE sweep's)

        precompile(list(jobs.values()), log)
        del jobs
        torch.cuda.empty_cache()

    records, best_rows = [], []
    started = time.perf_counter()
    for name in names:
        n, k = all_shapes[name]
        copies = weight_copies(n * k, l2) if device == "cuda" else 1
        weights = quantised_copies(n, k, block, copies, device, gen)
        bf16_copies = weight_copies(2 * n * k, l2) if device == "cuda" else 1
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            ref = block_fp8_linear_ref(x, weights[0][0], weights[0][1], *block).float()
            calls = MAX_CALLS_PER_GRAPH if t <= W8_SWEEP_MAX_TOKENS else max(1, int(8192 / t))

            def timed(fn, n_copies):
                return graph_ms(fn, n_copies, calls, args.sweep_rep) if device == "cuda" else eager_ms(fn)

            bf16_ms = timed(lambda i: torch.mm(x, weights[i][2].T), bf16_copies)
            seen = {}  # (path, config without fill, splits) -> ms: fills that give the same split are one launch
            for path, cfg in paths(t):
                rec = dict(shape=name, N=n, K=k, tokens=t, path=path, config=cfg._asdict(), config_obj=cfg)
                try:
                    if path == "weight_only":
                        plan = fp8_linear.w8_plan(t, n, k, *block, x.dtype, False, fp8_linear.triton_interpreting(),
                                                  dev_index, cfg)
                        rec["splits"] = plan.splits
                        key = (path, cfg._replace(fill=0), plan.splits)
                    else:
                        key = (path, cfg, 1)
                    if key not in seen:
                        out = call(path, cfg, x, weights[0][0], weights[0][1]).float()
                        err = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                        if not err <= MAX_REL_ERR[path]:
                            raise AssertionError(f"wrong result: rel_err {err:.3g}")
                        seen[key] = (timed(lambda i: call(path, cfg, x, weights[i][0], weights[i][1]), copies), err)
                    rec["ms"], rec["rel_err"] = seen[key]
                except Exception as exc:  # out of shared memory, registers, ...: recorded, the sweep goes on
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                records.append(rec)
            for path in ("weight_only", "fp8_tc"):
                done = [r for r in records if r["shape"] == name and r["tokens"] == t and r["path"] == path
                        and "ms" in r]
                if done:
                    top = min(done, key=lambda r: r["ms"])
                    row = dict(shape=name, tokens=t, path=path, config=top["config"], splits=top.get("splits"),
                               ms=top["ms"], bf16_ms=bf16_ms, speedup_vs_bf16=bf16_ms / top["ms"],
                               weight_frac_of_copy=(n * k / top["ms"] / 1e6 / result["copy_GBps"]
                                                    if "copy_GBps" in result else None),
                               configs_ok=len(done))
                    best_rows.append(row)
                    log(f"[{time.perf_counter() - started:6.1f}s] {name} T={t} {path}: best {top['ms'] * 1e3:.1f} us "
                        f"(bf16 {bf16_ms * 1e3:.1f} us, {row['speedup_vs_bf16']:.2f}x) {top['config']} "
                        f"splits={top.get('splits')} ({len(done)} ok)")
                    if path == "fp8_tc":  # the best of each way of loading tiles, beside each other
                        for tma in (False, True):
                            own = [r for r in done if r["config"].get("tma") == tma]
                            if own:
                                best = min(own, key=lambda r: r["ms"])
                                row[f"best_ms_tma_{tma}"] = best["ms"]
                                log(f"    tiles {'by TMA' if tma else 'from pointers'}: {best['ms'] * 1e3:.1f} us "
                                    f"({bf16_ms / best['ms']:.2f}x bf16) {best['config']}")
            x = ref = None  # (freed before the next size; not del: the timed lambdas close over these names)
        weights = None
        if device == "cuda":
            torch.cuda.empty_cache()
    tables = suggest_tables(records)
    for r in records:
        del r["config_obj"]
    threshold = {}
    for r in best_rows:
        threshold.setdefault((r["shape"], r["tokens"]), {})[r["path"]] = r["ms"]
    paths_compared = [dict(shape=sh, tokens=t, **v) for (sh, t), v in threshold.items() if len(v) == 2]
    result["sweep"] = dict(records=records, best=best_rows, both_paths=paths_compared, suggested_tables=tables)
    log("\nsuggested table rows (mla_fuser/kernels/fp8/linear.py; keep an unbounded last row in each):")
    for table, rows in tables.items():
        log(f"{table} = (")
        for row in rows:
            log(f"    # {row['note']}\n    {row['row']}")
        log(")")
    for c in paths_compared:
        log(f"both paths at T={c['tokens']} on {c['shape']}: weight-only {c['weight_only'] * 1e3:.1f} us, "
            f"FP8 tensor cores {c['fp8_tc'] * 1e3:.1f} us")
    return result


# ----------------------------------------------------------------------------------------------------------------
# the GEMM rows


GEMV_SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (4, 8, 16) for bk in (256, 512, 1024)
              for w in (4, 8)]
GEMV_SWEEP_SHAPES = ("v2lite.q_proj", "v2lite.kv_a_proj", "v2lite.o_proj", "v2lite.shared.gate_up",
                     "v2lite.shared.down", "v3.mlp.gate_up", "v3.mlp.down")


def run_gemv_sweep(args, result, device, graph_ms, tokens):
    """``--gemv-sweep``: every ``GEMV_SWEEP`` tile of the linear decode GEMV (per shape) and of the experts' two
    decode GEMVs (one V2-Lite MoE layer, both GEMVs on one tile), GPU time as ``*_ms`` of the default section; the
    best tile per row and the tile with the best geometric-mean time overall."""
    import math

    import torch
    from mla_fuser.kernels.fp8 import block_fp8_linear_ref
    from mla_fuser.kernels.fp8 import linear as fp8_linear
    from mla_fuser.kernels.fused_moe import fused_experts_fp8_ref, fused_experts_fp8_triton

    block = tuple(result["block"])
    grid = GEMV_SWEEP[:2] if args.dry_run else GEMV_SWEEP
    shapes = TINY_SHAPES if args.dry_run else {k: v for k, v in {**SHAPES, **EXTRA_SHAPES}.items()
                                               if k in GEMV_SWEEP_SHAPES}
    timer = graph_ms if device == "cuda" else (lambda fn, copies, calls, rep: 0.0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) if device == "cuda" else 0
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for name, (n, k) in shapes.items():
        copies = weight_copies(n * k, l2) if l2 else 1
        weights = quantised_copies(n, k, block, copies, device, gen)
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            ref = block_fp8_linear_ref(x, *weights[0][:2], *block).float()
            for cfg in grid:
                conf = fp8_linear.GEMVConfig(cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"])
                fn = (lambda i, c=conf: fp8_linear.w8_gemv_triton(x, *weights[i][:2], None, *block, config=c))
                err = float((fn(0).float() - ref).abs().max() / ref.abs().max())
                records.append(dict(kind="linear", shape=name, tokens=t, **cfg, rel_err=err,
                                    ms=timer(fn, copies, min(copies * 2, MAX_CALLS_PER_GRAPH), args.sweep_rep)))
        weights = None  # (freed before the next shape's copies are made)
    shape, _, _, (q1, s1, q2, s2), layout = expert_layer(args, device, gen)
    for t in tokens:
        x = torch.randn(t, shape["hidden"], device=device, generator=gen).to(torch.bfloat16)
        routes = random_routes(t, shape, device, gen)
        ref = fused_experts_fp8_ref(x, q1, s1, q2, s2, *routes[0], **layout).float()
        for cfg in grid:
            conf = {"fp8_gemv1": cfg, "fp8_gemv2": cfg}
            fn = (lambda j, c=conf: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[j], **layout, config=c))
            err = float((fn(0).float() - ref).abs().max() / ref.abs().max())
            records.append(dict(kind="experts", shape="v2lite.experts", tokens=t, **cfg, rel_err=err,
                                ms=timer(fn, ROUTINGS, ROUTINGS, args.sweep_rep)))
    best, by_cfg = {}, {}
    for r in records:
        key = (r["kind"], r["shape"], r["tokens"])
        if r["rel_err"] < MAX_REL_ERR["weight_only"] and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    for r in records:
        cfg = (r["kind"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"])
        by_cfg.setdefault(cfg, []).append(r["ms"] / max(best[(r["kind"], r["shape"], r["tokens"])]["ms"], 1e-12))
    overall = {}
    for (kind, *cfg), ratios in by_cfg.items():
        geo = math.exp(sum(math.log(max(v, 1e-12)) for v in ratios) / len(ratios))
        if kind not in overall or geo < overall[kind]["geomean_vs_best"]:
            overall[kind] = dict(BLOCK_N=cfg[0], BLOCK_K=cfg[1], num_warps=cfg[2], geomean_vs_best=geo,
                                 worst_vs_best=max(ratios))
    result["gemv_sweep"] = dict(records=records, best=list(best.values()), best_overall=overall)
    for r in best.values():
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    print("best overall:", json.dumps(overall), flush=True)


EXPERTS_SWEEP = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=st)
                 for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8) for st in (3, 4, 5)]
# the W8A8 GEMMs' tiles (--experts-sweep-act-quant): K tiles are the quantisation block's bk; the transposed product
# takes at least 64 weight columns per warp group
EXPERTS_W8A8_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=w, num_stages=st)
                      for bm in (16, 32) for bn in (64, 128, 256) for w in (4, 8) for st in (3, 4, 6)
                      if bn >= 64 * w // 4]
# ... and at prefill sizes (above 32 pairs per expert, as configs.default_w8a8_config): more pairs per tile, grouped
# row tiles
EXPERTS_W8A8_PREFILL_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=gm, num_warps=w, num_stages=st)
                              for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8) for st in (3, 4)
                              for gm in (8,) if bn >= 64 * w // 4]


def run_experts_sweep(args, result, device, graph_ms, tokens):
    """``--experts-sweep``: the FP8 experts of one V2-Lite MoE layer at decode batch sizes above the GEMVs' (8, 16
    tokens): every ``EXPERTS_SWEEP`` tile for both GEMMs of one path (``--experts-sweep-path``), and the other path
    with its default tiles, GPU time as ``--experts``; the best tile per size."""
    import torch
    from mla_fuser.kernels.fused_moe import fused_experts_fp8_ref, fused_experts_fp8_triton

    from mla_fuser.kernels.fused_moe.configs import W8A8_DECODE_MAX_PAIRS

    act_quant = args.experts_sweep_act_quant
    layer = TINY_EXPERTS if args.dry_run else EXPERTS

    def tiles(t):
        prefill = t * layer["topk"] / layer["num_experts"] > W8A8_DECODE_MAX_PAIRS
        full = EXPERTS_SWEEP if not act_quant else (EXPERTS_W8A8_PREFILL_SWEEP if prefill else EXPERTS_W8A8_SWEEP)
        return [dict(c, BLOCK_K=16) for c in full[:2]] if args.dry_run else full

    gen = torch.Generator(device=device).manual_seed(0)
    shape, _, _, (q1, s1, q2, s2), layout = expert_layer(args, device, gen)
    timer = graph_ms if device == "cuda" else (lambda fn, copies, calls, rep: 0.0)
    records = []
    for t in tokens:
        x = torch.randn(t, shape["hidden"], device=device, generator=gen).to(torch.bfloat16)
        routes = random_routes(t, shape, device, gen)
        ref = fused_experts_fp8_ref(x, q1, s1, q2, s2, *routes[0], **layout, act_quant=act_quant).float()
        swept = args.experts_sweep_path
        other = "aligned" if swept == "small" else "small"
        runs = [(swept, cfg, {"gemm1": cfg, "gemm2": cfg}) for cfg in tiles(t)] + [(other, None, None),
                                                                                    (swept, None, None)]
        for path, cfg, conf in runs:
            fn = (lambda j, p=path, c=conf: fused_experts_fp8_triton(x, q1, s1, q2, s2, *routes[j], **layout, path=p,
                                                                     config=c, act_quant=act_quant))
            try:
                err = float((fn(0).float() - ref).abs().max() / ref.abs().max())
                records.append(dict(tokens=t, path=path, **(cfg or {}), rel_err=err,
                                    ms=timer(fn, ROUTINGS, ROUTINGS, args.sweep_rep)))
            except Exception as exc:  # (a tile that needs more shared memory than the GPU has): record, go on
                records.append(dict(tokens=t, path=path, **(cfg or {}), error=f"{type(exc).__name__}: {exc}"[:300]))
    best = {}
    for r in records:
        if "error" in r:
            continue
        if r["rel_err"] < MAX_REL_ERR["weight_only"] and (r["tokens"] not in best or r["ms"] < best[r["tokens"]]["ms"]):
            best[r["tokens"]] = r
    result["experts_sweep"] = dict(records=records, best=list(best.values()))
    for r in records:
        if "BLOCK_N" not in r or r is best.get(r["tokens"]):  # the default tiles of both paths, and the best
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)


def bench_gemms(args, result, device, shapes, tokens, eager_ms, graph_ms):
    """The default section: each variant at each (shape, T), GPU and eager times."""
    import torch
    from mla_fuser.kernels.fp8 import block_fp8_linear, block_fp8_linear_ref
    from mla_fuser.kernels.fp8 import linear as fp8_linear

    block = tuple(result["block"])
    has_tc = device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) if device == "cuda" else 0
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        n_copies = {"fp8": weight_copies(n * k, l2), "bf16": weight_copies(2 * n * k, l2)} if l2 else \
            {"fp8": 1, "bf16": 1}
        weights = quantised_copies(n, k, block, n_copies["fp8"], device, gen)
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            wq, ws, _ = weights[0]
            ref = block_fp8_linear_ref(x, wq, ws, *block).float()
            variants = {"bf16_mm": lambda i: torch.mm(x, weights[i][2].T),
                        "weight_only": lambda i: fp8_linear.w8_linear_triton(x, *weights[i][:2], None, *block),
                        "auto": lambda i: block_fp8_linear(x, *weights[i][:2], block)}
            if t <= fp8_linear.GEMV_MAX_TOKENS:
                variants["gemv"] = lambda i: fp8_linear.w8_gemv_triton(x, *weights[i][:2], None, *block)
            if has_tc:
                variants["fp8_tc"] = lambda i: fp8_linear.fp8_linear_triton(x, *weights[i][:2], None, *block)
            if has_tc and t < fp8_linear.FP8_TENSOR_CORE_MIN_TOKENS:
                # the split-K GEMM's W8A8 variant (activations quantised in the kernel) with its table's tile for t
                # tokens, K tiles of bk, whether or not choose_path takes it ("auto_path" says)
                w8a8 = fp8_linear.table_config(fp8_linear.W8A8_CONFIGS, t, n * k)._replace(block_k=block[1])
                variants["w8a8"] = lambda i, c=w8a8: fp8_linear.w8_linear_triton(x, *weights[i][:2], None, *block,
                                                                                config=c)
            # the same GEMMs with the same tiles, their weight tiles (and the tensor-core GEMM's activation tiles) by
            # TMA
            bk = fp8_linear.pow2_divisor(block[1], 128)  # (the tables' K tile capped as their launches cap it)
            w8 = fp8_linear.table_config(fp8_linear.W8_CONFIGS, t, n * k)
            w8 = w8._replace(tma=True, block_k=min(w8.block_k, bk))
            variants["weight_only_tma"] = lambda i, c=w8: fp8_linear.w8_linear_triton(x, *weights[i][:2], None, *block,
                                                                                     config=c)
            if "fp8_tc" in variants:
                tc = fp8_linear.table_config(fp8_linear.TC_CONFIGS, t, n * k)
                tc = tc._replace(tma=True, block_k=min(tc.block_k, bk))
                variants["fp8_tc_tma"] = lambda i, c=tc: fp8_linear.fp8_linear_triton(x, *weights[i][:2], None, *block,
                                                                                     config=c)
            if "w8a8" in variants:
                variants["w8a8_tma"] = lambda i, c=w8a8._replace(tma=True): fp8_linear.w8_linear_triton(
                    x, *weights[i][:2], None, *block, config=c)
            row = {"shape": name, "N": n, "K": k, "tokens": t, "auto_path": fp8_linear.choose_path(t, x, n, k, *block)}
            for label, fn in variants.items():
                try:
                    out = fn(0).float()
                    row[f"{label}_rel_err"] = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                    row[f"{label}_eager_ms"] = eager_ms(fn)
                    if device == "cuda":
                        calls = calls_per_graph(row[f"{label}_eager_ms"])
                        copies = min(calls, n_copies["bf16" if label == "bf16_mm" else "fp8"])
                        row[f"{label}_ms"] = graph_ms(fn, copies, calls)
                        row[f"{label}_graph_calls"] = calls
                    ms = row.get(f"{label}_ms", row[f"{label}_eager_ms"])
                    weight_bytes = n * k * (2 if label == "bf16_mm" else 1)
                    row[f"{label}_weight_GBps"] = weight_bytes / ms / 1e6
                    row[f"{label}_TFLOPs"] = 2 * t * n * k / ms / 1e9
                except Exception as exc:  # record and go on: one run on the GPU must give every other number
                    row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                    traceback.print_exc()
            for label in ("weight_only", "gemv", "fp8_tc", "w8a8", "auto", "weight_only_tma", "fp8_tc_tma", "w8a8_tma"):
                for kind in ("", "eager_"):
                    if f"{label}_{kind}ms" in row and f"bf16_mm_{kind}ms" in row:
                        row[f"{label}_{kind}speedup_vs_bf16"] = row[f"bf16_mm_{kind}ms"] / row[f"{label}_{kind}ms"]
                if "copy_GBps" in result and f"{label}_weight_GBps" in row:
                    row[f"{label}_frac_of_copy"] = row[f"{label}_weight_GBps"] / result["copy_GBps"]
            result["rows"].append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            x = ref = None  # (freed before the next size; not del: the timed lambdas close over these names)
        weights = None
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        # set before torch/triton import: the interpreter flag is read when kernels are wrapped (this is a script,
        # not the library, so setting the process environment here is its own business)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    import torch
    import triton
    from mla_fuser.kernels.fp8 import linear as fp8_linear

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on a CPU")
    tokens = [1, 3] if args.dry_run else [int(t) for t in args.tokens.split(",")]
    shapes = TINY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in {**shapes, **EXTRA_SHAPES}.items() if k in args.shapes.split(",")}
    block = (32, 64) if args.dry_run else (128, 128)
    eager_ms, graph_ms = make_timers(args, device)

    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "block": block,
              "tensor_core_min_tokens": fp8_linear.FP8_TENSOR_CORE_MIN_TOKENS, "dry_run": args.dry_run,
              "timing": ("*_ms: CUDA-graph replay / calls (GPU time); *_eager_ms: one eager call per do_bench run"
                         if device == "cuda" else "dry run: *_eager_ms only (one interpreted call)"),
              "rows": []}
    if device == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=args.rep, return_mode="median")
        result["copy_GBps"] = 2 * src.numel() / ms / 1e6
        del src, dst
        print(f"copy bandwidth {result['copy_GBps']:.0f} GB/s", flush=True)
    if args.experts_sweep:
        run_experts_sweep(args, result, device, graph_ms,
                          [3] if args.dry_run else [int(t) for t in args.experts_sweep_tokens.split(",")])
    elif args.gemv_sweep:
        run_gemv_sweep(args, result, device, graph_ms, [1, 3] if args.dry_run else [1, 4])
    elif args.sweep:
        run_sweep(args, result, device, eager_ms, graph_ms, lambda msg: print(msg, flush=True))
    elif args.experts:
        bench_experts(args, eager_ms, graph_ms, result, device, [1, 5] if args.dry_run else tokens)
    else:
        bench_gemms(args, result, device, shapes, tokens, eager_ms, graph_ms)
    sweep_kind = args.experts_sweep_path + ("_w8a8" if args.experts_sweep_act_quant else "")
    stem = (f"fp8_experts_sweep_{sweep_kind}.json" if args.experts_sweep
            else "fp8_gemv_sweep.json" if args.gemv_sweep else "fp8_experts.json" if args.experts
            else "fp8_gemm_sweep.json" if args.sweep else "fp8_gemm.json")
    out = args.out or (os.path.join(tempfile.mkdtemp(), stem) if args.dry_run
                       else os.path.join(ROOT, "benchmarks", "results", stem))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
