"""DecodeGraph on CPU (no capture): same tokens as the model's own decode, and the refusals that keep a captured
step from ever replaying on memory that moved or grew.  The captured replay itself is tested in test_gpu.py."""

import pytest
import torch
from transformers import DynamicCache

import mla_fuser
from mla_fuser import DecodeGraph
from mla_fuser.cache import CachePoolExhausted, PagedLatentCache

from conftest import needs_mamba_fusion, tiny_deepseek
from tiny_mamba_configs import make_model

from mla_fuser.compat import cache_keyword
from mla_fuser.plans import model_state

KW = cache_keyword(tiny_deepseek())  # Transformers renamed ``past_key_values`` to ``cache`` in 5.2x


def _fused_pair(arch="deepseek_v2"):
    native = tiny_deepseek(arch)
    fused = tiny_deepseek(arch, attn="vllm_mla")
    mla_fuser.fuse(fused)
    return native, fused


def _prompt(batch=2, length=7, vocab=128, seed=3):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy_with_graph(model, cache, ids, steps):
    with torch.no_grad():
        logits = model(input_ids=ids, **{KW: cache}, use_cache=True).logits[:, -1]
    step = DecodeGraph(model, cache, capture=False)
    token = logits.argmax(-1, keepdim=True)
    tokens, all_logits = [token], [logits]
    for i in range(steps):
        position = torch.full_like(token, ids.shape[1] + i)
        logits = step(token, position)
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        all_logits.append(logits)
    return torch.cat(tokens, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_graph_steps_equal_native_generate(arch):
    native, fused = _fused_pair(arch)
    ids = _prompt()
    cache = PagedLatentCache(fused, static=True, max_seq_len=32, page_size=16, max_cache_tokens=128)
    tokens, _ = _greedy_with_graph(fused, cache, ids, 12)
    with torch.no_grad():
        ref = native.generate(ids, max_new_tokens=13, do_sample=False)[:, ids.shape[1]:]
    assert torch.equal(tokens, ref)


@needs_mamba_fusion
def test_mamba2_graph_steps_equal_native_generate():
    native = make_model("mamba2")
    fused = make_model("mamba2")
    mla_fuser.fuse(fused)
    assert fused.fusion_report.fused("mamba")
    ids = _prompt(length=9, vocab=native.config.vocab_size)
    tokens, logits = _greedy_with_graph(fused, DynamicCache(config=fused.config), ids, 10)
    with torch.no_grad():
        out = native.generate(ids, max_new_tokens=11, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    assert torch.equal(tokens, out.sequences[:, ids.shape[1]:])
    ref = torch.stack(out.scores, 1)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_refuses_caches_that_grow():
    _, fused = _fused_pair()
    with pytest.raises(ValueError, match="static=True"):
        DecodeGraph(fused, PagedLatentCache(fused, max_cache_tokens=64), capture=False)
    with pytest.raises(ValueError, match="DynamicLayer"):
        DecodeGraph(fused, DynamicCache(config=fused.config), capture=False)
    with pytest.raises(TypeError, match="Cache"):
        DecodeGraph(fused, object(), capture=False)


def test_refuses_bad_steps_and_a_full_cache():
    _, fused = _fused_pair()
    ids = _prompt(length=5)
    cache = PagedLatentCache(fused, static=True, max_seq_len=7, page_size=4, max_cache_tokens=64)
    step = DecodeGraph(fused, cache, capture=False)
    token = torch.full((2, 1), 5)
    with pytest.raises(RuntimeError, match="prefill"):
        step(token, token)
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
    with pytest.raises(ValueError, match=r"1 to 16 tokens"):
        step(torch.full((2, 17), 5), torch.full((2, 17), 5))
    with pytest.raises(ValueError, match="batch of 3"):
        step(torch.full((3, 1), 5), torch.full((3, 1), 5))
    step(token, torch.full((2, 1), 5))
    step(token, torch.full((2, 1), 6))
    before = [layer.pool.pages.clone() for layer in cache.layers]
    with pytest.raises(CachePoolExhausted, match="full"):
        step(token, torch.full((2, 1), 7))
    assert all(torch.equal(b, layer.pool.pages) for b, layer in zip(before, cache.layers))
    assert cache.get_seq_length() == 7


def test_capture_needs_cuda():
    _, fused = _fused_pair()
    cache = PagedLatentCache(fused, static=True, max_seq_len=8, max_cache_tokens=64)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraph(fused, cache, capture=True)


def test_generate_replays_decode_steps_through_the_graphed_forward():
    """What a fused model's generate() does on CUDA, run eagerly: the prefill goes to the model's forward, every
    decode step through the DecodeGraph, and the tokens equal native generate's; the forward is restored."""
    from mla_fuser.runtime.generate import GraphedForward

    native, fused = _fused_pair()
    ids = _prompt(length=6)
    cache = PagedLatentCache.static_for(fused, 2, 6 + 13, page_size=4)
    with GraphedForward(fused, cache) as graphed:
        out = fused.generate(ids, attention_mask=torch.ones_like(ids), **{KW: cache}, max_new_tokens=12,
                             do_sample=False)
    assert graphed.steps == 11
    assert "forward" not in fused.__dict__
    assert torch.equal(out, native.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                            do_sample=False))


@pytest.mark.parametrize("padded", [False, True])
def test_replayed_steps_get_their_inputs_without_transformers_prepare(monkeypatch, padded):
    """During a graphed call, the decode steps' inputs are prepared by ``GraphedForward``: the same keys and values as
    Transformers' own ``prepare_inputs_for_generation`` gives for the same arguments (the last ids and positions as
    views), which runs for the prefill only.  The tokens equal native generate's; the instance is as it was after."""
    from transformers.generation.utils import GenerationMixin

    from mla_fuser.runtime import generate as runtime_generate
    from mla_fuser.runtime.generate import GraphedForward
    from conftest import left_padded_prompts

    native, fused = _fused_pair()
    fallbacks, compared = [], []
    real = runtime_generate._prepare_step_inputs

    def spy(graphed, input_ids, **kwargs):
        out = real(graphed, input_ids, **kwargs)
        if kwargs.get("next_sequence_length") == 1:
            want = GenerationMixin.prepare_inputs_for_generation(fused, input_ids, **kwargs)
            assert set(out) == set(want)
            assert all(torch.equal(out[k], want[k]) if isinstance(want[k], torch.Tensor) else out[k] is want[k]
                       or out[k] == want[k] for k in want)
            compared.append(sorted(out))
        return out

    monkeypatch.setattr(runtime_generate, "_prepare_step_inputs", spy)
    ids, mask = left_padded_prompts([3, 8, 5], seed=9) if padded else (_prompt(length=6), None)
    mask = torch.ones_like(ids) if mask is None else mask
    cache = PagedLatentCache.static_for(fused, ids.shape[0], ids.shape[1] + 13, page_size=4)
    with GraphedForward(fused, cache, move_padding=mask if padded else None) as graphed:
        original = graphed._original_prepare
        assert original is not None and "prepare_inputs_for_generation" in fused.__dict__
        graphed._original_prepare = lambda *a, **k: fallbacks.append(k.get("next_sequence_length")) or original(*a,
                                                                                                            **k)
        out = fused.generate(ids, attention_mask=mask, **{KW: cache}, max_new_tokens=12, do_sample=False)
    assert graphed.steps == 11 and len(compared) == 11 and "input_ids" in compared[0]
    assert fallbacks == [ids.shape[1]]  # (the prefill)
    assert "forward" not in fused.__dict__ and "prepare_inputs_for_generation" not in fused.__dict__
    assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))


