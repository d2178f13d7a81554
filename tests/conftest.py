import contextlib
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails only because this Triton's interpreter cannot run our kernels (``interpreter_probe``: Triton
    3.6 with NumPy 2.x, the GPU image's) is reported as skipped, with the reason, not as a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        from interpreter_probe import REASON, is_known_limitation

        if is_known_limitation(call.excinfo):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {REASON}")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def interp(monkeypatch):
    """Run the Triton kernels under Triton's interpreter, forced through the public dispatch (the kernels are
    ``LazyJit``: the flag only has to be set before their first launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")


def tiny_deepseek(arch="deepseek_v2", attn="sdpa", seed=0, layers=2, **overrides):
    """A tiny DeepSeek-V2/V3 causal LM with seeded random weights (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    kwargs = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                  first_k_dense_replace=1, vocab_size=128, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if arch == "deepseek_v3":
        kwargs.update(n_group=2, topk_group=1, n_shared_experts=1)
    kwargs.update(overrides)
    config = (DeepseekV2Config if arch == "deepseek_v2" else DeepseekV3Config)(**kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def assert_generates_like_native(native, fused, ids, new_tokens):
    """Greedy ``generate`` of ``fused`` gives ``native``'s tokens, every step's logits within 1e-4 of their largest
    magnitude (fp32 models)."""
    import torch

    kw = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = native.generate(ids, **kw), fused.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4


def close_to_reference(out, ref, dtype):
    """A kernel's output against its reference: same dtype and shape, max error within 1e-5 (fp32) or 2e-2 (half
    types) of the reference's largest magnitude."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item() + 1e-6
    err = (out.float() - ref.float()).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


def native_and_fused_deepseek():
    """``(native, fused)``: two tiny DeepSeek-V2 models with the same seeded weights, sdpa and ``vllm_mla`` fused."""
    import mla_fuser

    native, fused = tiny_deepseek(), tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    return native, fused


def callers_cache(kind, model, max_cache_len):
    """An empty cache of Transformers' own that a caller would pass to ``generate``: ``"dynamic"`` a DynamicCache,
    ``"static"`` a StaticCache of ``max_cache_len`` tokens."""
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def swap_experts_like_on_a_gpu(model):
    """Transformers' generate switches ``grouped_mm`` experts to ``batched_mm`` for its decode steps off a CPU only
    (``_optimize_model_for_decode``); on this instance, do here what it does there.  Returns the list of
    swaps made, one entry per call of generate."""
    swaps = []

    @contextlib.contextmanager
    def swap(self):
        swaps.append(1)
        self.set_experts_implementation("batched_mm")
        try:
            yield
        finally:
            self.set_experts_implementation("grouped_mm")

    model._optimize_model_for_decode = types.MethodType(swap, model)
    return swaps


def left_padded_prompts(lengths, vocab=128, seed=0):
    """Random prompts of the given lengths, left-padded with 0 to the longest, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, longest - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, longest - n:] = 1
    return ids, mask


def _mamba_fusion_missing() -> str:
    from mla_fuser import compat

    return ", ".join(compat.missing_mamba_cache_methods())


# tests that need the Mamba fuser to fuse (Transformers >= 5.21: the mixers' states live in the cache API); on older
# releases the fuser declines every mixer with a report row (tested in test_settings.py)
needs_mamba_fusion = pytest.mark.skipif(
    bool(_mamba_fusion_missing()),
    reason=f"the installed Transformers' Cache lacks {_mamba_fusion_missing()}: Mamba fusion needs >=5.21",
)


@torch.no_grad()
def divergence_gaps(native, fused_out, mask, prompt_len, first, native_tokens, **generate_kwargs):
    """For each row where the paths split, native's preference for its own token over fused's, relative to the
    logits' scale.  Read from native's own ``generate`` forced along the fused tokens (a logits processor leaves
    only the fused token; ``output_logits`` are the raw logits before it), so each step sees exactly what native's
    generate would feed its forward on that prefix: its positions (on a right-padded row Transformers counts new
    tokens from 1, not from the prompt's length), mask and cache; a plain teacher-forced forward differs there by
    ~1e-3 even in fp32.  ``generate_kwargs``: the native reference call's other settings (greedy, one beam).
    Random-weight bf16 logits have near-ties; a split at a tie (gap within bf16 rounding, the same 3e-2 bound as
    the decode logits) is rounding, a split at a clear preference would be a wrong value."""
    from transformers import LogitsProcessor, LogitsProcessorList

    forced = fused_out[:, prompt_len:]

    class FollowFused(LogitsProcessor):
        def __call__(self, input_ids, scores):
            token = forced[:, input_ids.shape[1] - prompt_len]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, token[:, None], 0.0)

    kwargs = {k: v for k, v in generate_kwargs.items() if k not in ("max_new_tokens", "min_new_tokens")}
    run = native.generate(fused_out[:, :prompt_len], attention_mask=mask, max_new_tokens=forced.shape[1],
                          min_new_tokens=forced.shape[1], do_sample=False, output_logits=True,
                          return_dict_in_generate=True, logits_processor=LogitsProcessorList([FollowFused()]),
                          **kwargs)
    assert torch.equal(run.sequences[:, prompt_len:], forced), "native did not follow the fused tokens"
    logits = torch.stack(run.logits, 1).float()  # [B, new tokens, V]
    gaps = []
    for row, t in enumerate(first):
        if t >= native_tokens.shape[1]:
            continue
        scores = logits[row, t]
        gap = scores[native_tokens[row, t]] - scores[forced[row, t]]
        gaps.append(max(0.0, (gap / scores.abs().max()).item()))
    return gaps


@pytest.fixture
def device_path(monkeypatch):
    """The device path on CPU tensors, with the host-bounded path made unreachable (a host read would fail)."""
    from mla_fuser.attention_interfaces import ragged

    def host_read(cu):
        raise AssertionError("the device path read bounds on the host")

    calls = []
    joined, in_pages = ragged.ragged_mla_attention_on_device, ragged.ragged_mla_attention_in_pages
    monkeypatch.setattr(ragged, "DEVICE_PATH_ON_CPU", True)
    monkeypatch.setattr(ragged, "host_bounds", host_read)
    monkeypatch.setattr(ragged, "ragged_mla_attention_on_device", lambda *a: calls.append("joined") or joined(*a))
    monkeypatch.setattr(ragged, "ragged_mla_attention_in_pages", lambda *a: calls.append("pages") or in_pages(*a))
    yield calls
    assert calls, "no step took the device path"
