#!/usr/bin/env python
"""Benchmark mla_fuser's SSM kernels (causal conv1d, Mamba-1 selective scan, Mamba-2 SSD) on a GPU.

Why: the kernels exist to make transformers' Mamba / Mamba-2 mixers fast without ``mamba_ssm`` /
``causal_conv1d``; this script measures them, at the shapes of real checkpoints, against the torch
fallback transformers runs today, and checks on the way that the results still match the references.

Shapes (bf16, batch 1, 2048 prompt tokens; targets on an H200 in brackets):

* Mamba-2 2.7B mixer: hidden 2560, 80 heads x 64, N = 128, 1 group, conv width 4, chunk 256
  [conv + SSD <= 2 ms per layer];
* Mamba-1 1.4B mixer: hidden 2048, I = 4096, N = 16, dt rank 128, conv width 4 [conv + scan <= 2.5 ms];
* decode (one token, after the prompt): conv update + state update [<= 0.3 ms per layer].

For each: the kernel time (median of ``triton.testing.do_bench``), the torch fallback's time
(transformers' module-level ``causal_conv1d_fn`` / ``mamba_selective_scan`` / ``mamba2_chunk_scan`` /
state-update functions, called unwrapped), the relative error of the kernel against the fp32 torch
reference, and whole-mixer forwards (torch fallback vs the same mixer with the kernels patched into
the module-level hook points the mixer calls).  ``--sweep`` also times a few tile configurations.

Usage::

    python benchmarks/bench_ssm_kernels.py                # GPU; writes benchmarks/results/ssm_kernels.json
    python benchmarks/bench_ssm_kernels.py --dry-run      # CPU, Triton interpreter, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter on tiny shapes (smoke test)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/ssm_kernels.json; a dry run writes to the temp dir)")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sweep", action="store_true", help="also time a few tile configurations")
    p.add_argument("--no-mixer", action="store_true", help="skip whole-mixer timings")
    return p.parse_args(argv)


ARGS = _parse_args()
if ARGS.out is None:
    ARGS.out = (os.path.join(tempfile.gettempdir(), "ssm_kernels_dryrun.json") if ARGS.dry_run
                else os.path.join(_REPO, "benchmarks", "results", "ssm_kernels.json"))
if ARGS.dry_run:
    # Triton decorates its own library functions when it is imported: the interpreter switch has to be
    # in the environment before the first `import triton` (torch and transformers import it lazily).
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["MLA_FUSER_BACKEND"] = "triton"
sys.path.insert(0, _REPO)

import torch  # noqa: E402

from mla_fuser.kernels import causal_conv1d as conv_mod  # noqa: E402
from mla_fuser.kernels import selective_scan as scan_mod  # noqa: E402
from mla_fuser.kernels import ssd as ssd_mod  # noqa: E402

DEVICE = "cpu" if ARGS.dry_run else "cuda"


# ----------------------------------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------------------------------

if ARGS.dry_run:
    M2 = dict(hidden=32, heads=4, head_dim=16, state=16, groups=1, conv=4, chunk=16, seqlen=40, batch=1)
    M1 = dict(hidden=16, inner=32, state=16, dt_rank=4, conv=4, seqlen=24, batch=1)
else:
    M2 = dict(hidden=2560, heads=80, head_dim=64, state=128, groups=1, conv=4, chunk=256,
              seqlen=ARGS.seqlen, batch=ARGS.batch)
    M1 = dict(hidden=2048, inner=4096, state=16, dt_rank=128, conv=4, seqlen=ARGS.seqlen, batch=ARGS.batch)


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def bench(fn, quick=False):
    """Median milliseconds of fn()."""
    if ARGS.dry_run:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=40 if quick else 200, return_mode="median"))


def bench_graph(fn):
    """GPU-only time of fn() replayed from a CUDA graph (no Python / launch overhead), or None."""
    if ARGS.dry_run:
        return None
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception as e:  # capture can fail on odd setups; the eager number still stands
        print(f"  (cuda graph timing failed: {type(e).__name__}: {str(e)[:120]})")
        return None


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def unwrapped(module, name):
    """transformers' torch fallback of a hooked function (bypassing the hub/package wrapper)."""
    fn = getattr(module, name, None)
    if fn is None:
        return None
    return getattr(fn, "__wrapped__", fn)


