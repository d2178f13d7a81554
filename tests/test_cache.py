"""Paged latent cache: generation equals native, pool budget and isolation, beam search, crop, static."""

import pytest
import torch
from transformers import DynamicCache

import mla_fuser
from mla_fuser.cache import CachePoolExhausted, PagedLatentCache, PagedLatentLayer, paged_layer_indices

from conftest import left_padded_prompts, tiny_deepseek

import inspect

from transformers import DeepseekV2ForCausalLM

# Transformers renamed ``past_key_values`` to ``cache`` in 5.2x; use whichever the installed version takes
KW = "cache" if "cache" in inspect.signature(DeepseekV2ForCausalLM.forward).parameters else "past_key_values"


def _pair(arch="deepseek_v2", **kw):
    native = tiny_deepseek(arch, **kw)
    fused = tiny_deepseek(arch, attn="vllm_mla", **kw)
    mla_fuser.fuse(fused)
    return native, fused


_prompts = left_padded_prompts


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_auto_paged_cache_greedy_equals_native(arch):
    native, fused = _pair(arch)
    ids, mask = _prompts([7, 7])
    seen = []
    orig = PagedLatentLayer.update

    def spy(self, *a, **k):
        seen.append(self.layer_idx)
        return orig(self, *a, **k)

    PagedLatentLayer.update = spy
    try:
        out = fused.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    finally:
        PagedLatentLayer.update = orig
    ref = native.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    assert seen, "generate did not use the paged cache"


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_left_padded_batch_equals_native(arch, page_size):
    native, fused = _pair(arch)
    ids, mask = _prompts([3, 9, 6], seed=1)
    cache = PagedLatentCache(fused, page_size=page_size, max_cache_tokens=256)
    out = fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=16, do_sample=False)
    ref = native.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)
    assert isinstance(cache.layers[0], PagedLatentLayer)
    assert cache.get_seq_length() == ids.shape[1] + 16 - 1


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_beam_search_equals_native(arch):
    native, fused = _pair(arch)
    ids, mask = _prompts([5, 8], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=10, num_beams=2, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))


def test_sampling_equals_native():
    native, fused = _pair()
    ids, mask = _prompts([6], seed=3)
    torch.manual_seed(7)
    ref = native.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20)
    torch.manual_seed(7)
    out = fused.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_static_paged_cache_equals_native_and_keeps_addresses(arch):
    native, fused = _pair(arch)
    ids, mask = _prompts([4, 6], seed=4)
    cache = PagedLatentCache(fused, page_size=8, static=True, max_seq_len=32, max_cache_tokens=128)
    out = fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=12, do_sample=False)
    ref = native.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    layer = cache.layers[1]
    assert layer.block_table.shape == (2, 4)
    assert cache.get_max_length() == 32


def test_static_paged_cache_beam_search_crosses_pages_like_native():
    """Beam reordering of a static cache keeps every sequence's full reservation, so later steps that cross
    page boundaries still find their pages (and the block table keeps its shape and address)."""
    native, fused = _pair()
    ids, mask = _prompts([3, 5], seed=11)
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=24, max_cache_tokens=4 * 24)
    kw = dict(attention_mask=mask, max_new_tokens=14, num_beams=2, do_sample=False)
    assert torch.equal(fused.generate(ids, **{KW: cache}, **kw), native.generate(ids, **kw))
    assert cache.layers[1].block_table.shape == (4, 6)


def test_failed_sequence_copy_leaves_the_cache_as_it_was():
    _, fused = _pair()
    ids, _ = _prompts([9, 9], seed=12)
    cache = PagedLatentCache(fused, page_size=4, max_cache_tokens=24)  # 6 pages per layer, 3 per sequence used
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
    layer = cache.layers[1]
    tables, lens, data = [list(t) for t in layer.host_tables], list(layer.host_lens), layer.gather().clone()
    with pytest.raises(CachePoolExhausted, match="copying sequences"):
        cache.batch_repeat_interleave(3)  # 6 sequences x 3 pages > 6 pages
    assert layer.host_tables == tables and layer.host_lens == lens
    assert torch.equal(layer.gather(), data)


def test_transformers_static_cache_still_works_when_fused():
    native, fused = _pair()
    ids, mask = _prompts([4, 6], seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))


