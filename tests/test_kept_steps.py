"""A graphed ``generate()`` keeps its static cache and captured step for the next call of the same shape
(``runtime.kept_steps``), on a CPU with the graphed plan forced (as in ``test_generation_modes.py``): every call's
tokens equal native's, a reused step runs on the same cache memory (``layouts == 1``: on CUDA, no recapture), and
nothing is reused where the shape, the model or the caller's hold on the cache says otherwise."""

import pytest
import torch

from mla_fuser.plans import model_state
from mla_fuser.runtime import generate as runtime_generate
from mla_fuser.runtime import kept_steps
from mla_fuser.runtime.generate import last_generate_plan

from conftest import left_padded_prompts, native_and_fused_deepseek


@pytest.fixture(scope="module")
def pair():
    return native_and_fused_deepseek()


@pytest.fixture
def graphed(monkeypatch, pair):
    monkeypatch.setattr(runtime_generate, "graphs_possible", lambda model: True)
    kept_steps.release_decode_graphs(pair[1])
    yield
    kept_steps.release_decode_graphs(pair[1])


def _call(pair, lengths, seed, new_tokens=10, **extra):
    native, fused = pair
    ids, mask = left_padded_prompts(lengths, seed=seed)
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **extra)
    out = fused.generate(ids, **kw)
    want = native.generate(ids, **kw)
    if isinstance(out, torch.Tensor):
        assert torch.equal(out, want)
    else:
        assert torch.equal(out.sequences, want.sequences)
    return last_generate_plan(fused), out


@pytest.mark.parametrize("lengths", [[6, 6], [4, 7]])  # unpadded, left-padded
def test_second_call_of_the_same_shape_replays_the_kept_step(pair, graphed, lengths):
    first, _ = _call(pair, lengths, seed=1)
    assert first.graphed and first.graph is None and first.keep_key is not None, first.reason
    kept = model_state(pair[1]).kept_step
    assert kept is not None and kept.cache is first.cache
    for seed in (2, 3):  # other prompts of the same lengths: the same shape
        plan, _ = _call(pair, lengths, seed=seed)
        assert plan.graph is kept.graph and plan.cache is kept.cache, "the kept step was not reused"
        assert plan.steps == 9 and plan.layouts == 1, "a reused step moved the cache's memory (a recapture on CUDA)"
    # a prompt a few tokens longer rounds to the same cache size
    plan, _ = _call(pair, [l + 3 for l in lengths], seed=4)
    assert plan.cache is kept.cache
    assert plan.cache.max_seq_len == kept_steps.cache_size(max(lengths) + 3 + 10 + 1)


def test_beam_search_reorders_then_the_next_call_starts_clean(pair, graphed):
    for seed in (5, 6):
        plan, _ = _call(pair, [5, 8], seed=seed, num_beams=3)
    assert plan.graph is not None and plan.layouts == 1


def test_another_shape_gets_its_own_cache_and_frees_the_kept_one(pair, graphed):
    first, _ = _call(pair, [6, 6], seed=7)
    other, _ = _call(pair, [6, 6, 6], seed=8)  # another batch
    assert other.graph is None and other.cache is not first.cache
    assert model_state(pair[1]).kept_step.cache is other.cache
    right = _call(pair, [6, 6, 6], seed=9, new_tokens=8 + kept_steps.SIZE_STEP)[0]  # another cache size
    assert right.graph is None and right.cache is not other.cache


def test_a_cache_the_caller_receives_is_not_kept(pair, graphed):
    plan, out = _call(pair, [6, 6], seed=10, return_dict_in_generate=True)
    assert out.past_key_values is plan.cache and model_state(pair[1]).kept_step is None
    held = [layer.keys.clone() for layer in plan.cache.layers]
    again, _ = _call(pair, [6, 6], seed=11, return_dict_in_generate=True)
    assert again.cache is not plan.cache
    assert all(torch.equal(layer.keys, k) for layer, k in zip(plan.cache.layers, held)), "the caller's cache changed"


def _changed_by_a_hook(model):
    return model.model.layers[0].register_forward_hook(lambda *a: None)


def _changed_by_a_new_weight(model):
    linear = model.lm_head
    linear.weight = torch.nn.Parameter(linear.weight.detach().clone())


@pytest.mark.parametrize("change", [_changed_by_a_hook, _changed_by_a_new_weight])
def test_a_changed_model_captures_again(pair, graphed, change):
    _call(pair, [6, 6], seed=12)
    handle = change(pair[1])
    try:
        plan, _ = _call(pair, [6, 6], seed=13)
        assert plan.graph is None, "a graph of the unchanged model was replayed"
    finally:
        if handle is not None:
            handle.remove()


def test_switched_off_or_released_nothing_is_kept(pair, graphed, monkeypatch):
    _call(pair, [6, 6], seed=14)
    assert kept_steps.release_decode_graphs(pair[1]) and not kept_steps.release_decode_graphs(pair[1])
    monkeypatch.setenv("MLA_FUSER_REUSE_DECODE_GRAPHS", "0")
    plan, _ = _call(pair, [6, 6], seed=15)
    assert plan.keep_key is None and model_state(pair[1]).kept_step is None
    assert plan.cache.max_seq_len == 6 + 10 + 1  # (not rounded up either)


def test_right_padding_is_not_kept(pair, graphed):
    native, fused = pair
    ids, mask = left_padded_prompts([4, 7], seed=16)
    ids, mask = ids.flip(1), mask.flip(1)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    assert last_generate_plan(fused).keep_key is None and model_state(fused).kept_step is None
