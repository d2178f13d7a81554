"""The TMA decode kernel (``kernels/mla_decode_tma.py``) compiled on a GPU, case by case: each case in a process of its
own (an illegal memory access ends the process that hits it), its output per sequence against ``mla_decode``'s own
kernel, and the fp32 reference; where a sequence is off, which heads and 64-column blocks.

    python benchmarks/probe_mla_decode_tma_cases.py --out cases.jsonl      # every case below, one line each
    python benchmarks/probe_mla_decode_tma_cases.py NAME '{"lens": [150], "splits": 1}'   # one case

Results: ``mla_decode_tma_cases_h100.jsonl`` (an H100, Triton 3.6).
"""
import json
import os
import subprocess
import sys

CASES = {
    "full_split": {"splits": None},
    "full_1split": {"splits": 1},
    "full_3split": {"splits": 3},
    "tail150": {"lens": [150], "splits": 1},
    "tail150_nonan": {"lens": [150], "splits": 1, "nan": False},
    "len64": {"lens": [64], "splits": 1},
    "len65": {"lens": [65], "splits": 1},
    "full_r256": {"r": 256, "rope": 32, "splits": 3},
    "full_h5": {"H": 5, "splits": 3},
    "full_rope0": {"rope": 0, "splits": 3},
    "starts": {"lens": [70, 130, 200, 9], "starts": [5, 64, 97, 0], "splits": 1},
    "starts_3split": {"lens": [70, 130, 200, 9], "starts": [5, 64, 97, 0], "splits": 3},
    "both_ends": {"lens": [40, 130, 64], "starts": [5, 100, 63], "splits": 1},
    "page128": {"lens": [150, 200, 3000], "ps": 128, "splits": 3},
    "page128_starts": {"lens": [150, 200, 40], "starts": [70, 3, 5], "ps": 128, "splits": 1},
}


def run_all(out_path):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(out_path, "w") as f:
        for name, case in CASES.items():
            try:
                done = subprocess.run([sys.executable, __file__, name, json.dumps(case)], capture_output=True,
                                      text=True, timeout=120, cwd=os.path.dirname(here))
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                line = lines[-1] if lines else json.dumps({"case": name, "died": True, "rc": done.returncode})
            except subprocess.TimeoutExpired:
                line = json.dumps({"case": name, "timed_out": True})
            print(line, flush=True)
            f.write(line + "\n")


def run_one(name, overrides):
    sys.path.insert(0, "tests")
    import torch

    from mla_fuser.kernels import mla_decode as md, mla_decode_tma
    from test_kernel_mla_decode import _ref32, make_case

    cfg = dict(lens=[64, 128, 3008], H=16, r=512, rope=64, splits=None, nan=True, starts=None, ps=64)
    cfg.update(overrides)
    q, kv, bt, sl = make_case(cfg["lens"], cfg["H"], cfg["r"], cfg["rope"], cfg["ps"], torch.bfloat16, seed=1)
    if not cfg["nan"]:
        kv = torch.nan_to_num(kv, nan=0.0)
    q, kv, bt, sl = q.cuda(), kv.cuda(), bt.cuda(), sl.cuda()
    kw = dict(num_splits=cfg["splits"])
    if cfg["starts"] is not None:
        kw["starts"] = torch.tensor(cfg["starts"], dtype=torch.int32, device="cuda")
    res = {"case": name, **cfg}
    try:
        mla_decode_tma.ENABLED = False
        plain = md.mla_decode(q, kv, bt, sl, 0.05, cfg["r"], **kw)
        torch.cuda.synchronize()
        mla_decode_tma.ENABLED = True
        out = md.mla_decode(q, kv, bt, sl, 0.05, cfg["r"], **kw)
        torch.cuda.synchronize()
        res["tma_ran"] = bool(md.LAST_LAUNCH["config"].tma)
        res["num_splits"] = md.LAST_LAUNCH["num_splits"]
        res["per_seq_err_vs_plain"] = [round((out[b].float() - plain[b].float()).abs().max().item(), 4)
                                       for b in range(len(cfg["lens"]))]
        res["per_seq_finite"] = [bool(torch.isfinite(out[b]).all()) for b in range(len(cfg["lens"]))]
        if cfg["starts"] is None:
            ref = _ref32(q, kv, bt, sl, 0.05, cfg["r"])
            res["plain_err_vs_ref"] = round((plain.float() - ref).abs().max().item(), 4)
        # where within a bad sequence: which heads / column ranges
        bad = [b for b, e in enumerate(res["per_seq_err_vs_plain"]) if not (e < 0.03)]
        if bad:
            b = bad[0]
            d = (out[b].float() - plain[b].float()).abs()
            res["bad_heads"] = [h for h in range(cfg["H"]) if d[h].max() > 0.03]
            res["bad_col_blocks_of_64"] = [c for c in range(cfg["r"] // 64) if d[:, c * 64:(c + 1) * 64].max() > 0.03]
    except Exception as e:  # noqa: BLE001 - recorded: an illegal memory access is a result here
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--out"]:
        run_all(sys.argv[2])
    else:
        run_one(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else CASES[sys.argv[1]])
