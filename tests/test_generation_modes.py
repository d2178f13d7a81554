"""Generation modes through the graphed decode plan, on a CPU: beam search, right and inner padding, sampling and the
caches a caller can pass give native's tokens (fp32, tiny DeepSeek-V2), and the reasons the other modes stay eager.

A CPU cannot capture; ``graphs_possible`` is forced on (``graphed`` fixture), so ``generate`` takes the plan it takes on
CUDA and each decode step runs through the same ``DecodeGraph`` step function, eagerly.  ``layouts`` counts the cache
memory layouts those steps ran on: on CUDA every layout after the first is a recapture, so ``layouts == 1`` across a
beam search is what says here that the captured step stays valid after every reorder.  The replay itself, captures
and bf16 tokens are in ``test_gpu_generation_modes.py``."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

import mla_fuser
from mla_fuser.cache import PagedLatentCache, PagedLatentLayer
from mla_fuser.compat import cache_keyword
from mla_fuser.runtime import generate as runtime_generate
from mla_fuser.runtime.generate import last_generate_plan

from conftest import (callers_cache, left_padded_prompts, native_and_fused_deepseek,
                      swap_experts_like_on_a_gpu, tiny_deepseek)

KW = cache_keyword(tiny_deepseek(layers=1))  # ``cache`` (5.2x) or ``past_key_values``


@pytest.fixture(scope="module")
def pair():
    return native_and_fused_deepseek()


@pytest.fixture
def graphed(monkeypatch):
    """generate() plans as on CUDA; a step the plan graphs must never copy sequences to reorder beams."""
    monkeypatch.setattr(runtime_generate, "graphs_possible", lambda model: True)
    copies = []
    original = PagedLatentLayer._copy_sequences

    def spy(self, source):
        copies.append(source)
        return original(self, source)

    monkeypatch.setattr(PagedLatentLayer, "_copy_sequences", spy)
    return copies


def _right_padded(lengths, seed=0, vocab=128):
    ids, mask = left_padded_prompts(lengths, vocab, seed)
    return ids.flip(1), mask.flip(1)


def _inner_padded(seed=0):
    """Rows with padding on the left, the right and in the middle."""
    ids, mask = left_padded_prompts([9, 9, 9], seed=seed)
    mask[0, 3:5] = 0
    mask[1, :2] = 0
    mask[1, -1] = 0
    mask[2, 4] = 0
    return ids * mask, mask


def _check_graphed(fused, new_tokens, copies):
    plan = last_generate_plan(fused)
    assert plan.graphed, plan.reason
    assert plan.steps == new_tokens - 1 and plan.captures == 0  # every decode step through the DecodeGraph (CPU)
    assert plan.layouts == 1, "the cache moved its memory: a captured step would be captured again"
    assert not copies, "a beam reorder copied the sequences instead of permuting block-table rows"


def _assert_cache_like_native(cache, native_cache, mask, new_tokens):
    """Layer by layer, the latent at the real positions equals native's (the layout is native's again after the
    call; padding positions hold whatever a fully masked query produced below, in both)."""
    real = torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens - 1)], 1).bool()
    assert cache.get_seq_length() == native_cache.get_seq_length() == real.shape[1]
    for layer, ref in zip(cache.layers, native_cache.layers):
        torch.testing.assert_close(layer.keys[:, 0][real], ref.keys[:, 0][real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[:, 0][real], ref.values[:, 0][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [
    dict(num_beams=3),
    dict(num_beams=3, length_penalty=0.3, num_return_sequences=2, early_stopping=True),
    dict(num_beams=3, length_penalty=-1.0, num_return_sequences=3),
])
def test_beam_search_graphed_equals_native(pair, graphed, extra):
    native, fused = pair
    ids, mask = left_padded_prompts([5, 8], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, **extra)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    _check_graphed(fused, 12, graphed)


@pytest.mark.parametrize("page_size", [4, 16])
def test_beam_search_over_a_callers_static_cache_shares_written_pages(pair, graphed, page_size):
    """Small pages: beams cross page boundaries, rows of the block table share written pages of other beams, and the
    cache (a static PagedLatentCache the caller passes) ends with native's latent."""
    native, fused = pair
    ids, mask = left_padded_prompts([5, 8], seed=3)
    cache = PagedLatentCache(fused, page_size=page_size, static=True, max_seq_len=32, max_cache_tokens=6 * 32)
    native_cache = DynamicCache(config=native.config)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, num_beams=3)
    out = fused.generate(ids, **{KW: cache}, **kw)
    assert torch.equal(out, native.generate(ids, **{KW: native_cache}, **kw))
    _check_graphed(fused, 20, graphed)
    layer = cache.layers[1]
    if page_size == 4:
        written = [row[: 27 // 4] for row in layer.host_tables]
        assert len({p for row in written for p in row}) < sum(map(len, written)), "no page is shared"
    assert sorted(p for row in layer.home for p in row) == sorted(set(p for row in layer.home for p in row))
    _assert_cache_like_native(cache, native_cache, mask.repeat_interleave(3, 0), 20)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("padding", ["right", "inner"])
def test_right_and_inner_padding_graphed_equal_native(pair, graphed, num_beams, padding):
    native, fused = pair
    ids, mask = _right_padded([4, 9, 6], seed=4) if padding == "right" else _inner_padded(seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=num_beams,
              return_dict_in_generate=True)
    out, ref = fused.generate(ids, **kw), native.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    _check_graphed(fused, 10, graphed)
    cache = getattr(out, KW if hasattr(out, KW) else "past_key_values")
    ref_cache = getattr(ref, KW if hasattr(ref, KW) else "past_key_values")
    assert isinstance(cache, PagedLatentCache) and cache.padding_starts is None  # the padding was moved back
    _assert_cache_like_native(cache, ref_cache, mask.repeat_interleave(num_beams, 0), 10)


def test_padding_inferred_from_pad_tokens_is_honoured(pair, graphed):
    """No mask passed: generate infers one from the pad tokens in the ids, and so does the plan."""
    native, fused = pair
    ids, _ = _right_padded([4, 9], seed=6)  # pad token 0
    kw = dict(max_new_tokens=9, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    _check_graphed(fused, 9, graphed)
    assert last_generate_plan(fused).padding is not None


def test_sampling_top_p_graphed_equals_native(pair, graphed):
    native, fused = pair
    ids, mask = _right_padded([5, 7], seed=7)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_p=0.8, num_return_sequences=2)
    torch.manual_seed(11)
    ref = native.generate(ids, **kw)
    torch.manual_seed(11)
    assert torch.equal(fused.generate(ids, **kw), ref)
    _check_graphed(fused, 10, graphed)


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_callers_dynamic_cache_is_converted_and_filled(pair, graphed, with_config, num_beams):
    """An empty DynamicCache: the call runs graphed on a static paged cache, and the caller's cache ends holding
    native's latent; an output that returns a cache returns the caller's."""
    native, fused = pair
    ids, mask = _right_padded([6, 3], seed=8)
    cache = DynamicCache(config=fused.config) if with_config else DynamicCache()
    native_cache = DynamicCache(config=native.config)
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, num_beams=num_beams,
              return_dict_in_generate=True)
    out = fused.generate(ids, **{KW: cache}, **kw)
    ref = native.generate(ids, **{KW: native_cache}, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    _check_graphed(fused, 9, graphed)
    assert type(cache) is DynamicCache and any(getattr(out, name, None) is cache for name in (KW, "past_key_values"))
    _assert_cache_like_native(cache, native_cache, mask.repeat_interleave(num_beams, 0), 9)


@pytest.mark.parametrize("extra", [dict(num_beams=1), dict(num_beams=3), dict(do_sample=True, top_k=20)])
def test_callers_static_cache_is_converted_and_filled(pair, graphed, extra):
    """An empty StaticCache: the call runs graphed on a static paged cache, and the caller's cache ends holding
    native's latent in its own fixed-size tensors (nothing past the written tokens); an output that returns a cache
    returns the caller's."""
    native, fused = pair
    ids, mask = _right_padded([6, 3], seed=12)
    cache = StaticCache(config=fused.config, max_cache_len=24)
    native_cache = StaticCache(config=native.config, max_cache_len=24)
    kw = {**dict(attention_mask=mask, max_new_tokens=9, do_sample=False, return_dict_in_generate=True), **extra}
    torch.manual_seed(5)
    out = fused.generate(ids, **{KW: cache}, **kw)
    torch.manual_seed(5)
    ref = native.generate(ids, **{KW: native_cache}, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    _check_graphed(fused, 9, graphed)
    assert any(getattr(out, name, None) is cache for name in (KW, "past_key_values"))
    rows = extra.get("num_beams", 1)
    real = torch.cat([mask, mask.new_ones(mask.shape[0], 8)], 1).bool().repeat_interleave(rows, 0)
    length = real.shape[1]
    assert int(cache.get_seq_length()) == int(native_cache.get_seq_length()) == length
    for layer, ref_layer in zip(cache.layers, native_cache.layers):
        assert layer.keys.shape == ref_layer.keys.shape and layer.keys.shape[:3] == (2 * rows, 1, 24)
        for mine, theirs in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            torch.testing.assert_close(mine[:, 0, :length][real], theirs[:, 0, :length][real], atol=1e-5, rtol=1e-5)
            assert not mine[:, :, length:].any() and not theirs[:, :, length:].any()


def test_static_caches_that_stay_eager_say_why_and_equal_native(pair, graphed):
    """A StaticCache too small for the call (Transformers' own error), one allocated for other rows or one with
    sliding-window layers runs as given."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    native, fused = pair
    ids, mask = left_padded_prompts([4, 7], seed=13)
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=False)
    written = ids.shape[1] + 9 - 1
    with pytest.raises(IndexError):
        native.generate(ids, **{KW: StaticCache(config=native.config, max_cache_len=written - 1)}, **kw)
    with pytest.raises(IndexError):
        fused.generate(ids, **{KW: StaticCache(config=fused.config, max_cache_len=written - 1)}, **kw)
    assert f"max_cache_len={written - 1}" in last_generate_plan(fused).reason
    exact = StaticCache(config=fused.config, max_cache_len=written)  # (an exact fit is converted)
    assert torch.equal(fused.generate(ids, **{KW: exact}, **kw),
                       native.generate(ids, **{KW: StaticCache(config=native.config, max_cache_len=written)}, **kw))
    assert last_generate_plan(fused).graphed and int(exact.get_seq_length()) == written
    for model in (native, fused):  # (allocated for 3 rows, then emptied: Transformers' own error for 2)
        other_rows = StaticCache(config=model.config, max_cache_len=24)
        with torch.no_grad():
            model(input_ids=torch.cat([ids, ids[:1]]), **{KW: other_rows}, use_cache=True)
        other_rows.reset()
        with pytest.raises(RuntimeError, match="same slice shapes"):
            model.generate(ids, **{KW: other_rows}, **kw)
    assert "allocated for 3 rows" in last_generate_plan(fused).reason
    sliding = StaticCache(config=fused.config, max_cache_len=24)
    sliding.layers[0] = StaticSlidingWindowLayer(max_cache_len=24, sliding_window=20)
    assert torch.equal(fused.generate(ids, **{KW: sliding}, **kw), native.generate(ids, **kw))
    assert "sliding-window" in last_generate_plan(fused).reason


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_callers_cache_holding_earlier_turns_is_converted_and_extended(pair, graphed, kind, padding):
    """A chat's next turn: the caller's cache already holds the previous turns (filled by the previous call) and the
    prompt is the whole conversation.  The held tokens are written into the call's static paged cache first, the
    call runs graphed, and the cache ends extended by what the call added: tokens and latent equal native's doing the
    same with its own cache, turn after turn (right padding leaves padding inside the second turn's sequence)."""
    native, fused = pair
    if padding == "right":
        ids, mask = _right_padded([6, 3], seed=14)
    elif padding == "left":
        ids, mask = left_padded_prompts([6, 3], seed=14)
    else:
        ids, mask = left_padded_prompts([6, 6], seed=14)
    mine, theirs = callers_cache(kind, fused, 40), callers_cache(kind, native, 40)
    new = 8
    fed = []  # tokens per sequence of each forward of the fused model: the prefill feeds only what is not held
    hook = fused.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    for turn in range(3):
        kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False)
        held = int(mine.get_seq_length())
        fed.clear()
        out = fused.generate(ids, **{KW: mine}, **kw)
        ref = native.generate(ids, **{KW: theirs}, **kw)
        assert torch.equal(out, ref), f"turn {turn}"
        plan = last_generate_plan(fused)
        assert plan.graphed and plan.held == held and plan.steps == new - 1, (turn, plan.reason)
        assert fed[0] == ids.shape[1] - held
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], new)], 1)
        _assert_cache_like_native(_written(mine), _written(theirs), mask[:, :-1], 1)
        reply = torch.randint(3, 100, (ids.shape[0], 3), generator=torch.Generator().manual_seed(turn))
        ids, mask = torch.cat([out, reply], 1), torch.cat([mask, mask.new_ones(mask.shape[0], 3)], 1)
    hook.remove()


