"""GPU equivalences in bf16 on the DeepSeek-V2-Lite layer shape (skipped without CUDA).

Run on a GPU machine with ``python -m pytest tests/test_gpu.py -q``; results go to stdout and, when
``MLA_FUSER_GPU_RESULTS`` names a file, to that JSON file.  bf16 greedy tokens of two mathematically equal
paths can differ where two logits tie within rounding; the tests therefore check logits within bf16 tolerance
and report the greedy agreement.
"""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import mla_fuser  # noqa: E402
from mla_fuser.cache import PagedLatentCache  # noqa: E402
from mla_fuser.plans import model_state  # noqa: E402
from mla_fuser.presets import preset_config  # noqa: E402

from conftest import divergence_gaps, left_padded_prompts, needs_mamba_fusion  # noqa: E402

RESULTS = {}


def _build(attn, layers=4):
    from transformers import AutoModelForCausalLM

    cfg = preset_config("deepseek-v2-lite", num_hidden_layers=layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).eval()
    if attn == "vllm_mla":
        mla_fuser.fuse(model)
    return model


@pytest.fixture(scope="module")
def models():
    native, fused = _build("sdpa"), _build("vllm_mla")
    fused.load_state_dict(native.state_dict())
    yield native, fused
    path = os.environ.get("MLA_FUSER_GPU_RESULTS")
    if path:
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=2)


def _cache_kw(model, cache):
    from mla_fuser.compat import cache_keyword

    return {cache_keyword(model): cache}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def _prompts(lengths, vocab, seed=0):
    ids, mask = left_padded_prompts(lengths, vocab, seed)
    return ids.cuda(), mask.cuda()


