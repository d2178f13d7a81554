"""Benchmark the paged MLA decode kernel (``mla_fuser.kernels.mla_decode``) on a GPU.

Setting: bf16, page size 64, D = 576 (kv_lora_rank 512 + rope 64), full-length sequences whose
pages are scattered randomly over the cache (shuffled block tables), heads H in {16, 128} and
B x L in {64x8192, 128x4096, 16x32768, 1x32768}.

Reported per case:
* time: median of ``triton.testing.do_bench`` (which warms up and flushes L2 between runs, so
  B=1 L=32768, 38 MB, is not served from the 60 MB L2), or of CUDA-graph replays with
  ``--cuda-graph`` (removes the Python/launch overhead of the two kernels);
* GB/s = B*L*576*2 / time (the cache bytes; q/out are negligible), and its ratio to the measured
  device copy bandwidth (a large ``copy_``, counting bytes read + written);
* TFLOP/s = 2*B*H*L*(576+512) / time (QK^T over 576 dims + PV over 512).
Targets (from the project brief): >= 3400 GB/s at H=16 for the three large shapes, >= 2000 GB/s at
B=1 L=32768, >= 300 TFLOP/s at H=128.

``--tma-ab`` runs the main rows on ``mla_decode_tma``'s kernel (whatever ``MLA_FUSER_DECODE_TMA`` says; without
``--tma-ab`` the setting decides, on by default) and times every case again with it off (``mla_decode``'s own kernel
and tiles), in the same run; the correctness check runs on it too and says FAIL where it is wrong.

Also: a correctness check against ``mla_decode_ref`` (fp32) on a ragged batch, ``--num-splits`` to
force the split count, ``--sweep`` to time a grid of tile configs (BLOCK_H, BLOCK_N, num_warps,
num_stages) and ``--sweep-splits`` to time split counts, so one GPU call can pick the best config.
Everything lands in a JSON file (``--out``).

``--fp8-cache`` also times, in the same run and on the same latent quantised per token, ``mla_decode_fp8`` over an
FP8 cache (``PagedLatentCache(dtype=torch.float8_e4m3fn)``: 592-byte rows, ``kernels.latent_fp8``) and reports its
speedup over the bf16 kernel (issue 15's target: >= 1.8x at H=16 B=64 L=8192) and its error against the fp32
reference of the unquantised latent; with ``--sweep`` it also times ``fp8_sweep_configs(H)`` (the FP8 kernel's own
tiles and variants, each checked against the kernel's torch twin) and records the fastest correct one as
``fp8_cache.sweep_best`` (``--sweep-fp8-only`` skips the bf16 tile sweep; ``--fp8-config`` forces one FP8 config).
Its GB/s count the FP8 rows' bytes.  Default output: ``benchmarks/results/mla_decode_fp8_cache.json``.  Typical calls::

    python benchmarks/bench_mla_decode_kernel.py --fp8-cache --heads 16 --shapes 64x8192
    python benchmarks/bench_mla_decode_kernel.py --fp8-cache --sweep --sweep-fp8-only --no-check --no-eager \
        --heads 16,128 --shapes 64x8192,1x32768 --sweep-shapes 64x8192 --out fp8_sweep.json

``--dry-run`` runs the whole flow on CPU under Triton's interpreter with tiny shapes (seconds), to
check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SHAPES = "64x8192,128x4096,16x32768,1x32768"
R, ROPE, PAGE = 512, 64, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", default="16,128", help="comma list of head counts")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxL")
    p.add_argument("--page-size", type=int, default=PAGE)
    p.add_argument("--num-splits", type=int, default=None, help="force the KV split count (default: auto)")
    p.add_argument("--config", default=None,
                   help="force a tile config: BLOCK_H,BLOCK_N,num_warps,num_stages[,swap_ab 0/1[,ctas_per_sm]]")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per case")
    p.add_argument("--sweep-splits", action="store_true", help="also time several split counts per case")
    p.add_argument("--sweep-joint", action="store_true",
                   help="with --sweep: time every swept config at several split counts too (small-shape tuning; "
                        "adds narrower and lighter tiles for H <= 16)")
    p.add_argument("--sweep-max-configs", type=int, default=0, help="cap the configs swept per H (0: all)")
    p.add_argument("--sweep-shapes", default=None, help="comma list of BxL to sweep on (default: all shapes)")
    p.add_argument("--tma-ab", action="store_true",
                   help="main rows on mla_decode_tma's kernel, each case again with it off (mla_decode's own)")
    p.add_argument("--no-eager", action="store_true", help="skip the do_bench (eager) timing of the main rows")
    p.add_argument("--graph-replays", type=int, default=15, help="CUDA-graph replays per timing")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mla_decode_kernel.json; "
                   "a dry run defaults to a temp file so it never overwrites GPU results)")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--fp8-cache", action="store_true",
                   help="also time mla_decode_fp8 over an FP8 (e4m3, per-token scales) cache, vs bf16 in the same run")
    p.add_argument("--sweep-fp8-only", action="store_true",
                   help="with --fp8-cache --sweep: sweep the FP8 kernel's configs only, not the bf16 kernel's")
    p.add_argument("--fp8-config", default=None,
                   help="force the FP8 kernel's config: BLOCK_H,BLOCK_N,num_warps,num_stages,ctas_per_sm,v_split,"
                        "shared_cvt 0/1,f16_dots 0/1")
    args = p.parse_args(argv)
    if args.out is None:
        name = "mla_decode_fp8_cache" if args.fp8_cache else "mla_decode_kernel"
        args.out = (
            os.path.join(tempfile.gettempdir(), f"{name}_dryrun.json")
            if args.dry_run
            else os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
        )
    args.heads = [int(h) for h in args.heads.split(",") if h]
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    if args.sweep_shapes:
        args.sweep_shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sweep_shapes.split(",") if s]
    if args.config:
        parts = [int(x) for x in args.config.split(",")]
        if not 4 <= len(parts) <= 6:
            p.error("--config needs BLOCK_H,BLOCK_N,num_warps,num_stages[,swap_ab[,ctas_per_sm]]")
        args.config = parts
    if args.fp8_config:
        parts = [int(x) for x in args.fp8_config.split(",")]
        if len(parts) != 8:
            p.error("--fp8-config needs BLOCK_H,BLOCK_N,num_warps,num_stages,ctas_per_sm,v_split,shared_cvt,f16_dots")
        args.fp8_config = parts
    return args


def small_shape_configs():
    """Extra H <= 16 candidates for ``--sweep-joint``: narrower tiles, fewer warps and more programs per SM, for
    shapes where each program has one or two tiles (16x1024, 1x32k) and launch and tail latency dominate."""
    from mla_fuser.kernels.mla_decode import MLADecodeConfig as C

    return [C(16, 32, 4, 2, False, 3), C(16, 32, 2, 2, False, 4), C(16, 64, 4, 1, False, 2), C(16, 32, 4, 3, False, 2),
            C(16, 16, 2, 2, False, 4), C(16, 64, 4, 3, False, 2)]


def sweep_configs(H):
    """Candidate tile configs (a few dozen: each costs a compile).  Shared memory per pipeline stage
    is BLOCK_N*576*2 bytes (72 KB at BLOCK_N=64); configs that do not fit fail to compile and are
    recorded as errors.  ``swap_ab`` turns the head tile into the MMA's N dimension (wgmma-able)."""
    from mla_fuser.kernels.mla_decode import MLADecodeConfig as C

    cta = 2 if H <= 16 else 1
    out = []
    if H <= 16:
        # On an H200 (triton 3.6) the 16x64 tile with 4 warps won clearly; swap_ab (wgmma) and
        # 8 warps lost 10-40%.  Kept small so a sweep stays cheap.
        out += [C(16, 64, 4, 2, False, cta), C(16, 64, 4, 3, False, cta), C(16, 32, 4, 2, False, cta),
                C(16, 64, 8, 2, False, cta), C(16, 64, 4, 2, True, cta), C(16, 128, 4, 1, False, cta),
                C(16, 64, 4, 2, False, 3)]
    else:
        # BLOCK_N=128 spans two 64-token pages (per-row page lookup); with 8 warps the two
        # warpgroups split the QK^T product's N = BLOCK_N, so a wider tile feeds wgmma better.
        out += [C(64, 64, 8, 2, False, cta), C(64, 32, 8, 3, False, cta), C(32, 64, 4, 2, False, cta),
                C(64, 128, 8, 1, False, cta), C(64, 128, 8, 2, False, cta), C(64, 128, 4, 1, True, cta),
                C(64, 32, 8, 3, True, cta), C(64, 64, 8, 2, True, cta), C(128, 64, 8, 1, True, cta)]
    return out


