"""Gated-MLP fuser: ``down(act(gate(x)) * up(x))`` recognised by what it computes (any names), gate and up stacked
into one weight (the originals views of it), ``act_mul`` bound per instance; look-alikes declined with a reason;
tiny DeepSeek-V2 / V3 fused end to end (dense MLP and shared experts) equal to the native model."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from conftest import tiny_deepseek  # noqa: E402
from toy_modules import GluMlp  # noqa: E402

import mla_fuser  # noqa: E402
from mla_fuser.fusers import Fuser, GatedMLPFuser, MoEFuser  # noqa: E402
from mla_fuser.fusers.gated_mlp import GatedMLPMatch, mlp_plan  # noqa: E402

H, I = 32, 48


class Greek(nn.Module):
    """A gated MLP under other names, the activation a module: ``gamma(nonlin(alpha(x)) * beta(x))``."""

    def __init__(self, inter=I, bias=False, nonlin=None):
        super().__init__()
        self.alpha = nn.Linear(H, inter, bias=bias)
        self.beta = nn.Linear(H, inter, bias=bias)
        self.gamma = nn.Linear(inter, H, bias=bias)
        self.nonlin = nonlin or nn.SiLU()

    def forward(self, x):
        return self.gamma(self.nonlin(self.alpha(x)) * self.beta(x))


class Swapped(nn.Module):
    """Functional activation (tanh GELU), the product written ``up * act(gate)``, children declared out of order."""

    def __init__(self):
        super().__init__()
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.w1 = nn.Linear(H, I, bias=False)

    def forward(self, hidden):
        return self.w2(self.w3(hidden) * F.gelu(self.w1(hidden), approximate="tanh"))


class Relu(nn.Module):
    """``torch.relu`` with biases on every linear (only the gate's and the down's)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(H, I, bias=True)
        self.q = nn.Linear(H, I, bias=False)
        self.r = nn.Linear(I, H, bias=True)

    def forward(self, x):
        return self.r(torch.relu(self.p(x)) * self.q(x))


class Plain(nn.Module):
    """Two linears, no gate."""

    def __init__(self):
        super().__init__()
        self.inn, self.out = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return self.out(F.silu(self.inn(x)))


class Added(Greek):
    """``act(g) + u``: not a gated product."""

    def forward(self, x):
        return self.gamma(self.nonlin(self.alpha(x)) + self.beta(x))


class OtherInput(Greek):
    """The up projection reads a scaled input."""

    def forward(self, x):
        return self.gamma(self.nonlin(self.alpha(x)) * self.beta(x * 2))


class InlineNorm(Greek):
    """An RMSNorm without a weight written inline before the projections."""

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.gamma(self.nonlin(self.alpha(x)) * self.beta(x))


class Reshaped(Greek):
    """Flattens its input: ``mlp_spec`` lets views through, the strict graph check does not."""

    def forward(self, x):
        x = x.view(-1, H)
        return self.gamma(self.nonlin(self.alpha(x)) * self.beta(x))


class SelfGated(Greek):
    """``act(g) * g``: the up projection is never used."""

    def forward(self, x):
        g = self.alpha(x)
        return self.gamma(self.nonlin(g) * g)


class Scaled(Greek):
    """The product is scaled before the down projection."""

    def forward(self, x):
        return self.gamma(self.nonlin(self.alpha(x)) * self.beta(x) * 0.5)


