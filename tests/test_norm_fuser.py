"""Norm fuser: RMSNorm modules recognised by what they compute (any names), rebound per instance, bitwise equal on
CPU; look-alikes declined with a reason; a whole tiny DeepSeek-V2 fused with every norm through the kernel."""

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from conftest import tiny_deepseek  # noqa: E402

import mla_fuser  # noqa: E402
from mla_fuser.fusers import Fuser, NormFuser  # noqa: E402
from mla_fuser.plans import plan_of  # noqa: E402


class Smoother(nn.Module):
    """Llama-style under other names: weight times the row cast back to the input dtype."""

    def __init__(self, width, tiny=1e-6):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.5 * torch.randn(width))
        self.tiny = tiny

    def forward(self, inputs):
        kind = inputs.dtype
        h = inputs.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.tiny)
        return self.gain * h.to(kind)


class Brightener(nn.Module):
    """Gemma-style: ``1 + weight`` in fp32, one cast at the end; ``x * x`` instead of ``pow``."""

    def __init__(self, width):
        super().__init__()
        self.delta = nn.Parameter(0.3 * torch.randn(width))
        self.fudge = 1e-5

    def _core(self, v):
        return v * torch.rsqrt((v * v).mean(dim=-1, keepdim=True) + self.fudge)

    def forward(self, x):
        out = self._core(x.float())
        out = out * (1.0 + self.delta.float())
        return out.type_as(x)


class Polisher(nn.Module):
    """Weight applied in fp32 before the final cast (OLMo / GPT-OSS style), eps under an unusual name."""

    def __init__(self, width, the_small_constant_that_keeps_rsqrt_finite=3e-4):
        super().__init__()
        self.scale_vector = nn.Parameter(1 + 0.5 * torch.randn(width))
        self.the_small_constant_that_keeps_rsqrt_finite = the_small_constant_that_keeps_rsqrt_finite

    def forward(self, hidden):
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        var = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(var + self.the_small_constant_that_keeps_rsqrt_finite)
        return (self.scale_vector * hidden).to(dtype)


class Centred(nn.Module):
    """LayerNorm without bias: subtracts the mean."""

    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        return self.gain * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Biased(Smoother):
    def __init__(self, width):
        super().__init__(width)
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, inputs):
        return super().forward(inputs) + self.shift


class ExtraScale(Smoother):
    """A second learned parameter: a scalar scale."""

    def __init__(self, width):
        super().__init__(width)
        self.alpha = nn.Parameter(torch.tensor(2.0))

    def forward(self, inputs):
        return self.alpha * super().forward(inputs)


class Doubled(Smoother):
    """One parameter, but an operation no RMSNorm has."""

    def forward(self, inputs):
        return super().forward(inputs) * 2.0


class WithLinear(Smoother):
    def __init__(self, width):
        super().__init__(width)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, inputs):
        return self.proj(super().forward(inputs))


class Gated(Smoother):
    """Takes a gate besides the hidden states (Mamba-2 style)."""

    def forward(self, inputs, gate=None):
        out = super().forward(inputs)
        return out if gate is None else out * torch.sigmoid(gate)


@pytest.fixture(autouse=True)
def _fresh_cache():
    Fuser.cache_clear()
    yield
    Fuser.cache_clear()


def _fuse_one(module):
    match, reason = NormFuser.explain(module)
    assert match is not None, reason
    row = NormFuser.apply(module, match, "norm")
    assert row.status == "fused", row.reason
    return match


def _inputs(width, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, width, generator=gen) * 3
    x[2, 1] *= 1000
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls,eps,offset,in_fp32", [
    (Smoother, 1e-6, 0.0, False),
    (Brightener, 1e-5, 1.0, True),
    (Polisher, 3e-4, 0.0, True),
])
def test_toy_norms_match_and_stay_bitwise_equal(dtype, cls, eps, offset, in_fp32):
    torch.manual_seed(0)
    fused, native = cls(48).to(dtype), cls(48).to(dtype)
    native.load_state_dict(fused.state_dict())
    assert NormFuser.is_candidate(fused)
    match = _fuse_one(fused)
    assert (match.eps, match.weight_offset, match.weight_in_fp32, match.width) == (eps, offset, in_fp32, 48)
    # this instance only: the class and the other instance keep the original forward
    assert "forward" in fused.__dict__ and "forward" not in native.__dict__
    assert type(fused) is cls and cls.forward is type(native).forward
    x = _inputs(48, dtype)
    with torch.no_grad():
        assert torch.equal(fused(x), native(x))
        assert torch.equal(fused(x[0]), native(x[0]))  # other leading shapes


def test_eps_is_read_per_instance_not_per_class():
    torch.manual_seed(0)
    a, b = Smoother(32, tiny=1e-6), Smoother(32, tiny=0.5)
    assert _fuse_one(a).eps == 1e-6
    assert _fuse_one(b).eps == 0.5
    b.gain.data.copy_(a.gain.data)
    x = _inputs(32, torch.float32)
    with torch.no_grad():
        assert not torch.equal(a(x), b(x))
        assert torch.equal(b(x), Smoother.forward(b, x))


def test_weight_is_read_at_call_time():
    torch.manual_seed(0)
    fused, native = Smoother(32), Smoother(32)
    _fuse_one(fused)
    fused.load_state_dict(native.state_dict())  # weights loaded after fusion
    x = _inputs(32, torch.float32)
    with torch.no_grad():
        assert torch.equal(fused(x), native(x))
        # a dtype move: the fused forward follows, or defers to the original when its match does not cover it
        fused.to(torch.bfloat16)
        native.to(torch.bfloat16)
        assert torch.equal(fused(x.bfloat16()), native(x.bfloat16()))
        assert torch.equal(fused(x.double()), native(x.double()))  # a dtype the kernel does not take