def _written(cache):
    """``cache`` as a DynamicCache of its written tokens (a StaticCache's tensors are longer)."""
    if type(cache) is DynamicCache:
        return cache
    length = int(cache.get_seq_length())
    out = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :length], layer.values[:, :, :length], idx)
    return out


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_callers_cache_holding_tokens_stays_eager_with_beams_or_verification(pair, graphed, kind):
    """Beams or verification steps over a cache that holds tokens run as given: Transformers' own result, or its own
    error (it does not expand a filled cache for beams)."""
    native, fused = pair
    ids = left_padded_prompts([6, 6], seed=15)[0]
    cases = [(dict(num_beams=2), "for a call of 4 rows"), (dict(prompt_lookup_num_tokens=3), "prompt-lookup")]
    for extra, why in cases:
        batch = ids[:1] if "prompt_lookup_num_tokens" in extra else ids  # (Transformers assists one row only)
        mine, theirs = callers_cache(kind, fused, 40), callers_cache(kind, native, 40)
        with torch.no_grad():
            fused(input_ids=batch[:, :-2], **{KW: mine}, use_cache=True)
            native(input_ids=batch[:, :-2], **{KW: theirs}, use_cache=True)
        kw = dict(max_new_tokens=8, do_sample=False, **extra)
        try:
            ref = native.generate(batch, **{KW: theirs}, **kw)
        except Exception as err:  # noqa: BLE001 - whatever Transformers raises, the fused call raises too
            with pytest.raises(type(err)):
                fused.generate(batch, **{KW: mine}, **kw)
        else:
            assert torch.equal(fused.generate(batch, **{KW: mine}, **kw), ref)
        plan = last_generate_plan(fused)
        assert not plan.graphed and why in plan.reason, plan.reason