def fp8_config(block_h, block_n, warps, stages, ctas, v_split, shared_cvt, f16_dots):
    from mla_fuser.kernels.mla_decode_fp8 import MLADecodeFP8Config

    return MLADecodeFP8Config(block_h, block_n, warps, stages, False, ctas, v_split=v_split,
                              shared_cvt=bool(shared_cvt), f16_dots=bool(f16_dots))


def fp8_sweep_configs(H):
    """The FP8 kernel's candidates (``mla_decode_fp8.MLADecodeFP8Config``), at most a dozen per H: each costs a
    compile.  Fields: BLOCK_H, BLOCK_N, warps, stages, programs per SM (sizes the split count), v_split, shared_cvt,
    f16_dots.  The first is ``default_fp8_config``'s.  Registers / spilled bytes / shared memory in the comments are
    ptxas's for sm_90a (triton 3.6, compiled offline); num_stages 5 is the first that keeps two cache tiles in
    flight (the block-table load takes a stage of its own)."""
    c = fp8_config
    if H <= 16:
        return [
            c(16, 32, 4, 5, 2, 2, 1, 1),  # default, two tiles in flight: 223 regs, 90 KB (H200: 234 us at B64x8k)
            c(16, 32, 4, 2, 2, 2, 1, 1),  # 219 regs, 0 spilled, 71 KB: 2 programs / SM (248 us)
            c(16, 32, 4, 2, 2, 1, 1, 1),  # whole value width: 255 regs, 0 spilled
            c(16, 32, 4, 2, 2, 2, 0, 1),  # second conversion, in the QK operand: 219 regs, 71 KB
            c(16, 16, 4, 5, 3, 2, 0, 1),  # small tiles, 3 programs / SM: 168 regs, 54 KB
            c(16, 64, 4, 2, 1, 2, 1, 1),  # 64 tokens: 255 regs, 144 B spilled, 124 KB
            c(16, 64, 4, 2, 1, 2, 0, 1),  # 255 regs, 136 B spilled, 124 KB
            c(16, 64, 8, 2, 1, 2, 1, 1),  # 228 regs, 124 KB
            c(16, 64, 8, 5, 1, 2, 1, 1),  # 232 regs, 161 KB
            c(16, 128, 8, 2, 1, 2, 0, 1),  # 255 regs, 64 B spilled, 224 KB
            c(16, 32, 4, 2, 2, 2, 1, 0),  # bf16 dots (e4m3 -> bf16 costs a slow conversion per value): 103 KB
            c(16, 64, 4, 2, 2, 1, 0, 0),  # the bf16 kernel's tiles, bf16 dots (the first FP8 kernel's choice)
        ]
    return [
        c(64, 32, 8, 5, 1, 2, 1, 1),  # default, two tiles in flight: 96 B spilled, 148 KB (H200: 1108 us at B64x8k)
        c(64, 32, 8, 2, 1, 2, 1, 1),  # 255 regs, 52 B spilled, 129 KB (1126 us)
        c(64, 16, 8, 2, 1, 2, 1, 1),  # 0 spilled, 102 KB
        c(64, 32, 8, 2, 1, 1, 1, 1),  # 716 B spilled
        c(64, 32, 8, 2, 1, 2, 0, 1),  # 664 B spilled, 142 KB
        c(64, 32, 8, 2, 1, 2, 1, 0),  # bf16 dots, q read by wgmma from shared memory as in mla_decode: 132 B spilled
        c(64, 32, 8, 2, 1, 2, 0, 0),  # 36 B spilled, 158 KB
        c(64, 64, 8, 2, 1, 2, 1, 1),  # 64 tokens (the bf16 kernel's): 2.2 KB spilled, 185 KB
        c(64, 64, 8, 2, 1, 2, 1, 0),  # 1.9 KB spilled
        c(32, 32, 8, 2, 1, 2, 1, 1),  # 32-head tiles (mma.sync; the cache re-read from L2 4x at H=128): 0 spilled
    ]


