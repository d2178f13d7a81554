"""MLAFuser.match: roles by structure, under any names; negatives must not match."""

import pytest
import torch
from torch import nn

import mla_fuser  # noqa: F401
from mla_fuser.fusers import MLAFuser
from mla_fuser.fusers.base import Fuser
from mla_fuser.fusers.mla import MLAPlan
from mla_fuser.graph import rmsnorm_width

from toy_modules import (
    CenteredKv, Churn, FilledRipple, GluMlp, Ripple, RotaryNorm, Scaler, Tangle, TinyLM, TwoNorms, Twins, Wobble,
)


def deepseek_v2_attention(q_lora_rank):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                           q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                           num_hidden_layers=1, vocab_size=32)
    cfg._attn_implementation = "sdpa"
    return DeepseekV2Attention(cfg, layer_idx=0)


def test_deepseek_v2_with_q_lora():
    m = MLAFuser.match(deepseek_v2_attention(24))
    assert m is not None
    assert (m.q_proj, m.q_a_proj, m.q_a_layernorm, m.q_b_proj) == (None, "q_a_proj", "q_a_layernorm", "q_b_proj")
    assert (m.kv_a_proj, m.kv_a_layernorm, m.kv_b_proj, m.o_proj) == (
        "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    assert (m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank) == (
        4, 8, 4, 8, 16, 24)


def test_deepseek_v2_without_q_lora():
    m = MLAFuser.match(deepseek_v2_attention(None))
    assert m is not None
    assert (m.q_proj, m.q_a_proj, m.q_a_layernorm, m.q_b_proj) == ("q_proj", None, None, None)
    assert m.q_lora_rank is None and m.kv_b_proj == "kv_b_proj"


def test_same_class_with_and_without_q_lora_match_separately():
    Fuser.cache_clear()
    a, b = MLAFuser.match(Wobble(q_lora=True)), MLAFuser.match(Wobble(q_lora=False))
    assert a.q_a_proj == "alpha" and a.q_proj is None
    assert b.q_proj == "kappa" and b.q_a_proj is None
    assert Fuser.cache_size() == 2


def test_arbitrary_names():
    m = MLAFuser.match(Wobble(hidden=40, heads=3, q_rank=20, rank=12, rope=6, nope=10, v=5))
    assert m is not None
    assert (m.q_a_proj, m.q_a_layernorm, m.q_b_proj) == ("alpha", "beta", "gamma")
    assert (m.kv_a_proj, m.kv_a_layernorm, m.kv_b_proj, m.o_proj) == ("delta", "epsilon", "zeta", "omega")
    assert (m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank) == (3, 10, 6, 5, 12)


def test_rmsnorm_by_computation():
    assert rmsnorm_width(Scaler(7)) == 7
    assert rmsnorm_width(nn.RMSNorm(5)) == 5
    assert rmsnorm_width(nn.LayerNorm(5)) is None
    assert rmsnorm_width(nn.Linear(3, 3)) is None
    from toy_modules import Centerer

    assert rmsnorm_width(Centerer(6)) is None


def _llama_attention():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    return LlamaAttention(cfg, layer_idx=0)


def _qwen2_attention():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    return Qwen2Attention(cfg, layer_idx=0)


def _qwen3_attention():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, head_dim=16)
    cfg._attn_implementation = "sdpa"
    return Qwen3Attention(cfg, layer_idx=0)


def _llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))


@pytest.mark.parametrize("factory", [
    _llama_attention, _qwen2_attention, _qwen3_attention, _llama_mlp, GluMlp, TwoNorms, CenteredKv,
    lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
    Tangle, lambda: Tangle(attend="sdpa"), lambda: Tangle(qk_norm=True), lambda: Tangle(attend="sdpa", qk_norm=True),
    Twins, lambda: Twins(attend="sdpa"), RotaryNorm, lambda: RotaryNorm(attend="sdpa"), Churn,
], ids=["llama_attn", "qwen2_attn", "qwen3_attn", "llama_mlp", "glu_mlp", "two_equal_norms", "layernorm_kv",
        "plain_mlp", "gqa_inline", "gqa_sdpa", "gqa_qk_norm_inline", "gqa_qk_norm_sdpa", "twin_chains_inline",
        "twin_chains_sdpa", "rotary_norm_inline", "rotary_norm_sdpa", "mamba_like"])