@pytest.mark.parametrize("where", ["argument", "generation_config"])
@pytest.mark.parametrize("implementation", ["static", "dynamic"])
def test_cache_implementation_graphed_equals_native(pair, graphed, where, implementation):
    native, fused = pair
    ids, mask = left_padded_prompts([4, 7], seed=9)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=2)
    ref = native.generate(ids, cache_implementation=implementation, **kw)
    if where == "argument":
        out = fused.generate(ids, cache_implementation=implementation, **kw)
    else:
        previous = fused.generation_config.cache_implementation
        fused.generation_config.cache_implementation = implementation
        try:
            out = fused.generate(ids, **kw)
        finally:
            fused.generation_config.cache_implementation = previous
    assert torch.equal(out, ref)
    _check_graphed(fused, 10, graphed)


def test_caches_that_stay_eager_say_why_and_equal_native(pair, graphed):
    native, fused = pair
    ids, mask = left_padded_prompts([4, 7], seed=10)
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=False)
    ref = native.generate(ids, **kw)
    cases = {"growing PagedLatentCache": PagedLatentCache(fused, page_size=4)}
    for why, cache in cases.items():
        assert torch.equal(fused.generate(ids, **{KW: cache}, **kw), ref), why
        plan = last_generate_plan(fused)
        assert not plan.graphed and why in plan.reason and plan.cache is None
    for extra, why in [(dict(use_cache=False), "use_cache=False"), (dict(max_new_tokens=3), "new tokens"),
                       (dict(output_hidden_states=True, return_dict_in_generate=True), "hidden states")]:
        fused.generate(ids, **{**kw, **extra})
        assert why in last_generate_plan(fused).reason


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup", "prompt_lookup_sampled"])
def test_assisted_and_prompt_lookup_verification_steps_are_graphed_and_equal_native(pair, graphed, monkeypatch,
                                                                                    mode):
    """Verification forwards of several tokens go through the graphed step (token counts rounded up to buckets of
    1, 2, 4, 8, 16; rejected candidates cropped from the static cache) and the tokens are native's; one memory
    layout for the whole call (on CUDA: one capture per bucket, never one per count)."""
    from mla_fuser.runtime.decode_graph import DecodeGraph

    native, fused = pair
    ids, mask = left_padded_prompts([12], seed=12)
    ids = torch.cat([ids, ids[:, 2:8], ids[:, 1:9]], 1)  # repeats for prompt lookup to find
    mask = torch.ones_like(ids)
    extra = dict(assistant_model=tiny_deepseek(seed=5, layers=1)) if mode == "assistant" \
        else dict(prompt_lookup_num_tokens=5)
    if mode == "prompt_lookup_sampled":
        extra.update(do_sample=True, top_k=4)
    kw = {**dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False), **extra}
    counts = []
    original = DecodeGraph.__call__

    def spy(self, input_ids, position_ids):
        counts.append(input_ids.shape[1])
        return original(self, input_ids, position_ids)

    monkeypatch.setattr(DecodeGraph, "__call__", spy)
    torch.manual_seed(7)
    ref = native.generate(ids, **kw)
    torch.manual_seed(7)
    out = fused.generate(ids, **kw)
    assert torch.equal(out, ref)
    plan = last_generate_plan(fused)
    assert plan.graphed and plan.layouts == 1, plan.reason
    assert plan.steps == len(counts) and any(n > 1 for n in counts), counts


