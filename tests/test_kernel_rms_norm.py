"""RMSNorm kernel: Triton (under the interpreter on CPU, tiny shapes) vs ``rms_norm_ref``, and the reference vs
Transformers' own RMSNorm modules, bitwise on CPU.

``TRITON_INTERPRET`` is set per test with ``monkeypatch`` (the kernel is wrapped lazily at its first launch, see
``dispatch.LazyJit``), ``MLA_FUSER_BACKEND=triton`` only for the tests that compare the kernel with the
reference.  With a GPU the same tests run the compiled kernel.  Interpreter artefact the tolerances allow for:
its fp32 -> bf16 conversions truncate instead of rounding; and Triton's reduction order is not torch's, so
fp32 results differ by a few units in the last place.
"""

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("mla_fuser") is None:  # plain `pytest` from the repo without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_fuser.kernels.dispatch import triton_available  # noqa: E402
from mla_fuser.kernels.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# relative tolerance by input dtype: the first variant rounds up to three times (``1 + weight``, the row cast
# back to x's dtype, the product), and the interpreter truncates each bf16 rounding, so up to ~4 units of bf16
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -5, torch.float16: 2 ** -9}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")


def _inputs(lead, width, dtype, weight_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, width, generator=gen) * 3).to(DEV, dtype)
    w = (1 + 0.5 * torch.randn(width, generator=gen)).to(DEV, weight_dtype or dtype)
    return x, w


def _close(got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=RTOL[dtype], atol=RTOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [48, 100, 512])
@pytest.mark.parametrize("lead", [(3,), (2, 5)])
@pytest.mark.parametrize("weight_in_fp32,offset", [(False, 0.0), (True, 0.0), (True, 1.0), (False, 1.0)])
def test_triton_matches_ref(triton_backend, dtype, width, lead, weight_in_fp32, offset):
    x, w = _inputs(lead, width, dtype)
    got = rms_norm(x, w, 1e-6, offset, weight_in_fp32)
    _close(got, rms_norm_ref(x, w, 1e-6, offset, weight_in_fp32), dtype)


@needs_triton
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_triton_non_contiguous_inputs(triton_backend, weight_in_fp32):
    dtype, width = torch.bfloat16, 100
    _, w = _inputs((1,), width, dtype)
    strided_last = (torch.randn(2, width, 5) * 3).to(DEV, dtype).transpose(1, 2)  # last dim not unit-stride
    padded_rows = (torch.randn(2, 5, width + 28) * 3).to(DEV, dtype)[..., :width]  # rows farther apart
    for x in (strided_last, padded_rows):
        assert not x.is_contiguous()
        got = rms_norm(x, w, 1e-5, 0.0, weight_in_fp32)
        assert got.is_contiguous()
        _close(got, rms_norm_ref(x, w, 1e-5, 0.0, weight_in_fp32), dtype)


@needs_triton
@pytest.mark.parametrize("weight_in_fp32,out_dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_mixed_dtypes_follow_torch_promotion(triton_backend, weight_in_fp32, out_dtype):
    """An fp32 weight on a bf16 input: ``weight * h.to(bf16)`` is fp32, the fp32-weight variant casts to bf16."""
    x, w = _inputs((2, 5), 48, torch.bfloat16, weight_dtype=torch.float32)
    ref = rms_norm_ref(x, w, 1e-6, 0.0, weight_in_fp32)
    assert ref.dtype == out_dtype
    _close(rms_norm_triton(x, w, 1e-6, 0.0, weight_in_fp32), ref, torch.bfloat16)


@needs_triton
def test_triton_empty_and_fp32_exactness_bounds(triton_backend):
    x, w = _inputs((0,), 64, torch.float32)
    assert rms_norm(x, w, 1e-6).shape == (0, 64)
    # a row of large values and a row of zeros (rsqrt(eps) * 0) stay finite and close
    x, w = _inputs((3,), 64, torch.float32)
    x[1] *= 1e4
    x[2] = 0
    got = rms_norm(x, w, 1e-6)
    assert torch.isfinite(got).all()
    _close(got, rms_norm_ref(x, w, 1e-6), torch.float32)


@needs_triton
def test_autograd_runs_the_reference(triton_backend):
    """The kernel has no backward: with autograd recording, gradients still flow (through the reference)."""
    x, w = _inputs((2, 3), 32, torch.float32)
    w.requires_grad_(True)
    rms_norm(x, w, 1e-6).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_custom_op_fake_impl_agrees():
    x, w = _inputs((2, 3), 32, torch.bfloat16, weight_dtype=torch.float32)
    for args in ((x, w, 1e-6, 0.0, False), (x, w, 1e-6, 1.0, True)):
        torch.library.opcheck(torch.ops.mla_fuser.rms_norm.default, args)
        assert torch.equal(torch.ops.mla_fuser.rms_norm(*args), rms_norm_ref(*args))


# ---------------------------------------------------------------- the reference vs Transformers' modules


def _hf_norm(kind, width, dtype):
    if kind == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm as cls
    elif kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as cls
    elif kind == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as cls
    else:  # weight applied in fp32, then cast: (self.weight * hidden_states).to(input_dtype)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm as cls
    module = cls(width, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_(0.0 if kind == "gemma" else 1.0, 0.5)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,weight_in_fp32,offset", [("deepseek_v2", False, 0.0), ("llama", False, 0.0),
                                                        ("gemma", True, 1.0), ("gpt_oss", True, 0.0)])
def test_ref_is_bitwise_the_transformers_module(dtype, kind, weight_in_fp32, offset):
    pytest.importorskip("transformers")
    module = _hf_norm(kind, 100, dtype)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 100, generator=gen) * 3).to(dtype)
    x[1, 2] *= 100
    with torch.no_grad():
        expected = module(x)
        got = rms_norm_ref(x, module.weight, 1e-6, offset, weight_in_fp32)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    # and on a non-contiguous input, where the module reduces over a strided row
    xt = x.transpose(0, 1)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(xt, module.weight, 1e-6, offset, weight_in_fp32), module(xt))


def test_ref_with_fp32_weight_on_bf16_input_matches_the_module_promotion():
    module = _hf_norm("deepseek_v2", 64, torch.float32)  # fp32 weight kept, bf16 activations
    x = (torch.randn(3, 64) * 3).to(torch.bfloat16)
    with torch.no_grad():
        expected = module(x)
        got = rms_norm_ref(x, module.weight, 1e-6)
    assert expected.dtype == got.dtype == torch.float32
    assert torch.equal(got, expected)
