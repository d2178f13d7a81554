"""Sweep the paged MLA decode kernel's tiles over the latent shapes of the architectures we fuse; write the tuned table.

``mla_decode.default_config`` was tuned for one shape (16 heads, latent 512 + rope 64, DeepSeek-V2-Lite).  Other
architectures get tiles sized for it: 20 or 40 heads fill 32- or 64-row head tiles, a 256-wide latent (MiniCPM3) or
NoPE (Kimi-Linear) leaves shared memory unused.  This script times, for each zoo shape ``(heads, latent, rope)``:

* a grid of tile configs (head tile, token tile, warps, stages) and programs per SM (which sizes the split count),
* on a batch-bound case (B=32, L=4096) and a split-bound one (B=1, L=16384), plus the issue's extra targets
  (B=1 L=32768 at 16 heads, B=64 L=8192 at 128 heads);
* by CUDA-graph replay with inputs rotated past L2 (``bench_mla_decode_kernel.Timer``); every config's output is
  checked against ``mla_decode_ref`` (fp32) on the timed inputs and a wrong one is never picked.

Per shape it keeps the config with the smallest worst-case regret (time over the best time of each case), and
writes the table ``mla_fuser/kernels/tuned/mla_decode.json`` (``--table``) that ``kernels.decode_tiles`` reads, plus
every timing (``--out``).  Compiles are the slow part: ``--jobs`` worker processes compile every config first (one
process per shape, filling Triton's on-disk cache), then this process times them one at a time.

    python benchmarks/tune_mla_decode.py --out benchmarks/results/mla_decode_tune.json
    python benchmarks/tune_mla_decode.py --table my_gpu.json   # another GPU: MLA_FUSER_DECODE_TILES=my_gpu.json
    python benchmarks/tune_mla_decode.py --dry-run     # CPU, Triton's interpreter, tiny cases: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (what has this shape, heads, latent width = kv_lora_rank = v_dim, rope width)
ZOO = [
    ("DeepSeek-V2-Lite, Moonlight", 16, 512, 64),
    ("20 heads", 20, 512, 64),
    ("Kimi-Linear (NoPE)", 32, 512, 0),
    ("MiniCPM3", 40, 256, 32),
    ("Kimi-K2, LongCat", 64, 512, 64),
    ("DeepSeek-V3", 128, 512, 64),
]
CASES = [(32, 4096), (1, 16384)]
EXTRA_CASES = {16: [(1, 32768)], 128: [(64, 8192)]}
PAGE = 64
CTAS = (1, 2, 4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None, help="comma list of zoo indices (default: all)")
    p.add_argument("--jobs", type=int, default=6, help="compile worker processes (0: compile while timing)")
    p.add_argument("--graph-replays", type=int, default=9)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mla_decode_tune.json"))
    p.add_argument("--table", default=os.path.join(ROOT, "mla_fuser", "kernels", "tuned", "mla_decode.json"))
    p.add_argument("--compile-only", type=int, default=None, help=argparse.SUPPRESS)  # (a worker: one zoo index)
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny cases, temp outputs")
    args = p.parse_args(argv)
    args.shapes = list(range(len(ZOO))) if args.shapes is None else [int(s) for s in args.shapes.split(",")]
    return args


def candidates(H, R, rope):
    """Tile configs worth a compile for ``H`` heads and a ``R + rope`` row: head tiles from 16 up to the head count's
    power of two, token tiles of 32/64 (128 where a stage still fits: narrow rows), 4 or 8 warps, 2 or 3 stages."""
    from mla_fuser.kernels.dispatch import next_pow2
    from mla_fuser.kernels.mla_decode import MLADecodeConfig as C

    top = max(16, next_pow2(H))
    narrow = R + rope <= 320
    tiles = []
    if top >= 16:
        tiles += [(16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 2), (16, 32, 4, 3)]
        tiles += [(16, 128, 4, 2), (16, 128, 8, 2)] if narrow else []
    if top >= 32:
        tiles += [(32, 64, 4, 2), (32, 64, 8, 2), (32, 32, 4, 3), (32, 32, 8, 3)]
        tiles += [(32, 128, 8, 2)] if narrow else []
    if top >= 64:
        tiles += [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2)]
        tiles += [(64, 128, 8, 2)] if narrow else []
    if top >= 128:
        tiles += [(128, 32, 8, 2)]
    return [C(bh, bn, w, s, False, cta) for bh, bn, w, s in tiles for cta in CTAS]


def compile_key(cfg):
    return (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.swap_ab)


def cases_of(H, dry):
    if dry:
        return [(2, 128), (1, 256)]
    return CASES + EXTRA_CASES.get(H, [])


def compile_worker(index, dry):
    """Launch every candidate once on the timed shapes (compiles land in Triton's on-disk cache)."""
    import torch

    from bench_mla_decode_kernel import make_inputs_fast
    from mla_fuser.kernels import mla_decode as md

    _, H, R, rope = ZOO[index]
    device, dtype = ("cpu" if dry else "cuda"), torch.bfloat16
    failed = 0
    for B, L in cases_of(H, dry):
        q, kv, bt, lens = make_inputs_fast(B, L, H, PAGE, device, dtype, 0, width=R + rope)
        for cfg in candidates(H, R, rope):
            try:
                md.mla_decode_triton(q, kv, bt, lens, 0.1, R, config=cfg)
            except Exception:  # (out of shared memory etc.: the timing pass records it)
                failed += 1
        if device == "cuda":
            torch.cuda.synchronize()
        del q, kv, bt, lens
    print(json.dumps({"shape": index, "failed_launches": failed}))


def precompile(args):
    procs, started = [], time.perf_counter()
    pending = list(args.shapes)
    while pending or procs:
        while pending and len(procs) < max(1, args.jobs):
            i = pending.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), "--compile-only", str(i)] + (["--dry-run"] * args.dry_run)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(0.2)
        for p in [p for p in procs if p.poll() is not None]:
            procs.remove(p)
            out, err = p.communicate()
            if p.returncode:
                print(f"compile worker failed ({p.returncode}): {err[-500:]}", flush=True)
    return time.perf_counter() - started