def test_a_model_s_own_prepare_inputs_is_left_alone(monkeypatch):
    from mla_fuser.runtime import generate as runtime_generate
    from mla_fuser.runtime.generate import GraphedForward

    _, fused = _fused_pair()
    monkeypatch.setattr(runtime_generate, "PREPARE_STEP_INPUTS", False)  # (the benchmarks' A/B: nothing bound)
    with GraphedForward(fused, PagedLatentCache.static_for(fused, 2, 20, page_size=4)) as graphed:
        assert graphed._original_prepare is None and "prepare_inputs_for_generation" not in fused.__dict__
    monkeypatch.setattr(runtime_generate, "PREPARE_STEP_INPUTS", True)
    own = fused.prepare_inputs_for_generation
    fused.prepare_inputs_for_generation = own  # (an instance's own, as a user might set)
    cache = PagedLatentCache.static_for(fused, 2, 20, page_size=4)
    with GraphedForward(fused, cache) as graphed:
        assert graphed._original_prepare is None and fused.prepare_inputs_for_generation is own
    assert fused.prepare_inputs_for_generation is own


def test_left_padded_generate_through_the_graphed_forward_equals_native():
    """A left-padded batch: the cache carries the padding (set_left_padding), the graphed decode steps get no
    mask and the decode kernel skips the padding; positions come from generate's own position ids."""
    from mla_fuser.runtime.generate import _left_padding, generate_graphed
    from conftest import left_padded_prompts

    native, fused = _fused_pair()
    ids, mask = left_padded_prompts([3, 8, 5], seed=9)
    cache = PagedLatentCache.static_for(fused, 3, 8 + 13, page_size=4)
    cache.set_left_padding(_left_padding(mask))
    out = generate_graphed(fused, fused.generate, cache, (ids,),
                           dict(attention_mask=mask, max_new_tokens=12, do_sample=False, **{KW: cache}))
    state = model_state(fused)
    assert state.graphed_steps == 11 and state.graph_captures == 0  # CPU: eager steps
    assert torch.equal(out, native.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    assert cache.layers[1].starts.tolist() == [5, 0, 3]


def test_generate_shape_for_single_beam_unpadded_or_left_padded_calls():
    from mla_fuser.runtime.generate import generate_shape, graphed_generate_plan

    _, fused = _fused_pair()
    ids = _prompt(length=6)
    ones = torch.ones_like(ids)
    assert generate_shape(fused, (ids,), dict(attention_mask=ones, max_new_tokens=20)) == (2, 27, None)
    assert generate_shape(fused, (), dict(input_ids=ids, max_new_tokens=9, num_return_sequences=2)) == (4, 16, None)
    left = ones.clone()
    left[0, :2] = 0
    batch, length, starts = generate_shape(fused, (ids,), dict(attention_mask=left, max_new_tokens=20,
                                                               num_return_sequences=2))
    assert (batch, length, starts.tolist()) == (4, 27, [2, 2, 0, 0])
    right = ones.clone()
    right[1, -1] = 0
    assert generate_shape(fused, (ids,), dict(attention_mask=right, max_new_tokens=20)) is None
    assert generate_shape(fused, (ids,), dict(max_new_tokens=20, num_beams=2)) is None
    assert generate_shape(fused, (ids,), dict(max_new_tokens=3)) is None
    assert generate_shape(fused, (ids,), dict(max_new_tokens=20, cache_implementation="static")) is None
    assert graphed_generate_plan(fused, (ids,), dict(max_new_tokens=20)) is None  # CPU: no graphs


@needs_mamba_fusion
def test_mamba_generate_through_the_graphed_forward_equals_native():
    from mla_fuser.runtime import GraphedForward, extend_generate

    native = make_model("mamba2")
    fused = make_model("mamba2")
    mla_fuser.fuse(fused)
    ids = _prompt(length=9, vocab=native.config.vocab_size)
    cache = DynamicCache(config=fused.config)
    with GraphedForward(fused, cache) as graphed:
        out = fused.generate(ids, **{KW: cache}, max_new_tokens=10, do_sample=False)
    assert graphed.steps == 9
    assert torch.equal(out, native.generate(ids, max_new_tokens=10, do_sample=False))
    # the fused Mamba model's generate is the graphed one (graphs only on CUDA; here it runs as before)
    assert model_state(fused).generate_extended
    assert not extend_generate(fused)  # extended once
    assert torch.equal(fused.generate(ids, max_new_tokens=10, do_sample=False), out)


@needs_mamba_fusion
def test_graphed_output_uses_the_models_own_cache_field():
    """Transformers 5.23's Mamba2CausalLMOutput calls its cache field ``cache_params`` (5.24: ``cache``), and graphed
    decode crashed there with a TypeError (the field was picked from a fixed pair of names).  A replayed step must
    build the output with whatever field the model's own output uses: here one named like no release does (5.24's
    outputs map ``cache_params`` onto ``cache`` themselves, so that exact name cannot be simulated on 5.24)."""
    import functools
    from dataclasses import dataclass

    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput

    from mla_fuser.runtime.generate import GraphedForward

    @dataclass
    class OlderOutput(ModelOutput):  # the 5.23 layout, under a name no release maps onto another
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        recurrent_cache: Cache | None = None
        hidden_states: tuple | None = None

    native = make_model("mamba2")
    fused = make_model("mamba2")
    mla_fuser.fuse(fused)
    real_forward = fused.forward

    @functools.wraps(real_forward)
    def older_forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        return OlderOutput(logits=out.logits, recurrent_cache=kwargs.get(KW))

    fused.forward = older_forward
    ids = _prompt(length=9, vocab=native.config.vocab_size)
    cache = DynamicCache(config=fused.config)
    with torch.no_grad(), GraphedForward(fused, cache) as graphed:
        prefill = graphed(input_ids=ids, **{KW: cache}, use_cache=True)
        token = prefill.logits[:, -1].argmax(-1, keepdim=True)
        step = graphed(input_ids=token, **{KW: cache}, use_cache=True)
    assert graphed.steps == 1 and type(step) is OlderOutput and step.recurrent_cache is cache
    with torch.no_grad():
        ref = native(input_ids=torch.cat([ids, token], 1)).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], ref, atol=1e-4, rtol=1e-4)