def test_in_place_reorder_keeps_addresses_and_equals_a_copy(pair):
    """The cache API a replayed beam step relies on: a reorder permutes block-table rows in place (same buffers),
    reads back exactly ``old[beam_idx]``, and a crop afterwards gives every sequence its own pages again before it
    writes; continuing equals native's DynamicCache put through the same reorders and crop."""
    native, fused = pair
    ids, mask = left_padded_prompts([10, 7, 9, 4], seed=13)  # rows of different left padding: starts move too
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=24, max_cache_tokens=4 * 24)
    cache.set_left_padding(10 - mask.sum(1))
    ref_cache = DynamicCache(config=native.config)
    step = torch.tensor([[5], [6], [7], [8]])
    positions = mask.sum(1, keepdim=True)

    def both_step():  # fused: no mask (the cache's starts), native: its mask
        nonlocal mask, positions
        mask = torch.cat([mask, torch.ones_like(step)], 1)
        a = fused(input_ids=step, position_ids=positions, **{KW: cache}, use_cache=True).logits
        b = native(input_ids=step, position_ids=positions, attention_mask=mask, **{KW: ref_cache}, use_cache=True)
        torch.testing.assert_close(a, b.logits, atol=1e-5, rtol=1e-4)
        positions = positions + 1

    with torch.no_grad():
        fused(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True)
        native(input_ids=ids, attention_mask=mask, **{KW: ref_cache}, use_cache=True)
        layer = cache.layers[1]
        addresses = [t.data_ptr() for t in layer.buffers()]
        for beam_idx in (torch.tensor([2, 2, 0, 1]), torch.tensor([1, 1, 1, 3])):
            before = layer.gather().clone()
            cache.reorder_cache(beam_idx)
            ref_cache.reorder_cache(beam_idx)
            mask, positions = mask[beam_idx], positions[beam_idx]
            assert torch.equal(layer.gather(), before[beam_idx])
            both_step()
        assert [t.data_ptr() for t in layer.buffers()] == addresses
        assert layer.host_tables[0][:2] == layer.host_tables[1][:2] == layer.host_tables[2][:2]  # shared pages
        cache.crop(-5)
        ref_cache.crop(-5)
        mask, positions = mask[:, :-5], positions - 5
        assert all(row[1:] == own[1:] for row, own in zip(layer.host_tables, layer.home))
        for _ in range(3):
            both_step()
        assert [t.data_ptr() for t in layer.buffers()] == addresses


def test_beam_search_through_the_triton_kernels(monkeypatch, graphed):
    """The Triton page write and decode kernels (interpreted) read the permuted block tables from device memory."""
    import mla_fuser.kernels.mla_decode as decode
    import mla_fuser.kernels.paged_cache_ops as ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    launches = []
    for module, name in ((decode, "mla_decode_triton"), (ops, "paged_append_triton")):
        def spy(*args, _original=getattr(module, name), _name=name, **kwargs):
            launches.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    native = tiny_deepseek(layers=1)
    fused = tiny_deepseek(attn="vllm_mla", layers=1)
    mla_fuser.fuse(fused)
    ids, mask = _right_padded([3, 6], seed=14)
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=2)
    out = fused.generate(ids, **{KW: cache}, **kw)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    assert torch.equal(out, native.generate(ids, **kw))
    _check_graphed(fused, 8, graphed)
    assert launches.count("mla_decode_triton") >= 7 and launches.count("paged_append_triton") >= 7


