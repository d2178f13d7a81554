"""Fused MoE experts: Triton (under the interpreter on CPU, tiny shapes) vs the torch reference, the reference
vs a naive per-token loop, the alignment invariants, and the router reference on hand-computed examples.

Interpreter mode (checked on Triton 3.9): ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function,
and Triton's own ``tl.sum``/``tl.cumsum`` helpers are wrapped when ``triton`` is imported.  The fused_moe
kernels are wrapped lazily at first launch, once per mode, and avoid those helpers, so setting the variable
at *call* time (``monkeypatch.setenv`` in the fixture below) is enough whatever imported Triton before
(``test_interpreter_flag_after_import`` checks it).  ``MLA_FUSER_BACKEND`` is read per call by
``dispatch.use_triton``.  With a GPU present the same tests run compiled on CUDA instead.

Interpreter artefacts the tolerances allow for: bf16 dot operands are upcast to fp32 there (its bf16 dot is
broken; the compiled kernel uses bf16 tensor cores) and its fp32->bf16 conversions truncate.
"""

import importlib.util
import json
import os
import sys

import pytest
import torch

if importlib.util.find_spec("mla_fuser") is None:  # plain `pytest` from the repo without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_fuser.kernels import fused_moe as fm  # noqa: E402
from mla_fuser.kernels.dispatch import triton_available  # noqa: E402

from conftest import close_to_reference as _close  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")

# Tile config small enough for the interpreter; BLOCK_M=16 is the minimum tl.dot M; SCAN_P below the pair
# count so the small path scans the ids in several steps.
TINY = {
    "gemm1": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2, SCAN_P=16),
    "gemm2": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2, SCAN_P=32),
    "gemv2": dict(BLOCK_N=8, BLOCK_K=8, num_warps=4, num_stages=2),  # 2 steps over I=16
}
H, I, E = 32, 16, 6  # hidden, intermediate, experts


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")


def _weights(dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.25).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.25).to(dtype)
    gub = (torch.randn(E, 2 * I, generator=g) * 0.5).to(dtype) if bias else None
    db = (torch.randn(E, H, generator=g) * 0.5).to(dtype) if bias else None
    return gate_up, down, gub, db


def _routing(num_tokens, topk, seed=1, weight_dtype=torch.float32):
    """Experts 3 and 5 are never picked; expert 0 is picked by every token (so by > BLOCK_M pairs once
    num_tokens > 16: exercises the small path's chunk loop and multi-block experts when aligned)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([1, 2, 4])
    ids = torch.empty(num_tokens, topk, dtype=torch.int64)
    for t in range(num_tokens):
        ids[t, 0] = 0
        ids[t, 1:] = pool[torch.randperm(3, generator=g)[: topk - 1]]
    w = torch.rand(num_tokens, topk, generator=g).to(weight_dtype)
    return ids, w


def _naive(hidden, gate_up, down, ids, w, gub, db, interleaved, act=torch.nn.functional.silu):
    """Per-token, per-k loop in float64, straight from the definition."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < gate_up.shape[0]:
                continue
            gu = gate_up[e].double() @ hidden[t].double()
            if gub is not None:
                gu = gu + gub[e].double()
            gate, up = (gu[0::2], gu[1::2]) if interleaved else (gu[:I], gu[I:])
            y = down[e].double() @ (act(gate) * up)
            if db is not None:
                y = y + db[e].double()
            out[t] += float(w[t, k]) * y
    return out


def _dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _dev_kw(kw):
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# ---------------------------------------------------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_ref_matches_naive_loop(interleaved, bias):
    gate_up, down, gub, db = _weights(torch.float32, bias)
    hidden = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    ids, w = _routing(9, 3)
    ids[4, 2] = E  # expert-parallel sentinel: dropped
    ref = fm.fused_experts_ref(
        hidden, gate_up, down, ids, w, gate_up_bias=gub, down_bias=db, interleaved=interleaved
    )
    naive = _naive(hidden, gate_up, down, ids, w, gub, db, interleaved)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)