def test_gradients_flow_through_the_fused_forward():
    torch.manual_seed(0)
    fused, native = Polisher(16), Polisher(16)
    native.load_state_dict(fused.state_dict())
    _fuse_one(fused)
    x = _inputs(16, torch.float32)
    fused(x).square().sum().backward()
    native(x).square().sum().backward()
    assert torch.equal(fused.scale_vector.grad, native.scale_vector.grad)


@pytest.mark.parametrize("module,reason", [
    (Centred(32), None),
    (Biased(32), "one 1-D weight"),
    (ExtraScale(32), "one 1-D weight"),
    (WithLinear(32), "child modules"),
    (Doubled(32), "scales by a constant"),
    (nn.RMSNorm(32), "already one kernel"),
    (Gated(32), "more than the hidden states"),
])
def test_look_alikes_are_declined(module, reason):
    match, why = NormFuser.explain(module)
    assert match is None
    if reason is not None:
        assert reason in why, why
    if not isinstance(module, (nn.RMSNorm, Doubled, Gated)):
        assert not NormFuser.is_candidate(module)


def test_meta_weights_are_declined():
    with torch.device("meta"):
        module = Smoother(32)
    match = NormFuser.match(module)
    row = NormFuser.apply(module, match, "norm")
    assert row.status == "fallback" and "meta weights" in row.reason
    assert "forward" not in module.__dict__


def test_mismatch_restores_the_original_forward(monkeypatch):
    """A match that does not describe the module (here a wrong eps) fails the check and is undone."""
    torch.manual_seed(0)
    module = Smoother(32, tiny=0.25)
    match = NormFuser.match(module)
    wrong = type(match)(**{**match.__dict__, "eps": 1e-6})
    row = NormFuser.apply(module, wrong, "norm")
    assert row.status == "fallback" and "differs from the original" in row.reason
    assert "forward" not in module.__dict__ and plan_of(module, "norm") is None


def test_fused_deepseek_matches_native_and_reports_norms():
    native = tiny_deepseek()
    fused = tiny_deepseek(attn="vllm_mla")
    report = mla_fuser.fuse(fused)
    norms = [r for r in report.rows if r.fuser == "norm"]
    # per layer: input, post-attention, q-LoRA and KV-latent norms; plus the final norm
    assert len(norms) == 2 * 4 + 1 and all(r.status == "fused" for r in norms), str(report)
    assert len(report.fused("mla")) == 2
    kv_norm = fused.model.layers[0].self_attn.kv_a_layernorm
    assert "forward" in kv_norm.__dict__ and plan_of(kv_norm, "norm").match.eps == 1e-6
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = native(ids).logits, fused(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cls", [Smoother, Brightener, Polisher])
def test_triton_backend_passes_the_check(monkeypatch, dtype, cls):
    """With the kernel forced (Triton's interpreter on CPU) the check allows its reduction order, nothing more.
    (bf16 is left out on CPU: the interpreter truncates fp32 -> bf16 instead of rounding.)"""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    fused, native = cls(100).to(device, dtype), cls(100).to(device, dtype)
    native.load_state_dict(fused.state_dict())
    _fuse_one(fused)
    x = _inputs(100, dtype).to(device)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), native(x), rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-3)


def test_eager_few_rows_run_the_original_and_launch_free_contexts_the_kernel(monkeypatch):
    """On CUDA an eager call with few rows runs the module's own ops (a kernel launch costs more host time);
    captured / warm-up / compiled calls run the kernel.  Checked through the decision itself (no GPU here)."""
    import mla_fuser.fusers.norm as nf
    from mla_fuser.kernels.dispatch import graph_warmup, launches_are_free

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    few = torch.zeros(3, 64).as_subclass(FakeCuda)
    many = torch.zeros(nf.EAGER_MIN_ROWS, 64).as_subclass(FakeCuda)
    assert not launches_are_free()
    assert not nf._pays(few) and nf._pays(many)
    with graph_warmup():
        assert launches_are_free() and nf._pays(few)
    assert nf._pays(torch.zeros(3, 64))  # CPU: the kernel's torch twin, no launch cost question


def test_eager_cpu_calls_run_the_module_own_ops_and_triton_backend_the_kernel(monkeypatch):
    """An eager CPU call runs the original forward (the torch backend's twin is those very ops, so checks and
    dispatch before it would only cost host time); with the Triton backend forced (the interpreter) the same call
    takes the kernel.  Told apart by which of the two the plan's kernel sees."""
    torch.manual_seed(0)
    fused, native = Smoother(32), Smoother(32)
    native.load_state_dict(fused.state_dict())
    _fuse_one(fused)
    plan = plan_of(fused, "norm")
    calls = []
    kernel, original = plan.kernel, plan.original

    def counted_kernel(x, w):
        calls.append("kernel")
        return kernel(x, w)

    def counted_original(*args, **kwargs):
        calls.append("original")
        return original(*args, **kwargs)

    monkeypatch.setattr(plan, "kernel", counted_kernel)
    monkeypatch.setattr(plan, "original", counted_original)
    x = _inputs(32, torch.float32)
    with torch.no_grad():
        assert torch.equal(fused(x), native(x)) and torch.equal(fused(inputs=x), native(x))
        assert calls == ["original", "original"]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
        got = fused(x)
    assert calls == ["original", "original", "kernel"]
    torch.testing.assert_close(got, native(x).detach())