class SpelledGelu(nn.Module):
    """tanh GELU written out in torch ops (``gelu_new``): in 16-bit it rounds at every step."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class Softsign(nn.Module):
    def forward(self, x):
        return F.softsign(x)


class Experts(nn.Module):
    """A ModuleList of gated MLPs (experts) next to a shared one."""

    def __init__(self):
        super().__init__()
        self.crew = nn.ModuleList(Greek() for _ in range(3))
        self.aside = Greek()

    def forward(self, x):
        return sum(e(x) for e in self.crew) + self.aside(x)


def _inputs(seed=0, shape=(2, 5, H)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()


def _fuse_one(module, name="mlp"):
    match, reason = GatedMLPFuser.explain(module)
    assert match is not None, reason
    row = GatedMLPFuser.apply(module, match, name)
    assert row.status == "fused", row.reason
    return match


def _twins(make):
    torch.manual_seed(0)
    fused = make().eval()
    native = make().eval()
    native.load_state_dict(fused.state_dict())
    return fused, native


# ---------------------------------------------------------------- matches

@pytest.mark.parametrize("make,roles,activation", [
    (Greek, ("alpha", "beta", "gamma"), "silu"),
    (lambda: Greek(nonlin=nn.GELU()), ("alpha", "beta", "gamma"), "gelu"),
    (Swapped, ("w1", "w3", "w2"), "gelu_tanh"),
    (Relu, ("p", "q", "r"), "relu"),
    (lambda: Greek(bias=True), ("alpha", "beta", "gamma"), "silu"),
])
def test_matches_by_structure_and_equals_the_original(make, roles, activation):
    fused, native = _twins(make)
    assert GatedMLPFuser.is_candidate(fused)
    match = _fuse_one(fused)
    assert (match.gate, match.up, match.down, match.activation) == (*roles, activation)
    assert (match.hidden_size, match.intermediate_size) == (H, I)
    assert "forward" in fused.__dict__ and type(fused).forward is type(native).forward  # the instance only
    for shape in ((2, 5, H), (7, H), (1, 1, H)):
        x = _inputs(1, shape)
        with torch.no_grad():
            want, got = native(x), fused(x)
        assert got.shape == want.shape and _rel(want, got) <= 1e-6


def test_stacked_weight_is_shared_and_state_dict_unchanged():
    fused, native = _twins(Greek)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    _fuse_one(fused)
    after = fused.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())
    stacked = mlp_plan(fused).stacked
    assert stacked.weight.shape == (2 * I, H)
    assert fused.alpha.weight.data_ptr() == stacked.weight.data_ptr()
    assert fused.beta.weight.data_ptr() == stacked.weight[I:].data_ptr()
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in native.parameters())
    # an in-place load writes through the views into the stack
    other = Greek()
    fused.load_state_dict(other.state_dict())
    assert fused.alpha.weight.data_ptr() == stacked.weight.data_ptr()
    x = _inputs(2)
    with torch.no_grad():
        assert _rel(other(x), fused(x)) <= 1e-6


def test_dtype_round_trip_restacks():
    fused, native = _twins(Greek)
    _fuse_one(fused)
    for m in (fused, native):
        m.to(torch.bfloat16).to(torch.float32)
    x = _inputs(3)
    with torch.no_grad():
        assert _rel(native(x), fused(x)) <= 1e-6
    assert fused.alpha.weight.data_ptr() == mlp_plan(fused).stacked.weight.data_ptr()
    # and in bfloat16 itself: the torch path on CPU is the native ops over a stacked GEMM
    for m in (fused, native):
        m.to(torch.bfloat16)
    with torch.no_grad():
        assert _rel(native(x.bfloat16()).float(), fused(x.bfloat16()).float()) <= 2 ** -6


def test_calls_the_match_cannot_vouch_for_run_the_original(monkeypatch):
    fused, native = _twins(Greek)
    _fuse_one(fused)
    plan = mlp_plan(fused)
    calls = []
    original = plan.original
    monkeypatch.setattr(plan, "original", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = _inputs(4)
    with torch.no_grad():
        fused(x)
        assert not calls
        fused(x=x)  # by keyword: still the hidden states alone
        assert not calls
    out = fused(x)  # autograd records: the original ops (they have the backward)
    assert calls == [1]
    out.square().sum().backward()
    native(x).square().sum().backward()
    assert torch.allclose(fused.alpha.weight.grad, native.alpha.weight.grad, rtol=1e-5, atol=1e-6)


def test_down_projection_is_called_as_itself():
    """Hooks on the down linear still run (the fused forward calls the module)."""
    fused, _ = _twins(Greek)
    _fuse_one(fused)
    seen = []
    fused.gamma.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        fused(_inputs(5))
    assert seen == [torch.Size([2, 5, I])]


# ---------------------------------------------------------------- declines

@pytest.mark.parametrize("module,reason", [
    (Plain(), "not three linear children"),
    (GluMlp(H, I), "not three linear children"),  # a norm (with a weight) inside
    (Added(), "unaccounted op"),
    (OtherInput(), "unaccounted op"),
    (InlineNorm(), "unaccounted op"),
    (SelfGated(), "state outside its linears"),  # up never called
    (Scaled(), "unaccounted op"),
    (Reshaped(), "an op outside"),
    (Greek(nonlin=SpelledGelu()), "rounds differently"),
    (Greek(nonlin=Softsign()), "activation is not"),
])
def test_look_alikes_are_declined(module, reason):
    match, why = GatedMLPFuser.explain(module)
    assert match is None
    assert reason in why, why


def test_expert_items_of_a_module_list_are_left_to_the_moe_fuser():
    holder = Experts()
    names = GatedMLPFuser.candidate_names(holder)
    assert names == ["aside"]
    assert all(GatedMLPFuser.is_candidate(e) for e in holder.crew)  # by themselves they would match


def test_meta_weights_are_declined():
    with torch.device("meta"):
        module = Greek()
    match = GatedMLPFuser.match(module)
    row = GatedMLPFuser.apply(module, match, "mlp")
    assert row.status == "fallback" and "meta weights" in row.reason
    assert "forward" not in module.__dict__ and mlp_plan(module) is None


def test_mismatch_restores_the_original_forward():
    """A match that does not describe the module (here the wrong activation) fails the check and is undone."""
    fused, native = _twins(Greek)
    match = GatedMLPFuser.match(fused)
    wrong = GatedMLPMatch(**{**match.__dict__, "activation": "gelu"})
    row = GatedMLPFuser.apply(fused, wrong, "mlp")
    assert row.status == "fallback" and "differs from the original" in row.reason
    assert "forward" not in fused.__dict__ and mlp_plan(fused) is None
    x = _inputs(6)
    with torch.no_grad():
        assert torch.equal(native(x), fused(x))


def test_accelerate_style_hook_keeps_wrapping():
    """Under an accelerate hook (``_hf_hook`` + ``_old_forward``) the fused forward replaces what the hook wraps."""
    fused, native = _twins(Greek)
    calls = []
    fused._hf_hook = object()
    fused._old_forward = fused.forward
    fused.forward = lambda *a, **k: calls.append(1) or fused._old_forward(*a, **k)
    _fuse_one(fused)
    assert fused._old_forward.__func__.__name__ == "_fused_forward"
    x = _inputs(7)
    with torch.no_grad():
        assert _rel(native(x), fused(x)) <= 1e-6
    assert calls == [1]


def test_triton_backend_passes_the_check(monkeypatch):
    """With the kernel forced (Triton's interpreter on CPU) the check's fp32 kernel tolerance holds."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for make in (Greek, Swapped):
        fused, native = _twins(make)
        fused.to(device), native.to(device)
        _fuse_one(fused)
        x = _inputs(8).to(device)
        with torch.no_grad():
            assert _rel(native(x), fused(x)) <= 1e-5


# ---------------------------------------------------------------- whole models

@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_fused_deepseek_matches_native(arch):
    Fuser.cache_clear()
    native = tiny_deepseek(arch)
    fused = tiny_deepseek(arch, attn="vllm_mla")
    keys = {k: v.shape for k, v in fused.state_dict().items()}
    report = mla_fuser.fuse(fused)
    rows = {r.qualname: r for r in report.rows if r.fuser == "mlp"}
    assert set(rows) == {"model.layers.0.mlp", "model.layers.1.mlp.shared_experts"}, str(report)
    assert all(r.status == "fused" for r in rows.values()), str(report)
    assert report.fused("moe") and not report.fallbacks(), str(report)
    assert {k: v.shape for k, v in fused.state_dict().items()} == keys
    dense = fused.model.layers[0].mlp
    assert dense.gate_proj.weight.data_ptr() == mlp_plan(dense).stacked.weight.data_ptr()
    # the MoE block still matches with its shared experts' forward rebound (traced from the class)
    Fuser.cache_clear()
    assert MoEFuser.match(fused.model.layers[1].mlp) is not None
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = native(ids).logits, fused(ids).logits
    assert _rel(want, got) <= 1e-4
    mask = torch.ones_like(ids)
    tokens_native = native.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    tokens_fused = fused.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens_native, tokens_fused)


def test_save_and_reload_keeps_the_weights(tmp_path):
    """``save_pretrained`` of a fused model writes gate and up as themselves; an unfused load is the same model."""
    from transformers import AutoModelForCausalLM

    fused = tiny_deepseek(attn="vllm_mla", seed=3)
    mla_fuser.fuse(fused)
    fused.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    for key, value in fused.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
