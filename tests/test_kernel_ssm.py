"""SSM kernels (causal conv1d, Mamba-1 selective scan, Mamba-2 SSD): Triton vs torch refs vs transformers.

Three layers of checks:

* each Triton kernel against its ``*_ref`` twin (``MLA_FUSER_BACKEND=triton``; on a machine without a
  GPU under Triton's interpreter, on tiny shapes);
* each ``*_ref`` against transformers' own torch fallbacks (``causal_conv1d_fn``, ``causal_conv1d_update``,
  ``mamba_selective_scan``, ``mamba_selective_state_update``, ``mamba2_chunk_scan``,
  ``mamba2_selective_state_update``), fp32 and bf16;
* whole tiny ``MambaMixer`` / ``Mamba2Mixer`` forwards (prefill, then decode steps through a
  ``DynamicCache``) with the kernels patched into the module-level hook points, against the unpatched
  mixer.

About ``TRITON_INTERPRET`` (checked on triton 3.9): ``triton.jit`` reads it when it wraps a function, and
``triton.language``'s own ``@jit`` helpers (``tl.zeros``, ``tl.sum``, ``tl.cumsum``, ``tl.sigmoid``) are
wrapped when ``import triton`` runs, i.e. at import time.  The SSM kernels are wrapped lazily at their first
launch, once per mode (``dispatch.LazyJit``), and use only builtins, so setting the variable at *call*
time is enough whatever imported triton before (in a full run ``test_kernel_fused_moe`` does, at
collection).  An autouse fixture sets it per test (monkeypatch) on machines without CUDA, and
``MLA_FUSER_BACKEND=triton`` for the tests that compare kernels with refs; nothing leaks into other test
files.  With a CUDA device the same tests run the compiled kernels on it.
"""

from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()

try:
    import mla_fuser  # noqa: F401
except ImportError:  # running from a checkout without installing it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mla_fuser.kernels import causal_conv1d as conv_mod  # noqa: E402
from mla_fuser.kernels.dispatch import triton_available  # noqa: E402
from mla_fuser.kernels import selective_scan as scan_mod  # noqa: E402
from mla_fuser.kernels.causal_conv1d import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from mla_fuser.kernels.selective_scan import (  # noqa: E402
    selective_scan,
    selective_scan_ref,
    selective_state_update,
    selective_state_update_ref,
)
from mla_fuser.kernels.ssd import (  # noqa: E402
    mamba_chunk_scan_combined,
    ssd_chunk_scan,
    ssd_chunk_scan_ref,
    ssd_state_update,
    ssd_state_update_ref,
)

transformers = pytest.importorskip("transformers")
from transformers.models.mamba import modeling_mamba as hf_mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def hf(fn):
    """transformers' torch fallback behind its hub/package wrapper."""
    return getattr(fn, "__wrapped__", fn)


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def close(a, b, dtype=torch.float32, tol=None):
    tol = TOL[dtype] if tol is None else tol
    assert torch.isfinite(a.float()).all()
    r = rel(a, b)
    assert r < tol, f"relative error {r:.3g} >= {tol:g}"


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(DEV, dtype)


# ----------------------------------------------------------------------------------------------------
# causal conv1d
# ----------------------------------------------------------------------------------------------------


