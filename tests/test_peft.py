"""PEFT LoRA adapters on fused MLA modules, added before or after fusion: the numbers of the native model with the
same adapters (logits, greedy tokens through the paged cache, LoRA gradients), whatever happens to the adapters
afterwards (in-place updates, other adapters, disabling, merging, unloading)."""

import pytest
import torch

import mla_fuser
import mla_fuser.attention_interfaces.vllm_mla as vm
from mla_fuser.rewrite import STACKED_ATTR

from conftest import tiny_deepseek

peft = pytest.importorskip("peft")

# every MLA projection of DeepSeek-V2/V3, with and without q-LoRA (names a model lacks are simply not found)
ALL = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
CASES = [("deepseek_v2", 24), ("deepseek_v2", None), ("deepseek_v3", 24)]


def _ids(batch=2, seq=6, seed=1):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _close(a, b, tol=1e-4):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item() <= tol


def _lora_config(targets, **extra):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                           **extra)


def _with_lora(model, targets, seed=7, **extra):
    torch.manual_seed(seed)  # the same random adapter weights for the native and the fused model
    return peft.get_peft_model(model, _lora_config(targets, **extra))


def _pair(arch, q_lora_rank, when, targets=ALL, **extra):
    """``(native, fused, report)``: two PEFT models with identical weights and adapters; the second's base model
    is fused before (``when="after"``: the adapters wrap fused modules) or after (``"before"``) adding them."""
    native = tiny_deepseek(arch, q_lora_rank=q_lora_rank)
    fused = tiny_deepseek(arch, q_lora_rank=q_lora_rank)
    report = mla_fuser.fuse(fused) if when == "after" else None
    native, fused = _with_lora(native, targets, **extra), _with_lora(fused, targets, **extra)
    if when == "before":
        report = mla_fuser.fuse(fused.get_base_model())
    return native, fused, report


@pytest.fixture
def decode_paths(monkeypatch):
    """Counts of the fused decode paths over the paged cache: absorbed from the pages, or gathered (and expanded)."""
    seen = {"paged_decode": 0, "gathered": 0}
    real_decode, real_gather = vm.paged_decode, vm.gathered_latent

    def decode(*args, **kwargs):
        seen["paged_decode"] += 1
        return real_decode(*args, **kwargs)

    def gather(*args, **kwargs):
        seen["gathered"] += 1
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(vm, "paged_decode", decode)
    monkeypatch.setattr(vm, "gathered_latent", gather)
    return seen


def _assert_same(native, fused, ids=None):
    ids = _ids() if ids is None else ids
    want, got = _logits(native, ids), _logits(fused, ids)
    assert _close(want, got), (want - got).abs().max().item()
    kw = dict(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(native.generate(**kw), fused.generate(**kw))


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("arch,q_lora_rank", CASES)
def test_adapters_give_native_numbers(arch, q_lora_rank, when, decode_paths):
    native, fused, report = _pair(arch, q_lora_rank, when)
    rows = [r for r in report.rows if r.fuser == "mla"]
    assert len(rows) == 2 and all(r.status == "fused" for r in rows), str(report)
    if when == "before":
        assert all("adapters on kv_b_proj: K/V expanded through it" in r.reason for r in rows), str(report)
        assert all(("adapters on q_a_proj, kv_a_proj_with_mqa" in r.reason) == bool(q_lora_rank) for r in rows)
    _assert_same(native, fused)
    # generate ran on the paged latent cache; kv_b_proj carries adapters, so never from absorbed weights
    assert decode_paths["gathered"] > 0 and decode_paths["paged_decode"] == 0
    # and on a contiguous (dynamic) cache, whose single-token steps would otherwise be absorbed
    kw = dict(input_ids=_ids(), max_new_tokens=6, do_sample=False, cache_implementation="dynamic")
    assert torch.equal(native.generate(**kw), fused.generate(**kw))


@pytest.mark.parametrize("targets", [["kv_b_proj"], ["q_a_proj"], ["q_b_proj", "o_proj"]])
def test_adapters_on_some_projections(targets, decode_paths):
    """Projections without adapters keep their fused form (stacked down-projection, absorbed decode)."""
    native, fused, _ = _pair("deepseek_v2", 24, "after", targets)
    calls = []  # the KV down-projection runs as itself only when the stacked GEMM is not used
    fused.get_base_model().model.layers[0].self_attn.kv_a_proj_with_mqa.register_forward_hook(
        lambda *_: calls.append(1))
    _assert_same(native, fused)
    assert bool(calls) == ("q_a_proj" in targets)
    assert (decode_paths["paged_decode"] > 0) == ("kv_b_proj" not in targets)


@pytest.mark.parametrize("when", ["after", "before"])
def test_in_place_adapter_updates_are_seen(when):
    native, fused, _ = _pair("deepseek_v2", 24, when)
    _assert_same(native, fused)
    before = _logits(fused, _ids())
    for model in (native, fused):  # an optimizer step, as the same update on both
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=gen))
    assert not _close(before, _logits(fused, _ids()))  # the update matters
    _assert_same(native, fused)


