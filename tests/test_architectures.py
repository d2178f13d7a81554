"""Every MLA architecture of Transformers, tiny and float32: fused (``mla_fuser.fuse``) vs the native model.

For each of the 17 architectures two identical models are built from the tiny recipes (``tiny_configs.py``): the
native one runs ``sdpa`` (``eager`` where the class does not support SDPA) and the other is fused.  Checked:
the report (every MLA module fused, or a fallback whose reason is asserted), the logits (or last hidden state of
base models) within 1e-4 relative, and 32 tokens of greedy decoding (``generate`` for causal LMs; for base models a
DynamicCache decode that feeds back ``argmax(h · R)`` for a fixed random read-out ``R``).

Some recipes get test-only overrides so the variant each architecture is known for is actually exercised:
sliding-window layers (dots3_note), KV sharing across layers and NoPE layers (mistral_large4), position-dependent
query scaling past the original context (mistral4), non-trivial attention sinks (hy_v4), DSA top-k smaller than the
prompt (all DSA archs, via ``index_topk=4``).

Also: generation with an explicit DynamicCache (absorbed decode over the contiguous latent) besides the fused
model's default cache; a left-padded batch of 3 prompts and ``cache_implementation="static"`` for every causal LM
(deepseek_v2 with and without q-LoRA and deepseek_v3 additionally check each padded row against its unpadded run);
and ``VLLM_MLA_DISABLE=1`` on every architecture (every module a fallback row, output still exact).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("mla_fuser") is None:  # plain `pytest` from the repo without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mla_fuser  # noqa: E402
from mla_fuser.plans import plan_of  # noqa: E402

import tiny_configs  # noqa: E402

# every MLA architecture the installed Transformers ships (5.17 lacks a few that later releases added)
ARCHS = [a for a in tiny_configs.ARCHS if tiny_configs.available(a)]


def test_only_older_releases_lack_architectures():
    import transformers

    missing = sorted(set(tiny_configs.ARCHS) - set(ARCHS))
    newest = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 23)
    assert not (newest and missing), f"transformers {transformers.__version__} lacks {missing}"

PROMPT_LEN = 9
NEW_TOKENS = 32
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is as fast and does not stall when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# test-only overrides on top of the recipes: make each architecture's peculiarity show up in a tiny model
OVERRIDES = {
    # layers 0-1 DSA (indexed), 2-3 sliding-window MLA with their own (tiny) per-layer head layout
    "dots3_note": dict(
        num_hidden_layers=4, sliding_window=5, shared_experts_intermediate_size=64,
        swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=40, swa_kv_lora_rank=24,
        swa_head_dim=20, swa_qk_nope_head_dim=12, swa_v_head_dim=16,
    ),
    # RoPE / NoPE / RoPE / NoPE; layers 2 and 3 reuse the latent KV of layers 0 and 1; layer 3 reuses DSA top-k
    "mistral_large4": dict(
        num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], kv_source_layers=[0, 1, 0, 1],
        indexer_types=["full", "full", "full", "shared"],
    ),
    # llama-4 query scaling grows every 8 positions instead of every 8192
    "mistral4": dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5,
    }),
}

# MLA modules that are expected to fall back, with the reason the report must give: none today
KNOWN_FALLBACKS: dict[str, dict[str, str]] = {}


def _expected_unreported(arch: str, model) -> set[str]:
    """MLA modules that are not fusion candidates at all (so no report row): KV-sharing consumer layers own no
    KV down-projection or KV norm; they run unfused (expanded K/V through vllm_mla's padded path)."""
    if arch != "mistral_large4":
        return set()
    return {n for n, m in model.named_modules() if getattr(m, "is_kv_shared_layer", False)}


def _pair(arch: str, **overrides):
    """(native, fused) copies with identical weights; the fused one has been through ``mla_fuser.fuse``."""
    kwargs = {**OVERRIDES.get(arch, {}), **overrides}
    native = tiny_configs.build(arch, **kwargs)
    with torch.no_grad():
        for name, p in native.named_parameters():
            if name.endswith("sinks"):  # attention sinks are initialised to a constant: make them per-head
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    fused = tiny_configs.build(arch, **kwargs)
    fused.load_state_dict(native.state_dict())
    report = mla_fuser.fuse(fused)
    return native, fused, report


def _ids(batch=1, seq=PROMPT_LEN, seed=1):
    vocab = tiny_configs.COMMON["vocab_size"]
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-12)).item()


def _is_causal_lm(model) -> bool:
    return hasattr(model, "generate") and model.get_output_embeddings() is not None


def _out(model, ids, **kw):
    with torch.no_grad():
        o = model(input_ids=ids, **kw)
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