def conv_inputs(B=2, C=24, L=19, W=4, dtype=torch.float32, channel_last=True, bias=True):
    x = rnd(B, L, C, dtype=dtype).transpose(1, 2) if channel_last else rnd(B, C, L, dtype=dtype)
    w = rnd(C, W, dtype=dtype, scale=0.5)
    b = rnd(C, dtype=dtype, scale=0.2) if bias else None
    return x, w, b


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channel_last,bias,act,W", [(True, True, "silu", 4), (False, False, None, 2), (True, False, "swish", 3)])
def test_conv_triton_vs_ref(triton_backend, dtype, channel_last, bias, act, W):
    x, w, b = conv_inputs(W=W, dtype=dtype, channel_last=channel_last, bias=bias)
    out, fin = causal_conv1d(x, w, b, act, return_final_states=True)
    ref, fin_ref = causal_conv1d_ref(x, w, b, act, return_final_states=True)
    close(out, ref, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)
    assert out.stride(1) == (1 if channel_last else out.shape[2])  # layout follows the input
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)  # a copy: exact
    assert fin.shape[-1] == W


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_ref_vs_transformers(dtype):
    x, w, b = conv_inputs(dtype=dtype)
    for mod in (hf_mamba, hf_mamba2):
        close(causal_conv1d_ref(x, w, b, "silu"), hf(mod.causal_conv1d_fn)(x, w, b, activation="silu"), dtype)
        close(causal_conv1d_ref(x, w, None, None), hf(mod.causal_conv1d_fn)(x, w, None, activation=None), dtype)


def test_conv_final_state_is_transformers_cache_window():
    """transformers' cache keeps the last W inputs, left zero-padded for short prompts."""
    for L in (2, 9):
        x, w, b = conv_inputs(L=L)
        _, fin = causal_conv1d_ref(x, w, b, "silu", return_final_states=True)
        padded = F.pad(x, (max(0, 4 - L), 0))[..., -4:]
        torch.testing.assert_close(fin, padded, rtol=0, atol=0)


@needs_triton
def test_conv_initial_states_chunked_prefill(triton_backend):
    x, w, b = conv_inputs(L=23)
    full = causal_conv1d(x, w, b, "silu")
    o1, s1 = causal_conv1d(x[..., :10], w, b, "silu", return_final_states=True)
    o2, s2 = causal_conv1d(x[..., 10:], w, b, "silu", initial_states=s1, return_final_states=True)
    close(torch.cat([o1, o2], -1), full)
    torch.testing.assert_close(s2, x[..., -4:], rtol=0, atol=0)
    # the package convention (W-1 columns) works as initial state too
    o2b = causal_conv1d(x[..., 10:], w, b, "silu", initial_states=s1[..., 1:])
    close(o2b, o2)
    r2 = causal_conv1d_ref(x[..., 10:], w, b, "silu", initial_states=s1)
    close(o2, r2)


