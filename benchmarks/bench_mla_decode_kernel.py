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

Also: a correctness check against ``mla_decode_ref`` (fp32) on a ragged batch, ``--num-splits`` to
force the split count, ``--sweep`` to time a grid of tile configs (BLOCK_H, BLOCK_N, num_warps,
num_stages) and ``--sweep-splits`` to time split counts, so one GPU call can pick the best config.
Everything lands in a JSON file (``--out``).

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
    p.add_argument("--config", default=None, help="force a tile config: BLOCK_H,BLOCK_N,num_warps,num_stages")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per case")
    p.add_argument("--sweep-splits", action="store_true", help="also time several split counts per case")
    p.add_argument("--sweep-max-configs", type=int, default=0, help="cap the configs swept per H (0: all)")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays instead of do_bench")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mla_decode_kernel.json; "
                   "a dry run defaults to a temp file so it never overwrites GPU results)")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            os.path.join(tempfile.gettempdir(), "mla_decode_kernel_dryrun.json")
            if args.dry_run
            else os.path.join(ROOT, "benchmarks", "results", "mla_decode_kernel.json")
        )
    args.heads = [int(h) for h in args.heads.split(",") if h]
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    if args.config:
        parts = [int(x) for x in args.config.split(",")]
        if len(parts) != 4:
            p.error("--config needs BLOCK_H,BLOCK_N,num_warps,num_stages")
        args.config = parts
    return args


def sweep_configs(H):
    """Candidate tile configs.  Shared memory per stage is BLOCK_N*576*2 bytes (72 KB at 64), so
    BLOCK_N=64 allows 2 stages and BLOCK_N=32 up to 4 on Hopper's 227 KB; configs that do not fit
    fail to compile and are recorded as errors."""
    from mla_fuser.kernels.mla_decode import MLADecodeConfig

    out = []
    bhs = [16] if H <= 16 else [16, 32, 64]
    for bh in bhs:
        for bn in (32, 64):
            for nw in (4, 8):
                for ns in ((1, 2, 3, 4) if bn == 32 else (1, 2, 3)):
                    out.append(MLADecodeConfig(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns))
    return out


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