def metrics(B, L, H, R, rope, us):
    nbytes = B * L * (R + rope) * 2
    flops = 2 * B * H * L * (R + rope + R)
    return {"us": us, "GBps": nbytes / us / 1e3, "TFLOPs": flops / us / 1e6}


def choose(rows_by_case):
    """The config whose worst case is closest to that case's best (ties: the smaller sum of regrets)."""
    best_us = {case: min(r["us"] for r in rows if r.get("ok")) for case, rows in rows_by_case.items()}
    regrets: dict = {}
    for case, rows in rows_by_case.items():
        for r in rows:
            key = json.dumps(r["config"], sort_keys=True)
            regrets.setdefault(key, {})[case] = r["us"] / best_us[case] if r.get("ok") else math.inf
    full = {k: v for k, v in regrets.items() if len(v) == len(rows_by_case)}
    key = min(full, key=lambda k: (max(full[k].values()), sum(full[k].values())))
    return json.loads(key), full[key], regrets


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # (this process and its workers, before triton is imported)
        os.environ["MLA_FUSER_BACKEND"] = "triton"
        import tempfile

        tmp = tempfile.mkdtemp(prefix="tune_mla_decode_")
        args.out, args.table = os.path.join(tmp, "tune.json"), os.path.join(tmp, "table.json")
        args.shapes = [0, 3] if args.shapes == list(range(len(ZOO))) else args.shapes
        args.graph_replays = 1
    sys.path.insert(0, ROOT)
    if args.compile_only is not None:
        return compile_worker(args.compile_only, args.dry_run)
    import torch
    import triton

    from bench_mla_decode_kernel import Timer, copy_bandwidth, make_inputs_fast
    from mla_fuser.kernels import mla_decode as md

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run on CPU")
    dtype = torch.bfloat16
    timer = Timer(args, device)
    compile_s = precompile(args) if args.jobs else 0.0
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor()}) interpreter",
        "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16", "page_size": PAGE,
        "timing": "us: CUDA-graph replay median, inputs rotated past L2 (bench_mla_decode_kernel.Timer)",
        "dry_run": args.dry_run, "compile_s": compile_s,
        "copy": copy_bandwidth(timer, device, args.dry_run), "shapes": [],
    }
    l2 = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if device == "cuda" else 0) or (60 << 20)
    table = {}
    for index in args.shapes:
        name, H, R, rope = ZOO[index]
        shape = {"name": name, "heads": H, "latent": R, "rope": rope, "cases": {}}
        default = md.default_config(H, dtype)
        rows_by_case = {}
        for B, L in cases_of(H, args.dry_run):
            copies = 1 if device == "cpu" else max(1, min(8, math.ceil(3 * l2 / (B * L * (R + rope) * 2))))
            sets = [make_inputs_fast(B, L, H, PAGE, device, dtype, B * 131 + L + i, width=R + rope)
                    for i in range(copies)]
            ref = md.mla_decode_ref(*sets[0], 0.1, R).float()
            rows = []
            for cfg in [default] + candidates(H, R, rope):
                row = {"config": vars(cfg), "default": cfg is default}
                try:
                    out = md.mla_decode_triton(*sets[0], 0.1, R, config=cfg).float()
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                    row["rel_err"] = err
                    us = timer.graph([lambda s=s: md.mla_decode_triton(*s, 0.1, R, config=cfg) for s in sets]) * 1e3
                    row.update(metrics(B, L, H, R, rope, us), num_splits=md.LAST_LAUNCH.get("num_splits"))
                    row["ok"] = err < 2e-2
                except Exception as e:  # e.g. out of shared memory: recorded, never chosen
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
            case = f"{B}x{L}"
            rows_by_case[case] = [r for r in rows if not r["default"]]
            d = rows[0]
            ok = sorted((r for r in rows if r.get("ok")), key=lambda r: r["us"])
            shape["cases"][case] = {"copies": copies, "default": d, "best": ok[0] if ok else None, "rows": rows}
            print(f"H={H:3d} R={R} rope={rope:2d} {case:>9}: default {d.get('us', math.nan):8.1f} us "
                  f"{d.get('GBps', math.nan):6.0f} GB/s | best {ok[0]['us']:8.1f} us {ok[0]['GBps']:6.0f} GB/s "
                  f"{ok[0]['TFLOPs']:6.1f} TF {ok[0]['config']}", flush=True)
            del sets, ref
            if device == "cuda":
                torch.cuda.empty_cache()
        chosen, regret, regrets = choose(rows_by_case)
        default_key = json.dumps(vars(default), sort_keys=True)
        shape.update(chosen=chosen, chosen_regret=regret, default_regret=regrets.get(default_key))
        shape["chosen_cases"] = {c: metrics_of(rows_by_case[c], chosen) for c in rows_by_case}
        table[f"{H},{R},{rope}"] = chosen
        print(f"  chosen {chosen}: worst regret {max(regret.values()):.3f}", flush=True)
        result["shapes"].append(shape)
        dump(result, args.out)
    dump({"about": "tiles of mla_decode per (heads, latent, rope), tuned by benchmarks/tune_mla_decode.py; read by "
                   "mla_fuser.kernels.decode_tiles for bf16/fp16 on GPUs of this compute capability's major",
          "measured_on": result["device"], "capability": result["capability"], "triton": triton.__version__,
          "page_size": PAGE, "shapes": table}, args.table)
    print(f"wrote {args.out} and {args.table}")
    return result


def metrics_of(rows, config):
    for r in rows:
        if r["config"] == config and r.get("ok"):
            return {k: r[k] for k in ("us", "GBps", "TFLOPs", "num_splits")}
    return None


def dump(obj, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)


if __name__ == "__main__":
    main()