def _decode_base(model, ids, steps=NEW_TOKENS):
    """Greedy decode of a base model with a DynamicCache, through a fixed random read-out (a stand-in LM head)."""
    from transformers import DynamicCache

    emb = model.get_input_embeddings().weight
    readout = torch.randn(emb.shape[1], emb.shape[0], generator=torch.Generator().manual_seed(7))
    cache = DynamicCache(config=model.config)
    tokens, states = ids, []
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(steps):
            h = out.last_hidden_state[:, -1]
            states.append(h)
            nxt = (h @ readout)[:, 3:].argmax(-1, keepdim=True) + 3  # skip pad/bos/eos ids
            tokens = torch.cat([tokens, nxt], dim=-1)
            out = model(input_ids=nxt, cache=cache, use_cache=True)
    return tokens, torch.stack(states)


def _cache_kw(model) -> str:
    from mla_fuser.compat import cache_keyword

    return cache_keyword(model)


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kw)


# Architectures whose forward caches the expanded K/V instead of the latent before this Transformers release: the
# rewrite declines them (a fallback row saying why), and they run padded attention, still exact
LATENT_CACHED_FROM = {arch: (5, 18) for arch in ("deepseek_v32", "glm_moe_dsa", "glm5_next", "axk2", "hy_v4")}


def _expected_fallbacks(arch, fused) -> dict:
    from mla_fuser import compat

    known = dict(KNOWN_FALLBACKS.get(arch, {}))
    if compat.transformers_version() < LATENT_CACHED_FROM.get(arch, (0, 0)):
        known.update({n: "caches the expanded key/value states" for n, m in fused.named_modules()
                      if n and callable(getattr(type(m), "expand_kv", None))})
    return known


def _check_report(arch, fused, report):
    rows = {r.qualname: r for r in report.rows if r.fuser == "mla"}
    mla_modules = {n for n, m in fused.named_modules() if n and callable(getattr(type(m), "expand_kv", None))}
    unreported = _expected_unreported(arch, fused)
    assert mla_modules, "the recipe builds no MLA module"
    assert set(rows) == mla_modules - unreported, str(report)
    known = _expected_fallbacks(arch, fused)
    for name, row in rows.items():
        if name in known:
            assert row.status == "fallback" and known[name] in row.reason, str(report)
            assert plan_of(fused.get_submodule(name), "mla") is None
        else:
            assert row.status == "fused", f"{name}: {row.reason}\n{report}"
            assert plan_of(fused.get_submodule(name), "mla") is not None
    for name in unreported:
        assert plan_of(fused.get_submodule(name), "mla") is None
    # tracing leaves nothing behind (fx stores tensors made inside a forward as ``_tensor_constant<i>``)
    assert not [n for n, m in fused.named_modules() if any(k.startswith("_tensor_constant") for k in vars(m))]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_fused_matches_native(arch):
    native, fused, report = _pair(arch)
    _check_report(arch, fused, report)
    assert fused.config._attn_implementation == "vllm_mla"

    ids = _ids()
    ref, got = _out(native, ids), _out(fused, ids)
    assert _rel(ref, got) <= TOL, f"{arch}: relative error {_rel(ref, got):.2e}"

    if _is_causal_lm(native):
        from transformers import DynamicCache

        # default cache of a fused model (mla_fuser's paged latent cache when installed), then an explicit
        # DynamicCache (absorbed attention over the contiguous latent)
        a, b = _generate(native, ids), _generate(fused, ids)
        assert a.shape[1] == PROMPT_LEN + NEW_TOKENS
        assert torch.equal(a, b), f"{arch}: greedy generations differ\n{a}\n{b}"
        c = _generate(fused, ids, **{_cache_kw(fused): DynamicCache(config=fused.config)})
        assert torch.equal(a, c), f"{arch}: greedy generation with a DynamicCache differs\n{a}\n{c}"
    else:
        (ta, ha), (tb, hb) = _decode_base(native, ids), _decode_base(fused, ids)
        assert torch.equal(ta, tb), f"{arch}: decoded tokens differ\n{ta}\n{tb}"
        assert _rel(ha, hb) <= TOL, f"{arch}: decode hidden states differ by {_rel(ha, hb):.2e}"


@pytest.mark.parametrize("arch", [a for a in ARCHS if not tiny_configs.classes(a)[1].__name__.endswith("ForCausalLM")])
def test_base_model_decode_is_not_degenerate(arch):
    """The base-model decode really attends over a growing cache: the per-step states keep changing."""
    native = tiny_configs.build(arch, **OVERRIDES.get(arch, {}))
    tokens, states = _decode_base(native, _ids(), steps=6)
    assert tokens.shape[1] == PROMPT_LEN + 6
    assert all(_rel(states[i], states[i + 1]) > 1e-3 for i in range(len(states) - 1))


# ------------------------------------------------------------------ padded batches and static caches


def _left_padded_batch():
    """3 prompts of lengths 9, 5 and 2, left-padded with pad id 0, and their attention mask."""
    lengths = [PROMPT_LEN, 5, 2]
    ids = torch.zeros(3, PROMPT_LEN, dtype=torch.long)
    mask = torch.zeros(3, PROMPT_LEN, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, PROMPT_LEN - n:] = _ids(1, n, seed=10 + i)[0]
        mask[i, PROMPT_LEN - n:] = 1
    return ids, mask