def make_inputs_fast(B, L, H, page_size, device, dtype, seed):
    """Full-length sequences, generated on the device (the large cases are up to 600 MB)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = math.ceil(L / page_size)
    total = B * pages_per_seq
    kv = torch.randn(total, page_size, R + ROPE, device=device, dtype=dtype, generator=g)
    bt = torch.randperm(total, device=device, generator=g).to(torch.int32).view(B, pages_per_seq)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    q = torch.randn(B, H, R + ROPE, device=device, dtype=dtype, generator=g)
    return q, kv, bt, lens


class Timer:
    def __init__(self, args, device):
        self.args, self.device = args, device

    def __call__(self, fn):
        """Median milliseconds of fn()."""
        import torch

        if self.device == "cpu":
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return sorted(ts)[1]
        import triton.testing

        if self.args.cuda_graph:
            fn()
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=self.args.rep, return_mode="median")
        return triton.testing.do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")


def copy_bandwidth(timer, device, dry):
    import torch

    n = (1 << 16) if dry else (1 << 30)  # 2 GiB of bf16 each side on the GPU
    x = torch.randn(n, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    ms = timer(lambda: y.copy_(x))
    return {"bytes_rw": 2 * x.numel() * 2, "ms": ms, "GBps": 2 * x.numel() * 2 / ms / 1e6}


def metrics(B, L, H, ms, copy_gbps):
    nbytes = B * L * (R + ROPE) * 2
    flops = 2 * B * H * L * ((R + ROPE) + R)
    gbps = nbytes / ms / 1e6
    return {"ms": ms, "us": ms * 1e3, "GBps": gbps, "TFLOPs": flops / ms / 1e9, "ratio_to_copy": gbps / copy_gbps}


def kernel_info():
    from mla_fuser.kernels import mla_decode as md

    info = {k: v for k, v in md._LAST_LAUNCH.items() if k != "stage1"}
    k1 = md._LAST_LAUNCH.get("stage1")
    for attr in ("n_regs", "n_spills"):
        if k1 is not None and hasattr(k1, attr):
            info[attr] = getattr(k1, attr)
    if k1 is not None and hasattr(k1, "metadata") and hasattr(k1.metadata, "shared"):
        info["shared_bytes"] = k1.metadata.shared
    return info


def check_correctness(device, dtype, heads, page_size, dry, gen):
    import torch

    from mla_fuser.kernels.mla_decode import mla_decode, mla_decode_ref

    res = []
    B, L = (3, 130) if dry else (8, 3000)
    for H in heads:
        q, kv, bt, lens = make_inputs(B, L, H, page_size, device, dtype, gen, ragged=True)
        scale = 1.0 / math.sqrt(192)
        for ns in (None, 1, 7):
            out = mla_decode(q, kv, bt, lens, scale, R, num_splits=ns)
            ref = mla_decode_ref(q.float(), kv.float(), bt, lens, scale, R)
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            ok = bool(torch.isfinite(out).all()) and rel < 1e-2 and bool((out[0] == 0).all())
            res.append({"H": H, "B": B, "lens": lens.tolist(), "num_splits": ns, "rel_err": rel, "ok": ok})
            print(f"check H={H} splits={ns}: rel_err={rel:.2e} {'OK' if ok else 'FAIL'}", flush=True)
    return res


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        # Must be set before triton is imported (its standard library is decorated then).
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MLA_FUSER_BACKEND"] = "triton"
        args.heads = [min(h, 20) for h in args.heads]
        args.shapes = [(2, 128), (1, 256)]
    sys.path.insert(0, ROOT)
    import torch
    import triton

    from mla_fuser.kernels import mla_decode as md

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
        "timing": "cuda_graph_median" if args.cuda_graph else "do_bench_median",
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
        bh, bn, nw, ns = args.config
        forced = md.MLADecodeConfig(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns)
    scale = 1.0 / math.sqrt(192)
    cases = []
    for H in args.heads:
        for B, L in args.shapes:
            q, kv, bt, lens = make_inputs_fast(B, L, H, args.page_size, device, dtype, seed=B * 131 + L)
            case = {"H": H, "B": B, "L": L}

            def run(cfg=None, ns=args.num_splits):
                if cfg is None:
                    return lambda: md.mla_decode(q, kv, bt, lens, scale, R, num_splits=ns)
                return lambda: md.mla_decode_triton(q, kv, bt, lens, scale, R, num_splits=ns, config=cfg)

            fn = run(forced)
            ms = timer(fn)
            fn()
            case.update(metrics(B, L, H, ms, copy_gbps))
            case["config"] = vars(forced or md.default_config(H, dtype))
            case.update(kernel_info())
            print(
                f"H={H:4d} B={B:4d} L={L:6d}: {case['us']:9.1f} us  {case['GBps']:7.0f} GB/s "
                f"({case['ratio_to_copy']:.2f}x copy)  {case['TFLOPs']:6.1f} TFLOP/s  "
                f"splits={case.get('num_splits')} regs={case.get('n_regs')} spills={case.get('n_spills')}",
                flush=True,
            )
            if args.sweep:
                rows = []
                cfgs = sweep_configs(H)
                if args.sweep_max_configs:
                    cfgs = cfgs[: args.sweep_max_configs]
                for cfg in cfgs:
                    row = {"config": vars(cfg)}
                    try:
                        ms = timer(run(cfg))
                        row.update(metrics(B, L, H, ms, copy_gbps))
                        row.update(kernel_info())
                    except Exception as e:  # e.g. out of shared memory
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                ok = [r for r in rows if "ms" in r]
                case["sweep"] = rows
                if ok:
                    best = min(ok, key=lambda r: r["ms"])
                    case["sweep_best"] = best
                    print(f"    sweep best: {best['config']} {best['us']:.1f} us {best['GBps']:.0f} GB/s "
                          f"{best['TFLOPs']:.1f} TFLOP/s ({len(ok)}/{len(rows)} compiled)", flush=True)
            if args.sweep_splits:
                rows = []
                for ns in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                    if ns > bt.shape[1]:
                        break
                    ms = timer(run(forced, ns))
                    rows.append({"num_splits": ns, **metrics(B, L, H, ms, copy_gbps)})
                case["splits_sweep"] = rows
                best = min(rows, key=lambda r: r["ms"])
                print(f"    splits best: {best['num_splits']} {best['us']:.1f} us {best['GBps']:.0f} GB/s", flush=True)
            cases.append(case)
            del q, kv, bt, lens
            if device == "cuda":
                torch.cuda.empty_cache()
    result["cases"] = cases

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    print("\nsummary (H, B, L, us, GB/s, x copy, TFLOP/s):")
    for c in cases:
        print(f"  {c['H']:4d} {c['B']:4d} {c['L']:6d} {c['us']:9.1f} {c['GBps']:7.0f} {c['ratio_to_copy']:5.2f} {c['TFLOPs']:6.1f}")
    return result


if __name__ == "__main__":
    main()