def test_ref_gelu_and_bf16_rounding():
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    ids, w = _routing(5, 2)
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w, activation="gelu")
    naive = _naive(hidden, gate_up, down, ids, w, None, None, False, act=torch.nn.functional.gelu)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)
    # bf16 in, bf16 out, close to the fp64 definition on the bf16-rounded inputs.
    bf = [t.bfloat16() for t in (hidden, gate_up, down)]
    ref_bf = fm.fused_experts_ref(*bf, ids, w)
    naive_bf = _naive(*bf, ids, w, None, None, False)
    assert ref_bf.dtype == torch.bfloat16
    _close(ref_bf, naive_bf.bfloat16(), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# Triton vs reference
# ---------------------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("path", ["small", "aligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,interleaved", [(False, False), (True, True), (True, False), (False, True)])
def test_triton_matches_ref(path, dtype, bias, interleaved):
    gate_up, down, gub, db = _weights(dtype, bias)
    num_tokens = 18 if (bias == interleaved) else 5  # 18 tokens -> expert 0 holds 18 > BLOCK_M pairs
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    ids, w = _routing(num_tokens, 3, weight_dtype=torch.float32 if bias else dtype)
    kw = dict(gate_up_bias=gub, down_bias=db, interleaved=interleaved)
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w, **kw)
    out = fm.fused_experts_triton(*_dev(hidden, gate_up, down, ids, w), path=path, config=TINY, **_dev_kw(kw))
    _close(out.cpu(), ref, dtype)


# the decode GEMVs' tiles at interpreter size: GEMM1 too as a GEMV (2 K steps over H=32, rows masked past I=16 with
# 32-row tiles: BLOCK_N 32 > I)
TINY_GEMVS = dict(TINY, gemv1=dict(BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2))


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,interleaved", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("up_gemv", [False, True])
def test_triton_small_gemv_down(num_tokens, dtype, bias, interleaved, up_gemv, monkeypatch):
    """Up to GEMV_DOWN_MAX_TOKENS tokens the small path fuses the down projection and the K-sum (a GEMV), and with
    a ``gemv1`` tile runs the gate/up projection as a GEMV too (biases, both row layouts)."""
    assert num_tokens <= fm.GEMV_DOWN_MAX_TOKENS
    gate_up, down, gub, db = _weights(dtype, bias)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(10)).to(dtype)
    ids, w = _routing(num_tokens, 3, weight_dtype=dtype)
    kw = dict(gate_up_bias=gub, down_bias=db, interleaved=interleaved)
    launched = []
    for name in ("launch_up_gemv", "launch_gemm"):
        real = getattr(fm.launch, name)
        monkeypatch.setattr(fm.launch, name, lambda *a, _n=name, _r=real, **k: launched.append(_n) or _r(*a, **k))
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w, **kw)
    out = fm.fused_experts_triton(*_dev(hidden, gate_up, down, ids, w), path="small",
                                  config=TINY_GEMVS if up_gemv else TINY, **_dev_kw(kw))
    _close(out.cpu(), ref, dtype)
    assert launched == ["launch_up_gemv" if up_gemv else "launch_gemm"]


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5])
def test_default_tiles_decide_the_up_gemv(num_tokens, monkeypatch):
    """With the default tiles, GEMM1 runs as a GEMV exactly where the shipped table has a ``gemv1`` tile for the
    layer's size and token count (never past ``GEMV_DOWN_MAX_TOKENS``); results equal the reference either way."""
    from mla_fuser.kernels.fused_moe import configs, gemv_tiles

    tiles = gemv_tiles.decode_gemv_tiles(num_tokens, H)
    cfg = configs.default_config("small", num_tokens, 3, E, H)
    assert ("gemv1" in cfg) == (tiles is not None and tiles[0] is not None)
    assert cfg["gemv2"] == (tiles[1] if tiles else configs.default_config("small", 16, 3, E)["gemv2"])
    launched = []
    real = fm.launch.launch_up_gemv
    monkeypatch.setattr(fm.launch, "launch_up_gemv", lambda *a, **k: launched.append(1) or real(*a, **k))
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(11))
    ids, w = _routing(num_tokens, 3)
    out = fm.fused_experts_triton(*_dev(hidden, gate_up, down, ids, w), path="small")
    _close(out.cpu(), fm.fused_experts_ref(hidden, gate_up, down, ids, w), torch.float32)
    assert bool(launched) == ("gemv1" in cfg and num_tokens <= fm.GEMV_DOWN_MAX_TOKENS)