def _native_steps(native, ids, mask, feeds, positions):
    """Native logits of the prompt's last token and of each fed block, over a DynamicCache with the full mask."""
    cache = DynamicCache(config=native.config)
    with torch.no_grad():
        out = [native(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True).logits[:, -1:]]
        for feed, pos in zip(feeds, positions):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], feed.shape[1])], 1)
            out.append(native(input_ids=feed, attention_mask=mask, position_ids=pos, **{KW: cache},
                              use_cache=True).logits)
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_steps_of_several_tokens_equal_natives_forward(padded):
    """Steps of 1, 3 (bucket 4), 2, 5 (bucket 8) and 1 tokens per sequence, left-padded or not: each token's logits
    equal native's over the same tokens and positions; the bucket padding a step writes past the real tokens is
    taken back (the next step and the cache length show it), with no batch of any size leaving the cache."""
    native, fused = _fused_pair()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 128, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
    starts = (mask == 0).sum(1)
    cache = PagedLatentCache(fused, static=True, max_seq_len=40, page_size=4, max_cache_tokens=2 * 40)
    if padded:
        cache.set_left_padding(starts)
    with torch.no_grad():
        first = fused(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True).logits[:, -1:]
    step = DecodeGraph(fused, cache, capture=False)
    feeds = [torch.randint(3, 128, (2, n), generator=gen) for n in (1, 3, 2, 5, 1)]
    positions, seen = [], ids.shape[1]
    for feed in feeds:
        positions.append(torch.arange(seen, seen + feed.shape[1]).expand(2, -1) - starts.view(-1, 1))
        seen += feed.shape[1]
    ref = _native_steps(native, ids, mask, feeds, positions)
    got = [first]
    for feed, pos in zip(feeds, positions):
        logits = step(feed, pos)
        got.append(logits.unsqueeze(1) if logits.dim() == 2 else logits)
        assert cache.get_seq_length() == ids.shape[1] + sum(f.shape[1] for f in feeds[:len(got) - 1])
    for a, b in zip(ref, got):
        assert b.shape == a.shape
        assert torch.allclose(b, a, atol=2e-5, rtol=1e-4), (b - a).abs().max()