@torch.no_grad()
def test_divergence_gap_is_natives_own_margin_on_right_padded_rows(pair):
    """The GPU tests judge a split between fused and native tokens by ``conftest.divergence_gaps``: native's margin
    for its token over the other path's, on the common prefix.  On a right-padded row that margin must come from
    native's generate itself (its step positions count from 1 there), not from a teacher-forced forward (which
    differs by ~1e-3 in fp32 and made bf16 splits at near-ties look like clear preferences): a sequence that
    swaps one of native's tokens for its runner-up must give exactly native's own top-2 margin."""
    from conftest import divergence_gaps

    native, _ = pair
    ids, mask = left_padded_prompts([5, 12, 9], 128, seed=1)
    ids, mask = ids.flip(1), mask.flip(1)
    run = native.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    new = run.sequences[:, ids.shape[1]:]
    step = 3
    scores = run.logits[step][0].float()
    top2 = scores.topk(2)
    swapped = run.sequences.clone()
    swapped[0, ids.shape[1] + step] = top2.indices[1]  # row 0 is right-padded (5 of 12 tokens)
    gaps = divergence_gaps(native, swapped, mask, ids.shape[1], [step, 6, 6], new)
    margin = ((top2.values[0] - top2.values[1]) / scores.abs().max()).item()
    assert len(gaps) == 1 and gaps[0] == pytest.approx(margin, rel=1e-5, abs=1e-7)


