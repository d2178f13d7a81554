"""Steps launched ahead (``runtime.step_ahead``) on a CPU: the graphed plan forced on (``graphs_possible``) and steps
ahead allowed without capture (``WITHOUT_CAPTURE``), so the next decode step runs from the stopping criterion, eagerly,
through the same bookkeeping as on CUDA: tokens equal native's, the cache reads as native's when the call returns
(a step nobody asked for is taken back), and the cases that must not launch ahead do not.  The replay on a side
stream and bf16 tokens with and without steps ahead are in ``test_gpu_generation_modes.py``."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from mla_fuser.compat import cache_keyword
from mla_fuser.runtime import generate as runtime_generate
from mla_fuser.runtime import step_ahead
from mla_fuser.runtime.decode_graph import DecodeGraph
from mla_fuser.runtime.generate import last_generate_plan

from conftest import callers_cache, left_padded_prompts, native_and_fused_deepseek, tiny_deepseek

KW = cache_keyword(tiny_deepseek(layers=1))
NEW = 12


@pytest.fixture(scope="module")
def pair():
    return native_and_fused_deepseek()


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setattr(runtime_generate, "graphs_possible", lambda model: True)
    monkeypatch.setattr(step_ahead, "WITHOUT_CAPTURE", True)


def _ids(batch=2, length=7, seed=0):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def _cached_length(out):
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return cache.get_seq_length()


def test_greedy_steps_run_ahead_and_equal_native(pair, ahead):
    native, fused = pair
    ids = _ids()
    want = native.generate(ids, max_new_tokens=NEW, do_sample=False)
    for call in range(2):  # a new capture, then the kept step (launched ahead from the prefill's token on)
        got = fused.generate(ids, max_new_tokens=NEW, do_sample=False)
        plan = last_generate_plan(fused)
        assert torch.equal(got, want)
        assert plan.graphed and plan.steps == NEW - 1
        # the first call's first decode step runs before the step is ready to run again; nothing launched after the
        # last token (the call's length is known)
        assert plan.steps_ahead == NEW - 1 - (call == 0)
        assert plan.taken_back == 0


def test_a_step_launched_past_an_end_token_is_taken_back(pair, ahead):
    native, fused = pair
    ids = _ids(batch=1, seed=3)
    free = native.generate(ids, max_new_tokens=NEW, do_sample=False)
    eos = int(free[0, ids.shape[1] + 4])  # the fifth new token ends the call
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True)
    want = native.generate(ids, **kw)
    got = fused.generate(ids, **kw)
    plan = last_generate_plan(fused)
    assert torch.equal(got.sequences, want.sequences) and got.sequences.shape[1] < free.shape[1]
    assert plan.steps_ahead > 0 and plan.taken_back == 1
    assert _cached_length(got) == _cached_length(want)  # the cache the caller gets reads as without the extra step


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_callers_cache_is_filled_after_the_step_launched_past_the_end_is_taken_back(pair, ahead, kind):
    """An empty DynamicCache / StaticCache the caller passes is filled when the call returns: after the step launched
    past an end token was taken back, so it holds what native's does, token for token."""
    native, fused = pair
    ids = _ids(batch=1, seed=3)
    eos = int(native.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1] + 4])
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    mine, theirs = (callers_cache(kind, model, ids.shape[1] + NEW) for model in (fused, native))
    got = fused.generate(ids, **{KW: mine}, **kw)
    want = native.generate(ids, **{KW: theirs}, **kw)
    plan = last_generate_plan(fused)
    assert torch.equal(got, want) and plan.graphed and plan.steps_ahead > 0 and plan.taken_back == 1
    assert int(mine.get_seq_length()) == int(theirs.get_seq_length()) == want.shape[1] - 1
    for layer, ref in zip(mine.layers, theirs.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-5)


def test_a_callers_stopping_criterion_runs_first_and_is_honoured(pair, ahead):
    native, fused = pair
    ids = _ids()
    seen = []

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(input_ids.shape[1])
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 6, dtype=torch.bool)

    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    want = native.generate(ids, stopping_criteria=StoppingCriteriaList([StopAt()]), **kw)
    calls_native, seen[:] = list(seen), []
    got = fused.generate(ids, stopping_criteria=StoppingCriteriaList([StopAt()]), **kw)
    plan = last_generate_plan(fused)
    assert torch.equal(got.sequences, want.sequences) and got.sequences.shape[1] == ids.shape[1] + 6
    assert seen == calls_native
    assert plan.steps_ahead > 0 and plan.taken_back == 1
    assert _cached_length(got) == _cached_length(want)


def test_sampling_and_left_padding_equal_native(pair, ahead):
    native, fused = pair
    ids, mask = left_padded_prompts([5, 9, 7])
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=20)):
        torch.manual_seed(0)
        want = native.generate(ids, attention_mask=mask, max_new_tokens=NEW, **kw)
        torch.manual_seed(0)
        got = fused.generate(ids, attention_mask=mask, max_new_tokens=NEW, **kw)
        assert torch.equal(got, want), kw
        assert last_generate_plan(fused).steps_ahead > 0