def make_inputs(B, L, H, page_size, device, dtype, gen, ragged=False):
    import torch

    lens = torch.full((B,), L, dtype=torch.int32)
    if ragged:
        lens = torch.randint(0, L + 1, (B,), generator=gen, dtype=torch.int32)
        lens[0] = 0
        if B > 1:
            lens[1] = 1
    n_pages = (lens + page_size - 1) // page_size
    max_pages = max(1, int(math.ceil(L / page_size)))
    total = int(n_pages.sum()) + 8
    kv = torch.randn(total, page_size, R + ROPE, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    bt = torch.full((B, max_pages), -1, dtype=torch.int32)
    used = 0
    for b in range(B):
        n = int(n_pages[b])
        bt[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(B, H, R + ROPE, generator=gen).to(dtype)
    return q.to(device), kv.to(device), bt.to(device), lens.to(device)


def make_inputs_fast(B, L, H, page_size, device, dtype, seed, width=R + ROPE):
    """Full-length sequences of ``width``-wide latent rows, generated on the device (the large cases are up to
    600 MB)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = math.ceil(L / page_size)
    total = B * pages_per_seq
    kv = torch.randn(total, page_size, width, device=device, dtype=dtype, generator=g)
    bt = torch.randperm(total, device=device, generator=g).to(torch.int32).view(B, pages_per_seq)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    q = torch.randn(B, H, width, device=device, dtype=dtype, generator=g)
    return q, kv, bt, lens


class Timer:
    """Median milliseconds of a call.

    * ``eager``: ``triton.testing.do_bench`` (warm-up, L2 flushed before each call, median).  A call
      whose host work (Python, the custom op, two launches) outlasts the GPU work measures the host.
    * ``graph``: the call captured ``k`` times in a CUDA graph, cycling over several copies of the
      inputs when one copy fits in L2 (so every call reads cold cache lines from HBM), replays timed
      with CUDA events; median over replays of (replay time / calls).  This is what a model served
      with CUDA graphs sees, and what the targets refer to.
    """

    def __init__(self, args, device):
        self.args, self.device = args, device

    def eager(self, fn):
        if self.device == "cpu":
            return self._cpu(fn)
        import triton.testing

        return triton.testing.do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")

    def graph(self, fns):
        """fns: one callable per input copy."""
        if self.device == "cpu":
            return self._cpu(fns[0])
        import torch

        for f in fns:  # compile + warm up outside the capture
            f()
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for f in fns:
            f()
        t1.record()
        torch.cuda.synchronize()
        per_call = max(t0.elapsed_time(t1) / len(fns), 1e-3)
        k = max(1, min(200, int(2.0 / per_call / len(fns))))  # ~2 ms of work per replay
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                for _ in range(k):
                    for f in fns:
                        f()
        torch.cuda.current_stream().wait_stream(s)
        t_warm = time.perf_counter()
        while time.perf_counter() - t_warm < 0.05:  # >= 50 ms of replays first: clocks settle
            g.replay()
            torch.cuda.synchronize()
        ts = []
        for _ in range(max(5, self.args.graph_replays)):
            t0.record()
            g.replay()
            t1.record()
            torch.cuda.synchronize()
            ts.append(t0.elapsed_time(t1) / (k * len(fns)))
        del g
        ts.sort()
        return ts[len(ts) // 2]

    @staticmethod
    def _cpu(fn):
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[1]


def copy_bandwidth(timer, device, dry):
    import torch

    n = (1 << 16) if dry else (1 << 30)  # 2 GiB of bf16 each side on the GPU
    x = torch.randn(n, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = timer.eager(lambda: y.copy_(x))
    return {"bytes_rw": 2 * x.numel() * 2, "ms": ms, "GBps": 2 * x.numel() * 2 / ms / 1e6}


def metrics(B, L, H, ms, copy_gbps):
    nbytes = B * L * (R + ROPE) * 2
    flops = 2 * B * H * L * ((R + ROPE) + R)
    gbps = nbytes / ms / 1e6
    return {"ms": ms, "us": ms * 1e3, "GBps": gbps, "TFLOPs": flops / ms / 1e9, "ratio_to_copy": gbps / copy_gbps}


def kernel_info():
    from mla_fuser.kernels import mla_decode as md

    info = {k: v for k, v in md.LAST_LAUNCH.items() if k not in ("stage1", "config")}
    k1 = md.LAST_LAUNCH.get("stage1")
    for attr in ("n_regs", "n_spills"):
        if k1 is not None and hasattr(k1, attr):
            info[attr] = getattr(k1, attr)
    if k1 is not None and hasattr(k1, "metadata") and hasattr(k1.metadata, "shared"):
        info["shared_bytes"] = k1.metadata.shared
    ptx = getattr(k1, "asm", {}).get("ptx") if k1 is not None else None
    if ptx:  # which MMA and load paths the compiler chose
        info["wgmma"] = "wgmma.mma_async" in ptx
        info["cp_async"] = "cp.async" in ptx
        info["tma"] = "cp.async.bulk" in ptx
    return info


def check_correctness(device, dtype, heads, page_size, dry, gen):
    import torch

    from mla_fuser.kernels.mla_decode import MLADecodeConfig, mla_decode, mla_decode_ref, mla_decode_triton

    res = []
    B, L = (3, 130) if dry else (8, 3000)
    for H in heads:
        q, kv, bt, lens = make_inputs(B, L, H, page_size, device, dtype, gen, ragged=True)
        scale = 1.0 / math.sqrt(192)
        ref = mla_decode_ref(q.float(), kv.float(), bt, lens, scale, R)
        bh = 16 if H <= 16 else 64
        variants = [(None, ns) for ns in (None, 1, 7)]
        variants += [(MLADecodeConfig(bh, bn, 4, 2, True), ns) for bn in (32, 64) for ns in (None, 5)]
        variants += [(MLADecodeConfig(bh, 32, 8, 3, False), 3)]
        if dry:  # the interpreter is slow: one default and one swap_ab variant
            variants = [variants[0], variants[3]]
        for cfg, ns in variants:
            if cfg is None:
                out = mla_decode(q, kv, bt, lens, scale, R, num_splits=ns)
            else:
                out = mla_decode_triton(q, kv, bt, lens, scale, R, num_splits=ns, config=cfg)
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            ok = bool(torch.isfinite(out).all()) and rel < 1e-2 and bool((out[0] == 0).all())
            name = "default" if cfg is None else f"{cfg.block_h},{cfg.block_n},{cfg.num_warps},{cfg.num_stages},swap={int(cfg.swap_ab)}"
            res.append({"H": H, "B": B, "lens": lens.tolist(), "config": name, "num_splits": ns, "rel_err": rel, "ok": ok})
            print(f"check H={H} {name} splits={ns}: rel_err={rel:.2e} {'OK' if ok else 'FAIL'}", flush=True)
        for dt in (torch.float16, torch.float32):  # other dtypes, default configs (compile + numerics)
            q2, kv2 = q.to(dt), kv.to(dt)
            ref2 = mla_decode_ref(q2.float(), kv2.float(), bt, lens, scale, R)
            for ns in (None,) if dry else (None, 3):
                out = mla_decode(q2, kv2, bt, lens, scale, R, num_splits=ns)
                rel = ((out.float() - ref2).norm() / ref2.norm()).item()
                tol = 1e-4 if dt == torch.float32 else 1e-2
                ok = out.dtype == dt and bool(torch.isfinite(out).all()) and rel < tol and bool((out[0] == 0).all())
                res.append({"H": H, "B": B, "dtype": str(dt), "config": "default", "num_splits": ns, "rel_err": rel, "ok": ok})
                print(f"check H={H} {dt} default splits={ns}: rel_err={rel:.2e} {'OK' if ok else 'FAIL'}", flush=True)
    # paged_write (Triton) vs its torch reference, with padding slots
    from mla_fuser.kernels.paged_cache_ops import paged_write, paged_write_ref

    kv = torch.randn(64, page_size, R + ROPE, generator=gen).to(dtype).to(device)
    kv_ref = kv.clone()
    n = 300
    slots = torch.randperm(64 * page_size, generator=gen)[:n].to(device)
    slots[::7] = -1
    c = torch.randn(n, R, generator=gen).to(dtype).to(device)
    pe = torch.randn(n, ROPE, generator=gen).to(dtype).to(device)
    paged_write(kv, slots, c, pe)
    paged_write_ref(kv_ref, slots, c, pe)
    ok = bool(torch.equal(kv, kv_ref))
    res.append({"op": "paged_write", "ok": ok})
    print(f"check paged_write: {'OK' if ok else 'FAIL'}", flush=True)
    return res


def fp8_case(args, timer, device, sets, bf16_case, scale, copy_gbps, l2, forced):
    """The FP8-cache row of a case: the same latents (``sets``) quantised per token, timed like the bf16 ones;
    ``forced``: the FP8 config to time instead of the default (``--fp8-config``, else ``--config``'s tiles)."""
    import torch

    from mla_fuser.kernels.latent_fp8 import packed_width, quantise_rows
    from mla_fuser.kernels.mla_decode import mla_decode_ref
    from mla_fuser.kernels.mla_decode_fp8 import (
        default_fp8_config, mla_decode_fp8, mla_decode_fp8_ref, mla_decode_fp8_triton,
    )

    H, B, L = bf16_case["H"], bf16_case["B"], bf16_case["L"]
    width = packed_width(R + ROPE)
    nbytes = B * L * width
    n_copies = 1 if device == "cpu" else max(1, min(len(sets), math.ceil(3 * l2 / nbytes)))
    fp8_sets = []
    for q, kv, bt, lens in sets[:n_copies]:
        pages = torch.empty(kv.shape[0], kv.shape[1], width, device=kv.device, dtype=torch.float8_e4m3fn)
        for i in range(0, kv.shape[0], 4096):  # in chunks: fp32 temporaries of the largest case are ~1 GB each
            pages[i:i + 4096] = quantise_rows(kv[i:i + 4096, :, :R], kv[i:i + 4096, :, R:])
        fp8_sets.append((q, pages, bt, lens))
    row = {"bytes_per_token": width, "input_copies": n_copies,
           "config": vars(forced or default_fp8_config(H, sets[0][0].dtype))}
    # accuracy on the first set: kernel vs its twin, and vs the fp32 reference of the unquantised latent (a few
    # sequences: the reference is dense)
    q, pages, bt, lens = fp8_sets[0]
    kv = sets[0][1]
    n = min(B, 4)
    twin = mla_decode_fp8_ref(q[:n], pages, bt[:n], lens[:n], scale, R).float()
    exact = mla_decode_ref(q[:n].float(), kv.float(), bt[:n], lens[:n], scale, R)

    def rel_err(out, ref):
        return ((out[:n].float() - ref).norm() / ref.norm()).item()

    if forced is None:
        fns = [lambda s=s: mla_decode_fp8(*s, scale, R, num_splits=args.num_splits) for s in fp8_sets]
    else:
        fns = [lambda s=s: mla_decode_fp8_triton(*s, scale, R, num_splits=args.num_splits, config=forced)
               for s in fp8_sets]
    out = fns[0]()
    row["rel_err_vs_twin"] = rel_err(out, twin)
    row["rel_err_vs_unquantised_fp32"] = rel_err(out, exact)
    row["check_ok"] = bool(torch.isfinite(out).all()) and row["rel_err_vs_twin"] < 1e-2
    ms = timer.graph(fns)
    gbps = nbytes / ms / 1e6
    row.update(ms=ms, us=ms * 1e3, GBps=gbps, ratio_to_copy=gbps / copy_gbps, speedup_vs_bf16=bf16_case["ms"] / ms)
    if not args.no_eager:
        row["eager_us"] = timer.eager(fns[0]) * 1e3
    fns[0]()
    row.update(kernel_info())
    print(f"    fp8 cache: {row['us']:8.1f} us  {gbps:6.0f} GB/s ({row['ratio_to_copy']:.2f}x copy)  "
          f"{row['speedup_vs_bf16']:.2f}x bf16  rel_err vs twin {row['rel_err_vs_twin']:.1e}, vs unquantised "
          f"{row['rel_err_vs_unquantised_fp32']:.1e} {'OK' if row['check_ok'] else 'FAIL'}  "
          f"splits={row.get('num_splits')} regs={row.get('n_regs')} spills={row.get('n_spills')}", flush=True)
    if args.sweep and (not args.sweep_shapes or (B, L) in args.sweep_shapes):
        rows = []
        for cfg in fp8_sweep_configs(H)[: args.sweep_max_configs or None]:
            r = {"config": vars(cfg)}
            name = (f"{cfg.block_h:3d} {cfg.block_n:3d} w{cfg.num_warps} s{cfg.num_stages} c{cfg.ctas_per_sm} "
                    f"v{cfg.v_split} {'shared' if cfg.shared_cvt else 'tile  '} {'f16 ' if cfg.f16_dots else 'bf16'}")
            try:
                sweep_fns = [lambda s=s: mla_decode_fp8_triton(*s, scale, R, config=cfg) for s in fp8_sets]
                r["rel_err_vs_twin"] = rel_err(sweep_fns[0](), twin)
                r["ok"] = r["rel_err_vs_twin"] < 1e-2  # (NaN fails)
                ms = timer.graph(sweep_fns)
                r.update(ms=ms, us=ms * 1e3, GBps=nbytes / ms / 1e6, speedup_vs_bf16=bf16_case["ms"] / ms)
                r.update(kernel_info())
                verdict = "OK" if r["ok"] else f"WRONG (rel_err {r['rel_err_vs_twin']:.1e})"
                print(f"      fp8 {name}: {r['us']:8.1f} us {r['GBps']:6.0f} GB/s {r['speedup_vs_bf16']:.2f}x bf16 "
                      f"S={r.get('num_splits')} regs={r.get('n_regs')} spills={r.get('n_spills')} "
                      f"smem={r.get('shared_bytes')} {verdict}", flush=True)
            except Exception as e:  # e.g. out of shared memory
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"      fp8 {name}: {r['error'][:120]}", flush=True)
            rows.append(r)
        row["sweep"] = rows
        ok = [r for r in rows if r.get("ok") and "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            row["sweep_best"] = best
            c = best["config"]
            print(f"    fp8 sweep best: {c['block_h']},{c['block_n']},{c['num_warps']},{c['num_stages']},"
                  f"{c['ctas_per_sm']},{c['v_split']},{int(c['shared_cvt'])},{int(c['f16_dots'])} (--fp8-config) "
                  f"{best['us']:.1f} us {best['GBps']:.0f} GB/s {best['speedup_vs_bf16']:.2f}x bf16 "
                  f"({len(ok)}/{len(rows)} ok)", flush=True)
    del fp8_sets
    return row


def dump(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def tma_ab(timer, fns, B, L, H, copy_gbps) -> dict:
    """The same calls timed with ``mla_decode_tma``'s kernel turned off (``mla_decode``'s own kernel and tiles)."""
    from mla_fuser.kernels import mla_decode as md, mla_decode_tma

    mla_decode_tma.ENABLED = False
    try:
        ms = timer.graph(fns)
        fns[0]()
        row = {**metrics(B, L, H, ms, copy_gbps), "config": vars(md.LAST_LAUNCH.get("config")), **kernel_info()}
    finally:
        mla_decode_tma.ENABLED = True  # (the main rows' setting: --tma-ab sets it)
    print(f"    without the TMA kernel: {row['us']:8.1f} us  {row['GBps']:6.0f} GB/s  splits={row.get('num_splits')}",
          flush=True)
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        # Must be set before triton is imported (its standard library is decorated then).
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MLA_FUSER_BACKEND"] = "triton"
        args.heads = sorted({min(h, 20) for h in args.heads})
        args.shapes = [(2, 128), (1, 256)]
        if args.sweep_shapes:  # (the GPU shapes do not exist here: sweep on the first tiny one)
            args.sweep_shapes = args.shapes[:1]
        args.graph_replays = 1
    sys.path.insert(0, ROOT)
    import torch
    import triton

    from mla_fuser.kernels import mla_decode as md, mla_decode_tma

    if args.tma_ab:  # (the main rows and the check with the TMA kernel; tma_ab without it)
        mla_decode_tma.ENABLED = True
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run on CPU")
    dtype = torch.bfloat16
    timer = Timer(args, device)
    gen = torch.Generator().manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()}) interpreter",
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "page_size": args.page_size,
        "D": R + ROPE,
        "v_dim": R,
        "timing": "us/GBps/TFLOPs: CUDA-graph replay median, inputs rotated past L2; eager_us: do_bench median",
        "l2_bytes": getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None) if device == "cuda" else None,
        "dry_run": args.dry_run,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    result["copy"] = copy_bandwidth(timer, device, args.dry_run)
    copy_gbps = result["copy"]["GBps"]
    print(f"device: {result['device']}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy bandwidth (read+write): {copy_gbps:.0f} GB/s", flush=True)

    if not args.no_check:
        result["check"] = check_correctness(device, dtype, args.heads, args.page_size, args.dry_run, gen)

    forced = None
    if args.config:
        forced = md.MLADecodeConfig(*args.config[:4], *(bool(x) if i == 0 else x for i, x in enumerate(args.config[4:])))
    scale = 1.0 / math.sqrt(192)
    l2 = result["l2_bytes"] or (60 << 20)
    cases = []
    for H in args.heads:
        for B, L in args.shapes:
            # One input set per copy; several copies when one fits in L2, so graph-timed calls
            # read HBM like a real decode step (each layer's cache is read once per step).
            nbytes = B * L * (R + ROPE) * 2
            n_copies = 1 if device == "cpu" else max(1, min(8, math.ceil(3 * l2 / nbytes)))
            sets = [make_inputs_fast(B, L, H, args.page_size, device, dtype, seed=B * 131 + L + i) for i in range(n_copies)]
            q, kv, bt, lens = sets[0]
            case = {"H": H, "B": B, "L": L, "input_copies": n_copies}

            def run(cfg=None, ns=args.num_splits):
                if cfg is None:
                    return [lambda s=s: md.mla_decode(*s, scale, R, num_splits=ns) for s in sets]
                return [lambda s=s: md.mla_decode_triton(*s, scale, R, num_splits=ns, config=cfg) for s in sets]

            fns = run(forced)
            ms = timer.graph(fns)
            fns[0]()
            case.update(metrics(B, L, H, ms, copy_gbps))
            if not args.no_eager:
                case["eager_us"] = timer.eager(fns[0]) * 1e3
            case["config"] = vars(md.LAST_LAUNCH.get("config") or forced or md.default_config(H, dtype))
            case.update(kernel_info())
            if args.tma_ab:
                case["without_tma_kernel"] = tma_ab(timer, run(forced), B, L, H, copy_gbps)
            print(
                f"H={H:4d} B={B:4d} L={L:6d}: {case['us']:8.1f} us  {case['GBps']:6.0f} GB/s "
                f"({case['ratio_to_copy']:.2f}x copy)  {case['TFLOPs']:6.1f} TFLOP/s  eager {case.get('eager_us', float('nan')):7.1f} us  "
                f"splits={case.get('num_splits')} regs={case.get('n_regs')} spills={case.get('n_spills')} "
                f"wgmma={case.get('wgmma')} cp.async={case.get('cp_async')}",
                flush=True,
            )
            if args.sweep and not args.sweep_fp8_only and (not args.sweep_shapes or (B, L) in args.sweep_shapes):
                rows = []
                cfgs = sweep_configs(H) + (small_shape_configs() if args.sweep_joint and H <= 16 else [])
                if args.sweep_max_configs:
                    cfgs = cfgs[: args.sweep_max_configs]
                split_counts = [None]
                if args.sweep_joint:
                    split_counts += [ns for ns in (4, 8, 16, 32, 64, 128, 256) if ns <= bt.shape[1]]
                for cfg in cfgs:
                    for ns in split_counts:
                        row = {"config": vars(cfg), "forced_splits": ns}
                        try:
                            ms = timer.graph(run(cfg, ns if ns is not None else args.num_splits))
                            row.update(metrics(B, L, H, ms, copy_gbps))
                            row.update(kernel_info())
                        except Exception as e:  # e.g. out of shared memory
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            rows.append(row)
                            break
                        rows.append(row)
                ok = [r for r in rows if "ms" in r]
                case["sweep"] = rows
                if ok:
                    best = min(ok, key=lambda r: r["ms"])
                    case["sweep_best"] = best
                    print(f"    sweep best: {best['config']} {best['us']:.1f} us {best['GBps']:.0f} GB/s "
                          f"{best['TFLOPs']:.1f} TFLOP/s ({len(ok)}/{len(rows)} compiled)", flush=True)
                    for r in sorted(ok, key=lambda r: r["ms"]):
                        c = r["config"]
                        print(f"      {c['block_h']:3d} {c['block_n']:3d} w{c['num_warps']} s{c['num_stages']} "
                              f"swap={int(c['swap_ab'])}: {r['us']:8.1f} us {r['GBps']:6.0f} GB/s {r['TFLOPs']:6.1f} TF "
                              f"S={r.get('num_splits')} regs={r.get('n_regs')} spill={r.get('n_spills')} "
                              f"smem={r.get('shared_bytes')} wgmma={r.get('wgmma')} cp.async={r.get('cp_async')}", flush=True)
                    for r in rows:
                        if "error" in r:
                            print(f"      {r['config']}: {r['error'][:120]}", flush=True)
            if args.fp8_cache:
                try:
                    case["fp8_cache"] = fp8_case(args, timer, device, sets, case, scale, copy_gbps, l2,
                                                 fp8_config(*args.fp8_config) if args.fp8_config else forced)
                except Exception as e:  # recorded, so the bf16 numbers of the run survive
                    case["fp8_cache"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"    fp8 cache: {case['fp8_cache']['error']}", flush=True)
            if args.sweep_splits:
                rows = []
                for ns in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                    if ns > bt.shape[1]:
                        break
                    ms = timer.graph(run(forced, ns))
                    rows.append({"num_splits": ns, **metrics(B, L, H, ms, copy_gbps)})
                case["splits_sweep"] = rows
                print("    splits: " + "  ".join(f"{r['num_splits']}:{r['us']:.0f}us" for r in rows), flush=True)
            cases.append(case)
            result["cases"] = cases
            dump(result, args.out)  # after every case: a run cut short still leaves its numbers
            del q, kv, bt, lens, sets
            if device == "cuda":
                torch.cuda.empty_cache()
    result["cases"] = cases
    dump(result, args.out)
    print(f"wrote {args.out}")
    print("\nsummary (H, B, L, us, GB/s, x copy, TFLOP/s):")
    for c in cases:
        print(f"  {c['H']:4d} {c['B']:4d} {c['L']:6d} {c['us']:9.1f} {c['GBps']:7.0f} {c['ratio_to_copy']:5.2f} {c['TFLOPs']:6.1f}")
        f8 = c.get("fp8_cache", {})
        if "us" in f8:
            print(f"       fp8 cache {f8['us']:9.1f} {f8['GBps']:7.0f} {f8['ratio_to_copy']:5.2f}  "
                  f"{f8['speedup_vs_bf16']:.2f}x bf16")
    return result


if __name__ == "__main__":
    main()
