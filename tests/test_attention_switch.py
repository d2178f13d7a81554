"""What Transformers' own model tests do to a fused model: switch the attention implementation after fusion, and
ask for attention weights."""

import pytest
import torch

import mla_fuser

from conftest import left_padded_prompts, tiny_deepseek


def _pair(arch="deepseek_v2", **kw):
    native = tiny_deepseek(arch, attn="eager", **kw)
    fused = tiny_deepseek(arch, attn="vllm_mla", **kw)
    mla_fuser.fuse(fused)
    return native, fused


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_switching_attention_after_fusion_runs_the_unfused_computation(arch, implementation):
    native, fused = _pair(arch)
    ids, mask = left_padded_prompts([6, 3], seed=2)
    fused.set_attn_implementation(implementation)
    native.set_attn_implementation(implementation)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, attention_mask=mask).logits, native(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=1e-4)
        out = fused.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    # as the assisted-decoding tests do: the config attribute itself
    fused.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, native(ids).logits, atol=1e-4, rtol=1e-4)
    # and back: fused again, still exact (on the real tokens: a fully masked padding row is undefined)
    fused.set_attn_implementation("vllm_mla")
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, attention_mask=mask).logits[real],
                                   native(ids, attention_mask=mask).logits[real], atol=1e-4, rtol=1e-4)
        out = fused.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_output_attentions_returns_the_weights_native_eager_returns(q_lora_rank):
    native, fused = _pair(q_lora_rank=q_lora_rank)
    ids, mask = left_padded_prompts([7, 5], seed=3)
    with torch.no_grad():
        got = fused(ids, attention_mask=mask, output_attentions=True)
        ref = native(ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(ref.attentions) == native.config.num_hidden_layers
    real = mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]  # padded query rows are undefined
    for a, b in zip(got.attentions, ref.attentions):
        assert a.shape == b.shape
        torch.testing.assert_close(a * real, b * real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits[mask.bool()], ref.logits[mask.bool()], atol=1e-4, rtol=1e-4)


def test_output_attentions_in_a_decode_step_over_the_paged_cache():
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword

    native, fused = _pair()
    kw = cache_keyword(fused)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        paged = PagedLatentCache(fused)
        fused(ids, **{kw: paged}, use_cache=True)
        got = fused(ids[:, :1], **{kw: paged}, use_cache=True, output_attentions=True)
        ref_out = native(ids, use_cache=True)
        ref = native(ids[:, :1], **{kw: ref_out.past_key_values}, use_cache=True, output_attentions=True)
    assert len(got.attentions) == len(ref.attentions) == native.config.num_hidden_layers
    for a, b in zip(got.attentions, ref.attentions):
        assert a.shape == b.shape == (2, 4, 1, 7)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