VARIANTS = [
    pytest.param("deepseek_v2", {}, id="deepseek_v2-q_lora"),
    pytest.param("deepseek_v2", {"q_lora_rank": None}, id="deepseek_v2-no_q_lora"),
    pytest.param("deepseek_v3", {}, id="deepseek_v3"),
]


@pytest.mark.parametrize("arch,overrides", VARIANTS)
def test_left_padded_batch_and_static_cache(arch, overrides):
    native, fused, report = _pair(arch, **overrides)
    _check_report(arch, fused, report)
    if overrides.get("q_lora_rank", 1) is None:
        assert all(
            plan_of(fused.get_submodule(r.qualname), "mla").match.q_lora_rank is None for r in report.fused("mla")
        )

    ids, mask = _left_padded_batch()
    ref, got = _out(native, ids, attention_mask=mask), _out(fused, ids, attention_mask=mask)
    real = mask.bool()
    assert _rel(ref[real], got[real]) <= TOL  # padded positions are don't-care
    a = _generate(native, ids, attention_mask=mask, pad_token_id=0)
    b = _generate(fused, ids, attention_mask=mask, pad_token_id=0)
    assert torch.equal(a, b), f"left-padded batch differs\n{a}\n{b}"
    # each row equals its own unpadded generation: the padding really is masked
    for i, n in enumerate([PROMPT_LEN, 5, 2]):
        alone = _generate(fused, ids[i:i + 1, PROMPT_LEN - n:])
        assert torch.equal(alone[0, n:], b[i, PROMPT_LEN:]), f"row {i} depends on its padding"

    one = _ids()
    a = _generate(native, one, cache_implementation="static")
    b = _generate(fused, one, cache_implementation="static")
    assert torch.equal(a, b), f"static cache generation differs\n{a}\n{b}"
    assert torch.equal(b, _generate(fused, one)), "static and dynamic caches disagree"
    a = _generate(native, ids, attention_mask=mask, pad_token_id=0, cache_implementation="static")
    b = _generate(fused, ids, attention_mask=mask, pad_token_id=0, cache_implementation="static")
    assert torch.equal(a, b), f"left-padded static-cache generation differs\n{a}\n{b}"


CAUSAL_LMS = [a for a in ARCHS if tiny_configs.classes(a)[1].__name__.endswith("ForCausalLM")]


@pytest.mark.parametrize("arch", [a for a in CAUSAL_LMS if a not in ("deepseek_v2", "deepseek_v3")])
def test_left_padded_batch_and_static_cache_match_native(arch):
    """Every other causal LM: a left-padded batch and a static cache generate exactly as the native model.

    (Row-by-row independence from the padding is not asserted here: DSA indexers select top-k over the padded
    positions natively too, so a padded row may legitimately differ from its unpadded run.)"""
    native, fused, _ = _pair(arch)
    ids, mask = _left_padded_batch()
    a = _generate(native, ids, attention_mask=mask, pad_token_id=0)
    b = _generate(fused, ids, attention_mask=mask, pad_token_id=0)
    assert torch.equal(a, b), f"{arch}: left-padded batch differs\n{a}\n{b}"
    a = _generate(native, ids, attention_mask=mask, pad_token_id=0, cache_implementation="static")
    b = _generate(fused, ids, attention_mask=mask, pad_token_id=0, cache_implementation="static")
    assert torch.equal(a, b), f"{arch}: left-padded static-cache generation differs\n{a}\n{b}"


@pytest.mark.parametrize("arch", ARCHS)
def test_fallback_path_is_correct_on_every_architecture(arch, monkeypatch):
    """``VLLM_MLA_DISABLE=1``: every MLA module is a fallback row and the model still computes exactly the native
    result through ``vllm_mla``'s padded full attention (the path any unfusable module takes)."""
    import warnings

    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native, fused, report = _pair(arch)
    assert fused.config._attn_implementation == "vllm_mla"
    rows = [r for r in report.rows if r.fuser == "mla"]
    assert rows and all(r.status == "fallback" and r.reason == "VLLM_MLA_DISABLE=1" for r in rows), str(report)
    assert not any(plan_of(m, "mla") is not None for m in fused.modules())
    ids = _ids()
    ref, got = _out(native, ids), _out(fused, ids)
    assert _rel(ref, got) <= TOL, f"{arch}: relative error {_rel(ref, got):.2e}"
    if _is_causal_lm(native):
        ids, mask = _left_padded_batch()
        a = _generate(native, ids, attention_mask=mask, pad_token_id=0)
        b = _generate(fused, ids, attention_mask=mask, pad_token_id=0)
        assert torch.equal(a, b), f"{arch}: padded fallback generation differs\n{a}\n{b}"
    else:
        (ta, ha), (tb, hb) = _decode_base(native, ids), _decode_base(fused, ids)
        assert torch.equal(ta, tb) and _rel(ha, hb) <= TOL
