"""The expert-selection kernel (``kernels.moe_router``) against its torch twin, and the router child binding
(``fusers.moe.router_binding``): the kernel only where the child's first run returned what the kernel path returns.

Triton runs under its interpreter on CPU (``TRITON_INTERPRET`` per test).  Routings are compared as sets per row
(ids sorted, weights matched per id): the kernel's order is by decreasing choice, ``topk(sorted=False)``'s is free.
"""

import pytest
import torch

import mla_fuser
from conftest import assert_generates_like_native, tiny_deepseek
from mla_fuser.fusers.moe import router_binding as rb
from mla_fuser.kernels import moe_router
from mla_fuser.kernels.moe_router import RouteParams, select_experts_ref, select_experts_triton
from mla_fuser.plans import plan_of

pytest.importorskip("triton")

V2_LIKE = RouteParams(top_k=6, scoring="softmax", post=(("scale", 1.0),))
V3_LIKE = RouteParams(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, group_topn=2, group_fill=0.0,
                      weights_from="scores", renorm=True, renorm_eps=1e-20, post=(("scale", 2.5),))
GROUP_MAX = RouteParams(top_k=4, scoring="softmax", n_group=4, topk_group=2, group_fill=float("-inf"),
                        weights_from="values", post=(("div", 3.0), ("scale", 0.5)), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("params,experts", [(V2_LIKE, 64), (V3_LIKE, 64), (GROUP_MAX, 32)], ids=["v2", "v3", "max"])
def test_kernel_selects_what_its_twin_selects(interp, params, experts):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, experts, generator=g) * 3
    correction = torch.randn(experts, generator=g) * 0.1 if params.scoring == "sigmoid" else None
    got, want = select_experts_triton(logits, correction, params), select_experts_ref(logits, correction, params)
    excused = rb._near_ties(logits, correction, params)
    assert not excused.all()
    assert got[0].dtype == want[0].dtype == params.out_dtype and got[1].dtype == torch.int64
    assert rb._same_sets(got, want, excused)
    # ids come out by decreasing choice, as topk(sorted=True) gives them
    assert torch.equal(got[1][~excused], want[1][~excused])


def _spy(monkeypatch):
    calls = []
    original = moe_router.select_experts_triton
    monkeypatch.setattr(moe_router, "select_experts_triton", lambda *a: calls.append(1) or original(*a))
    return calls


def _gate(model):
    return model.model.layers[1].mlp.gate


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_router_runs_on_the_kernel_and_tokens_equal_native(interp, monkeypatch, arch):
    """DeepSeek-V2's softmax top-k and V3's sigmoid + correction bias + top-2-sum groups + renorm + scale: both
    routers return ``(logits, weights, ids)`` from their child, so both move to the kernel after their first call."""
    calls = _spy(monkeypatch)
    native = tiny_deepseek(arch=arch, layers=3)
    fused = tiny_deepseek(arch=arch, attn="vllm_mla", layers=3)
    report = mla_fuser.fuse(fused)
    assert all("router child 'gate'" in r.reason for r in report.rows if r.fuser == "moe")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    assert_generates_like_native(native, fused, ids, 6)
    assert list(plan_of(_gate(fused), "router").verdicts.values()) == [True]
    assert len(calls) >= 2 * 6  # two MoE layers, every step after the first check