def test_crop_then_continue_matches_native():
    native, fused = _pair()
    ids, _ = _prompts([10], seed=6)
    cache = PagedLatentCache(fused, page_size=4, max_cache_tokens=64)
    ref_cache = DynamicCache(config=native.config)
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
        native(input_ids=ids, **{KW: ref_cache}, use_cache=True)
        cache.crop(-3)
        ref_cache.crop(-3)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 7
        nxt = torch.tensor([[11, 12]])
        a = fused(input_ids=nxt, **{KW: cache}, use_cache=True).logits
        b = native(input_ids=nxt, **{KW: ref_cache}, use_cache=True).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_assisted_decoding_equals_native():
    native, fused = _pair()
    assistant = tiny_deepseek(seed=5, layers=1)
    ids, mask = _prompts([6], seed=8)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))


def test_pool_exhaustion_is_clear_and_leaves_other_sequences_untouched():
    native, fused = _pair()
    ids_a, mask_a = _prompts([6], seed=9)
    ids_b, mask_b = _prompts([40], seed=10)
    first = PagedLatentCache(fused, page_size=4, max_cache_tokens=40)
    second = PagedLatentCache(fused, page_size=4, share_pools_with=first)
    with torch.no_grad():
        fused(input_ids=ids_a, attention_mask=mask_a, **{KW: first}, use_cache=True)
        snapshot = {i: p.pages.clone() for i, p in first.pools.items()}
        with pytest.raises(CachePoolExhausted, match="more pages of 4 tokens needed"):
            fused(input_ids=ids_b, attention_mask=mask_b, **{KW: second}, use_cache=True)
    for i, p in first.pools.items():
        assert torch.equal(p.pages, snapshot[i])
    # the first request continues exactly like the native model
    out = fused.generate(ids_a, attention_mask=mask_a, **{KW: PagedLatentCache(fused, max_cache_tokens=64)},
                         max_new_tokens=6, do_sample=False)
    ref = native.generate(ids_a, attention_mask=mask_a, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)


def test_paged_layers_are_the_fused_ones_and_user_cache_wins():
    _, fused = _pair()
    assert paged_layer_indices(fused) == [0, 1]
    cache = DynamicCache(config=fused.config)
    ids, mask = _prompts([5], seed=11)
    fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=3, do_sample=False)
    assert type(cache) is DynamicCache and cache.get_seq_length() > 0


