"""fuse(): per-instance rewrite, weights, state dicts, flags, report, loaders."""

import os
import pathlib
import re
import warnings

import pytest
import torch

import mla_fuser
from mla_fuser.fusers import MLAFuser
from mla_fuser.fusers.base import Fuser
from mla_fuser.plans import plan_of, set_plan
from mla_fuser.rewrite import STACKED_ATTR, RewriteError, rewrite_mla_forward

from conftest import tiny_deepseek
from toy_modules import Wobble, toy_config, toy_rope


def _ids(batch=2, seq=6, vocab=128, seed=1):
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def _close(a, b, tol=1e-4):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item() <= tol


# ---------------------------------------------------------------- rewrite on a toy module, instance only

def test_toy_fused_instance_only_and_equal():
    cfg = toy_config("vllm_mla")
    torch.manual_seed(0)
    a = Wobble(config=cfg)
    b = Wobble(config=cfg)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 32)
    rope = toy_rope(2, 5, 4)
    ref = b(x, rope)  # unfused: expanded K/V through vllm_mla's padded path
    match = MLAFuser.match(a)
    diff = rewrite_mla_forward(a, match)
    set_plan(a, "mla", mla_fuser.fusers.mla.MLAPlan(match))
    assert "self._mla_fuser_down(hidden_states)" in diff and "(lat, rot)" in diff
    assert "forward" in a.__dict__ and "forward" not in b.__dict__
    assert Wobble.forward is type(b).forward
    out = a(x, rope)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    # the stacked weight shares storage with the original down-projections
    stacked = getattr(a, STACKED_ATTR)
    assert a.alpha.weight.data_ptr() == stacked.weight.data_ptr()
    assert a.delta.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()


class TwiceExpanded(Wobble):
    def forward(self, hidden_states, position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask=None,
                **kwargs):
        b, s, _ = hidden_states.shape
        out = super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)
        self.unfold(self.epsilon(self.delta(hidden_states)[..., : self.rank]).view(b, 1, s, -1),
                    hidden_states[..., : self.rope].view(b, 1, s, -1))
        return out


