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


def test_check_refuses_outputs_that_are_not_logits_weights_ids(interp):
    fused = tiny_deepseek(attn="vllm_mla", layers=2)
    mla_fuser.fuse(fused)
    gate = _gate(fused)
    plan = plan_of(gate, "router")
    x = torch.randn(5, fused.config.hidden_size, generator=torch.Generator().manual_seed(3))
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