def test_bad_arguments():
    _, fused = _pair()
    with pytest.raises(ValueError, match="not both"):
        PagedLatentCache(fused, max_cache_tokens=10, memory_fraction=0.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        PagedLatentCache(fused, static=True)
    with pytest.raises(ValueError, match="memory_fraction"):
        PagedLatentCache(fused, memory_fraction=2.0)


def test_paged_generation_through_the_triton_kernels(monkeypatch):
    """The Triton decode and page-write kernels (interpreted on CPU) drive a whole generation."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    native, fused = _pair(layers=1)
    ids, mask = _prompts([5, 5], seed=12)
    calls = []
    import mla_fuser.kernels.mla_decode as dec

    original = dec.mla_decode_triton

    def spy(*a, **k):
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(dec, "mla_decode_triton", spy)
    out = fused.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    ref = native.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)
    assert calls, "the Triton decode kernel did not run"


def test_decode_step_compiles_fullgraph_over_static_paged_cache():
    """A fused decode step traces into one torch.compile graph (no graph break) over a static paged cache,
    gives the eager outputs, and does not recompile every step: the precondition for capturing decode in a
    CUDA graph (``mode="reduce-overhead"``) on GPUs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    _, fused = _pair(layers=2)

    def run(compiled):
        cache = PagedLatentCache(fused, static=True, max_seq_len=64, max_cache_tokens=256, page_size=16)
        ids, _ = _prompts([7, 7], seed=13)
        outs = []
        with torch.no_grad():
            tok = fused(input_ids=ids, **{KW: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            step = torch.compile(fused.forward, backend="eager", fullgraph=True) if compiled else fused.forward
            for i in range(6):
                out = step(input_ids=tok, position_ids=torch.full((2, 1), 7 + i), **{KW: cache}, use_cache=True)
                outs.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
        return torch.cat(outs, 1)

    torch._dynamo.reset()
    counters.clear()
    try:
        eager, compiled = run(False), run(True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("static", [False, True])
def test_failed_first_prefill_leaves_the_cache_usable_for_any_batch(static):
    """A first prefill the pool cannot hold raises and stores nothing; the cache is then as new: a smaller batch
    (or another batch size) runs and equals native."""
    native, fused = _pair()
    big, big_mask = _prompts([30, 30], seed=4)
    ids, mask = _prompts([5], seed=5)
    if static:
        cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=20, max_cache_tokens=24)
    else:
        cache = PagedLatentCache(fused, page_size=4, max_cache_tokens=40)
    with torch.no_grad(), pytest.raises(CachePoolExhausted):
        fused(input_ids=big, attention_mask=big_mask, **{KW: cache}, use_cache=True)
    assert cache.get_seq_length() == 0
    assert all(len(p.free) == p.num_pages for p in cache.pools.values())
    out = fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


def test_paged_cache_exposes_the_latent_as_keys_and_values_like_native():
    """After a fused ``generate``, ``cache.layers[i].keys`` / ``.values`` hold the latent in native's layout
    (``[B, 1, T, kv_lora_rank]``, ``[B, 1, T, rope]``), read back from the pages, equal to native's own cache."""
    native, fused = _pair()
    ids, mask = _prompts([7, 4], seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        out = fused.generate(ids, **kwargs)
        ref = native.generate(ids, **kwargs)
    cache, ref_cache = out.past_key_values, ref.past_key_values
    assert isinstance(cache, PagedLatentCache) and torch.equal(out.sequences, ref.sequences)
    # padding positions hold whatever a fully masked query row produced in the layer below: compare real tokens
    real = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1).bool()
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert isinstance(layer, PagedLatentLayer)
        assert layer.keys.shape == ref_layer.keys.shape == (2, 1, ids.shape[1] + 4, 16)
        assert layer.values.shape == ref_layer.values.shape == (2, 1, ids.shape[1] + 4, 4)
        torch.testing.assert_close(layer.keys[:, 0][real], ref_layer.keys[:, 0][real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[:, 0][real], ref_layer.values[:, 0][real], atol=1e-5, rtol=1e-5)
    layer = cache.layers[0]
    reads, gather = [], layer.gather
    layer.gather = lambda *a, **k: reads.append(1) or gather(*a, **k)
    both = layer.keys_and_values()  # (keys and values from one read-back of the pages)
    assert len(reads) == 1 and torch.equal(both[0], layer.keys) and torch.equal(both[1], layer.values)
    del layer.gather
    empty = PagedLatentCache(fused)
    assert empty.layers[0].keys is None and empty.layers[0].values is None
    assert empty.layers[0].keys_and_values() == (None, None)
    with pytest.raises(AttributeError, match="read back from the pages"):
        cache.layers[0].keys = torch.zeros(1)


def test_compiled_left_padding_check_fails_loudly_on_other_masks():
    """Under torch.compile the decode step cannot branch on its mask (Transformers 5.17 hands compiled steps one):
    left padding is assumed and asserted on the device, so any other mask is an error, never a wrong answer."""
    from mla_fuser.attention_interfaces.vllm_mla import left_padding_of

    compiled = torch.compile(left_padding_of, fullgraph=True, backend="eager")
    left = torch.tensor([[False, True, True], [True, True, True]])
    assert torch.equal(compiled(left), torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not left padding"):
        compiled(torch.tensor([[True, True, False], [True, True, True]]))


def test_growable_pool_starts_at_the_first_write_and_doubles():
    """generate's automatic cache (growable) allocates the pages its prefill needs, not a fixed 1024 tokens per layer,
    and doubles when decode runs out; the tokens stay native's across the growths."""
    native, fused = _pair()
    ids, mask = _prompts([5, 5], seed=3)
    cache = PagedLatentCache(fused, page_size=4)
    sizes = []
    orig = PagedLatentLayer.update

    def spy(self, *a, **k):
        out = orig(self, *a, **k)
        sizes.append(self.pool.num_pages)
        return out

    PagedLatentLayer.update = spy
    try:
        out = fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=20, do_sample=False)
    finally:
        PagedLatentLayer.update = orig
    assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    assert cache.growable and sizes[0] == 2 * 2  # two sequences of 5 tokens: two pages of 4 each
    assert max(sizes) >= 2 * 7 and all(n in (4, 8, 16, 32) for n in sizes)  # 25 tokens: 7 pages each, by doubling