@contextlib.contextmanager
def patched(module, mapping):
    """Point a modeling module's hook functions at mla_fuser's (the mixers look them up at call time)."""
    old = {k: getattr(module, k) for k in mapping if hasattr(module, k)}
    missing = [k for k in mapping if k not in old]
    if missing:
        raise AttributeError(f"{module.__name__} has no {missing}")
    for k, v in mapping.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def record(results, key, **kw):
    results[key] = kw
    cells = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())
    print(f"{key:40s} {cells}", flush=True)


def safe(results, key, fn):
    try:
        fn()
    except Exception as e:  # keep going: one failing case should not hide the others
        results[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"{key:40s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


# ----------------------------------------------------------------------------------------------------
# Mamba-2
# ----------------------------------------------------------------------------------------------------


def mamba2_inputs(dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = M2
    inner = s["heads"] * s["head_dim"]
    conv_dim = inner + 2 * s["groups"] * s["state"]
    proj = inner + conv_dim + s["heads"]
    bsz, L = s["batch"], s["seqlen"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    zxbcdt = rnd(bsz, L, proj).to(dtype)
    gate, xBC, dt = zxbcdt.split([inner, conv_dim, s["heads"]], dim=-1)
    conv_w = rnd(conv_dim, s["conv"], scale=0.5).to(dtype)
    conv_b = rnd(conv_dim, scale=0.1).to(dtype)
    A = -torch.exp(rnd(s["heads"], scale=0.5))
    D = rnd(s["heads"])
    dt_bias = rnd(s["heads"], scale=0.5) - 3.0
    return dict(gate=gate, xBC=xBC.transpose(1, 2), dt=dt, conv_w=conv_w, conv_b=conv_b, A=A, D=D,
                dt_bias=dt_bias, inner=inner, conv_dim=conv_dim)


def bench_mamba2(results):
    s = M2
    t = mamba2_inputs()
    from transformers.models.mamba2 import modeling_mamba2 as m2

    bsz, L, H, P, G, N = s["batch"], s["seqlen"], s["heads"], s["head_dim"], s["groups"], s["state"]
    inner = t["inner"]

    def conv():
        return conv_mod.causal_conv1d(t["xBC"], t["conv_w"], t["conv_b"], "silu")

    xbc = conv()
    torch_conv = unwrapped(m2, "causal_conv1d_fn")
    ref_conv = conv_mod.causal_conv1d_ref(t["xBC"], t["conv_w"], t["conv_b"], "silu")
    conv_ms = bench(conv)
    torch_conv_ms = bench(lambda: torch_conv(t["xBC"], t["conv_w"], t["conv_b"], activation="silu")) if torch_conv else None
    record(results, "mamba2.conv1d", ms=conv_ms, torch_ms=torch_conv_ms, rel_err=rel_err(xbc, ref_conv))

    xs = xbc.transpose(1, 2)
    x, Bm, Cm = torch.split(xs, [inner, G * N, G * N], dim=-1)
    x = x.reshape(bsz, L, H, P)
    Bm = Bm.reshape(bsz, L, G, N)
    Cm = Cm.reshape(bsz, L, G, N)
    dt = t["dt"]

    def ssd():
        return ssd_mod.ssd_chunk_scan(x, dt, t["A"], Bm, Cm, s["chunk"], t["D"], None, t["dt_bias"], True)

    y, fin = ssd()
    ref_sub = slice(0, min(L, 512))  # the sequential reference is slow; check a prefix
    y_ref, f_ref = ssd_mod.ssd_chunk_scan_ref(
        x[:, ref_sub], dt[:, ref_sub], t["A"], Bm[:, ref_sub], Cm[:, ref_sub], s["chunk"], t["D"], None, t["dt_bias"], True
    )
    y_pre, f_pre = ssd_mod.ssd_chunk_scan(
        x[:, ref_sub], dt[:, ref_sub], t["A"], Bm[:, ref_sub], Cm[:, ref_sub], s["chunk"], t["D"], None, t["dt_bias"], True
    )
    ssd_ms = bench(ssd)
    torch_ssd = unwrapped(m2, "mamba2_chunk_scan")
    torch_ssd_ms = None
    if torch_ssd is not None:
        torch_ssd_ms = bench(lambda: torch_ssd(x, dt, t["A"], Bm, Cm, chunk_size=s["chunk"], D=t["D"], dt_bias=t["dt_bias"],
                                               dt_softplus=True, return_final_states=True), quick=True)
    record(results, "mamba2.ssd_chunk_scan", ms=ssd_ms, torch_ms=torch_ssd_ms,
           rel_err_y=rel_err(y_pre, y_ref), rel_err_state=rel_err(f_pre, f_ref))
    record(results, "mamba2.conv+ssd", ms=conv_ms + ssd_ms, target_ms=2.0,
           torch_ms=(torch_conv_ms + torch_ssd_ms) if (torch_conv_ms and torch_ssd_ms) else None)

    if ARGS.sweep and not ARGS.dry_run:
        sweep = {}
        configs = [(bl, bp, w, None) for bl in (32, 64, 128) for bp in (32, 64) for w in (4, 8)]
        configs += [(64, 64, 4, st) for st in (1, 2, 3, 4)]
        for block_l, block_p, warps, stages in configs:
            key = f"L{block_l}_P{block_p}_w{warps}" + (f"_s{stages}" if stages else "")
            try:
                fn = lambda: ssd_mod._ssd_launch(x, dt, t["A"], Bm, Cm, t["D"], None, t["dt_bias"], True, None, None,  # noqa: E731
                                                 0.0, math.inf, block_l=block_l, block_p=block_p, num_warps=warps,
                                                 num_stages=stages)
                sweep[key] = bench(fn, quick=True)
            except Exception as e:
                sweep[key] = f"{type(e).__name__}: {str(e)[:120]}"
        results["mamba2.ssd_sweep_ms"] = sweep
        print("mamba2.ssd_sweep_ms", json.dumps(sweep), flush=True)

    # decode: one token after the prompt
    conv_state = t["xBC"][..., -s["conv"]:].contiguous()
    ssm_state = fin.clone()
    x1 = torch.randn(bsz, t["conv_dim"], device=DEVICE, dtype=torch.bfloat16)
    dt1 = dt[:, -1]

    def decode():
        xc = conv_mod.causal_conv1d_update(x1, conv_state, t["conv_w"], t["conv_b"], "silu")
        xh, B1, C1 = torch.split(xc, [inner, G * N, G * N], dim=-1)
        return ssd_mod.ssd_state_update(ssm_state, xh.view(bsz, H, P), dt1, t["A"], B1.view(bsz, G, N), C1.view(bsz, G, N),
                                        t["D"], None, t["dt_bias"], True)

    cs2, ss2 = conv_state.clone(), ssm_state.clone()
    y1 = decode()
    xc_ref = conv_mod.causal_conv1d_update_ref(x1, cs2, t["conv_w"], t["conv_b"], "silu")
    xh, B1, C1 = torch.split(xc_ref, [inner, G * N, G * N], dim=-1)
    y1_ref = ssd_mod.ssd_state_update_ref(ss2, xh.view(bsz, H, P), dt1, t["A"], B1.view(bsz, G, N), C1.view(bsz, G, N),
                                          t["D"], None, t["dt_bias"], True)
    dec_ms = bench(decode)
    torch_upd = unwrapped(m2, "mamba2_selective_state_update")
    torch_cupd = unwrapped(m2, "causal_conv1d_update")
    torch_dec_ms = None
    if torch_upd is not None and torch_cupd is not None:
        def torch_decode():
            xc = torch_cupd(x1[..., None], conv_state, t["conv_w"], t["conv_b"], "silu")[..., 0]
            xh, B1, C1 = torch.split(xc, [inner, G * N, G * N], dim=-1)
            return torch_upd(ssm_state, xh.view(bsz, H, P), dt1[..., None].expand(-1, -1, P),
                             t["A"][:, None, None].expand(-1, P, N), B1.view(bsz, G, N), C1.view(bsz, G, N),
                             t["D"][:, None].expand(-1, P), dt_bias=t["dt_bias"][:, None].expand(-1, P), dt_softplus=True)
        torch_dec_ms = bench(torch_decode)
    record(results, "mamba2.decode(conv_update+state_update)", ms=dec_ms, graph_ms=bench_graph(decode),
           torch_ms=torch_dec_ms, target_ms=0.3, rel_err=rel_err(y1, y1_ref))

    if not ARGS.no_mixer:
        safe(results, "mamba2.mixer", lambda: bench_mamba2_mixer(results))


def bench_mamba2_mixer(results):
    from transformers import Mamba2Config
    from transformers.models.mamba2 import modeling_mamba2 as m2

    mod = m2
    s = M2
    cfg = Mamba2Config(hidden_size=s["hidden"], num_heads=s["heads"], head_dim=s["head_dim"], state_size=s["state"],
                       n_groups=s["groups"], conv_kernel=s["conv"], chunk_size=s["chunk"], expand=2, num_hidden_layers=1)
    torch.manual_seed(0)
    mixer = m2.Mamba2Mixer(cfg, layer_idx=0).to(DEVICE, torch.bfloat16).eval()
    hooks = {
        "causal_conv1d_fn": conv_mod.causal_conv1d,
        "causal_conv1d_update": conv_mod.causal_conv1d_update,
        "mamba2_chunk_scan": ssd_mod.mamba_chunk_scan_combined,
        "mamba2_selective_state_update": scan_mod.selective_state_update,
    }
    _mixer_prefill_then_decode(results, "mamba2", mixer, cfg, s, hooks, mod)


def _mixer_prefill_then_decode(results, kind, mixer, cfg, s, hooks, mod):
    """Prefill of ``mixer`` with Transformers' torch path vs our kernels patched into ``mod``, then the decode."""
    h = torch.randn(s["batch"], s["seqlen"], s["hidden"], device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mixer(h)
        torch_ms = bench(lambda: mixer(h), quick=True)
        with patched(mod, hooks):
            out = mixer(h)
            ms = bench(lambda: mixer(h))
    record(results, f"{kind}.mixer_prefill", ms=ms, torch_ms=torch_ms, rel_err_vs_torch=rel_err(out, ref))
    safe(results, f"{kind}.mixer_decode", lambda: _mixer_decode(results, kind, mixer, cfg, h, hooks, mod))


def _mixer_decode(results, kind, mixer, cfg, h, hooks, mod):
    """One-token mixer forwards through a DynamicCache filled by the prompt (torch vs kernels)."""
    from transformers.cache_utils import DynamicCache

    step = torch.randn(h.shape[0], 1, h.shape[2], device=DEVICE, dtype=h.dtype)
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        mixer(h, cache=cache)
        ref = mixer(step, cache=cache)
        torch_ms = bench(lambda: mixer(step, cache=cache))
        with patched(mod, hooks):
            cache2 = DynamicCache(config=cfg)
            mixer(h, cache=cache2)
            out = mixer(step, cache=cache2)
            ms = bench(lambda: mixer(step, cache=cache2))
    record(results, f"{kind}.mixer_decode", ms=ms, torch_ms=torch_ms, target_ms=0.3, rel_err_vs_torch=rel_err(out, ref))


# ----------------------------------------------------------------------------------------------------
# Mamba-1
# ----------------------------------------------------------------------------------------------------


def bench_mamba1(results):
    from transformers.models.mamba import modeling_mamba as mm

    s = M1
    g = torch.Generator(device="cpu").manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    bsz, L, I, N, R = s["batch"], s["seqlen"], s["inner"], s["state"], s["dt_rank"]
    proj = rnd(bsz, L, 2 * I).to(torch.bfloat16).transpose(1, 2)  # in_proj output, as the mixer sees it
    xin, gate = proj.chunk(2, dim=1)
    conv_w = rnd(I, s["conv"], scale=0.5).to(torch.bfloat16)
    conv_b = rnd(I, scale=0.1).to(torch.bfloat16)
    A = -torch.exp(rnd(I, N, scale=0.5))
    D = rnd(I)
    dt_bias = rnd(I, scale=0.5) - 3.0

    def conv():
        return conv_mod.causal_conv1d(xin, conv_w, conv_b, "silu")

    u = conv()
    torch_conv = unwrapped(mm, "causal_conv1d_fn")
    conv_ms = bench(conv)
    torch_conv_ms = bench(lambda: torch_conv(xin, conv_w, conv_b, activation="silu")) if torch_conv else None
    record(results, "mamba1.conv1d", ms=conv_ms, torch_ms=torch_conv_ms,
           rel_err=rel_err(u, conv_mod.causal_conv1d_ref(xin, conv_w, conv_b, "silu")))

    xdbl = rnd(bsz, L, R + 2 * N).to(torch.bfloat16)  # x_proj output
    _, Bm, Cm = torch.split(xdbl, [R, N, N], dim=-1)
    Bm, Cm = Bm.transpose(1, 2), Cm.transpose(1, 2)
    delta = rnd(bsz, I, L, scale=0.5).to(torch.bfloat16)

    def scan():
        return scan_mod.selective_scan(u, delta, A, Bm, Cm, D, gate, dt_bias, True, True)

    y, last = scan()
    sub = slice(0, min(L, 512))
    y_pre, last_pre = scan_mod.selective_scan(u[..., sub], delta[..., sub], A, Bm[..., sub], Cm[..., sub], D, gate[..., sub],
                                              dt_bias, True, True)
    y_ref, last_ref = scan_mod.selective_scan_ref(u[..., sub], delta[..., sub], A, Bm[..., sub], Cm[..., sub], D,
                                                  gate[..., sub], dt_bias, True, True)
    scan_ms = bench(scan)
    torch_scan = unwrapped(mm, "mamba_selective_scan")
    torch_scan_ms = None
    if torch_scan is not None:
        torch_scan_ms = bench(lambda: torch_scan(u, delta, A, Bm, Cm, D=D, z=gate, delta_bias=dt_bias, delta_softplus=True,
                                                 return_last_state=True), quick=True)
    record(results, "mamba1.selective_scan", ms=scan_ms, torch_ms=torch_scan_ms,
           rel_err_y=rel_err(y_pre, y_ref), rel_err_state=rel_err(last_pre, last_ref))
    record(results, "mamba1.conv+scan", ms=conv_ms + scan_ms, target_ms=2.5,
           torch_ms=(torch_conv_ms + torch_scan_ms) if (torch_conv_ms and torch_scan_ms) else None)

    if ARGS.sweep and not ARGS.dry_run:
        sweep = {}
        for block_i in (2, 4, 8, 16):
            for block_t in (16, 32, 64):
                for prefetch in (True, False):
                    key = f"I{block_i}_T{block_t}_w4_{'prefetch' if prefetch else 'noprefetch'}"
                    try:
                        fn = lambda: scan_mod._scan_launch(u, delta, A, Bm, Cm, D, gate, dt_bias, True, None, True,  # noqa: E731
                                                           block_i=block_i, block_t=block_t, num_warps=4,
                                                           prefetch=prefetch)
                        sweep[key] = bench(fn, quick=True)
                    except Exception as e:
                        sweep[key] = f"{type(e).__name__}: {str(e)[:120]}"
        results["mamba1.scan_sweep_ms"] = sweep
        print("mamba1.scan_sweep_ms", json.dumps(sweep), flush=True)

    conv_state = xin[..., -s["conv"]:].contiguous()
    ssm_state = last.clone()
    x1 = torch.randn(bsz, I, device=DEVICE, dtype=torch.bfloat16)
    z1 = gate[..., -1]
    dt1 = delta[..., -1]
    B1, C1 = Bm[..., -1], Cm[..., -1]

    def decode():
        xc = conv_mod.causal_conv1d_update(x1, conv_state, conv_w, conv_b, "silu")
        return scan_mod.selective_state_update(ssm_state, xc, dt1, A, B1, C1, D, z1, dt_bias, True)

    cs2, ss2 = conv_state.clone(), ssm_state.clone()
    y1 = decode()
    xc_ref = conv_mod.causal_conv1d_update_ref(x1, cs2, conv_w, conv_b, "silu")
    y1_ref = scan_mod.selective_state_update_ref(ss2, xc_ref, dt1, A, B1, C1, D, z1, dt_bias, True)
    dec_ms = bench(decode)
    torch_upd = unwrapped(mm, "mamba_selective_state_update")
    torch_cupd = unwrapped(mm, "causal_conv1d_update")
    torch_dec_ms = None
    if torch_upd is not None and torch_cupd is not None:
        def torch_decode():
            xc = torch_cupd(x1[..., None], conv_state, conv_w, conv_b, "silu")[..., 0]
            return torch_upd(ssm_state, xc, dt1, A, B1, C1, D, z=z1, dt_bias=dt_bias, dt_softplus=True)
        torch_dec_ms = bench(torch_decode)
    record(results, "mamba1.decode(conv_update+state_update)", ms=dec_ms, graph_ms=bench_graph(decode),
           torch_ms=torch_dec_ms, target_ms=0.3, rel_err=rel_err(y1, y1_ref))

    if not ARGS.no_mixer:
        safe(results, "mamba1.mixer", lambda: bench_mamba1_mixer(results))


def bench_mamba1_mixer(results):
    from transformers import MambaConfig
    from transformers.models.mamba import modeling_mamba as mm

    mod = mm
    s = M1
    cfg = MambaConfig(hidden_size=s["hidden"], expand=s["inner"] // s["hidden"], state_size=s["state"],
                      time_step_rank=s["dt_rank"], conv_kernel=s["conv"], num_hidden_layers=1, use_associative_scan=False)
    assert cfg.intermediate_size == s["inner"]
    torch.manual_seed(0)
    mixer = mm.MambaMixer(cfg, layer_idx=0).to(DEVICE, torch.bfloat16).eval()
    hooks = {
        "causal_conv1d_fn": conv_mod.causal_conv1d,
        "causal_conv1d_update": conv_mod.causal_conv1d_update,
        "mamba_selective_scan": scan_mod.selective_scan,
        "mamba_selective_state_update": scan_mod.selective_state_update,
    }
    _mixer_prefill_then_decode(results, "mamba1", mixer, cfg, s, hooks, mod)


# ----------------------------------------------------------------------------------------------------


def main():
    if not ARGS.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --dry-run")
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    results = {}
    meta = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dry_run": ARGS.dry_run,
        "mamba2_shape": M2,
        "mamba1_shape": M1,
        "dtype": "bfloat16",
        "timing": "median ms of triton.testing.do_bench" if not ARGS.dry_run else "one call, wall clock (interpreter)",
    }
    t0 = time.perf_counter()
    safe(results, "mamba2", lambda: bench_mamba2(results))
    safe(results, "mamba1", lambda: bench_mamba1(results))
    meta["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2, default=str)
    print(f"wrote {ARGS.out} ({meta['wall_s']:.1f}s)")


if __name__ == "__main__":
    main()
