"""A pre-quantised block-FP8 checkpoint loaded on a machine without a GPU (``fusers.fp8_checkpoint``): kept as float8
weights and scales, with the logits and ``state_dict`` of the model that wrote it, where Transformers alone would
dequantise it; checkpoints our kernels do not take, config overrides and other attention implementations are left
to Transformers (with a note), and an FP8 module our kernels decline is refused loudly, not left to fail later."""

import json

import pytest
import torch

import mla_fuser
from mla_fuser.fusers import fp8_checkpoint

from conftest import tiny_deepseek

transformers = pytest.importorskip("transformers")
from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import FP8Linear  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
IDS = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))


def _fp8_checkpoint(tmp_path, experts=True):
    """``(directory, the FP8 model that wrote it, its logits)``: FP8 on demand (linears and, with ``experts``, the
    expert stacks) of a tiny DeepSeek-V3, saved."""
    plain_dir, fp8_dir = tmp_path / "plain", tmp_path / "fp8"
    tiny_deepseek("deepseek_v3", attn="eager", q_lora_rank=32).save_pretrained(plain_dir)
    config = FineGrainedFP8Config(weight_block_size=[16, 16], modules_to_not_convert=None if experts else
                                  ["lm_head", "experts"])
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(plain_dir, quantization_config=config,
                                                           dtype=torch.float32)
    with torch.no_grad():
        logits = model(IDS).logits
    model.save_pretrained(fp8_dir)
    return fp8_dir, model, logits


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_an_fp8_checkpoint_stays_fp8_with_the_writers_logits(tmp_path):
    path, writer, logits = _fp8_checkpoint(tmp_path)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    q_a = model.model.layers[0].self_attn.q_a_proj
    assert isinstance(q_a, FP8Linear) and q_a.weight.dtype == torch.float8_e4m3fn
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    report = model.fusion_report
    assert any("kept in FP8" in n for n in report.notes), report.notes
    assert report.fused("fp8") and not report.fallbacks("fp8") and len(report.fused("mla")) == 2
    mine, theirs = model.state_dict(), writer.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(_bits(mine[k]), _bits(theirs[k])) for k in mine)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)
    # the checkpoint's own quantization config, written back as it was
    assert model.config.quantization_config.quant_method == "fp8"
    model.save_pretrained(tmp_path / "again")
    written = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert written == json.loads((path / "config.json").read_text())["quantization_config"]
    # what Transformers alone does with it here: dequantises (plain linears, other logits)
    native = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not isinstance(native.model.layers[0].self_attn.q_a_proj, FP8Linear)


def _edit_quantization_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,reason", [
    (dict(scale_fmt="ue8m0"), "scale format 'ue8m0'"),
    (dict(activation_scheme="static"), "activation scheme 'static'"),
    (dict(weight_block_size=None), "weight_block_size None"),
])
def test_checkpoints_our_kernels_do_not_take_are_left_to_transformers(tmp_path, changes, reason):
    path, _, _ = _fp8_checkpoint(tmp_path, experts=False)
    _edit_quantization_config(path, **changes)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert any("dequantised by Transformers" in n and reason in n for n in model.fusion_report.notes), \
        model.fusion_report.notes


def test_config_overrides_and_other_attention_leave_it_to_transformers(tmp_path):
    path, _, _ = _fp8_checkpoint(tmp_path, experts=False)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, max_position_embeddings=512)
    assert model.config.max_position_embeddings == 512
    assert not isinstance(model.model.layers[0].self_attn.q_a_proj, FP8Linear)
    assert any("config overrides given (max_position_embeddings)" in n for n in model.fusion_report.notes)
    eager = mla_fuser.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert not isinstance(eager.model.layers[0].self_attn.q_a_proj, FP8Linear)


def test_an_fp8_module_our_kernels_decline_is_refused(tmp_path):
    """A float8 module the FP8 fuser declines (here: scales of the wrong shape) would run Transformers' forward, which
    needs a Hub kernel: the loader's check names it instead of leaving it to fail at the first call."""
    from mla_fuser.fusers.fp8 import fuse_fp8_linears
    from mla_fuser.kernels.fp8.format import PLAN_ATTR

    path, _, _ = _fp8_checkpoint(tmp_path, experts=False)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert fp8_checkpoint.fp8_modules_not_taken(model, model.fusion_report) == []
    broken = model.model.layers[0].self_attn.q_b_proj
    broken.__dict__.pop(PLAN_ATTR, None)
    broken.weight_scale_inv = torch.nn.Parameter(broken.weight_scale_inv[:1].clone(), requires_grad=False)
    rows = [r for r in fuse_fp8_linears(model) if r.qualname == "model.layers.0.self_attn.q_b_proj"]
    assert rows and rows[0].status == "fallback"
    model.fusion_report.rows[:] = [r for r in model.fusion_report.rows if r.qualname != rows[0].qualname] + rows
    untaken = fp8_checkpoint.fp8_modules_not_taken(model, model.fusion_report)
    assert len(untaken) == 1 and untaken[0].startswith("model.layers.0.self_attn.q_b_proj (")
    with pytest.raises(ValueError, match="FineGrainedFP8Config\\(dequantize=True\\)"):
        fp8_checkpoint.refuse_untaken(model, model.fusion_report)
