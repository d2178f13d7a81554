"""``act(gate) * up`` kernel: Triton (under the interpreter on CPU, tiny shapes) vs ``act_mul_ref``, on the layouts a
stacked gate+up GEMM hands it (two halves of one ``[T, 2I]`` output), and the dispatch around it.

``TRITON_INTERPRET`` is set per test with ``monkeypatch`` (the kernel is wrapped lazily at its first launch, see
``dispatch.LazyJit``), ``MLA_FUSER_BACKEND=triton`` only for the tests that compare the kernel with the reference.
With a GPU the same tests run the compiled kernel.  Tolerances, in units in the last place (ulps) of the dtype:

* silu / relu: fp32 a few ulps (Triton's ``exp`` is not torch's: bitwise equality is not feasible there; 16 on an
  H200, where ``exp`` is ``ex2.approx`` and the division approximate: 8.5e-8 relative at most, as measured); 16-bit
  two: the activation, rounded to the dtype, may land one ulp off, and that ulp of ``a`` can be two of ``a * up``
  when the product sits low in its binade; bf16 four under the interpreter, whose fp32 -> bf16 conversions
  truncate instead of rounding (twice here: the activation and the product).  relu is exact where the
  conversions round (``test_relu_is_exact``);
* gelu / gelu_tanh: the same near the values that matter, plus an absolute allowance of 1e-6 of the largest
  output: in the far negative tail ``1 + erf`` / ``1 + tanh`` cancel, and two implementations of erf / tanh leave
  different (tiny) remainders there.
"""