def test_callers_own_positions_are_checked_and_the_call_goes_on_without_steps_ahead(pair, ahead):
    native, fused = pair
    ids = _ids(batch=1)
    positions = torch.arange(ids.shape[1])[None] + 5  # not where the cache would place the tokens
    want = native.generate(ids, position_ids=positions, max_new_tokens=NEW, do_sample=False)
    got = fused.generate(ids, position_ids=positions, max_new_tokens=NEW, do_sample=False)
    plan = last_generate_plan(fused)
    assert torch.equal(got, want)
    assert plan.steps_ahead == 0 and plan.taken_back == 1 and plan.steps == NEW - 1


@pytest.mark.parametrize("case", ["beam", "right_padded", "switched_off", "constant_off"])
def test_no_step_ahead_where_the_next_input_is_not_known_or_it_is_turned_off(pair, ahead, monkeypatch, case):
    native, fused = pair
    ids, mask = _ids(), None
    kw = dict(max_new_tokens=NEW, do_sample=False)
    if case == "beam":
        kw["num_beams"] = 2
    elif case == "right_padded":
        ids, mask = left_padded_prompts([5, 9])
        ids, mask = ids.flip(1), mask.flip(1)
        kw["attention_mask"] = mask
    elif case == "switched_off":
        monkeypatch.setenv("MLA_FUSER_STEP_AHEAD", "0")
    else:
        monkeypatch.setattr(step_ahead, "LAUNCH_AHEAD", False)
    launched = []
    monkeypatch.setattr(DecodeGraph, "launch", lambda self, *a: launched.append(1))
    got = fused.generate(ids, **kw)
    plan = last_generate_plan(fused)
    assert plan.graphed and plan.steps > 0
    assert launched == [] and plan.steps_ahead == 0
    assert torch.equal(got, native.generate(ids, **kw))


def test_take_back_shortens_every_paged_layer_on_the_device_and_the_host(pair, ahead):
    _, fused = pair
    ids = _ids()
    fused.generate(ids, max_new_tokens=NEW, do_sample=False)
    cache = last_generate_plan(fused).cache  # (as the call left it: kept, not yet restarted)
    graph = DecodeGraph(fused, cache, capture=False)
    before = [(layer.seq_lens.clone(), list(layer.host_lens)) for layer in cache.paged]
    assert before[0][1] == [ids.shape[1] + NEW - 1] * ids.shape[0]
    graph.take_back()
    for layer, (device, host) in zip(cache.paged, before):
        assert torch.equal(layer.seq_lens, device - 1) and layer.host_lens == [n - 1 for n in host]


def test_a_finished_call_leaves_no_cycle_holding_its_forward(pair, ahead, monkeypatch):
    """The call's forward and its step-ahead state hold each other while the call runs; at its end the cycle is
    broken, so they (and a graph only they hold) are freed at once, never by a collection that could run inside a
    later capture (where freeing CUDA objects invalidates it)."""
    import gc
    import weakref

    _, fused = pair
    forwards = []
    original = step_ahead.StepAhead.__init__

    def spy(self, graphed, stop_length):
        forwards.append(weakref.ref(graphed))
        original(self, graphed, stop_length)

    monkeypatch.setattr(step_ahead.StepAhead, "__init__", spy)
    gc.collect()
    gc.disable()
    try:
        fused.generate(_ids(), max_new_tokens=NEW, do_sample=False)
        assert len(forwards) == 1 and last_generate_plan(fused).steps_ahead > 0
        assert forwards[0]() is None, "the call's forward outlived it (held by a reference cycle)"
    finally:
        gc.enable()


def test_a_chat_turn_over_a_callers_cache_launches_steps_ahead_and_equals_native(pair, ahead):
    """The second turn over the caller's DynamicCache (its first turn held: written into the call's cache first) runs
    its steps ahead like any graphed call, and the cache it extends holds native's latent."""
    from transformers import DynamicCache

    native, fused = pair
    ids = _ids(seed=5)
    mine, theirs = DynamicCache(config=fused.config), DynamicCache(config=native.config)
    kw = dict(max_new_tokens=NEW, do_sample=False)
    for turn in range(2):
        held = int(mine.get_seq_length())
        got = fused.generate(ids, **{KW: mine}, **kw)
        want = native.generate(ids, **{KW: theirs}, **kw)
        plan = last_generate_plan(fused)
        assert torch.equal(got, want) and plan.graphed and plan.steps_ahead > 0, turn
        assert plan.held == held and held == (0 if turn == 0 else ids.shape[1] - 4)  # (turn 0's tokens but its last)
        ids = torch.cat([got, _ids(length=3, seed=6 + turn)], 1)
    assert int(mine.get_seq_length()) == int(theirs.get_seq_length())
    for layer, ref in zip(mine.layers, theirs.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-5)