@needs_triton
@pytest.mark.parametrize("path,gemv_tokens", [("small", "4"), ("small", "0"), ("aligned", "4")])
@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_triton_sentinel_ids_gelu_int32(path, gemv_tokens, activation, monkeypatch):
    """Ids outside [0, E) contribute nothing; int32 ids; other activations; fp16; biases on the GEMV paths."""
    monkeypatch.setenv("MLA_FUSER_MOE_GEMV_TOKENS", gemv_tokens)
    gate_up, down, gub, db = _weights(torch.float16, True)
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(6)).half()
    ids, w = _routing(4, 2)
    ids[1, 1] = E
    ids[3, 0] = -1
    ids = ids.int()
    out = fm.fused_experts_triton(
        *_dev(hidden, gate_up, down, ids, w), gate_up_bias=gub.to(DEVICE), down_bias=db.to(DEVICE),
        activation=activation, path=path, config=TINY_GEMVS,
    )  # fmt: skip
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w, gate_up_bias=gub, down_bias=db, activation=activation)
    _close(out.cpu(), ref, torch.float16)


@needs_triton
def test_public_op_dispatch_and_fake():
    gate_up, down, gub, db = _weights(torch.float32, True)
    hidden = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(7))  # leading dims are flattened
    ids, w = _routing(6, 2)
    ids, w = ids.view(2, 3, 2), w.view(2, 3, 2)
    kw = dict(gate_up_bias=gub, down_bias=db)
    ref = fm.fused_experts_ref(hidden.view(6, H), gate_up, down, ids.view(6, 2), w.view(6, 2), **kw).view(2, 3, H)
    out = fm.fused_experts(*_dev(hidden, gate_up, down, ids, w), **_dev_kw(kw))  # auto -> small path, Triton
    _close(out.cpu(), ref, torch.float32)
    # the registered op itself (what torch.compile sees; eager fused_experts calls the impl directly)
    out_op = torch.ops.mla_fuser.fused_experts(*_dev(hidden, gate_up, down, ids, w, gub, db), False, "silu", "aligned")
    _close(out_op.cpu(), ref, torch.float32)
    # fake impl: shape/dtype only
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.mla_fuser.fused_experts(
            *(mode.from_tensor(t) for t in (hidden, gate_up, down, ids, w)), None, None, False, "silu", "auto"
        )
    assert fake.shape == hidden.shape and fake.dtype == hidden.dtype


@needs_triton
def test_public_op_torch_backend_and_empty(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(3, H)
    ids, w = _routing(3, 2)
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w)
    torch.testing.assert_close(fm.fused_experts(hidden, gate_up, down, ids, w), ref)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    empty = fm.fused_experts(*_dev(hidden[:0], gate_up, down, ids[:0], w[:0]))
    assert empty.shape == (0, H)


def test_tuned_config_file(tmp_path, monkeypatch):
    table = {"small": {"8": TINY, "64": {"gemm1": dict(TINY["gemm1"], BLOCK_N=32), "gemm2": TINY["gemm2"]}}}
    f = tmp_path / "moe.json"
    f.write_text(json.dumps(table))
    monkeypatch.setenv("MLA_FUSER_MOE_CONFIGS", str(f))
    assert fm.get_moe_config("small", 4, 2, E) == TINY
    assert fm.get_moe_config("small", 9, 2, E)["gemm1"]["BLOCK_N"] == 32
    assert fm.get_moe_config("aligned", 9, 2, E) == fm.default_config("aligned", 9, 2, E)