import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("mla_fuser") is None:  # plain `pytest` from the repo without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_fuser.kernels.act_mul import ACTIVATIONS, act_mul, act_mul_ref, act_mul_triton  # noqa: E402
from mla_fuser.kernels.dispatch import triton_available  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
ULPS = {
    torch.float32: 16 if ON_GPU else 4,  # compiled, Triton's exp is ex2.approx and its fp32 division approximate
    torch.float16: 2,
    torch.bfloat16: 2 if ON_GPU else 4,
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")


def _stacked(lead, width, dtype, seed=0, scale=4.0):
    """``gate`` and ``up`` as the two halves of one ``[*lead, 2 * width]`` tensor (rows ``2 * width`` apart)."""
    gen = torch.Generator().manual_seed(seed)
    both = (torch.randn(*lead, 2 * width, generator=gen) * scale).to(DEV, dtype)
    return both[..., :width], both[..., width:]


def _spacing(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of ``ref`` (float64), subnormals included."""
    _, exp = torch.frexp(ref.double().abs())
    lowest = int(math.log2(torch.finfo(dtype).tiny)) + 1  # frexp's exponent of the smallest normal
    return torch.pow(2.0, exp.clamp(min=lowest).double() - 1 - MANTISSA[dtype])


def _check(got, ref, dtype, activation):
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    diff = (got.double() - ref.double()).abs()
    allowed = ULPS[dtype] * _spacing(ref, dtype)
    if activation in ("gelu", "gelu_tanh"):
        allowed = allowed + 1e-6 * ref.double().abs().max()
    bad = diff > allowed
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {ref.numel()} elements off, worst {diff.max().item():.3e} "
        f"(got {got[bad][:3].tolist()}, want {ref[bad][:3].tolist()})"
    )


@needs_triton
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,width", [((3,), 37), ((2, 5), 100), ((2,), 1500), ((4,), 1)])
def test_triton_matches_ref_on_stacked_halves(triton_backend, activation, dtype, lead, width):
    """Odd widths (not a multiple of the block), one row wider than a block (several programs), a width of 1."""
    gate, up = _stacked(lead, width, dtype)
    assert gate.stride(-2) == 2 * width and not gate.is_contiguous()
    got = act_mul(gate, up, activation)
    assert got.is_contiguous()
    _check(got, act_mul_ref(gate, up, activation), dtype, activation)


@needs_triton
def test_relu_is_exact(triton_backend):
    """No transcendental: the kernel rounds where torch rounds (fp32 and fp16, where the interpreter rounds too)."""
    for dtype in (torch.float32, torch.float16):
        gate, up = _stacked((6,), 77, dtype, seed=3)
        assert torch.equal(act_mul(gate, up, "relu"), act_mul_ref(gate, up, "relu"))


@needs_triton
def test_triton_layouts(triton_backend):
    """Contiguous inputs, leading dimensions that do not merge into one row stride (a copy), a strided last
    dimension (a copy), separate tensors with different row strides."""
    dtype, width = torch.float16, 48
    gen = torch.Generator().manual_seed(1)
    both = (torch.randn(5, 3, 2 * width, generator=gen) * 3).to(DEV, dtype)
    cases = [
        (both[..., :width].contiguous(), both[..., width:].contiguous()),
        (both.transpose(0, 1)[..., :width], both.transpose(0, 1)[..., width:]),  # [3, 5, w]: rows do not merge
        (both[..., 0::2], both[..., 1::2]),  # interleaved: last dimension strided
        (both[:, 0, :width], (torch.randn(5, width, generator=gen) * 3).to(DEV, dtype)),
    ]
    for gate, up in cases:
        got = act_mul(gate, up, "silu")
        assert got.shape == gate.shape and got.is_contiguous()
        _check(got, act_mul_ref(gate, up, "silu"), dtype, "silu")


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy overflows exp(-(-100)) to inf)
def test_triton_edge_values(triton_backend):
    """Large, tiny and zero gates; NaN stays NaN.  (Infinite gates are left out: torch's own CPU gelu gives NaN for
    +inf, its CUDA gelu inf.)"""
    gate = torch.tensor([[-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, float("nan")]])
    up = torch.full_like(gate, 1.5)
    for activation in ACTIVATIONS:
        got = act_mul_triton(gate.to(DEV), up.to(DEV), activation).cpu()
        ref = act_mul_ref(gate, up, activation)
        assert torch.isnan(got[0, -1]) and torch.isnan(ref[0, -1])
        torch.testing.assert_close(got[:, :-1], ref[:, :-1], rtol=1e-6, atol=1e-6, equal_nan=True)


@needs_triton
def test_empty_rows(triton_backend):
    gate, up = _stacked((0,), 16, torch.float32)
    assert act_mul(gate, up, "silu").shape == (0, 16)


def test_cpu_dispatch_runs_the_reference_bitwise():
    """Without a forced backend CPU tensors take the torch twin: bitwise the native ops."""
    for dtype in DTYPES:
        gate, up = _stacked((2, 3), 40, dtype)
        for activation in ACTIVATIONS:
            if DEV == "cpu":
                assert torch.equal(act_mul(gate, up, activation), act_mul_ref(gate, up, activation))


def test_reference_is_the_native_ops():
    gate, up = _stacked((3,), 20, torch.bfloat16)
    F = torch.nn.functional
    assert torch.equal(act_mul_ref(gate, up, "silu"), F.silu(gate) * up)
    assert torch.equal(act_mul_ref(gate, up, "gelu"), F.gelu(gate) * up)
    assert torch.equal(act_mul_ref(gate, up, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)
    assert torch.equal(act_mul_ref(gate, up, "relu"), torch.relu(gate) * up)


def test_unknown_activation_is_an_error():
    gate, up = _stacked((2,), 8, torch.float32)
    with pytest.raises(ValueError, match="unknown activation"):
        act_mul(gate, up, "swish")


def test_autograd_runs_the_reference(triton_backend):
    """The kernel has no backward: while autograd records, the torch twin runs (even with the kernel forced)."""
    gate, up = _stacked((3,), 24, torch.float32)
    gate = gate.detach().requires_grad_()
    out = act_mul(gate, up, "silu")
    out.sum().backward()
    assert gate.grad is not None and out.grad_fn is not None


def test_custom_op_and_fake_impl():
    """``mla_fuser::act_mul`` passes torch.library's checks (schema, fake implementation, dispatch)."""
    gate, up = _stacked((3,), 24, torch.float32)
    op = torch.ops.mla_fuser.act_mul.default
    assert torch.equal(op(gate, up, "silu"), act_mul(gate, up, "silu"))  # the op is what the eager call runs
    torch.library.opcheck(op, (gate, up, "silu"), test_utils=("test_schema", "test_faketensor"))
