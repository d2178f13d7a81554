"""Environment flags (``mla_fuser.envs``: one place, one vocabulary) and the Transformers range per feature
(``mla_fuser.compat``)."""

import os
import re

import pytest

import mla_fuser
from mla_fuser import compat, envs
from mla_fuser.fusion import fuse

from conftest import tiny_deepseek
from tiny_mamba_configs import make_model

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


@pytest.mark.parametrize("word,expected", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                           ("false", False), ("No", False), ("off", False), ("", False)])
def test_switches_share_one_vocabulary(monkeypatch, word, expected):
    monkeypatch.setenv("VLLM_MLA_DISABLE", word)
    assert envs.mla_disabled() is expected
    monkeypatch.setenv("MLA_FUSER_CUDA_GRAPHS", word)
    assert envs.cuda_graphs_enabled() is (expected if word else True)  # unset: graphs on


@pytest.mark.parametrize("name,value", [("VLLM_MLA_DISABLE", "maybe"), ("MLA_FUSER_CUDA_GRAPHS", "2"),
                                        ("MLA_FUSER_BACKEND", "cuda"), ("MLA_FUSER_MOE_GEMV_TOKENS", "-3"),
                                        ("MLA_FUSER_MOE_CONFIGS", "/nonexistent/tiles.json")])
def test_a_value_outside_the_vocabulary_is_an_error_naming_the_allowed_ones(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.SettingError, match=re.escape(f"{name}={value!r} is not valid: expected")):
        envs.get(name)
    # and it fails when the model is fused, not at some later forward
    with pytest.raises(envs.SettingError, match=name):
        fuse(tiny_deepseek(attn="vllm_mla"))


def test_disabled_report_names_the_value_as_set(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "yes")
    report = fuse(tiny_deepseek(attn="vllm_mla"))
    rows = report.fallbacks("mla")
    assert rows and all(r.reason == "VLLM_MLA_DISABLE=yes" for r in rows)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "off")
    assert fuse(tiny_deepseek(attn="vllm_mla")).fused("mla")


def test_readme_lists_every_variable():
    text = open(README).read()
    table = text[text.index("### Environment flags"):]
    table = table[: table.index("\n## ")]
    listed = set(re.findall(r"^\| `([A-Z0-9_]+)", table, flags=re.M))
    assert listed == set(envs.VARIABLES)
    # each switch's default column says what envs.py defaults to
    defaults = dict(re.findall(r"^\| `([A-Z0-9_]+)`.*\| (\S+) \|$", table, flags=re.M))
    for name, var in envs.VARIABLES.items():
        if var.kind == "switch":
            assert defaults[name] == ("on" if var.default else "off"), name


def test_mamba_needs_a_newer_transformers_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(compat, "missing_mamba_cache_methods", lambda: ["get_conv_state"])
    report = mla_fuser.fuse(make_model("mamba2"))
    assert not report.fused("mamba") and report.fallbacks("mamba")
    assert all("transformers>=5.21" in r.reason for r in report.fallbacks("mamba"))
    assert any("older than Mamba fusion needs (>=5.21" in n for n in report.notes), report.notes
    # models without Mamba mixers get no such note
    assert not any("Mamba" in n for n in fuse(tiny_deepseek(attn="vllm_mla")).notes)


def test_installed_transformers_fuses_mamba_exactly_when_its_cache_has_the_methods():
    report = mla_fuser.fuse(make_model("mamba2"))
    new_enough = compat.transformers_version() >= compat.FEATURE_MIN_VERSION["mamba"]
    assert bool(report.fused("mamba")) is new_enough is (not compat.missing_mamba_cache_methods())