def test_negatives(factory):
    Fuser.cache_clear()  # toys of one class and shapes differ in how they attend: no cached answer between them
    module = factory()
    match, reason = MLAFuser.explain(module)
    assert match is None
    assert reason


def test_explain_says_why_two_equal_norms():
    _, reason = MLAFuser.explain(TwoNorms())
    assert "KV chain" in reason


def test_matching_does_not_change_the_module():
    m = Wobble()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cfg_impl = m.config._attn_implementation
    MLAFuser.match(m)
    assert m.config._attn_implementation == cfg_impl
    assert "forward" not in m.__dict__
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])


# ---------------------------------------------------------------- attention computed inline (no interface call)


@pytest.mark.parametrize("rope", [4, 0], ids=["rope", "nope"])
@pytest.mark.parametrize("attend", ["matmul", "sdpa"])
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_inline_attention_roles_by_data_flow(q_lora, attend, rope):
    """Without an attention-interface call, query and key/value are told apart by data flow into the score
    matmul / SDPA's operands; head sizes come from their shapes."""
    Fuser.cache_clear()
    m = MLAFuser.match(Ripple(q_lora=q_lora, attend=attend, rope=rope))
    assert m is not None and not m.rewritable
    assert m.attention == ("matmul/softmax" if attend == "matmul" else "scaled_dot_product_attention")
    if q_lora:
        assert (m.q_proj, m.q_a_proj, m.q_a_layernorm, m.q_b_proj, m.q_lora_rank) == (None, "iota", "theta", "sigma", 24)
    else:
        assert (m.q_proj, m.q_a_proj, m.q_a_layernorm, m.q_b_proj, m.q_lora_rank) == ("psi", None, None, None, None)
    assert (m.kv_a_proj, m.kv_a_layernorm, m.kv_b_proj, m.o_proj) == ("rho", "tau", "phi", "chi")
    assert (m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank) == (2, 8, rope, 6, 16)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_query_and_key_filled_by_item_writes(q_lora):
    """Remote DeepSeek code writes q/k parts into ``new_empty`` buffers: the writes carry the data flow."""
    m = MLAFuser.match(FilledRipple(q_lora=q_lora))
    assert m is not None and (m.kv_b_proj, m.q_b_proj if q_lora else m.q_proj) == ("phi", "sigma" if q_lora else "psi")
    assert (m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (2, 8, 4, 6)


def test_only_interface_matches_are_rewritable():
    Fuser.cache_clear()
    assert MLAFuser.match(Wobble()).rewritable
    with pytest.raises(AssertionError):
        MLAPlan(MLAFuser.match(Ripple()))


def test_fuse_reports_inline_attention_and_leaves_it_untouched():
    model = TinyLM().eval()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
    report = mla_fuser.fuse(model)
    rows = [r for r in report.rows if r.fuser == "mla"]
    assert [(r.qualname, r.status) for r in rows] == [("layers.0", "fallback"), ("layers.1", "fallback")]
    assert all("computed inline (matmul/softmax)" in r.reason and "nothing to rewrite" in r.reason for r in rows)
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


def test_nested_value_walks_keep_their_semantics():
    """The tracer's walks over nested arguments (pytree with explicit leaves): namedtuples pass whole through the
    rebuilding walks, slices are mapped, ``torch.Size`` stays one, a dict argument is never a tensor argument."""
    from collections import namedtuple

    import torch.fx as fx

    from mla_fuser.graph import values

    node = fx.Graph().placeholder("x")
    node.meta["val"] = torch.empty(2, device="meta")
    pair = namedtuple("Pair", "a b")(node, 1)
    mapped = values.meta_of([node, pair, slice(None, node), {"k": (node,)}, torch.Size([3])])
    assert mapped[0].device.type == "meta" and mapped[1] is pair and mapped[2].stop is mapped[0]
    assert mapped[3]["k"][0] is mapped[0] and type(mapped[4]) is torch.Size
    assert values.contains_unknown([values.meta_of(fx.Graph().placeholder("y"))])
    assert values.has_tensor((torch.ones(1),)) and not values.has_tensor({"k": torch.ones(1)})
    assert values.meta_representable([torch.ones(1), None, 2]) and not values.meta_representable({"k": 1})
    assert type(values.to_meta(torch.Size([3]))) is torch.Size