@needs_triton
def test_conv_seq_idx_packed_equals_separate(triton_backend):
    x, w, b = conv_inputs(B=1, L=21)
    cut = 8
    seq = torch.tensor([[0] * cut + [1] * (21 - cut)], dtype=torch.int32, device=DEV)
    out, fin = causal_conv1d(x, w, b, "silu", seq_idx=seq, return_final_states=True)
    a = causal_conv1d(x[..., :cut], w, b, "silu")
    c, fin_c = causal_conv1d(x[..., cut:], w, b, "silu", return_final_states=True)
    close(out, torch.cat([a, c], -1))
    torch.testing.assert_close(fin, fin_c)
    ref, fin_ref = causal_conv1d_ref(x, w, b, "silu", seq_idx=seq, return_final_states=True)
    close(out, ref)
    torch.testing.assert_close(fin, fin_ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_len,T,squeeze", [(4, 1, True), (4, 1, False), (3, 3, False), (6, 2, False)])
def test_conv_update_triton_vs_ref(triton_backend, dtype, state_len, T, squeeze):
    B, C, W = 2, 40, 4
    _, w, b = conv_inputs(C=C, W=W, dtype=dtype)
    x = rnd(B, C, dtype=dtype) if squeeze else rnd(B, C, T, dtype=dtype)
    st = rnd(B, C, state_len, dtype=dtype)
    st_ref = st.clone()
    out = causal_conv1d_update(x, st, w, b, "silu")
    ref = causal_conv1d_update_ref(x, st_ref, w, b, "silu")
    assert out.shape == x.shape
    close(out, ref, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_ref_vs_transformers(dtype):
    _, w, b = conv_inputs(dtype=dtype)
    x = rnd(2, 24, 1, dtype=dtype)
    st = rnd(2, 24, 4, dtype=dtype)
    st_hf = st.clone()
    out = causal_conv1d_update_ref(x, st, w, b, "silu")
    out_hf = hf(hf_mamba2.causal_conv1d_update)(x, st_hf, w, b, "silu")
    close(out, out_hf, dtype)
    torch.testing.assert_close(st, st_hf, rtol=0, atol=0)


@needs_triton
def test_conv_prefill_then_steps_equals_full(triton_backend):
    x, w, b = conv_inputs(L=15)
    full = causal_conv1d(x, w, b, "silu")
    out, st = causal_conv1d(x[..., :9], w, b, "silu", return_final_states=True)
    steps = [causal_conv1d_update(x[..., t], st, w, b, "silu") for t in range(9, 15)]
    close(torch.stack(steps, -1), full[..., 9:])


# ----------------------------------------------------------------------------------------------------
# Mamba-1 selective scan
# ----------------------------------------------------------------------------------------------------


def scan_inputs(B=2, I=12, N=5, L=21, dtype=torch.float32, groups=None):
    u = rnd(B, L, I, dtype=dtype).transpose(1, 2)  # channel-last, like the mixer's view
    delta = rnd(B, I, L, dtype=dtype, scale=0.5)
    A = -torch.rand(I, N, device=DEV) * 2 - 0.1
    if groups:
        Bm, Cm = rnd(B, groups, N, L, dtype=dtype), rnd(B, groups, N, L, dtype=dtype)
    else:
        Bm, Cm = rnd(B, L, N, dtype=dtype).transpose(1, 2), rnd(B, N, L, dtype=dtype)
    D = rnd(I)
    z = rnd(B, I, L, dtype=dtype)
    bias = rnd(I, scale=0.3)
    return u, delta, A, Bm, Cm, D, z, bias


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_dz,groups,softplus", [(True, None, True), (False, 3, True), (True, None, False)])
def test_selective_scan_triton_vs_ref(triton_backend, dtype, with_dz, groups, softplus):
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(dtype=dtype, groups=groups)
    if not softplus:
        delta = delta.abs()  # keep dt >= 0 without softplus
    if not with_dz:
        D = z = None
    out, last = selective_scan(u, delta, A, Bm, Cm, D, z, bias, softplus, True)
    ref, last_ref = selective_scan_ref(u, delta, A, Bm, Cm, D, z, bias, softplus, True)
    assert out.dtype == dtype and last.dtype == torch.float32 and last.shape == (2, 12, 5)
    close(out, ref, dtype)
    close(last, last_ref, torch.float32, tol=1e-5)
    only = selective_scan(u, delta, A, Bm, Cm, D, z, bias, softplus)
    assert isinstance(only, torch.Tensor)


@needs_triton
def test_selective_scan_without_prefetch():
    """The kernel's non-prefetching loop (a tuning switch) computes the same thing."""
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(L=19)
    out, last = scan_mod._scan_launch(u, delta, A, Bm, Cm, D, z, bias, True, None, True, prefetch=False)
    ref, last_ref = selective_scan_ref(u, delta, A, Bm, Cm, D, z, bias, True, True)
    close(out, ref)
    close(last, last_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_ref_vs_transformers(dtype):
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(dtype=dtype)
    out, last = selective_scan_ref(u, delta, A, Bm, Cm, D, z, bias, True, True)
    out_hf, last_hf = hf(hf_mamba.mamba_selective_scan)(u, delta, A, Bm, Cm, D=D, z=z, delta_bias=bias,
                                                        delta_softplus=True, return_last_state=True)
    close(out, out_hf, dtype)
    close(last, last_hf, dtype)


@needs_triton
def test_selective_scan_seq_idx(triton_backend):
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(B=1, L=21)
    cut = 9
    seq = torch.tensor([[0] * cut + [1] * (21 - cut)], dtype=torch.int32, device=DEV)
    out, last = selective_scan(u, delta, A, Bm, Cm, D, z, bias, True, True, seq_idx=seq)
    sl = slice(cut, None)
    tail, last_tail = selective_scan(u[..., sl], delta[..., sl], A, Bm[..., sl], Cm[..., sl], D, z[..., sl], bias, True, True)
    head = selective_scan(u[..., :cut], delta[..., :cut], A, Bm[..., :cut], Cm[..., :cut], D, z[..., :cut], bias, True)
    close(out, torch.cat([head, tail], -1))
    close(last, last_tail)
    ref = selective_scan_ref(u, delta, A, Bm, Cm, D, z, bias, True, seq_idx=seq)
    close(out, ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_state_update_mamba1(triton_backend, dtype):
    B, I, N = 2, 40, 5
    st = rnd(B, I, N)
    x, dt, z = rnd(B, I, dtype=dtype), rnd(B, I, dtype=dtype), rnd(B, I, dtype=dtype)
    A = -torch.rand(I, N, device=DEV)
    Bv, Cv = rnd(B, N, dtype=dtype), rnd(B, N, dtype=dtype)
    D, bias = rnd(I), rnd(I)
    st_ref, st_hf = st.clone(), st.clone()
    y = selective_state_update(st, x, dt, A, Bv, Cv, D, z, bias, True)
    y_ref = selective_state_update_ref(st_ref, x, dt, A, Bv, Cv, D, z, bias, True)
    y_hf = hf(hf_mamba.mamba_selective_state_update)(st_hf, x, dt, A, Bv, Cv, D, dt_bias=bias, dt_softplus=True, z=z)
    close(y, y_ref, dtype)
    close(st, st_ref, torch.float32, tol=1e-5)
    close(y_ref, y_hf, dtype)
    close(st_ref, st_hf, dtype)


@needs_triton
def test_selective_scan_prefill_then_steps_equals_full(triton_backend):
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(L=14)
    full = selective_scan(u, delta, A, Bm, Cm, D, z, bias, True)
    k = 8
    _, st = selective_scan(u[..., :k], delta[..., :k], A, Bm[..., :k], Cm[..., :k], D, z[..., :k], bias, True, True)
    ys = [selective_state_update(st, u[..., t], delta[..., t], A, Bm[..., t], Cm[..., t], D, z[..., t], bias, True)
          for t in range(k, 14)]
    close(torch.stack(ys, -1), full[..., k:])


# ----------------------------------------------------------------------------------------------------
# Mamba-2 SSD
# ----------------------------------------------------------------------------------------------------


def ssd_inputs(B=2, L=37, H=4, P=6, G=2, N=5, dtype=torch.float32):
    x = rnd(B, L, H, P, dtype=dtype)
    dt = rnd(B, L, H, dtype=dtype)
    A = -torch.rand(H, device=DEV) * 2 - 0.1
    Bm, Cm = rnd(B, L, G, N, dtype=dtype), rnd(B, L, G, N, dtype=dtype)
    D = rnd(H)
    bias = rnd(H, scale=0.3)
    init = rnd(B, H, P, N)
    z = rnd(B, L, H, P, dtype=dtype)
    return x, dt, A, Bm, Cm, D, bias, init, z


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "init_z_Dhp_limit", "one_group_no_bias"])
def test_ssd_triton_vs_ref(triton_backend, dtype, variant):
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(dtype=dtype, G=1 if variant == "one_group_no_bias" else 2)
    kw = dict(chunk_size=8, D=D, z=None, dt_bias=bias, dt_softplus=True, initial_states=None, dt_limit=(0.0, float("inf")))
    if variant == "init_z_Dhp_limit":
        kw.update(D=rnd(4, 6), z=z, initial_states=init, dt_limit=(0.05, 1.5))
    if variant == "one_group_no_bias":
        kw.update(dt_bias=None, D=None)
    y, fin = ssd_chunk_scan(x, dt, A, Bm, Cm, **kw)
    y_ref, fin_ref = ssd_chunk_scan_ref(x, dt, A, Bm, Cm, **kw)
    assert y.dtype == dtype and fin.dtype == torch.float32 and fin.shape == (2, 4, 6, 5)
    close(y, y_ref, dtype)
    close(fin, fin_ref, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_ref_vs_transformers(dtype):
    """Sequential ref == transformers' chunked torch path: L=37 over chunks of 8, 2 groups for 4 heads."""
    x, dt, A, Bm, Cm, D, bias, init, _ = ssd_inputs(dtype=dtype)
    y, fin = ssd_chunk_scan_ref(x, dt, A, Bm, Cm, 8, D, None, bias, True, init)
    y_hf, fin_hf = hf(hf_mamba2.mamba2_chunk_scan)(x, dt, A, Bm, Cm, chunk_size=8, D=D, dt_bias=bias, initial_states=init,
                                                   dt_softplus=True, return_final_states=True)
    # (bf16: transformers adds dt_bias and applies softplus in bf16, mamba_ssm and we in fp32)
    close(y, y_hf, dtype, tol=1e-5 if dtype == torch.float32 else None)
    close(fin, fin_hf, dtype, tol=1e-5 if dtype == torch.float32 else None)


@needs_triton
def test_ssd_seq_idx(triton_backend):
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(B=1, L=37)
    cut = 21  # not on a 16-token tile boundary
    seq = torch.tensor([[0] * cut + [1] * (37 - cut)], dtype=torch.int32, device=DEV)
    y, fin = ssd_chunk_scan(x, dt, A, Bm, Cm, 8, D, z, bias, True, init, seq_idx=seq)
    h, _ = ssd_chunk_scan(x[:, :cut], dt[:, :cut], A, Bm[:, :cut], Cm[:, :cut], 8, D, z[:, :cut], bias, True, init)
    t, fin_t = ssd_chunk_scan(x[:, cut:], dt[:, cut:], A, Bm[:, cut:], Cm[:, cut:], 8, D, z[:, cut:], bias, True)
    close(y, torch.cat([h, t], 1))
    close(fin, fin_t)
    y_ref, fin_ref = ssd_chunk_scan_ref(x, dt, A, Bm, Cm, 8, D, z, bias, True, init, seq_idx=seq)
    close(y, y_ref)
    close(fin, fin_ref)


@needs_triton
def test_mamba_chunk_scan_combined_api(triton_backend):
    x, dt, A, Bm, Cm, D, bias, init, _ = ssd_inputs(L=12)
    out = mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 8, D=D, dt_bias=bias, dt_softplus=True)
    assert isinstance(out, torch.Tensor)
    out2, fin = mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 8, D=D, dt_bias=bias, dt_softplus=True,
                                          initial_states=init, return_final_states=True, z=None)
    assert fin.shape == (2, 4, 6, 5)
    with pytest.raises(NotImplementedError):
        mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 8, return_varlen_states=True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_state_update(triton_backend, dtype):
    B, H, P, G, N = 2, 4, 20, 2, 5
    st = rnd(B, H, P, N)
    x, z = rnd(B, H, P, dtype=dtype), rnd(B, H, P, dtype=dtype)
    dt = rnd(B, H, dtype=dtype)
    A = -torch.rand(H, device=DEV)
    Bv, Cv = rnd(B, G, N, dtype=dtype), rnd(B, G, N, dtype=dtype)
    D, bias = rnd(H), rnd(H)
    st_ref = st.clone()
    y = ssd_state_update(st, x, dt, A, Bv, Cv, D, z, bias, True)
    y_ref = ssd_state_update_ref(st_ref, x, dt, A, Bv, Cv, D, z, bias, True)
    close(y, y_ref, dtype)
    close(st, st_ref, torch.float32, tol=1e-5)
    # the Mamba2 mixer's call: broadcast views of dt / A / D / dt_bias, z=None
    st2, st_hf = st.clone(), st.clone()
    args = (x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), Bv, Cv, D[:, None].expand(-1, P))
    kw = dict(z=None, dt_bias=bias[:, None].expand(-1, P), dt_softplus=True)
    y2 = selective_state_update(st2, *args, **kw)
    y_hf = hf(hf_mamba2.mamba2_selective_state_update)(st_hf, *args, **kw)
    close(y2, y_hf, dtype)
    close(st2, st_hf, dtype, tol=1e-5 if dtype == torch.float32 else None)  # bf16: transformers rounds dt + bias