def test_several_token_steps_near_the_end_of_the_cache_run_exactly_and_stop_when_full():
    """No room for a bucket's padding at the end of a static cache: the step runs with its exact count; a step that
    does not fit at all is refused before anything is written."""
    native, fused = _fused_pair()
    ids = _prompt(length=5)
    cache = PagedLatentCache(fused, static=True, max_seq_len=9, page_size=4, max_cache_tokens=2 * 12)
    with torch.no_grad():
        fused(input_ids=ids, **{KW: cache}, use_cache=True)
    step = DecodeGraph(fused, cache, capture=False)
    feed = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(1))
    logits = step(feed, torch.arange(5, 8).expand(2, -1))  # bucket 4 would need 9 + 1 tokens of room
    ref = _native_steps(native, ids, torch.ones_like(ids), [feed], [torch.arange(5, 8).expand(2, -1)])[1]
    assert torch.allclose(logits, ref, atol=2e-5, rtol=1e-4)
    assert cache.get_seq_length() == 8
    with pytest.raises(CachePoolExhausted, match="full"):
        step(feed[:, :2], torch.arange(8, 10).expand(2, -1))
    assert cache.get_seq_length() == 8


@needs_mamba_fusion
def test_several_token_steps_need_paged_layers_only():
    model = make_model("mamba2")
    mla_fuser.fuse(model)
    ids = _prompt(batch=1, length=6, vocab=model.config.vocab_size)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **{KW: cache}, use_cache=True)
    step = DecodeGraph(model, cache, capture=False)
    with pytest.raises(ValueError, match="paged latent layers only"):
        step(ids[:, :3], torch.arange(6, 9).view(1, -1))


