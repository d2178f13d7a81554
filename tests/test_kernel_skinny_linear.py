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


# ---------------------------------------------------------------------------------------------------------
# skinny_bmm: absorbed MLA's per-head products


def _heads(rows, heads, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, k + 8, generator=g).to(DEV, dtype)  # (a query with rope columns after K)
    w_uk = (torch.randn(heads, k, n, generator=g) / k ** 0.5).to(DEV, dtype)  # [H, K, N], N contiguous
    w_uv = (torch.randn(heads, n, k, generator=g) / k ** 0.5).to(DEV, dtype)  # [H, N, K], used transposed
    return q.narrow(-1, 0, k).transpose(0, 1), w_uk, w_uv.transpose(1, 2)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_equals_torch_bmm_both_weight_layouts(kernel_device, rows, dtype):
    """A query's strided head view times a weight contiguous along N (W_UK) and along K (W_UV), the latter into a
    token-major ``out`` view: torch.bmm's result up to the order of the fp32 sums."""
    if dtype == torch.float32 and ON_GPU:
        pytest.skip("fp32 is the interpreter's stand-in; compiled, the kernel takes 16-bit operands only")
    x, w_n, w_k = _heads(rows, 3, 40, 72, dtype)  # (K, N not multiples of the tiles)
    rel = 1e-5 if dtype == torch.float32 else (2 ** -8 if ON_GPU else 2 ** -6)
    for w in (w_n, w_k):
        exact = torch.bmm(x.double(), w.double())
        dest = torch.empty(rows, 3, 72, dtype=dtype, device=DEV)
        for got in (sk.skinny_bmm_triton(x, w), sk.skinny_bmm_triton(x, w, out=dest.transpose(0, 1))):
            assert got.shape == (3, rows, 72) and got.dtype == dtype
            err = (got.double() - exact).abs()
            assert (err <= exact.abs() * rel + 1e-5).all(), err.max()
        torch.testing.assert_close(dest.transpose(0, 1), got)


def test_bmm_operands_it_cannot_take_are_refused(kernel_device):
    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    x, w_n, _ = _heads(4, 2, 32, 48, dtype)
    with pytest.raises(ValueError, match="skinny_bmm"):
        sk.skinny_bmm_triton(torch.cat([x, x, x, x, x], dim=1), w_n)  # 20 rows
    with pytest.raises(ValueError, match="skinny_bmm"):
        sk.skinny_bmm_triton(x, w_n[:, :, ::2])  # neither weight dimension unit-stride
    with pytest.raises(ValueError, match="skinny_bmm"):
        sk.skinny_bmm_triton(x.transpose(1, 2).contiguous().transpose(1, 2), w_n)  # x strided along K
    with pytest.raises(ValueError, match="skinny_bmm"):
        sk.skinny_bmm_triton(x, w_n, out=torch.empty(2, 4, 47, dtype=dtype, device=DEV))  # out of another shape
    with pytest.raises(ValueError, match="skinny_bmm"):
        sk.skinny_bmm_triton(x, w_n.half())  # dtypes differ


def test_bmm_dispatch_takes_the_kernel_only_where_it_runs(monkeypatch):
    """As the linear's dispatcher: torch.bmm for eager calls, the switch off, autograd recording and too many rows;
    the kernel inside a graph's warm-up with the interpreter and the Triton backend, ``out`` honoured either way."""
    from mla_fuser.kernels.dispatch import graph_warmup

    monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "1")
    launches = []
    real = sk.skinny_bmm_triton
    monkeypatch.setattr(sk, "skinny_bmm_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    x, w, _ = _heads(4, 2, 32, 48, torch.float32)
    x, w = x.cpu(), w.cpu()
    dest = torch.empty(4, 2, 48)
    assert sk.skinny_bmm(x, w, out=dest.transpose(0, 1)).data_ptr() == dest.data_ptr() and not launches
    torch.testing.assert_close(dest.transpose(0, 1), torch.bmm(x, w))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    sk.skinny_bmm(x, w)
    assert not launches  # (an eager call)
    with graph_warmup():
        dest.zero_()
        sk.skinny_bmm(x, w, out=dest.transpose(0, 1))
        assert launches == [1]
        torch.testing.assert_close(dest.transpose(0, 1), torch.bmm(x, w), rtol=1e-5, atol=1e-5)
        sk.skinny_bmm(torch.randn(2, 17, 32), w)
        with torch.enable_grad():
            sk.skinny_bmm(x.clone().requires_grad_(), w)
        monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "0")
        sk.skinny_bmm(x, w)
    assert launches == [1]


def test_paged_decode_step_takes_the_bmm_kernel_and_agrees_with_native(monkeypatch):
    """A fused DeepSeek-V2's decode step over the paged cache, in a graph's warm-up with the interpreter: both
    absorbed products of every layer (W_UK, W_UV) run on ``skinny_bmm`` and the logits equal native's."""
    import inspect

    from transformers import DynamicCache

    import mla_fuser
    from conftest import tiny_deepseek
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.kernels.dispatch import graph_warmup

    monkeypatch.setenv("MLA_FUSER_SKINNY_LINEAR", "1")
    native = tiny_deepseek()
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    kw = "cache" if "cache" in inspect.signature(type(native).forward).parameters else "past_key_values"
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    launches = []
    real = sk.skinny_bmm_triton
    monkeypatch.setattr(sk, "skinny_bmm_triton", lambda *a, **k: launches.append(a[1].shape) or real(*a, **k))
    with torch.no_grad():
        native_cache, paged = DynamicCache(config=native.config), PagedLatentCache(fused, page_size=4, max_cache_tokens=64)
        native(ids[:, :5], **{kw: native_cache})
        fused(ids[:, :5], **{kw: paged})
        want = native(ids[:, 5:], **{kw: native_cache}).logits
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
        with graph_warmup():
            got = fused(ids[:, 5:], **{kw: paged}).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cfg = fused.config
    heads, rank = cfg.num_attention_heads, cfg.kv_lora_rank
    assert launches.count((heads, cfg.qk_nope_head_dim, rank)) == cfg.num_hidden_layers  # W_UK
    assert launches.count((heads, rank, cfg.v_head_dim)) == cfg.num_hidden_layers  # W_UV (transposed view)
