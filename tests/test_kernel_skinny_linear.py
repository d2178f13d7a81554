"""``kernels.skinny_linear``: the decode-size linear against ``F.linear`` (interpreted on CPU, compiled on a GPU),
and when the dispatcher takes it."""

import pytest
import torch
import torch.nn.functional as F

from mla_fuser.kernels import skinny_linear as sk

pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def kernel_device(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return DEV


def _operands(rows, k, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k,n", [(64, 48), (200, 40)])  # (K not a multiple of the K tile, N not of the N tile)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_f_linear(kernel_device, rows, k, n, bias, dtype):
    if dtype == torch.float32 and ON_GPU:
        pytest.skip("fp32 is the interpreter's stand-in; compiled, the kernel takes 16-bit operands only")
    x, w, b = _operands(rows, k, n, dtype, bias)
    got = sk.skinny_linear_triton(x, w, b, sk.SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=2))
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        # compiled: one rounding to nearest of the fp32 sum, half a bf16 unit (2**-8 relative at most); the
        # interpreter truncates its bf16 stores (a whole unit, 2**-7): a unit more allowed there
        rel = 2 ** -8 if ON_GPU else 2 ** -6
        err = (got.double() - exact).abs()
        assert (err <= exact.abs() * rel + 1e-5).all(), err.max()
        want = F.linear(x, w, b)  # cuBLAS / torch: rounded on its own, so the two differ by one rounding more
        assert ((got.double() - want.double()).abs() <= exact.abs() * 2 * rel + 1e-5).all()


def test_leading_dims_and_strided_rows(kernel_device):
    x, w, _ = _operands(6, 64, 32, torch.float32 if not ON_GPU else torch.bfloat16, False)
    x3 = x.view(2, 3, 64)
    got = sk.skinny_linear_triton(x3, w)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.float(), F.linear(x3, w).float(), rtol=1e-2, atol=1e-2)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 apart: still contiguous in K
    torch.testing.assert_close(sk.skinny_linear_triton(wide, w).float(), F.linear(wide, w).float(),
                               rtol=1e-2, atol=1e-2)


def test_operands_it_cannot_take_are_refused(kernel_device):
    x, w, _ = _operands(17, 64, 32, torch.float32 if not ON_GPU else torch.bfloat16, False)
    with pytest.raises(ValueError, match="rows"):
        sk.skinny_linear_triton(x, w)  # 17 rows
    with pytest.raises(ValueError, match="rows"):
        sk.skinny_linear_triton(x[:4], w.t().contiguous().t())  # weight not contiguous in K
    with pytest.raises(ValueError, match="rows"):
        sk.skinny_linear_triton(x[:4].half(), w)  # dtypes differ


def test_dispatch_takes_the_kernel_only_where_it_runs(monkeypatch):
    """CPU: F.linear itself unless the interpreter and the Triton backend are forced and launches are free (a graph's
    warm-up step); the switch turns it off; more rows than a tile, or autograd recording, keep F.linear."""
    from mla_fuser.kernels.dispatch import graph_warmup

    monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "1")
    monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "1")

    launches = []
    real = sk.skinny_linear_triton
    monkeypatch.setattr(sk, "skinny_linear_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    x, w, b = _operands(4, 64, 32, torch.float32, True)
    x, w, b = x.cpu(), w.cpu(), b.cpu()
    assert torch.equal(sk.skinny_linear(x, w, b), F.linear(x, w, b)) and not launches
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    sk.skinny_linear(x, w, b)
    assert not launches  # (an eager call: launches are not free)
    with graph_warmup():
        torch.testing.assert_close(sk.skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert launches == [1]
        sk.skinny_linear(torch.randn(17, 64), w, b)
        with torch.enable_grad():
            sk.skinny_linear(x.requires_grad_(), w, b)
        monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "0")
        sk.skinny_linear(x.detach(), w, b)
    assert launches == [1]


def test_fusion_binds_o_proj_and_down_and_a_captured_step_takes_the_kernel(monkeypatch):
    """``fusers.linear``: a fused DeepSeek-V2's ``o_proj`` and gated-MLP down linears get the skinny forward (plain
    linears only; an FP8 or otherwise bound one keeps its own), eager CPU calls stay on ``F.linear``, and with the
    interpreter a captured step's calls (its warm-up) run the kernel and agree with native."""
    import mla_fuser
    from conftest import tiny_deepseek
    from mla_fuser.fusers.linear import _skinny_forward, bind_skinny_forward
    from mla_fuser.kernels.dispatch import graph_warmup

    monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "1")

    native = tiny_deepseek()
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    bound = sorted(n for n, m in fused.named_modules()
                   if getattr(m.__dict__.get("forward"), "__func__", None) is _skinny_forward)
    assert bound == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj",
                     "model.layers.1.mlp.shared_experts.down_proj", "model.layers.1.self_attn.o_proj"]
    assert not bind_skinny_forward(nn_linear_subclass := type("L", (torch.nn.Linear,), {})(4, 4))
    assert "forward" not in nn_linear_subclass.__dict__
    launches = []
    real = sk.skinny_linear_triton
    monkeypatch.setattr(sk, "skinny_linear_triton", lambda *a, **kw: launches.append(a[1].shape) or real(*a, **kw))
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = native(ids).logits, fused(ids).logits
        assert not launches  # (CPU without the interpreter: F.linear)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
        fused(ids[:, :1])
        assert not launches  # (eager)
        with graph_warmup():
            got_kernel = fused(ids[:, :1]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kernel, native(ids[:, :1]).logits, rtol=1e-4, atol=1e-4)
    cfg = fused.config
    assert (cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim) in launches  # o_proj
    assert any(shape[0] == cfg.hidden_size and shape[1] == cfg.intermediate_size for shape in launches)  # dense down