def _checked_gate(rows: int, seed: int):
    """A fused tiny DeepSeek-V2's router child, its plan and ``rows`` random hidden states."""
    fused = tiny_deepseek(attn="vllm_mla", layers=2)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    x = torch.randn(rows, fused.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return gate, plan_of(gate, "router"), x


def test_check_refuses_outputs_that_are_not_logits_weights_ids(interp):
    gate, plan, x = _checked_gate(5, 3)
    with torch.no_grad():
        logits, weights, ids = plan.original(x)
        assert plan.check(plan.tensors(gate), x, (logits, weights, ids)) is not None
        assert plan.check(plan.tensors(gate), x, (ids, weights, logits)) is None  # another order
        assert plan.check(plan.tensors(gate), x, (logits, weights * 2, ids)) is None  # another scale
        assert plan.check(plan.tensors(gate), x, (logits + 1e-3, weights, ids)) is None  # other logits
        assert plan.check(plan.tensors(gate), x, (logits, weights)) is None
        assert plan.check(plan.tensors(gate), x, logits) is None


def test_checking_call_answers_as_later_calls_do(interp):
    fused = tiny_deepseek(arch="deepseek_v3", attn="vllm_mla", layers=2)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    x = torch.randn(7, fused.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first, second = gate(x), gate(x)
    assert list(plan_of(gate, "router").verdicts.values()) == [True]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cpu_without_the_interpreter_runs_the_original():
    fused = tiny_deepseek(attn="vllm_mla", layers=2)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    x = torch.randn(3, fused.config.hidden_size)
    with torch.no_grad():
        out = gate(x)
        want = plan_of(gate, "router").original(x)
    assert all(torch.equal(a, b) for a, b in zip(out, want)) and plan_of(gate, "router").verdicts == {}


# ------------------------------------------------------------------------------------------- the logits kernel
@pytest.mark.parametrize("rows,experts,hidden,dtype,bias", [
    (1, 64, 2048, torch.bfloat16, False),  # DeepSeek-V2-Lite's gate, one decode row
    (5, 20, 100, torch.float32, True),  # experts not a multiple of the block, hidden not a power of two
    (3, 64, 3000, torch.float16, False),  # hidden past one 2048-wide pass
])
def test_logits_kernel_matches_its_twin(interp, rows, experts, hidden, dtype, bias):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(experts, hidden, generator=g).to(dtype)
    b = torch.randn(experts, generator=g) if bias else None
    assert moe_router.logits_fit(x, weight, b)
    got, want = moe_router.router_logits(x, weight, b), moe_router.router_logits_ref(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, experts)
    total = torch.nn.functional.linear(x.float().abs(), weight.float().abs())
    assert ((got - want).abs() <= rb.LOGITS_RTOL * total).all()
    assert not torch.equal(got, torch.zeros_like(got))
    # a row's logits do not depend on the rows beside it (one program per row and block of experts), for one tile
    assert torch.equal(moe_router.router_logits_triton(x[-1:], weight, b, block_e=2),
                       moe_router.router_logits_triton(x, weight, b, block_e=2)[-1:])
    for block_e in (1, 2, 8):
        tiled = moe_router.router_logits_triton(x, weight, b, block_e=block_e)
        assert ((tiled - want).abs() <= rb.LOGITS_RTOL * total).all()


def test_logits_kernel_takes_few_rows_and_small_gates_only(interp):
    x, weight = torch.randn(16, 64), torch.randn(8, 64)
    assert moe_router.logits_fit(x, weight, None)
    rows = moe_router.LOGITS_MAX_WORK // weight.numel()
    assert moe_router.logits_fit(torch.empty(rows, 64), weight, None)
    assert not moe_router.logits_fit(torch.empty(rows + 1, 64), weight, None)
    assert not moe_router.logits_fit(x, torch.randn(moe_router.LOGITS_MAX_WEIGHT // 64 + 1, 64), None)
    assert not moe_router.logits_fit(x, weight.to(torch.float8_e4m3fn), None)
    assert not moe_router.logits_fit(x, weight, torch.randn(7))


@pytest.mark.parametrize("rows,experts,hidden,dtype,bias,block_m", [
    (40, 64, 256, torch.bfloat16, False, 16),  # V2-Lite's expert count; rows not a multiple of the block
    (33, 20, 100, torch.float16, True, 32),  # experts not a multiple of 16, hidden not a power of two
])
def test_row_block_logits_kernel_matches_its_twin(interp, rows, experts, hidden, dtype, bias, block_m):
    """The row-block kernel (blocks of 16-bit rows on tensor cores: exact products, fp32 sums) within the summation
    order bound of ``F.linear`` on fp32 copies; a row's logits do not depend on the rows beside it (other values in
    every other row, the row at the same place in its block: the interpreter's matmul, OpenBLAS, sums a row in another
    order at another place in the block on some CPUs, an AMD EPYC's for one)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(experts, hidden, generator=g).to(dtype)
    b = torch.randn(experts, generator=g) if bias else None
    got = moe_router.router_logits_triton(x, weight, b, block_m=block_m)
    want = moe_router.router_logits_ref(x, weight, b)
    total = torch.nn.functional.linear(x.float().abs(), weight.float().abs())
    assert got.shape == (rows, experts) and ((got - want).abs() <= rb.LOGITS_RTOL * total).all()
    beside = torch.randn(rows - 1, hidden, generator=g).to(dtype)
    others = moe_router.router_logits_triton(torch.cat([beside, x[-1:]]), weight, b, block_m=block_m)
    assert torch.equal(others[-1:], got[-1:]) and not torch.equal(others[:-1], got[:-1])
    with pytest.raises(ValueError, match="16-bit"):
        moe_router.router_logits_triton(x.float(), weight, b, block_m=block_m)
    with pytest.raises(ValueError, match="power of two"):
        moe_router.router_logits_triton(x, weight, b, block_m=24)


def test_logits_path_by_rows_gate_and_dtype(interp):
    """One program per row up to ``LOGITS_MAX_WORK``; beyond, the row-block kernel from ``ROW_BLOCK_MIN_ROWS``
    16-bit rows; torch between the two, for fp32 values there, and for gates past ``LOGITS_MAX_WEIGHT``."""
    weight = torch.randn(64, 2048).to(torch.bfloat16)
    rows_max = moe_router.LOGITS_MAX_WORK // weight.numel()
    assert rows_max < moe_router.ROW_BLOCK_MIN_ROWS  # (V2-Lite's gate: a gap where torch runs)

    def path(rows, dtype=torch.bfloat16, w=weight):
        return moe_router.logits_path(torch.empty(rows, w.shape[1], dtype=dtype), w, None)

    assert path(rows_max) == moe_router.ROWS and path(rows_max + 1) == ""
    assert path(moe_router.ROW_BLOCK_MIN_ROWS) == path(8192) == moe_router.ROW_BLOCKS
    assert path(8192, torch.float32) == "" and path(8192, w=weight.float()) == ""
    big = torch.empty(moe_router.LOGITS_MAX_WEIGHT // 2048 + 1, 2048, dtype=torch.bfloat16)
    assert path(1, w=big) == path(8192, w=big) == ""
    assert [moe_router.row_block_rows(n) for n in (256, 1023, 1024, 4096)] == [16, 16, 32, 64]


def test_many_16_bit_rows_take_the_row_block_kernel(interp, monkeypatch):
    """A bf16 router's call of many rows runs the row-block kernel, as a kind of call of its own, checked against
    the original on its first call: the same experts, logits within the summation-order bound."""
    monkeypatch.setattr(moe_router, "LOGITS_MAX_WORK", 0)  # (no call is the per-row kernel's)
    monkeypatch.setattr(moe_router, "ROW_BLOCK_MIN_ROWS", 16)
    fused = tiny_deepseek(attn="vllm_mla", layers=2).to(torch.bfloat16)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    x = torch.randn(20, fused.config.hidden_size, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            logits, weights, ids = gate(x)
            want = plan_of(gate, "router").original(x)
            assert rb._same_sets((weights, ids), want[1:], torch.zeros(20, dtype=torch.bool))
            total = moe_router.router_logits_ref(x.abs(), _gate(fused).weight.abs(), None)
            assert ((logits - want[0]).abs() <= rb.LOGITS_RTOL * total).all()
    verdicts = plan_of(gate, "router").verdicts
    assert [kind[-1] for kind in verdicts] == [moe_router.ROW_BLOCKS] and all(verdicts.values())


def test_logits_kernel_off_the_interpreter_on_cpu_is_torch():
    x, weight = torch.randn(2, 64), torch.randn(8, 64)
    assert not moe_router.logits_fit(x, weight, None)
    assert torch.equal(moe_router.router_logits(x, weight, None), moe_router.router_logits_ref(x, weight, None))


def _logits_spy(monkeypatch):
    calls = []
    original = rb.router_logits_triton
    monkeypatch.setattr(rb, "router_logits_triton", lambda *a, **k: calls.append(a[0].shape[0]) or original(*a, **k))
    return calls


@pytest.mark.parametrize("switch", ["1", "0"])
def test_decode_rows_take_the_logits_kernel_prefill_rows_torch(interp, monkeypatch, switch):
    """Few rows: logits from the kernel (its own verdict, checked against the original on its first call); more rows
    than ``LOGITS_MAX_WORK`` allows for the gate: the traced ops' logits, bitwise.  ``MLA_FUSER_ROUTER_LOGITS_KERNEL=0``: torch always."""
    monkeypatch.setenv("MLA_FUSER_ROUTER_LOGITS_KERNEL", switch)
    calls = _logits_spy(monkeypatch)
    fused = tiny_deepseek(attn="vllm_mla", layers=2)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    g = torch.Generator().manual_seed(6)
    monkeypatch.setattr(moe_router, "LOGITS_MAX_WORK", 8 * _gate(fused).weight.numel())  # (8 rows, here)
    few = torch.randn(3, fused.config.hidden_size, generator=g)
    many = torch.randn(9, fused.config.hidden_size, generator=g)
    with torch.no_grad():
        for x in (few, few, many, many):
            logits, weights, ids = gate(x)
            want = plan_of(gate, "router").original(x)
            assert rb._same_sets((weights, ids), want[1:], torch.zeros(x.shape[0], dtype=torch.bool))
            if x is many or switch == "0":
                assert torch.equal(logits, want[0])
    verdicts = plan_of(gate, "router").verdicts
    assert sorted(kind[-1] for kind in verdicts) == (["", moe_router.ROWS] if switch == "1" else [""])
    assert all(verdicts.values())
    assert calls == ([3, 3] if switch == "1" else [])  # the checking call, then a plain one


def test_check_refuses_kernel_logits_beyond_summation_order(interp):
    gate, plan, x = _checked_gate(4, 7)
    with torch.no_grad():
        logits, weights, ids = plan.original(x)
        tensors = plan.tensors(gate)
        ours = plan.check(tensors, x, (logits, weights, ids), on_kernel=moe_router.ROWS)
        assert ours is not None and rb._same_sets(ours[1:], (weights, ids), torch.zeros(4, dtype=torch.bool))
        assert plan.check(tensors, x, (logits * (1 + 1e-3), weights, ids), on_kernel=moe_router.ROWS) is None
        assert plan.check(tensors, x, (logits, weights * 1.01, ids), on_kernel=moe_router.ROWS) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA device")


@cuda
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("experts,hidden,dtype", [(64, 2048, torch.bfloat16), (256, 7168, torch.float32)])
def test_compiled_logits_kernel_matches_its_twin(rows, experts, hidden, dtype):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to("cuda", dtype)
    got, want = moe_router.router_logits_triton(x, weight, None), moe_router.router_logits_ref(x, weight, None)
    total = torch.nn.functional.linear(x.float().abs(), weight.float().abs())
    assert ((got - want).abs() <= rb.LOGITS_RTOL * total).all()
    for block_e in (1, 8):  # (a row alone gives the bits it gets among others, with the same tile)
        assert torch.equal(moe_router.router_logits_triton(x[-1:], weight, None, block_e=block_e),
                           moe_router.router_logits_triton(x, weight, None, block_e=block_e)[-1:])


@cuda
def test_compiled_router_adopts_the_logits_kernel_in_bf16():
    """On a GPU in bf16: the first decode-sized call checks the two-launch router against the original and keeps it;
    later calls route as the original does (sets per row, near-ties aside)."""
    fused = tiny_deepseek(attn="vllm_mla", layers=2).to("cuda", torch.bfloat16)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    plan = plan_of(gate, "router")
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for rows in (16, 16, 4):
            x = torch.randn(rows, fused.config.hidden_size, generator=g).to("cuda", torch.bfloat16)
            _, weights, ids = gate(x)
            want = plan.original(x)
            deviation = (plan.ours(plan.tensors(gate), x, moe_router.ROWS)[0] - want[0]).abs().amax(dim=-1)
            assert rb._same_sets((weights, ids), want[1:], rb._near_ties(want[0], None, plan.params, deviation))
    assert list(plan.verdicts.values()) == [True] and next(iter(plan.verdicts))[-1] == moe_router.ROWS


@cuda
@pytest.mark.parametrize("rows", [256, 1024, 4096])
@pytest.mark.parametrize("experts,hidden", [(64, 2048), (160, 5120)])
def test_compiled_row_block_logits_kernel_matches_its_twin(rows, experts, hidden):
    """Compiled, on tensor cores: the row-block kernel's logits within the summation-order bound of fp32 F.linear at
    each of its tiles; a row's logits the same alone as among others."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(rows, hidden, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to("cuda", torch.bfloat16)
    assert moe_router.logits_path(x, weight, None) == moe_router.ROW_BLOCKS
    got, want = moe_router.router_logits(x, weight, None), moe_router.router_logits_ref(x, weight, None)
    total = torch.nn.functional.linear(x.float().abs(), weight.float().abs())
    assert ((got - want).abs() <= rb.LOGITS_RTOL * total).all()
    block_m = moe_router.row_block_rows(rows)
    assert torch.equal(moe_router.router_logits_triton(x[-1:], weight, None, block_m=block_m), got[-1:])