def test_transformers_own_compile_config_is_served_by_the_graphed_steps(pair, graphed):
    """``generation_config.compile_config`` with ``cache_implementation="static"`` (Transformers' own compiled
    generation, made to run here with ``_compile_all_devices``): our static paged cache says it is not compileable,
    so Transformers skips its compile (it logs that it does) and the decode steps are our graphed ones, the same
    purpose by CUDA graphs; nothing is compiled and the tokens are native's."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    native, fused = pair
    ids, mask = left_padded_prompts([9, 12], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    try:
        out = fused.generate(ids, cache_implementation="static", compile_config=config, **kw)
    finally:
        mla_fuser.release_decode_graphs(fused)
    plan = last_generate_plan(fused)
    assert plan.graphed and plan.steps > 0 and not plan.cache.is_compileable
    assert counters["stats"]["unique_graphs"] == 0
    assert torch.equal(out, native.generate(ids, cache_implementation="static", compile_config=config, **kw))


@pytest.mark.parametrize("implementation", [None, "static"])
def test_a_forward_the_caller_compiled_runs_over_a_static_paged_cache_not_our_graph(pair, graphed, implementation):
    """``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``, as Transformers'
    docs show it: our graph would capture around the compiled forward (a compile, or its own CUDA graphs, cannot run
    inside a capture), so the plan leaves the decode steps to it, over a static paged cache (fixed addresses), and
    says so.  With ``fullgraph=True`` the prefill must run uncompiled (its pool allocation cannot be traced: it raised
    before); the buffers the steps read are then marked static addresses (what ``reduce-overhead``'s CUDA graphs need
    of inputs written in place), and the next call of the same shape takes the same cache back, so nothing is
    compiled again.  Tokens are native's; the caller's compiled forward is in place after each call.  (Here the
    ``eager`` backend: tracing only, the CPU stand-in; ``test_gpu_generation_modes.py`` compiles for real.)  The
    decode steps run inside generate's swap of the experts to ``batched_mm``, as on a GPU: the compiled step reads
    the flag that keeps our experts fused (torch 2.11's Dynamo failed there on ``ContextVar.get``).  Every decode step
    has one shape: one graph, no symbolic sizes among its inputs (each value of one would be traced, and recorded
    as a CUDA graph by ``reduce-overhead``, again: 22-30 ms a step on an H100 before), the mask as long as the
    cache."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mla_fuser.runtime.compiled_forward import COMPILED_BY_CALLER, step_tensors

    native, _ = pair
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    swaps = swap_experts_like_on_a_gpu(fused)
    ids, mask = left_padded_prompts([9, 12], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    extra = {} if implementation is None else {"cache_implementation": implementation}
    inputs = []

    def backend(graph, example_inputs):  # (the eager backend, recording each graph's inputs)
        inputs.append(example_inputs)
        return graph.forward

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = fused.forward = torch.compile(fused.forward, backend=backend, fullgraph=True)
        out = fused.generate(ids, **kw, **extra)
        plan, graphs = last_generate_plan(fused), counters["stats"]["unique_graphs"]
        again = fused.generate(ids, **kw, **extra)
        assert counters["stats"]["unique_graphs"] == graphs > 0  # (the kept cache: its marked buffers, no recompile)
        assert last_generate_plan(fused).cache is plan.cache and fused.__dict__["forward"] is compiled
    finally:
        torch._dynamo.reset()
        mla_fuser.release_decode_graphs(fused)
    assert not plan.graphed and plan.reason == COMPILED_BY_CALLER and plan.prefill_uncompiled
    assert len(swaps) == 2  # (both calls decoded inside the swap)
    assert len(inputs) == 1 and not any(isinstance(x, torch.SymInt) for x in inputs[0])
    masks = [x for x in inputs[0] if isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype == torch.bool]
    assert masks and all(m.shape[-1] == plan.cache.max_seq_len for m in masks)
    assert not any(layer.is_compileable for layer in plan.cache.paged)  # (for the call only)
    assert isinstance(plan.cache, PagedLatentCache) and plan.cache.static
    tensors = [t for layer in plan.cache.paged for t in step_tensors(layer)]
    assert tensors and all(hasattr(t, "_dynamo_static_input_type") for t in tensors)  # (mark_static_address's tag)
    assert any(t is layer.pool.pages for layer in plan.cache.paged for t in step_tensors(layer))
    reference = native.generate(ids, **kw)
    assert torch.equal(out, reference) and torch.equal(again, reference)


def test_a_compiled_forward_over_a_right_padded_batch_runs_the_call_uncompiled(pair, graphed):
    """A compiled decode step asserts left padding on the device (it cannot branch on its mask; on CUDA a failed
    assert ends the process's CUDA context), so a right-padded call of a model whose forward the caller compiled runs
    as if it were not compiled: planned again over the uncompiled forward (graphed here, its padding moved in the
    cache), the reason saying so; tokens are native's and the compiled forward is back in place afterwards."""
    import torch._dynamo

    from mla_fuser.runtime.compiled_forward import PADDING_NOT_COMPILED

    native, _ = pair
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    ids, mask = left_padded_prompts([9, 12], seed=3)
    ids, mask = ids.flip(1), mask.flip(1)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    torch._dynamo.reset()
    try:
        compiled = fused.forward = torch.compile(fused.forward, backend="eager", fullgraph=True)
        out = fused.generate(ids, **kw)
        assert fused.__dict__["forward"] is compiled
    finally:
        torch._dynamo.reset()
        mla_fuser.release_decode_graphs(fused)
    plan = last_generate_plan(fused)
    assert plan.graphed and plan.reason.startswith(PADDING_NOT_COMPILED)
    assert torch.equal(out, native.generate(ids, **kw))


def test_a_compiled_forward_that_is_not_the_models_own_keeps_its_prefill_compiled(pair):
    """A function of the caller's compiled and set as the forward is not ours to bypass: the plan runs every forward
    through it (no uncompiled prefill), still over a static paged cache."""
    from mla_fuser.runtime.compiled_forward import uncompiled_forward
    from mla_fuser.runtime.generate import plan_generate

    _, fused = pair
    original = type(fused).forward

    def custom(*args, **kwargs):
        return original(fused, *args, **kwargs)

    fused.forward = torch.compile(custom, backend="eager")
    try:
        assert uncompiled_forward(fused) is None
        ids, mask = left_padded_prompts([9, 12], seed=3)
        plan = plan_generate(fused, (ids,), dict(attention_mask=mask, max_new_tokens=10), True, False)
        assert not plan.prefill_uncompiled and plan.cache.static
        fused.forward = torch.compile(fused.__class__.forward.__get__(fused), backend="eager")
        assert uncompiled_forward(fused) is not None
    finally:
        del fused.forward


def test_eager_decode_turns_the_graphs_off_for_its_block_only(pair, monkeypatch):
    """``mla_fuser.runtime.eager_decode()``: what ``MLA_FUSER_CUDA_GRAPHS=0`` does, for one block and one thread,
    without writing the environment; the plan says why its steps ran eagerly."""
    import threading

    from mla_fuser.runtime import eager_decode

    _, fused = pair
    monkeypatch.setattr(runtime_generate, "graphs_possible",
                        lambda model: runtime_generate.cuda_graphs_wanted())  # (a CPU: as on CUDA otherwise)
    ids, mask = left_padded_prompts([9, 12], seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False)
    seen_elsewhere = []
    with eager_decode():
        assert not runtime_generate.cuda_graphs_wanted()
        other = threading.Thread(target=lambda: seen_elsewhere.append(runtime_generate.cuda_graphs_wanted()))
        other.start()
        other.join(timeout=30)
        eager = fused.generate(ids, **kw)
        assert not last_generate_plan(fused).graphed and "eager_decode()" in last_generate_plan(fused).reason
    assert seen_elsewhere == [True]
    assert runtime_generate.cuda_graphs_wanted()
    graphed = fused.generate(ids, **kw)
    assert last_generate_plan(fused).graphed
    assert torch.equal(eager, graphed)


def _reorder_ops(cache, beam_idx):
    """The aten ops one ``reorder_cache`` runs (views excluded), by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func._schema.name.startswith(("aten::view", "aten::slice", "aten::select", "aten::unbind",
                                                  "aten::t", "aten::transpose", "aten::alias")):
                ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Count():
        cache.reorder_cache(beam_idx)
    return ops


@pytest.mark.parametrize("layers", [2, 6])
def test_a_reorder_does_the_host_work_once_for_all_layers(layers):
    """A static cache's beam reorder costs two ops per paged layer (the partly written page) and a handful for all
    layers together (block tables and left-padding starts by multi-tensor copies), not six per layer; the result is
    exactly each layer's sequences in the new order."""
    fused = tiny_deepseek(attn="vllm_mla", layers=layers, first_k_dense_replace=0)
    mla_fuser.fuse(fused)
    ids, mask = left_padded_prompts([6, 5, 6, 3], seed=3)  # 6 tokens: one whole page of 4 and a partial one
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
    cache.set_left_padding(6 - mask.sum(1))
    with torch.no_grad():
        fused(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True)
    paged = cache.paged
    assert len(paged) == layers
    before = [layer.gather().clone() for layer in paged]
    starts = [layer.starts.clone() for layer in paged]
    beam_idx = torch.tensor([3, 3, 0, 1])
    ops = _reorder_ops(cache, beam_idx)
    assert len(ops) <= 2 * layers + 10, ops  # (the first reorder also uploads the own-page columns: 3 ops)
    for layer, rows, start in zip(paged, before, starts):
        assert torch.equal(layer.gather(), rows[beam_idx])
        assert torch.equal(layer.starts, start[beam_idx])
        assert layer.host_tables == paged[0].host_tables
    assert all(a is not b for layer in paged[1:] for a, b in zip(layer.host_tables, paged[0].host_tables))


def test_layers_whose_tables_differ_are_reordered_one_by_one():
    """If the paged layers of a cache ever disagree (tables, lengths), the all-layers path declines and each layer is
    reordered alone, still exactly."""
    fused = tiny_deepseek(attn="vllm_mla", layers=2, first_k_dense_replace=0)
    mla_fuser.fuse(fused)
    ids, _ = left_padded_prompts([6, 6], seed=4)
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
    first, second = cache.paged
    second.reorder_cache(torch.tensor([1, 0]))  # only the second layer: their tables now differ
    assert first.host_tables != second.host_tables
    before = [layer.gather().clone() for layer in (first, second)]
    cache.reorder_cache(torch.tensor([0, 0]))
    for layer, rows in zip((first, second), before):
        assert torch.equal(layer.gather(), rows[torch.tensor([0, 0])])


class _Copy:
    """A stand-in for a reorder's index copy on its way to the host: ``done`` says whether it has arrived."""

    def __init__(self, done):
        self.done, self.waits = done, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True


def test_pending_tables_work_in_arrived_copies_and_wait_only_when_read():
    """A reorder's host tables: ``then`` works in the steps whose index copies have arrived (never waiting), so the
    chain stays short; ``tables`` waits for the rest; the result is each step's ``old[source][:full] + own[full:]``."""
    from mla_fuser.cache_reorder import PendingTables

    home = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    first, second, third = _Copy(False), _Copy(False), _Copy(False)
    pending = PendingTables([list(t) for t in home]).then((torch.tensor([2, 2, 0]), first, 1, home))
    pending = pending.then(([1, 0, 0], second, 2, home))  # the first copy has not arrived: both steps wait
    assert len(pending.steps) == 2 and first.waits == 0
    first.done = True
    pending = pending.then(([0, 0, 1], third, 2, home))  # the first one has: worked in, without waiting
    assert len(pending.steps) == 2 and first.waits == second.waits == 0
    after_first = [[6, 1, 2], [6, 4, 5], [0, 7, 8]]
    after_second = [after_first[1][:2] + [2], after_first[0][:2] + [5], after_first[0][:2] + [8]]
    after_third = [after_second[0][:2] + [2], after_second[0][:2] + [5], after_second[1][:2] + [8]]
    assert pending.tables() == after_third
    assert second.waits == third.waits == 1 and pending.steps == ()


def test_host_tables_after_in_place_reorders_are_worked_out_when_read(pair):
    """Reorders of a static cache leave the host tables pending (one object for all layers), worked out on first
    read: equal to the block tables on the device, and to what reading them after every reorder gives; a reorder of
    layers whose tables were made by one reorder chain stays in place (no sequence copy)."""
    _, fused = pair
    ids, _ = left_padded_prompts([6, 6, 6], seed=21)
    orders = [torch.tensor(o) for o in ([2, 2, 0], [1, 0, 0], [0, 2, 1], [1, 1, 2])]
    step = torch.tensor([[5], [6], [7]])

    def run(read_every_step):
        cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
        for beam_idx in orders:  # 6, 7, 8 (a page boundary), 9 tokens
            cache.reorder_cache(beam_idx)
            paged = cache.paged
            assert paged[0].pending_tables is not None
            assert all(layer.pending_tables is paged[0].pending_tables for layer in paged)
            if read_every_step:
                assert paged[0].host_tables and paged[0].pending_tables is None
            fused(input_ids=step, **{KW: cache}, use_cache=True)
        return cache

    with torch.no_grad():
        lazy, eager = run(False), run(True)
    for a, b in zip(lazy.paged, eager.paged):
        width = len(a.home[0])
        assert a.host_tables == b.host_tables == a.block_table[:, :width].tolist()
        assert a.host_tables[0] != a.home[0]  # (the reorders did share pages)
        assert torch.equal(a.gather(), b.gather())


def test_a_reorder_after_lengths_went_back_is_checked_on_worked_out_tables(pair):
    """Pending tables vouch for their rows only from their last reorder's whole pages on: after the lengths went back
    below that (a step's rewind), the next reorder checks worked-out tables, so no sequence is left writing into a
    page it shares (here: the in-place path declines and the sequences are copied), and the rows read back right."""
    _, fused = pair
    ids, _ = left_padded_prompts([9, 9, 9], seed=22)
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
    cache.reorder_cache(torch.tensor([2, 2, 0]))  # 9 tokens: pages 0-1 shared from here on
    for layer in cache.paged:
        layer.rewind([5, 5, 5])
        layer.seq_lens.fill_(5)
    before = [layer.gather().clone() for layer in cache.paged]
    beam_idx = torch.tensor([1, 0, 0])
    cache.reorder_cache(beam_idx)  # 5 tokens: from page 1 on, every row must name its own pages again
    for layer, rows in zip(cache.paged, before):
        assert torch.equal(layer.gather(), rows[beam_idx])
        own = [h[1:] for h in layer.home]
        assert layer.block_table[:, 1: len(layer.home[0])].tolist() == own


@pytest.mark.parametrize("make", ["left", "right"])
def test_a_padded_graphed_call_reads_its_mask_padding_once(pair, graphed, monkeypatch, make):
    """The plan reads whether the prompt is left padded (a mask reduction and a read on the host) once per call:
    for its kept-step key and for the cache's padding; tokens equal native's."""
    native, fused = pair
    ids, mask = left_padded_prompts([5, 8], seed=14) if make == "left" else _right_padded([5, 8], seed=14)
    reads = []
    original = runtime_generate._left_padding
    monkeypatch.setattr(runtime_generate, "_left_padding", lambda m: reads.append(1) or original(m))
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    assert last_generate_plan(fused).graphed and len(reads) == 1


@torch.no_grad()
def test_a_compiled_step_past_a_static_caches_end_raises_before_it_runs(pair):
    """A compiled step writes where the block table points without host checks, so the wrapper checks room first and
    raises what an uncompiled step of a static cache raises: nothing is compiled or run, the host lengths stay
    where they were, and the cache is compileable only inside the call."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mla_fuser.cache import CachePoolExhausted
    from mla_fuser.compat import cache_keyword
    from mla_fuser.runtime.compiled_forward import prefill_uncompiled

    _, fused = pair
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    cache = PagedLatentCache.static_for(fused, 2, 9)
    kw = {"use_cache": True, cache_keyword(fused): cache}
    torch._dynamo.reset()
    counters.clear()
    fused.forward = torch.compile(fused.forward, backend="eager", fullgraph=True)
    try:
        with prefill_uncompiled(fused, cache):
            fused(input_ids=ids, **kw)  # the prefill, uncompiled: all the cache's 9 tokens
            assert all(layer.is_compileable for layer in cache.paged)
            lengths = [layer.lengths for layer in cache.paged]
            with pytest.raises(CachePoolExhausted, match="room for 0"):
                fused(input_ids=ids[:, :1], **kw)
            assert [layer.lengths for layer in cache.paged] == lengths
        assert counters["stats"]["unique_graphs"] == 0
        assert not any(layer.is_compileable for layer in cache.paged)
    finally:
        del fused.forward
        torch._dynamo.reset()


@torch.no_grad()
def test_a_compiled_forward_that_runs_eagerly_advances_the_cache_once(pair):
    """A forward compiled without ``fullgraph`` runs eagerly where Dynamo does not trace it (``TORCHDYNAMO_DISABLE=1``,
    a frame it falls back on): its cache update then keeps the host lengths itself, and the wrapper must not advance
    them again after the step.  Before, it did: the host lengths ran ahead of the device's (30 against 21 here) and
    the tokens parted from native's.  Tokens equal native's; host and device lengths agree."""
    import torch._dynamo

    native, fused = pair
    ids, mask = left_padded_prompts([9, 12], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    fused.forward = torch.compile(fused.forward, backend="eager")
    try:
        with torch._dynamo.config.patch(disable=True):
            out = fused.generate(ids, cache_implementation="static", **kw)
        plan = last_generate_plan(fused)
    finally:
        del fused.forward
        mla_fuser.release_decode_graphs(fused)
    assert plan.prefill_uncompiled and plan.cache.static
    for layer in plan.cache.paged:
        assert layer.host_lens == layer.seq_lens.tolist() == [ids.shape[1] + 9] * 2
    assert torch.equal(out, native.generate(ids, **kw))


@torch.no_grad()
@pytest.mark.parametrize("mode", ["prompt_lookup", "beam_search"])
def test_a_fullgraph_compiled_forward_serves_prompt_lookup_and_beam_search(pair, mode):
    """Verification steps of several tokens (prompt lookup) over the static paged cache of a compiled call run
    uncompiled: traced, they branched on the cache's device length (``fullgraph=True`` raised ``Unsupported``:
    data-dependent branching); beam search reorders that cache between compiled steps.  Tokens equal native's."""
    import torch._dynamo

    native, fused = pair
    ids, mask = left_padded_prompts([9, 12], seed=3)
    if mode == "prompt_lookup":  # (one row: Transformers' prompt lookup takes a batch of one)
        ids = torch.cat([ids[1:], ids[1:, -6:], ids[1:, -6:]], 1)
        kw = dict(attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=3)
    else:
        kw = dict(attention_mask=mask, num_beams=2)
    kw.update(max_new_tokens=10, do_sample=False)
    torch._dynamo.reset()
    fused.forward = torch.compile(fused.forward, backend="eager", fullgraph=True)
    try:
        out = fused.generate(ids, **kw)
        plan = last_generate_plan(fused)
    finally:
        del fused.forward
        torch._dynamo.reset()
        mla_fuser.release_decode_graphs(fused)
    assert plan.prefill_uncompiled and plan.cache.static and not any(layer.is_compileable for layer in plan.cache.paged)
    assert torch.equal(out, native.generate(ids, **kw))


@torch.no_grad()
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_module_the_caller_compiled_is_served_as_a_compiled_forward(pair, graphed, padding):
    """``model.compile(fullgraph=True)`` (PyTorch's own method: ``__call__`` runs a compile of ``_call_impl``) is
    the compiled-forward habit by another name.  Before, the plan graphed the call and Dynamo traced our graphed
    forward: ``fullgraph=True`` raised ``Unsupported`` (a data-pointer comparison), and without it the step split
    into 23 graphs.  Now a left-padded call runs its decode steps on the caller's compile over a static paged cache
    (one graph, none again for a second call), its prefill uncompiled; a right-padded one runs as if the module were
    not compiled (graphed here).  Tokens equal native's; the module's compiled call is back after each call."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from mla_fuser.runtime.compiled_forward import COMPILED_BY_CALLER, PADDING_NOT_COMPILED

    native, _ = pair
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    ids, mask = left_padded_prompts([9, 12], seed=3)
    if padding == "right":
        ids, mask = ids.flip(1), mask.flip(1)
    kw = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    torch._dynamo.reset()
    counters.clear()
    fused.compile(backend="eager", fullgraph=True)
    compiled = fused._compiled_call_impl
    try:
        outs = []
        for _ in range(2):
            outs.append(fused.generate(ids, **kw))
            assert fused._compiled_call_impl is compiled and "forward" not in fused.__dict__
        graphs = counters["stats"]["unique_graphs"]
    finally:
        fused._compiled_call_impl = None
        torch._dynamo.reset()
        mla_fuser.release_decode_graphs(fused)
    plan = last_generate_plan(fused)
    if padding == "left":
        assert not plan.graphed and plan.reason == COMPILED_BY_CALLER and plan.prefill_uncompiled
        assert plan.cache.static and graphs == 1
    else:
        assert plan.graphed and plan.reason.startswith(PADDING_NOT_COMPILED) and graphs == 0
    reference = native.generate(ids, **kw)
    assert all(torch.equal(out, reference) for out in outs)
