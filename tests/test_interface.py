"""The vllm_mla attention function: absorbed path vs expanded attention, masks, indices, sinks."""

import pytest
import torch

import mla_fuser  # noqa: F401
from mla_fuser.attention_interfaces import padded_attention, vllm_mla_attention
from mla_fuser.fusers.mla import MLAMatch, MLAPlan
from mla_fuser.plans import clear_plan, plan_of, set_plan
from mla_fuser.kernels.mla_attention import mla_attention_ref


class FakeAttn(torch.nn.Module):
    def __init__(self, heads=3, nope=8, rope=4, v=6, rank=16, bias=False):
        super().__init__()
        self.kv_up = torch.nn.Linear(rank, heads * (nope + v), bias=bias)
        self.is_causal = True
        self.dims = (heads, nope, rope, v, rank)
        match = MLAMatch(None, "a", "b", "c", "d", "e", "kv_up", "o", heads, nope, rope, v, rank, 4)
        set_plan(self, "mla", MLAPlan(match))

    def expand(self, kv_c, k_pe):
        heads, nope, rope, v, rank = self.dims
        b, _, t, _ = kv_c.shape
        kv = self.kv_up(kv_c).view(b, t, heads, nope + v).transpose(1, 2)
        k_nope, val = kv.split([nope, v], -1)
        return torch.cat([k_nope, k_pe.expand(-1, heads, -1, -1)], -1), val


def _inputs(batch=2, s=3, t=7, mod=None):
    heads, nope, rope, v, rank = mod.dims
    q = torch.randn(batch, heads, s, nope + rope)
    kv_c = torch.randn(batch, 1, t, rank)
    k_pe = torch.randn(batch, 1, t, rope)
    return q, kv_c, k_pe


def _left_padded_mask(batch, s, t, pad):
    allowed = torch.ones(batch, 1, s, t, dtype=torch.bool).tril(diagonal=t - s)
    for b, p in enumerate(pad):
        allowed[b, :, :, :p] = False
    return allowed


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("s,t", [(1, 7), (4, 4), (3, 9)])
def test_absorbed_equals_expanded(bias, s, t):
    mod = FakeAttn(bias=bias)
    q, kv_c, k_pe = _inputs(s=s, t=t, mod=mod)
    mask = _left_padded_mask(2, s, t, [0, 2])
    key, value = mod.expand(kv_c, k_pe)
    fused, _ = vllm_mla_attention(mod, q, kv_c, k_pe, mask, scaling=0.3)
    ref = padded_attention(mod, q, key, value, mask, scaling=0.3)
    assert fused.shape == (2, s, 3, 6)
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-4)


def test_no_mask_prefill_is_causal_like_sdpa():
    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(s=5, t=5, mod=mod)
    key, value = mod.expand(kv_c, k_pe)
    fused, _ = vllm_mla_attention(mod, q, kv_c, k_pe, None, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, key, value, is_causal=True, scale=0.3).transpose(1, 2)
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-4)


def test_fully_masked_rows_are_finite():
    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(s=3, t=5, mod=mod)
    mask = torch.zeros(2, 1, 3, 5, dtype=torch.bool)
    out, _ = vllm_mla_attention(mod, q, kv_c, k_pe, mask, scaling=0.3)
    assert torch.isfinite(out).all()
    clear_plan(mod, "mla")
    key, value = FakeAttn().expand(kv_c, k_pe)
    out2, _ = vllm_mla_attention(mod, q, key, value, mask, scaling=0.3)
    assert torch.isfinite(out2).all()