@needs_triton
def test_ssd_prefill_then_steps_equals_full(triton_backend):
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(L=29)
    full, fin_full = ssd_chunk_scan(x, dt, A, Bm, Cm, 8, D, z, bias, True)
    k = 22
    _, st = ssd_chunk_scan(x[:, :k], dt[:, :k], A, Bm[:, :k], Cm[:, :k], 8, D, z[:, :k], bias, True)
    ys = [ssd_state_update(st, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D, z[:, t], bias, True) for t in range(k, 29)]
    close(torch.stack(ys, 1), full[:, k:])
    close(st, fin_full)


# ----------------------------------------------------------------------------------------------------
# dispatch and custom ops
# ----------------------------------------------------------------------------------------------------


def test_torch_backend_runs_refs(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(L=9)
    y, fin = ssd_chunk_scan(x, dt, A, Bm, Cm, 8, D, z, bias, True, init)
    y_ref, fin_ref = ssd_chunk_scan_ref(x, dt, A, Bm, Cm, 8, D, z, bias, True, init)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(fin, fin_ref, rtol=0, atol=0)


@needs_triton
def test_custom_ops_match_refs():
    """The torch.library ops (what torch.compile sees; eager calls launch the kernels directly)."""
    ops = torch.ops.mla_fuser
    x, w, b = conv_inputs()
    out, fin = ops.causal_conv1d_fwd(x, w, b, None, None, True, 4)
    ref, fin_ref = causal_conv1d_ref(x, w, b, "silu", return_final_states=True)
    close(out, ref)
    torch.testing.assert_close(fin, fin_ref)
    st = rnd(2, 24, 4)
    st_ref = st.clone()
    xs = rnd(2, 24)
    close(ops.causal_conv1d_update(xs, st, w, b, True), causal_conv1d_update_ref(xs, st_ref, w, b, "silu"))
    torch.testing.assert_close(st, st_ref)
    u, delta, A, Bm, Cm, D, z, bias = scan_inputs(L=9)
    out, last = ops.selective_scan_fwd(u, delta, A, Bm, Cm, D, z, bias, True, None, True)
    ref, last_ref = selective_scan_ref(u, delta, A, Bm, Cm, D, z, bias, True, True)
    close(out, ref)
    close(last, last_ref)
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(L=9)
    y, f = ops.ssd_chunk_scan_fwd(x, dt, A, Bm, Cm, D, z, bias, True, init, None, 0.0, float("inf"))
    y_ref, f_ref = ssd_chunk_scan_ref(x, dt, A, Bm, Cm, 8, D, z, bias, True, init)
    close(y, y_ref)
    close(f, f_ref)
    st = rnd(2, 4, 6, 5)
    st_ref = st.clone()
    args = (x[:, 0], dt[:, 0, :, None].expand(-1, -1, 6), A[:, None, None].expand(-1, 6, 5), Bm[:, 0], Cm[:, 0],
            D[:, None].expand(-1, 6), None, bias[:, None].expand(-1, 6), True)
    close(ops.selective_state_update(st, *args), selective_state_update_ref(st_ref, *args))
    close(st, st_ref)


def _opcheck_cases():
    u = rnd(2, 11, 8).transpose(1, 2)  # channel-last [B, I, L]
    d, A1 = rnd(2, 8, 11), -torch.rand(8, 4, device=DEV)
    B1, C1 = rnd(2, 4, 11), rnd(2, 4, 11)
    x, dt, A, Bm, Cm, D, bias, init, z = ssd_inputs(L=9)
    ops = torch.ops.mla_fuser
    return {
        "causal_conv1d_fwd": (ops.causal_conv1d_fwd, (u, rnd(8, 4), rnd(8), None, None, True, 4)),
        "causal_conv1d_update": (ops.causal_conv1d_update, (rnd(2, 24), rnd(2, 24, 4), rnd(24, 4), None, True)),
        "selective_scan_fwd": (ops.selective_scan_fwd, (u, d, A1, B1, C1, None, None, None, True, None, True)),
        "selective_state_update": (ops.selective_state_update,
                                   (rnd(2, 8, 4), rnd(2, 8), rnd(2, 8), A1, rnd(2, 4), rnd(2, 4), None, None, None, True)),
        "ssd_chunk_scan_fwd": (ops.ssd_chunk_scan_fwd,
                               (x, dt, A, Bm, Cm, D, None, bias, True, init, None, 0.0, float("inf"))),
    }


@needs_triton
@pytest.mark.parametrize("name", ["causal_conv1d_fwd", "causal_conv1d_update", "selective_scan_fwd",
                                  "selective_state_update", "ssd_chunk_scan_fwd"])
def test_custom_op_opcheck(name):
    """Schema, fake (meta) implementation and AOT dispatch of each torch.library op (torch.compile's view)."""
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------------------------------
# whole mixers through the hook points
# ----------------------------------------------------------------------------------------------------

MAMBA1_HOOKS = {
    "causal_conv1d_fn": causal_conv1d,
    "causal_conv1d_update": causal_conv1d_update,
    "mamba_selective_scan": selective_scan,
    "mamba_selective_state_update": selective_state_update,
}
MAMBA2_HOOKS = {
    "causal_conv1d_fn": causal_conv1d,
    "causal_conv1d_update": causal_conv1d_update,
    "mamba2_chunk_scan": mamba_chunk_scan_combined,
    "mamba2_selective_state_update": selective_state_update,
}


def _run_mixer(mixer, config, h, steps, monkeypatch=None, module=None, hooks=None):
    from transformers.cache_utils import DynamicCache

    if monkeypatch is not None:
        for k, v in hooks.items():
            assert hasattr(module, k), f"transformers moved hook point {k}"
            monkeypatch.setattr(module, k, v)
    with torch.no_grad():
        plain = mixer(h)
        cache = DynamicCache(config=config)
        outs = [mixer(h, cache=cache)]
        for s in steps:
            outs.append(mixer(s, cache=cache))
    return plain, outs, cache


@needs_triton
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_mixer_with_hooks_matches_torch_fallback(triton_backend, monkeypatch, kind):
    if kind == "mamba":
        from transformers import MambaConfig

        config = MambaConfig(hidden_size=16, state_size=5, time_step_rank=4, conv_kernel=4, num_hidden_layers=1,
                             use_associative_scan=False)
        mixer = hf_mamba.MambaMixer(config, layer_idx=0)
        module, hooks = hf_mamba, MAMBA1_HOOKS
    else:
        from transformers import Mamba2Config

        config = Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=5, n_groups=2, conv_kernel=4,
                              chunk_size=8, expand=2, num_hidden_layers=1)
        mixer = hf_mamba2.Mamba2Mixer(config, layer_idx=0)
        module, hooks = hf_mamba2, MAMBA2_HOOKS
    mixer = mixer.to(DEV).eval()
    h = rnd(2, 11, 16)
    steps = [rnd(2, 1, 16) for _ in range(3)]
    plain_ref, outs_ref, cache_ref = _run_mixer(mixer, config, h, steps)
    plain, outs, cache = _run_mixer(mixer, config, h, steps, monkeypatch, module, hooks)
    close(plain, plain_ref, tol=1e-4)
    for o, r in zip(outs, outs_ref):
        close(o, r, tol=1e-4)
    if hasattr(cache, "get_recurrent_state"):  # transformers >= 5.2x cache API (5.17 has no getter)
        close(cache.get_recurrent_state(0), cache_ref.get_recurrent_state(0), tol=1e-4)
        torch.testing.assert_close(cache.get_conv_state(0), cache_ref.get_conv_state(0))