def test_memory_that_moves_is_seen_and_a_new_view_of_the_same_memory_is_not():
    """Before each replay the step compares the cache layers' ``layout_key``: moves counted as buffers are assigned.
    A pool swapped for a copy, a grown pool or a new block table is a new layout (on CUDA: a capture again); the same
    memory viewed again is not (a false move would recapture every step)."""
    _, fused = _fused_pair()
    cache = PagedLatentCache(fused, static=True, max_seq_len=12, page_size=4, max_cache_tokens=64)
    step = DecodeGraph(fused, cache, capture=False)
    with torch.no_grad():
        fused(input_ids=_prompt(length=5), **{KW: cache}, use_cache=True)
    token = torch.full((2, 1), 5)
    step(token, torch.full((2, 1), 5))
    step(token, torch.full((2, 1), 6))
    assert step.layouts == 1
    layer = cache.layers[1]
    key = layer.layout_key()
    layer.block_table = layer.tables[: layer.block_table.numel()].view(layer.block_table.shape)  # (same memory)
    layer.seq_lens = layer.tables[layer.block_table.numel():]
    assert layer.layout_key() == key
    step(token, torch.full((2, 1), 7))
    assert step.layouts == 1
    layer.pool.pages = layer.pool.pages.clone()  # (what a grown pool does, too)
    assert layer.layout_key() != key
    step(token, torch.full((2, 1), 8))
    assert step.layouts == 2
    layer.tables = layer.tables.clone()
    step(token, torch.full((2, 1), 9))
    assert step.layouts == 3


def test_a_grown_pool_counts_a_move():
    from mla_fuser.cache import PagePool

    pool = PagePool(2, 4, 8, torch.float32, "cpu", growable=True)
    first = pool.moves  # (the first pages count as one: memory where there was none)
    pool.allocate(2)
    assert pool.moves == first
    pool.allocate(1)  # (doubles: new pages tensor)
    assert pool.moves == first + 1 and pool.num_pages == 4


def test_a_layer_whose_lengths_differ_from_the_first_is_checked_on_its_own():
    _, fused = _fused_pair()
    cache = PagedLatentCache(fused, static=True, max_seq_len=8, page_size=4, max_cache_tokens=64)
    step = DecodeGraph(fused, cache, capture=False)
    with torch.no_grad():
        fused(input_ids=_prompt(length=5), **{KW: cache}, use_cache=True)
    step._check_step(2)
    last = cache.layers[-1]
    saved = last.host_lens
    last.rewind([8, 5])  # (only this layer full: the first layer's lengths alone would pass)
    with pytest.raises(CachePoolExhausted, match="full"):
        step._check_step(2)
    last.rewind(saved)
    step._check_step(2)


def test_the_collector_is_off_while_a_step_is_captured_and_as_it_was_after(monkeypatch):
    """A collection inside a capture would free unreachable CUDA objects there (invalidating it): the collector is
    off while ``_capture`` runs, and afterwards as it was, when the capture raises too."""
    import gc

    seen = []

    def capture_now(self, bucket):
        seen.append(gc.isenabled())
        if bucket == "fail":
            raise RuntimeError("capture failed")

    monkeypatch.setattr(DecodeGraph, "_capture_now", capture_now)
    graph = DecodeGraph.__new__(DecodeGraph)  # (only _capture's own work: no model needed)
    assert gc.isenabled()
    graph._capture(None)
    with pytest.raises(RuntimeError, match="capture failed"):
        graph._capture("fail")
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        graph._capture(None)
        assert not gc.isenabled()  # (a caller that had it off keeps it off)
    finally:
        gc.enable()