def test_indices_select_keys_like_a_mask():
    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(s=2, t=6, mod=mod)
    indices = torch.tensor([[[0, 3], [1, -1]], [[5, 4], [2, 2]]], dtype=torch.int32)  # [B, S, topk], -1 = none
    selected = torch.zeros(2, 1, 2, 6, dtype=torch.bool)
    for b in range(2):
        for s in range(2):
            for i in indices[b, s].tolist():
                if i >= 0:
                    selected[b, 0, s, i] = True
    full = torch.ones(2, 1, 2, 6, dtype=torch.bool)
    out, _ = vllm_mla_attention(mod, q, kv_c, k_pe, full, scaling=0.3, indices=indices)
    key, value = mod.expand(kv_c, k_pe)
    ref = padded_attention(mod, q, key, value, selected, scaling=0.3)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_sinks_join_the_normaliser():
    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(s=2, t=4, mod=mod)
    sinks = torch.tensor([0.5, -1.0, 2.0])
    out, _ = vllm_mla_attention(mod, q, kv_c, k_pe, None, scaling=0.3, s_aux=sinks)
    key, value = mod.expand(kv_c, k_pe)
    scores = torch.matmul(q, key.transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~torch.ones(2, 4, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    logits = torch.cat([scores, sinks.view(1, 3, 1, 1).expand(2, 3, 2, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :-1]
    ref = torch.matmul(probs, value).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_padded_attention_matches_eager_with_gqa_and_smaller_v():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    mod = torch.nn.Module()
    mod.is_causal, mod.num_key_value_groups, mod.training = True, 2, False
    q = torch.randn(2, 4, 3, 12)
    k = torch.randn(2, 2, 5, 12)
    v = torch.randn(2, 2, 5, 8)
    mask = _left_padded_mask(2, 3, 5, [1, 0])
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ref, _ = eager_attention_forward(mod, q, k, v, additive, scaling=0.25)
    out = padded_attention(mod, q, k, v, mask, scaling=0.25)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_latent_shape_mismatch_is_a_clear_error():
    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(mod=mod)
    with pytest.raises(RuntimeError, match="expected \\[B, 1, T, 16\\]"):
        vllm_mla_attention(mod, q, kv_c[..., :8], k_pe, None, scaling=0.3)


def test_reference_kernel_shapes():
    b, h, s, t, nope, rope, rank, v = 1, 2, 3, 4, 5, 2, 6, 3
    out = mla_attention_ref(torch.randn(b, h, s, nope), torch.randn(b, h, s, rope), torch.randn(b, t, rank),
                            torch.randn(b, t, rope), torch.randn(h, nope, rank), torch.randn(h, v, rank), 0.5)
    assert out.shape == (b, s, h, v)


def test_registration():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["vllm_mla"] is vllm_mla_attention
    assert "vllm_mla" in AttentionMaskInterface._global_mapping


def test_few_tokens_over_long_prefix_stay_absorbed_and_exact(monkeypatch):
    import mla_fuser.attention_interfaces.vllm_mla as vm

    mod = FakeAttn()
    q, kv_c, k_pe = _inputs(s=3, t=20, mod=mod)
    mask = _left_padded_mask(2, 3, 20, [0, 4])
    calls = []
    monkeypatch.setattr(vm, "mla_attention", lambda *a, **k: calls.append(1) or mla_attention_ref(*a, **k))
    out, _ = vllm_mla_attention(mod, q, kv_c, k_pe, mask, scaling=0.3)
    key, value = mod.expand(kv_c, k_pe)
    ref = padded_attention(mod, q, key, value, mask, scaling=0.3)
    assert calls and torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    assert vm._prefer_expanded(64, 64) and not vm._prefer_expanded(1, 4096) and not vm._prefer_expanded(4, 4096)


def test_left_padding_starts_only_for_left_padding_masks():
    from mla_fuser.attention_interfaces.vllm_mla import left_padding_starts

    allowed = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool).view(3, 1, 1, 5)
    assert left_padding_starts(allowed, 5).tolist() == [2, 0, 4]
    lowest = torch.finfo(torch.float32).min
    as_float = torch.zeros(3, 1, 1, 5).masked_fill(~allowed, lowest)
    assert left_padding_starts(as_float, 5).tolist() == [2, 0, 4]
    assert left_padding_starts(torch.cat([allowed, allowed[..., :2]], -1), 5).tolist() == [2, 0, 4]  # longer
    right = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool).view(1, 1, 1, 5)
    assert left_padding_starts(right, 5) is None
    holes = torch.tensor([[0, 1, 0, 1, 1]], dtype=torch.bool).view(1, 1, 1, 5)
    assert left_padding_starts(holes, 5) is None
    assert left_padding_starts(as_float + 0.5, 5) is None  # an additive bias is not padding
    assert left_padding_starts(allowed.expand(3, 2, 1, 5), 5) is None  # per-head masks
    assert left_padding_starts(allowed.expand(3, 1, 2, 5), 5) is None  # more than one query


def test_left_padded_decode_runs_the_kernel_with_starts(monkeypatch):
    """A left-padded batch's decode steps read the pages through the decode kernel with per-row starts (no
    read-back of the whole latent), with the tokens of the native model."""
    import mla_fuser.attention_interfaces.vllm_mla as vm
    from conftest import left_padded_prompts, tiny_deepseek

    seen = []
    real = vm.paged_decode

    def spy(*args, **kwargs):
        seen.append(args[-1] if len(args) > 7 else kwargs.get("starts"))
        return real(*args, **kwargs)

    monkeypatch.setattr(vm, "paged_decode", spy)
    native = tiny_deepseek()
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    ids, mask = left_padded_prompts([3, 7], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    assert seen and all(s is not None and s.tolist() == [4, 0] for s in seen)


@pytest.mark.parametrize("bias", [False, True])
def test_absorbed_views_follow_the_weight(bias):
    """The absorbed views of a plain kv_b_proj are kept between calls (an eager decode step is host-bound): in-place
    changes show through them, and a new storage, bias or module is noticed at the next call."""
    mod = FakeAttn(bias=bias)
    q, kv_c, k_pe = _inputs(s=1, t=9, mod=mod)

    def check():
        key, value = mod.expand(kv_c, k_pe)
        fused, _ = vllm_mla_attention(mod, q, kv_c, k_pe, None, scaling=0.3)
        ref = padded_attention(mod, q, key, value, None, scaling=0.3)
        assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-4)

    check()
    with torch.no_grad():
        mod.kv_up.weight.mul_(-2)  # in place: the kept views see it
    check()
    mod.kv_up.weight.data = torch.randn_like(mod.kv_up.weight)  # new storage (a load that assigns, .to())
    check()
    if bias:
        mod.kv_up.bias = torch.nn.Parameter(torch.randn_like(mod.kv_up.bias))
        check()
    mod.kv_up = torch.nn.Linear(*reversed(mod.kv_up.weight.shape), bias=bias)  # a new module
    check()


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_absorbed_decode_output_is_token_major_and_exact(tokens, bias):
    """The value projection writes the attention output token-major (``[B, T, H, v]`` contiguous: the modeling
    code's ``reshape(batch, tokens, -1)`` is then a view, not a copy kernel per layer), with the very values of the
    per-head batched GEMM; while autograd records it still runs (``out=`` has no backward)."""
    from types import SimpleNamespace

    from mla_fuser.attention_interfaces.paged import absorbed_decode

    torch.manual_seed(0)
    B, H, nope, rope, rank, v = 2, 3, 8, 4, 16, 6
    m = SimpleNamespace(qk_nope_head_dim=nope)
    query = torch.randn(B, H, tokens, nope + rope)
    w_uk, w_uv = torch.randn(H, nope, rank), torch.randn(H, v, rank)
    b_v = torch.randn(H, v) if bias else None
    lat_out = torch.randn(B * tokens, H, rank)
    out = absorbed_decode(query, w_uk, w_uv, b_v, m, torch.float32, lambda q_lat, q_pe: lat_out)
    want = torch.bmm(lat_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    want = (want if b_v is None else want + b_v).reshape(B, tokens, H, v)
    assert out.shape == (B, tokens, H, v) and out.is_contiguous()
    assert torch.equal(out, want)
    w_uv.requires_grad_(True)
    graded = absorbed_decode(query, w_uk, w_uv, b_v, m, torch.float32, lambda q_lat, q_pe: lat_out)
    assert graded.requires_grad and torch.allclose(graded, want)