class KeyTouched(Wobble):
    """Uses the expanded key for something else than the attention call: the rewrite must decline."""

    def forward(self, hidden_states, position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask=None,
                **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from toy_modules import eager_attention_forward, rotate

        b, s, _ = hidden_states.shape
        q = self.gamma(self.beta(self.alpha(hidden_states))).view(b, s, self.heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        lat, rot = self.delta(hidden_states).split([self.rank, self.rope], dim=-1)
        lat = self.epsilon(lat).view(b, 1, s, self.rank)
        rot = rot.view(b, 1, s, self.rope)
        cos, sin = position_embeddings
        q_rot, rot = rotate(q_rot, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(rot, cos.unsqueeze(1), sin.unsqueeze(1))
        key, value = self.unfold(lat, rot)
        key = key * 1.0
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attn(self, torch.cat([q_nope, q_rot], -1), key, value, attention_mask, scaling=self.scale)
        return self.omega(out.reshape(b, s, -1))


def test_rewrite_declines_when_in_doubt():
    with pytest.raises(RewriteError, match="key/value states are reassigned|used after the expansion"):
        rewrite_mla_forward(KeyTouched(), MLAFuser.match(KeyTouched()))


class ToyHolder(torch.nn.Module):
    """Wraps toy attention modules so ``fuse`` sees them inside a 'model'."""

    def __init__(self, *mods):
        super().__init__()
        self.config = mods[0].config
        self.layers = torch.nn.ModuleList(mods)

    def set_attn_implementation(self, name):
        self.config._attn_implementation = name


def test_fuse_declined_rewrite_reports_and_stays_correct():
    cfg = toy_config("sdpa")
    torch.manual_seed(0)
    bad = KeyTouched(config=cfg)
    holder = ToyHolder(bad)
    x, rope = torch.randn(1, 4, 32), toy_rope(1, 4, 4)
    ref = bad(x, rope)
    report = mla_fuser.fuse(holder)
    mla_rows = [r for r in report.rows if r.fuser == "mla"]
    assert [r.status for r in mla_rows] == ["fallback"]
    assert "rewrite declined" in mla_rows[0].reason
    assert torch.allclose(bad(x, rope), ref, atol=1e-5)


# ---------------------------------------------------------------- whole models

@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_fused_model_matches_native(q_lora_rank):
    native = tiny_deepseek(q_lora_rank=q_lora_rank)
    fused = tiny_deepseek(q_lora_rank=q_lora_rank, attn="vllm_mla")
    report = mla_fuser.fuse(fused)
    assert len(report.fused("mla")) == 2 and not report.fallbacks("mla")
    ids = _ids()
    assert _close(_logits(native, ids), _logits(fused, ids))


def test_fuse_is_idempotent_and_traces_each_class_shape_once(monkeypatch):
    Fuser.cache_clear()
    calls = []
    original = MLAFuser.trace.__func__

    def counting(cls, module, example_inputs=None, hidden_size=None):
        calls.append(type(module).__name__)
        return original(cls, module, example_inputs, hidden_size)

    monkeypatch.setattr(MLAFuser, "trace", classmethod(counting))
    model = tiny_deepseek(layers=6, attn="vllm_mla")
    report = mla_fuser.fuse(model)
    assert len(report.fused("mla")) == 6
    assert calls == ["DeepseekV2Attention"]
    again = mla_fuser.fuse(model)
    assert again is report and model.fusion_report is report
    assert calls == ["DeepseekV2Attention"]


def test_fuse_switches_an_sdpa_model_to_vllm_mla():
    native = tiny_deepseek()
    fused = tiny_deepseek()
    report = mla_fuser.fuse(fused)
    assert fused.config._attn_implementation == "vllm_mla"
    assert len(report.fused("mla")) == 2
    ids = _ids()
    assert _close(_logits(native, ids), _logits(fused, ids))


def test_state_dict_round_trip(tmp_path):
    fused = tiny_deepseek(attn="vllm_mla", seed=3)
    native_keys = set(tiny_deepseek(seed=3).state_dict())
    mla_fuser.fuse(fused)
    sd = fused.state_dict()
    assert set(sd) == native_keys
    fresh = tiny_deepseek(seed=99)
    fresh.load_state_dict(sd)
    ids = _ids()
    assert torch.allclose(_logits(fresh, ids), _logits(fused, ids), atol=1e-5, rtol=1e-4)
    # save_pretrained writes the original keys; an unfused load gives identical outputs
    fused.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert torch.allclose(_logits(reloaded, ids), _logits(fused, ids), atol=1e-5, rtol=1e-4)
    # and through the drop-in loader
    again = mla_fuser.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert len(again.fusion_report.fused("mla")) == 2
    assert torch.allclose(_logits(again, ids), _logits(fused, ids), atol=1e-5, rtol=1e-4)


# q-LoRA stacks its down-projection with the KV one; without q-LoRA the whole query projection is stacked instead
Q_SIDES = pytest.mark.parametrize("q_lora_rank,q_first", [(24, "q_a_proj"), (None, "q_proj")], ids=["q_lora", "q_proj"])


@Q_SIDES
def test_load_state_dict_into_fused_model_lands_in_stacked_weight(q_lora_rank, q_first):
    fused = tiny_deepseek(attn="vllm_mla", seed=1, q_lora_rank=q_lora_rank)
    report = mla_fuser.fuse(fused)
    assert all("stacked with KV down-projection" in r.reason for r in report.rows if r.fuser == "mla")
    other = tiny_deepseek(seed=2, q_lora_rank=q_lora_rank)
    fused.load_state_dict(other.state_dict())
    ids = _ids()
    assert _close(_logits(other, ids), _logits(fused, ids))
    attn = fused.model.layers[0].self_attn
    stacked = getattr(attn, STACKED_ATTR)
    assert getattr(attn, q_first).weight.data_ptr() == stacked.weight.data_ptr()
    added = [line for line in attn._mla_fuser_source.splitlines() if line.startswith("+ ")]
    assert any("self._mla_fuser_down(hidden_states)" in line for line in added)


@Q_SIDES
def test_dtype_move_restacks(q_lora_rank, q_first):
    fused = tiny_deepseek(attn="vllm_mla", q_lora_rank=q_lora_rank)
    native = tiny_deepseek(q_lora_rank=q_lora_rank)
    mla_fuser.fuse(fused)
    attn = fused.model.layers[1].self_attn
    before = getattr(attn, STACKED_ATTR).weight
    assert before is not None and before.shape[0] == getattr(attn, q_first).out_features + attn.kv_a_proj_with_mqa.out_features
    # a dtype round trip gives every parameter new storage (and rounds both models' weights alike)
    fused.to(torch.bfloat16).to(torch.float32)
    native.to(torch.bfloat16).to(torch.float32)
    ids = _ids()
    assert _close(_logits(native, ids), _logits(fused, ids))
    after = getattr(attn, STACKED_ATTR).weight
    assert after is not before and getattr(attn, q_first).weight.data_ptr() == after.data_ptr()


def test_loader_from_config_passes_keywords_and_reports():
    config = tiny_deepseek().config
    model = mla_fuser.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert model.dtype == torch.float64
    assert len(model.fusion_report.fused("mla")) == 2
    base = mla_fuser.AutoModel.from_config(config)
    assert type(base).__name__ == "DeepseekV2Model"
    assert len(base.fusion_report.fused("mla")) == 2
    plain = mla_fuser.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert not plain.fusion_report.rows and "not fused" in plain.fusion_report.notes[0]


def test_report_table_is_readable():
    model = tiny_deepseek(attn="vllm_mla")
    text = str(mla_fuser.fuse(model))
    assert "model.layers.0.self_attn" in text and "fused" in text and "summary: mla fused: 2" in text
    row = model.fusion_report.rows[0]
    assert (row.qualname, row.cls, row.fuser, row.status) == ("model.layers.0.self_attn", "DeepseekV2Attention",
                                                              "mla", "fused")


# ---------------------------------------------------------------- flags and fallbacks

def test_vllm_mla_disable(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    import mla_fuser.fusion as fuse_mod

    monkeypatch.setattr(fuse_mod, "_warned_disabled", False)
    native = tiny_deepseek()
    model = tiny_deepseek(attn="vllm_mla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mla_fuser.fuse(model)
    assert sum("VLLM_MLA_DISABLE" in str(w.message) for w in caught) == 1
    mla_rows = [r for r in report.rows if r.fuser == "mla"]
    assert mla_rows and all(r.status == "fallback" and r.reason == "VLLM_MLA_DISABLE=1" for r in mla_rows)
    assert any("VLLM_MLA_DISABLE" in n for n in report.notes)
    assert all(plan_of(m, "mla") is None for m in model.modules())
    ids = _ids()
    assert _close(_logits(native, ids), _logits(model, ids))
    gen_a = native.generate(ids, max_new_tokens=8, do_sample=False)
    gen_b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_unsupported_transformers_still_runs(monkeypatch):
    import mla_fuser.fusion as fuse_mod

    monkeypatch.setattr(fuse_mod, "transformers_supported", lambda: (False, "4.40.0"))
    model = tiny_deepseek()
    report = mla_fuser.fuse(model)
    assert not report.rows and "outside the supported range" in report.notes[0]
    assert model.config._attn_implementation == "sdpa"
    _logits(model, _ids())


def test_model_without_mla_runs_padded_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=128)
    torch.manual_seed(0)
    native = LlamaForCausalLM(cfg).eval()
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(native.state_dict())
    native.set_attn_implementation("sdpa")
    report = mla_fuser.fuse(model)
    assert not report.fused("mla")
    assert any("no MLA" in n for n in report.notes)
    ids = _ids()
    assert _close(_logits(native, ids), _logits(model, ids))


def test_library_never_writes_os_environ(monkeypatch):
    writes = []

    class Guard(type(os.environ)):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

        def __delitem__(self, key):
            writes.append(key)
            super().__delitem__(key)

    guarded = Guard(os.environ._data, os.environ.encodekey, os.environ.decodekey, os.environ.encodevalue,
                    os.environ.decodevalue)
    monkeypatch.setattr(os, "environ", guarded)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "0")
    writes.clear()
    model = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(model)
    model.generate(_ids(), max_new_tokens=4, do_sample=False)
    assert writes == []
    # and no code path in the package assigns to the environment
    src = pathlib.Path(mla_fuser.__file__).parent
    pattern = re.compile(r"os\.environ\s*\[[^\]]*\]\s*=|os\.environ\.(update|setdefault|pop)\(|os\.putenv|os\.unsetenv")
    offenders = [p.name for p in src.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