@needs_triton
@pytest.mark.skipif(ON_GPU, reason="interpreter only")
def test_interpreter_flag_after_import():
    """Triton was imported (by fused_moe, at collection) without TRITON_INTERPRET; the fixture sets it only
    now, and both paths plus the alignment kernel still run interpreted."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.sum, InterpretedFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1 already: nothing to check")
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(9))
    ids, w = _routing(3, 2)
    ref = fm.fused_experts_ref(hidden, gate_up, down, ids, w)
    for path in ("small", "aligned"):
        _close(fm.fused_experts_triton(hidden, gate_up, down, ids, w, path=path, config=TINY), ref, torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# alignment
# ---------------------------------------------------------------------------------------------------------------------


def _check_alignment(sorted_ids, expert_ids, num_post, flat_ids, num_experts, block_m):
    num_pairs = flat_ids.numel()
    n = int(num_post.item())
    assert n % block_m == 0 and sorted_ids.numel() % block_m == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    seen = []
    for b in range(expert_ids.numel()):
        blk = sorted_ids[b * block_m : (b + 1) * block_m].tolist()
        e = int(expert_ids[b])
        if b * block_m >= n:
            assert e == -1 and all(p == num_pairs for p in blk)  # unused tail marked
            continue
        assert 0 <= e < num_experts
        real = [p for p in blk if p != num_pairs]
        assert real, "a used block holds at least one pair"
        assert all(int(flat_ids[p]) == e for p in real)  # single expert per block
        assert blk == real + [num_pairs] * (block_m - len(real))  # padding only at the group's end
        seen += real
    valid = [p for p in range(num_pairs) if 0 <= int(flat_ids[p]) < num_experts]
    assert sorted(seen) == valid  # every valid pair exactly once, sentinels dropped
    counts = torch.bincount(flat_ids[(flat_ids >= 0) & (flat_ids < num_experts)].long(), minlength=num_experts)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())


@needs_triton
@pytest.mark.parametrize("block_m", [4, 16])
def test_alignment(block_m):
    g = torch.Generator().manual_seed(8)
    num_experts = 9
    ids = torch.randint(0, 6, (23, 3), generator=g)  # experts 6..8 never picked
    ids[:12, 0] = 2  # one heavy expert (> block_m pairs)
    ids[5, 1] = num_experts  # sentinel
    ids[7, 2] = -1
    tri = [t.cpu() for t in fm.align_tokens_to_experts(ids.int().to(DEVICE), num_experts, block_m)]
    ref = fm.align_tokens_to_experts_ref(ids, num_experts, block_m)
    for a, b in zip(tri, ref):
        assert a.dtype == torch.int32
        assert torch.equal(a, b)
    _check_alignment(*tri, ids.reshape(-1), num_experts, block_m)
    # groups hold pairs in ascending order (stable), as the reference says
    n = int(tri[2].item())
    real = tri[0][:n][tri[0][:n] != ids.numel()]
    keys = ids.reshape(-1)[real.long()]
    for e in keys.unique():
        assert torch.all(torch.diff(real[keys == e]) > 0)


# ---------------------------------------------------------------------------------------------------------------------
# routers
# ---------------------------------------------------------------------------------------------------------------------


def test_router_mixtral_softmax_renorm():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 5.0 + 1e-3]])
    w, ids = fm.route_topk_ref(logits, 2, scoring="softmax", renormalize=True)
    s1 = torch.sigmoid(torch.tensor(1.0)).item()  # e^3 / (e^3 + e^2)
    assert ids.tolist() == [[2, 1], [3, 2]]
    torch.testing.assert_close(w[0], torch.tensor([s1, 1 - s1]))
    torch.testing.assert_close(w[1].sum(), torch.tensor(1.0))
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


def test_router_deepseek_v2_greedy_and_group_limited():
    logits = torch.log(torch.tensor([[0.30, 0.25, 0.05, 0.05, 0.20, 0.05, 0.05, 0.05]]))  # softmax = these
    w, ids = fm.route_topk_ref(logits, 3, scaling=2.0)
    assert ids.tolist() == [[0, 1, 4]]
    torch.testing.assert_close(w, torch.tensor([[0.60, 0.50, 0.40]]))
    # 4 groups of 2, keep 1 group (group score = max): group 0 = {0, 1} wins, then 2 experts from it
    w, ids = fm.route_topk_ref(logits, 2, scaling=1.0, n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.30, 0.25]]))


def test_router_deepseek_v3_sigmoid_bias_groups():
    s = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.6, 0.55, 0.2, 0.2]])
    logits = torch.log(s / (1 - s))  # sigmoid(logits) == s
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 1.0])
    # biased: [.9 .1 | .5 .5 | .6 .55 | .2 1.2]; group top-2 sums: 1.0, 1.0, 1.15, 1.4 -> groups 3 and 2.
    # Top-2 biased inside them: expert 7 (1.2) and 4 (0.6) -- expert 0 (best unbiased) is excluded by its group.
    # Weights from the unbiased scores: 0.2, 0.6 -> renorm 0.25, 0.75 -> x2.5.
    w, ids = fm.route_topk_ref(
        logits, 2, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=2, renormalize=True, scaling=2.5
    )
    assert ids.tolist() == [[7, 4]]
    torch.testing.assert_close(w, torch.tensor([[0.625, 1.875]]))
    # no renorm: raw unbiased sigmoid scores x scaling
    w, ids = fm.route_topk_ref(logits, 2, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=2)
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.6]]))
    # without groups the bias still steers selection only
    w, ids = fm.route_topk_ref(logits, 2, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[7, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.2, 0.9]]))


# ---------------------------------------------------------------------------------------------------------------------
# the torch path for CPU tensors (pairs grouped on the host)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 9])
def test_cpu_path_equals_ref_bitwise(interleaved, bias, num_tokens):
    """``fused_experts_cpu`` (what ``fused_experts`` runs for CPU tensors) computes exactly the reference's numbers:
    one token (the decode fast path), experts picked by one or several tokens, a sentinel id, an expert listed twice
    by one token, gelu."""
    gate_up, down, gub, db = _weights(torch.float32, bias)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(5))
    ids, w = _routing(num_tokens, 3)
    kw = dict(gate_up_bias=gub, down_bias=db, interleaved=interleaved)
    for case in ("plain", "sentinel", "twice"):
        ids_c = ids.clone()
        if case == "sentinel":
            ids_c[-1, 2] = E
        elif case == "twice":
            ids_c[0, 2] = ids_c[0, 1]
        for act in ("silu", "gelu"):
            ref = fm.fused_experts_ref(hidden, gate_up, down, ids_c, w, activation=act, **kw)
            out = fm.fused_experts_cpu(hidden, gate_up, down, ids_c, w, activation=act, **kw)
            assert out.dtype == ref.dtype and torch.equal(out, ref), (case, act)


def test_cpu_path_bf16_and_edges():
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(6))
    ids, w = _routing(4, 2)
    bf = [t.bfloat16() for t in (hidden, gate_up, down)]
    for n in (1, 4):  # bf16 weights: act(gate) * up rounded to bf16 as in the reference
        out = fm.fused_experts_cpu(bf[0][:n], *bf[1:], ids[:n], w[:n])
        assert out.dtype == torch.bfloat16 and torch.equal(out, fm.fused_experts_ref(bf[0][:n], *bf[1:], ids[:n], w[:n]))
    assert fm.fused_experts_cpu(hidden[:0], gate_up, down, ids[:0], w[:0]).shape == (0, H)
    all_out = torch.full_like(ids[:1], E)  # no valid expert: zeros
    assert torch.equal(fm.fused_experts_cpu(hidden[:1], gate_up, down, all_out, w[:1]), torch.zeros(1, H))


def test_cpu_tensors_take_the_cpu_path(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    calls = []
    original = fm.fused_experts_cpu
    monkeypatch.setattr(fm, "fused_experts_cpu", lambda *a, **k: calls.append(1) or original(*a, **k))
    gate_up, down, _, _ = _weights(torch.float32, False)
    hidden = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(7))  # leading dims are kept
    ids, w = _routing(6, 2)
    out = fm.fused_experts(hidden, gate_up, down, ids.view(2, 3, 2), w.view(2, 3, 2))
    assert calls and out.shape == hidden.shape
    assert torch.equal(out.view(6, H), fm.fused_experts_ref(hidden.view(6, H), gate_up, down, ids, w))