@torch.no_grad()
def test_prefill_and_decode_logits_bf16(models):
    native, fused = models
    ids, mask = _prompts([300, 300], native.config.vocab_size)
    from transformers import DynamicCache

    a = native(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
    b = fused(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
    RESULTS["prefill_rel_err"] = _rel(a, b)
    assert RESULTS["prefill_rel_err"] < 3e-2
    cache = PagedLatentCache(fused, max_cache_tokens=4096)
    ref_cache = DynamicCache(config=native.config)
    key = "cache" if "cache" in __import__("inspect").signature(type(native).forward).parameters else "past_key_values"
    fused(input_ids=ids, **{key: cache}, use_cache=True)
    native(input_ids=ids, **{key: ref_cache}, use_cache=True)
    step = ids[:, -1:]
    errs = []
    for _ in range(8):
        x = native(input_ids=step, **{key: ref_cache}, use_cache=True).logits[:, -1]
        y = fused(input_ids=step, **{key: cache}, use_cache=True).logits[:, -1]
        errs.append(_rel(x, y))
        step = x.argmax(-1, keepdim=True)
    RESULTS["decode_rel_err_max"] = max(errs)
    assert max(errs) < 3e-2


@torch.no_grad()
@pytest.mark.parametrize("mode", ["greedy", "left_padded", "beam2", "static_paged"])
def test_generation_agreement_bf16(models, mode):
    native, fused = models
    vocab = native.config.vocab_size
    lengths = [64, 64] if mode != "left_padded" else [17, 64, 40]
    ids, mask = _prompts(lengths, vocab, seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    if mode == "beam2":
        kw["num_beams"] = 2
    ref = native.generate(ids, **kw)
    if mode == "static_paged":
        key = "cache" if "cache" in __import__("inspect").signature(type(native).forward).parameters \
            else "past_key_values"
        kw[key] = PagedLatentCache(fused, static=True, max_seq_len=128, max_cache_tokens=1024)
    model_state(fused).graphed_steps = 0
    out = fused.generate(ids, **kw)
    if mode in ("greedy", "left_padded"):  # one beam, no cache given: decode steps replayed from a CUDA graph
        assert model_state(fused).graphed_steps == kw["max_new_tokens"] - 1
    new_ref, new_out = ref[:, ids.shape[1]:], out[:, ids.shape[1]:]
    # position of the first disagreement per row (a bf16 tie flips everything after it)
    first = [(r != o).nonzero()[0].item() if (r != o).any() else r.numel() for r, o in zip(new_ref, new_out)]
    RESULTS[f"generation_{mode}_first_divergence"] = first
    RESULTS[f"generation_{mode}_token_agreement"] = float((new_ref == new_out).float().mean())
    if mode != "beam2":  # beam search re-ranks on near-ties of random-weight logits: reported, not asserted
        gaps = divergence_gaps(native, out, mask, ids.shape[1], first, new_ref)
        RESULTS[f"generation_{mode}_divergence_logit_gaps"] = gaps
        assert max(gaps, default=0.0) < 3e-2, f"fused and native split on a clear preference: {gaps}"


def _graph_steps(model, ids, steps, capture=True):
    """``ids`` prefilled into a fresh static paged cache, then ``steps`` greedy steps through one ``DecodeGraph``:
    ``(logits [B, steps, vocab], the DecodeGraph, the cache)``."""
    cache = PagedLatentCache(model, static=True, max_seq_len=160, max_cache_tokens=4 * 256)
    first = model(input_ids=ids, **_cache_kw(model, cache), use_cache=True).logits[:, -1]
    step = mla_fuser.DecodeGraph(model, cache, capture=capture)
    token, logits = first.argmax(-1, keepdim=True), []
    for i in range(steps):
        out = step(token, torch.full_like(token, ids.shape[1] + i))
        logits.append(out)
        token = out.argmax(-1, keepdim=True)
    return torch.stack(logits, 1), step, cache


@torch.no_grad()
def test_decode_graph_replays_equal_eager_bf16(models):
    """Steps replayed from one CUDA graph give the logits of the same steps run eagerly (same kernels), capture
    happens once, and the host-side lengths follow the device."""
    _, fused = models
    ids, _ = _prompts([96, 96, 96, 96], fused.config.vocab_size, seed=2)
    runs = []
    for capture in (False, True):
        logits, step, cache = _graph_steps(fused, ids, 12, capture)
        runs.append((logits, step.captures, cache.get_seq_length()))
    (eager, _, eager_len), (graph, captures, graph_len) = runs
    RESULTS["decode_graph_rel_err_vs_eager"] = _rel(eager, graph)
    RESULTS["decode_graph_captures"] = captures
    assert captures == 1 and eager_len == graph_len == 96 + 12
    assert RESULTS["decode_graph_rel_err_vs_eager"] < 1e-2


@torch.no_grad()
def test_shared_experts_beside_the_routed_ones_replay_the_same_logits_bf16(models, monkeypatch):
    """Shared experts on a side stream in the captured step (``fusers.moe.shared_overlap``): the same kernels, so the
    replayed logits equal those of a capture without the overlap bit for bit; the capture did take the side stream."""
    from mla_fuser.plans import plan_of

    _, fused = models
    plans = [plan_of(m, "shared_overlap") for m in fused.modules() if plan_of(m, "shared_overlap") is not None]
    assert plans
    ids, _ = _prompts([96, 96, 96, 96], fused.config.vocab_size, seed=3)
    runs = []
    for overlap in ("0", "1"):
        monkeypatch.setenv("MLA_FUSER_OVERLAP_SHARED_EXPERTS", overlap)
        before = sum(p.overlapped_calls for p in plans)
        logits, step, _ = _graph_steps(fused, ids, 8)
        runs.append((logits, sum(p.overlapped_calls for p in plans) - before, step.captures))
    (plain, plain_calls, _), (overlapped, overlapped_calls, captures) = runs
    RESULTS["shared_overlap_replay_bitwise_equal"] = torch.equal(plain, overlapped)
    RESULTS["shared_overlap_rel_err"] = _rel(plain, overlapped)
    assert plain_calls == 0 and overlapped_calls >= len(plans) and captures == 1
    assert torch.equal(plain, overlapped)


@torch.no_grad()
@needs_mamba_fusion
def test_decode_graph_mamba2_equals_eager_bf16():
    from transformers import DynamicCache, Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=512, num_heads=16, head_dim=64, state_size=64, n_groups=1, expand=2,
                       num_hidden_layers=2, vocab_size=1024, chunk_size=64)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Mamba2ForCausalLM(cfg).to(torch.bfloat16).eval()
    mla_fuser.fuse(model)
    assert model.fusion_report.fused("mamba")
    ids = torch.randint(3, 1024, (2, 100), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for capture in (False, True):
        cache = DynamicCache(config=model.config)
        token = model(input_ids=ids, **_cache_kw(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        step = mla_fuser.DecodeGraph(model, cache, capture=capture)
        logits = []
        for i in range(8):
            out = step(token, torch.full_like(token, ids.shape[1] + i))
            logits.append(out)
            token = out.argmax(-1, keepdim=True)
        runs.append(torch.stack(logits, 1))
    RESULTS["decode_graph_mamba2_rel_err_vs_eager"] = _rel(runs[0], runs[1])
    assert RESULTS["decode_graph_mamba2_rel_err_vs_eager"] < 1e-2


def _mamba(arch, dtype):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    if arch == "mamba2":
        cfg = Mamba2Config(hidden_size=512, num_heads=16, head_dim=64, state_size=64, n_groups=1, expand=2,
                           num_hidden_layers=4, vocab_size=1024, chunk_size=64)
        cls = Mamba2ForCausalLM
    else:
        cfg = MambaConfig(hidden_size=512, state_size=16, expand=2, num_hidden_layers=4, vocab_size=1024,
                          time_step_rank=32)
        cls = MambaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(cfg).to(dtype).eval()


@torch.no_grad()
@needs_mamba_fusion
@pytest.mark.parametrize("arch", ["mamba2", "mamba"])
def test_mamba_bf16_error_vs_fp32_like_native(arch):
    """bf16 fused (Triton conv/scan) and bf16 native (Transformers' torch path) against the fp32 native oracle:
    the fused kernels may round differently, never worse than native by more than bf16 noise."""
    oracle = _mamba(arch, torch.float32)
    native = _mamba(arch, torch.bfloat16)
    native.load_state_dict(oracle.state_dict())
    fused = _mamba(arch, torch.bfloat16)
    fused.load_state_dict(oracle.state_dict())
    mla_fuser.fuse(fused)
    assert fused.fusion_report.fused("mamba")
    ids = torch.randint(3, 1024, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    ref = oracle(input_ids=ids).logits
    err_native = _rel(ref, native(input_ids=ids).logits)
    err_fused = _rel(ref, fused(input_ids=ids).logits)
    RESULTS[f"{arch}_bf16_prefill_rel_err_vs_fp32"] = {"native": err_native, "fused": err_fused}
    assert err_fused <= 1.5 * err_native + 1e-2


@torch.no_grad()
@needs_mamba_fusion
def test_mamba2_generate_replays_decode_steps():
    model = _mamba("mamba2", torch.bfloat16)
    native = _mamba("mamba2", torch.bfloat16)
    native.load_state_dict(model.state_dict())
    mla_fuser.fuse(model)
    ids = torch.randint(3, 1024, (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
    out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert model_state(model).graphed_steps == 15
    ref = native.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    RESULTS["mamba2_generate_graphed_token_agreement"] = float((out == ref).float().mean())