@pytest.mark.parametrize("when", ["after", "before"])
def test_adapter_switching_merging_and_unloading(when, decode_paths):
    native, fused, _ = _pair("deepseek_v2", 24, when)
    for model in (native, fused):
        torch.manual_seed(11)
        model.add_adapter("second", _lora_config(ALL))
    for model in (native, fused):
        model.set_adapter("second")
    _assert_same(native, fused)
    for model in (native, fused):
        model.base_model.set_adapter(["default", "second"])  # both active at once
    _assert_same(native, fused)
    with native.disable_adapter(), fused.disable_adapter():
        _assert_same(native, fused)
    for model in (native, fused):
        model.merge_adapter()
    _assert_same(native, fused)
    for model in (native, fused):
        model.unmerge_adapter()
    _assert_same(native, fused)
    native, fused = native.unload(), fused.unload()
    decode_paths.update(paged_decode=0, gathered=0)
    _assert_same(native, fused)
    # plain linears are back: stacked and absorbed again
    attn = fused.model.layers[0].self_attn
    stacked = getattr(attn, STACKED_ATTR)
    assert stacked.weight is not None and stacked.weight.data_ptr() == attn.q_a_proj.weight.data_ptr()
    assert decode_paths["paged_decode"] > 0


def test_merge_and_unload_restores_the_fused_paths(decode_paths):
    native, fused, _ = _pair("deepseek_v2", 24, "after")
    native, fused = native.merge_and_unload(), fused.merge_and_unload()
    _assert_same(native, fused)
    assert decode_paths["paged_decode"] > 0


def test_dora_adapters():
    """Any adapter layer is called as itself, so variants the fused code knows nothing about are exact too."""
    native, fused, _ = _pair("deepseek_v2", 24, "after", use_dora=True)
    _assert_same(native, fused)


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("arch,q_lora_rank", CASES)
def test_lora_gradients_equal_native(arch, q_lora_rank, when):
    native, fused, _ = _pair(arch, q_lora_rank, when)
    ids = _ids()
    grads = []
    for model in (native, fused):
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    want, got = grads
    assert set(want) == set(got) and all("lora_" in n for n in want)
    for name in want:
        assert got[name] is not None and _close(want[name], got[name]), name


def test_fusing_the_peft_model_itself():
    """``fuse(peft_model)`` (not its base model): fused, and generate through the PEFT model equals native."""
    native = _with_lora(tiny_deepseek(), ALL)
    fused = _with_lora(tiny_deepseek(), ALL)
    report = mla_fuser.fuse(fused)
    assert report.fused("mla") and not report.fallbacks("mla"), str(report)
    assert any("paged latent cache" in n for n in report.notes), report.notes
    _assert_same(native, fused)
