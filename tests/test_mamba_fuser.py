"""MambaFuser: every Mamba-family architecture in transformers, fused vs native; roles by structure; negatives."""

from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch
import transformers
from torch import nn

import mla_fuser
from mla_fuser.fusers.mamba import forward as mamba_forward
from mla_fuser.fusers.base import Fuser
from conftest import needs_mamba_fusion
from mla_fuser.fusers.mamba import MambaFuser
from mla_fuser.kernels import causal_conv1d as conv_kernels
from mla_fuser.kernels import selective_scan as scan_kernels
from mla_fuser.kernels import ssd as ssd_kernels

from tiny_mamba_configs import ARCHS, make_model

MAMBA1 = {"mamba", "falcon_mamba", "jamba"}
TRANSFORMERS = tuple(int(p) for p in transformers.__version__.split(".")[:2])
NEW_TOKENS = 16


def _inputs(batch=2, seq=9, pad=3):
    ids = torch.randint(3, 200, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # left padding on the first row
    return ids, mask


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()


def _generate(model, ids, mask, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def _mixers(model):
    return [(n, m) for n, m in model.named_modules() if n and MambaFuser.is_candidate(m)]


def _counting_kernels(monkeypatch):
    """Count the fused forward's kernel calls (prefill conv/scan vs decode updates)."""
    counts = collections.Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    ops = mamba_forward.KERNELS
    monkeypatch.setattr(mamba_forward, "KERNELS", mamba_forward._Ops(
        **{f.name: counted(f.name, getattr(ops, f.name)) for f in dataclasses.fields(ops)}))
    return counts


# ---------------------------------------------------------------- every architecture, fused vs native


@needs_mamba_fusion
@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_fused_matches_native(arch):
    native, fused = make_model(arch), make_model(arch)
    report = mla_fuser.fuse(fused)

    rows = report.fused("mamba")
    mixers = _mixers(fused)
    assert mixers and sorted(r.qualname for r in rows) == sorted(n for n, _ in mixers), str(report)
    assert not report.fallbacks("mamba"), str(report)
    kind = "Mamba-1" if arch in MAMBA1 else "Mamba-2"
    assert all(r.reason.startswith(kind) for r in rows), str(report)
    if arch == "falcon_mamba" or arch == "jamba":
        assert all("dt/B/C RMSNorms" in r.reason for r in rows)
    if arch in ("nemotron_h", "zamba2"):  # their time_step_min clamp (5.25's NemotronH clamps to its time_step_limit)
        limit = "(0.0, inf)" if arch == "nemotron_h" and TRANSFORMERS >= (5, 25) else "(0.001, inf)"
        assert all(f"dt limit {limit}" in r.reason for r in rows), str(report)
    for name, mixer in mixers:  # a forward bound to this instance; the class and the native model untouched
        assert "forward" in mixer.__dict__ and "forward" not in native.get_submodule(name).__dict__

    ids, mask = _inputs()
    with torch.no_grad():
        # unpadded: every position; left-padded: the real positions (at padded positions the hybrids' attention
        # rows are fully masked, where vllm_mla and sdpa legitimately disagree; the mixers zero them either way)
        assert _rel(native(input_ids=ids).logits, fused(input_ids=ids).logits) <= 1e-4
        want, got = native(input_ids=ids, attention_mask=mask).logits, fused(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        assert _rel(want[real], got[real]) <= 1e-4

    expected = _generate(native, ids, mask)
    assert expected.shape[1] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(_generate(fused, ids, mask), expected)


@needs_mamba_fusion
def test_decode_is_one_update_per_token_per_layer(monkeypatch):
    """Prefill runs the conv + scan once per mixer; each further token one conv update + one state update."""
    for arch, scan, update in (("mamba", "scan", "scan_update"), ("mamba2", "ssd", "ssd_update")):
        model = make_model(arch)
        mla_fuser.fuse(model)
        counts = _counting_kernels(monkeypatch)
        ids, mask = _inputs()
        _generate(model, ids, mask, new_tokens=6)
        layers = len(_mixers(model))
        assert counts == {"conv": layers, scan: layers, "conv_update": 5 * layers, update: 5 * layers}, arch


@needs_mamba_fusion
def test_fuse_is_idempotent_and_apply_twice_is_a_no_op():
    model = make_model("mamba2")
    first = mla_fuser.fuse(model)
    assert mla_fuser.fuse(model) is first
    name, mixer = _mixers(model)[0]
    bound = mixer.forward
    row = MambaFuser.apply(mixer, MambaFuser.match(mixer), name)
    assert (row.status, row.reason) == ("fused", "already fused") and mixer.forward == bound
    assert set(model.state_dict()) == set(make_model("mamba2").state_dict())


@needs_mamba_fusion
def test_training_mode_runs_the_original_forward(monkeypatch):
    model = make_model("mamba2")
    mla_fuser.fuse(model)
    counts = _counting_kernels(monkeypatch)
    model.train()
    with torch.no_grad():
        model(input_ids=_inputs()[0])
    assert not counts
    model.eval()
    with torch.no_grad():
        model(input_ids=_inputs()[0])
    assert counts["conv"] == counts["ssd"] == 2


@pytest.mark.parametrize("arch", list(ARCHS))
def test_matches_on_the_meta_device(arch):
    """Structure alone (no weights, model in training mode as built): same roles, the flag left as it was."""
    import importlib

    from tiny_mamba_configs import make_config

    recipe = ARCHS[arch]
    with torch.device("meta"):
        model = getattr(importlib.import_module(f"transformers.models.{recipe['module']}"), recipe["model"])(
            make_config(arch))
    for _, mixer in _mixers(model):
        match, reason = MambaFuser.explain(mixer)
        assert match is not None, reason
        assert match.kind == ("mamba1" if arch in MAMBA1 else "mamba2") and mixer.training


def test_backend_flag_is_respected(monkeypatch):
    """``MLA_FUSER_BACKEND=triton`` on CPU without the interpreter: the kernels refuse, so they were asked."""
    model = make_model("mamba")
    mla_fuser.fuse(model)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"), torch.no_grad():
        model(input_ids=_inputs()[0])
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    with torch.no_grad():
        model(input_ids=_inputs()[0])


@needs_mamba_fusion
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_triton_kernels_under_interpreter(arch, monkeypatch):
    """The fused forward runs the Triton kernels (interpreted on CPU) and still equals native."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    launches = collections.Counter()
    for module, name in ((conv_kernels, "_conv_fwd_launch"), (conv_kernels, "_conv_update_launch"),
                         (scan_kernels, "_scan_launch"), (scan_kernels, "_update_launch"),
                         (ssd_kernels, "_ssd_launch")):
        original = getattr(module, name)

        def launch(*args, _name=name, _original=original, **kwargs):
            launches[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, launch)
    native, fused = make_model(arch, num_hidden_layers=1), make_model(arch, num_hidden_layers=1)
    mla_fuser.fuse(fused)
    ids, mask = _inputs(seq=6, pad=2)
    with torch.no_grad():
        want, got = native(input_ids=ids, attention_mask=mask).logits, fused(input_ids=ids, attention_mask=mask).logits
    assert _rel(want, got) <= 1e-4
    assert torch.equal(_generate(fused, ids, mask, new_tokens=3), _generate(native, ids, mask, new_tokens=3))
    scan = "_scan_launch" if arch == "mamba" else "_ssd_launch"
    assert launches["_conv_fwd_launch"] >= 2 and launches[scan] >= 2
    assert launches["_conv_update_launch"] >= 2 and launches["_update_launch"] >= 2


# ---------------------------------------------------------------- roles by structure, under any names


def _conv_impl(hidden_states, weight, bias=None, activation=None, **kwargs):
    return conv_kernels.causal_conv1d_ref(hidden_states, weight, bias, activation)


@functools.wraps(_conv_impl)
def conv_entry(*args, **kwargs):  # a kernel entry point, as transformers' hub/package/torch resolution makes them
    return _conv_impl(*args, **kwargs)


def _scan_impl(hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
               dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    y, final = ssd_kernels.ssd_chunk_scan_ref(hidden_states, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus,
                                              initial_states, dt_limit)
    return (y, final) if return_final_states else y


@functools.wraps(_scan_impl)
def scan_entry(*args, **kwargs):
    return _scan_impl(*args, **kwargs)


class Zebra(nn.Module):
    """A Mamba-2 mixer under unrelated names, its projection pieces in another order, two groups."""

    def __init__(self, hidden=32, heads=4, head_dim=8, groups=2, state=4, width=3, extra=False):
        super().__init__()
        from transformers.models.mamba2 import modeling_mamba2 as mamba2_modeling

        gated_norm = getattr(mamba2_modeling, "MambaRMSNormGated", None) or mamba2_modeling.Mamba2RMSNormGated  # 5.25
        self.layer_idx, self.extra = 0, extra
        self.shape = (heads, head_dim, groups, state)
        inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * state
        self.sizes = (conv_dim, heads, inner)  # [xBC, dt, z]
        self.alpha = nn.Linear(hidden, sum(self.sizes))
        self.beta = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, padding=width - 1)
        self.gamma = nn.Linear(inner, hidden)
        self.lam = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        self.mu = nn.Parameter(torch.randn(heads))
        self.nu = nn.Parameter(torch.randn(heads) * 0.5)
        self.rho = gated_norm(inner, group_size=inner // groups)

    def forward(self, hidden_states, cache: "Cache | None" = None, attention_mask: torch.Tensor | None = None):
        heads, head_dim, groups, state = self.shape
        b, length, _ = hidden_states.shape
        if attention_mask is not None:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        xbc, dt, z = self.alpha(hidden_states).split(self.sizes, dim=-1)
        xbc = conv_entry(xbc.transpose(1, 2), self.beta.weight.squeeze(1), self.beta.bias, activation="silu")
        xbc = xbc.transpose(1, 2)
        if attention_mask is not None:
            xbc = (xbc * attention_mask[:, :, None]).to(xbc.dtype)
        x, B, C = xbc.split([heads * head_dim, groups * state, groups * state], dim=-1)
        y = scan_entry(x.view(b, length, heads, head_dim), dt, -torch.exp(self.lam.float()),
                       B.view(b, length, groups, state), C.view(b, length, groups, state), 8, D=self.mu,
                       dt_bias=self.nu, dt_softplus=True)
        out = self.gamma(self.rho(y.reshape(b, length, -1), z))
        return out * 1.5 if self.extra else out


def _callable_module(function):
    """``function`` as Hugging Face's ``kernels`` package makes a decorated function (Transformers 5.25): an instance
    of a module class whose forward calls it."""

    class Func(nn.Module):
        def forward(self, *args, **kwargs):
            return function(*args, **kwargs)

    return Func()


conv_module_entry = _callable_module(conv_entry)
scan_module_entry = _callable_module(scan_entry)


def conv_layer_forward(conv, hidden_states, cache, layer_idx, activation=None):
    """What 5.25's ``causal_conv1d_forward`` is: the layer's conv module and cache in, an entry point called (no
    entry point itself: the trace goes through it)."""
    return conv_module_entry(hidden_states, conv.weight.squeeze(1), conv.bias, activation=activation)


def scan_layer_forward(module, x, B, C, dt, cache):
    """What 5.25's ``mamba2_scan_forward`` is: ``A`` and the other parameters read off the layer, the last tokens
    split off for a cache that keeps intermediate states (none here), the pieces joined again."""
    heads, head_dim, groups, state = module.shape
    b, length, _ = x.shape
    keep = module.split_off  # (5.25: tokens whose states a cache keeps; 0 without one)
    x, _ = torch.tensor_split(x, [length - keep], dim=1)
    B, _ = torch.tensor_split(B, [length - keep], dim=1)
    n = length - keep
    y = scan_module_entry(x.view(b, n, heads, head_dim), dt[:, :n], -torch.exp(module.lam.float()),
                          B.view(b, n, groups, state), C[:, :n].view(b, n, groups, state), 8, D=module.mu,
                          dt_bias=module.nu, dt_softplus=True)
    return torch.cat([y.reshape(b, n, -1)], dim=1)


class Okapi(Zebra):
    """Zebra written the way Transformers 5.25 writes its mixers: kernel entry points as callable modules, called
    from functions that take the layer's modules (and the layer itself) as arguments."""

    split_off = 0

    def forward(self, hidden_states, cache: "Cache | None" = None, attention_mask: torch.Tensor | None = None):
        heads, head_dim, groups, state = self.shape
        if attention_mask is not None:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        xbc, dt, z = self.alpha(hidden_states).split(self.sizes, dim=-1)
        xbc = conv_layer_forward(self.beta, xbc.transpose(1, 2), cache, self.layer_idx, activation="silu")
        xbc = xbc.transpose(1, 2)
        if attention_mask is not None:
            xbc = (xbc * attention_mask[:, :, None]).to(xbc.dtype)
        x, B, C = xbc.split([heads * head_dim, groups * state, groups * state], dim=-1)
        return self.gamma(self.rho(scan_layer_forward(self, x, B, C, dt, cache), z))


@needs_mamba_fusion
@pytest.mark.parametrize("mixer_class", [Zebra, Okapi])
def test_roles_by_structure_under_any_names(mixer_class):
    Fuser.cache_clear()
    zebra = mixer_class()
    m = MambaFuser.match(zebra)
    assert m is not None and m.kind == "mamba2"
    assert (m.in_proj, m.conv1d, m.out_proj, m.norm, m.a_log, m.d, m.dt_bias) == (
        "alpha", "beta", "gamma", "rho", "lam", "mu", "nu")
    assert (m.in_split, m.x_piece, m.dt_piece, m.z_piece) == ((48, 4, 32), 0, 1, 2)
    assert (m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_width) == (4, 8, 2, 4, 3)
    assert m.mask_arg == "attention_mask" and m.mask_input and m.mask_conv

    x = torch.randn(2, 7, 32)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        want = zebra(x, attention_mask=mask)
        row = MambaFuser.apply(zebra, m, "zebra")
        got = zebra(x, attention_mask=mask)
    assert row.status == "fused" and "forward" in zebra.__dict__
    assert _rel(want, got) <= 1e-5


# ---------------------------------------------------------------- negatives


class ConvMlp(nn.Module):
    """Linear -> depthwise conv -> linear with a learned scale: passes the pre-filter, is no mixer."""

    def __init__(self, hidden=32, inner=64):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.conv = nn.Conv1d(inner, inner, 4, groups=inner, padding=3)
        self.down = nn.Linear(inner, hidden)
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, hidden_states):
        h = self.conv(self.up(hidden_states).transpose(1, 2))[..., : hidden_states.shape[1]]
        return self.down(nn.functional.silu(h).transpose(1, 2)) * self.scale


def test_conv_mlp_does_not_match():
    mlp = ConvMlp()
    assert MambaFuser.is_candidate(mlp)
    match, reason = MambaFuser.explain(mlp)
    assert match is None and "Cache argument" in reason
    no_scale = ConvMlp()
    del no_scale.scale
    no_scale.register_buffer("scale", torch.ones(32))
    assert not MambaFuser.is_candidate(no_scale) and MambaFuser.match(no_scale) is None


def test_attention_does_not_match():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    attention = LlamaAttention(cfg, layer_idx=0)
    assert not MambaFuser.is_candidate(attention)
    assert MambaFuser.match(attention) is None


@needs_mamba_fusion
def test_unaccounted_operation_declines_with_reason():
    Fuser.cache_clear()
    match, reason = MambaFuser.explain(Zebra(extra=True))
    assert match is None and reason.startswith("unaccounted operation on the way to the output") and "mul" in reason


@needs_mamba_fusion
def test_unaccounted_parameter_declines_with_reason():
    zebra = Zebra()
    zebra.register_parameter("omega", nn.Parameter(torch.zeros(3)))
    match, reason = MambaFuser.explain(zebra)
    assert match is None and reason == "unaccounted parameter(s): ['omega']"


class OkapiDroppingATokenFromTheScan(Okapi):
    split_off = 1  # the scan's first piece is not all of its input: no mixer of ours


@needs_mamba_fusion
def test_scan_over_part_of_the_sequence_declines():
    Fuser.cache_clear()
    match, reason = MambaFuser.explain(OkapiDroppingATokenFromTheScan())
    assert match is None and reason
