"""The CLI on the embedded default preset."""

import ast
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

from mla_fuser.cli import main


def test_generate_check(capsys):
    assert main(["generate", "--check", "--max-new-tokens", "6", "--prompt-len", "5"]) == 0
    out = capsys.readouterr().out
    assert "fused" in out and "tokens/s" in out and "EQUALS" in out


@pytest.mark.parametrize("no_warmup", [False, True])
def test_generate_times_after_a_warmup_call_unless_told(capsys, monkeypatch, no_warmup):
    """Each model is timed over 3 calls, the models alternating, after an untimed call of each just like them
    (one-time costs fall on whichever model runs first); ``--no-warmup`` times each model's first call, once.  The
    output says which it timed."""
    from transformers import GenerationMixin

    calls = []
    real = GenerationMixin.generate

    def counted(self, *args, **kwargs):
        calls.append(("fused" if self.config._attn_implementation == "vllm_mla" else "native",
                      kwargs.get("max_new_tokens")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counted)
    args = ["generate", "--check", "--max-new-tokens", "5", "--prompt-len", "4"]
    assert main(args + (["--no-warmup"] if no_warmup else [])) == 0
    out = capsys.readouterr().out
    assert calls == [("fused", 5), ("native", 5)] * (1 if no_warmup else 4)
    said = "first call" if no_warmup else "median of 3 calls after a warm-up call"
    assert f"tokens/s (fused, {said})" in out and f"tokens/s ({said})" in out and "EQUALS" in out


def test_generate_prompt_ids(capsys):
    assert main(["generate", "--prompt-ids", "5", "6", "7", "--max-new-tokens", "3"]) == 0
    assert "prompt ids: [5, 6, 7]" in capsys.readouterr().out


def test_inspect_show_source(capsys):
    assert main(["inspect", "--preset", "deepseek-v2-qlora-tiny", "--show-source"]) == 0
    out = capsys.readouterr().out
    assert "+++ DeepseekV2Attention.forward (mla-fuser)" in out
    assert "self._mla_fuser_down(hidden_states)" in out
    assert out.count("rewritten forward of") == 1


def test_bench_json(tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "--shapes", "1x16,2x8", "--steps", "2", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [(r["batch"], r["context"]) for r in data["runs"]] == [(1, 16), (2, 8)]
    assert all(r["greedy_tokens_equal"] for r in data["runs"])
    assert data["runs"][0]["fused"]["ms_per_step"] > 0


def test_bench_fp8_weights_and_cache(tmp_path):
    """``--fp8-weights --fp8-cache --generate``: the fused model quantised to block FP8 on load (its FP8 linears
    fused), timed over a float8 latent cache beside the same model over its default cache and the unquantised fused
    model; weight bytes shrink (fp32 preset: to about a quarter for the quantised linears)."""
    path = tmp_path / "bench.json"
    args = ["bench", "--shapes", "1x16", "--steps", "2", "--generate", "--fp8-weights", "--fp8-cache",
            "--out", str(path)]
    assert main(args) == 0
    data = json.loads(path.read_text())
    run = data["runs"][0]
    assert data["fp8_weights"] and data["fp8_cache"]
    assert 0 < data["weight_bytes_ratio"] < 0.6
    for key in ("fused", "fused_default_cache", "fused_unquantized", "native"):
        assert run[key]["ms_per_step"] > 0, key
    assert 0.0 <= run["greedy_tokens_agreement_vs_unquantized"] <= 1.0


def test_bench_fp8_cache_needs_generate(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--fp8-cache"])
    assert exc.value.code == 2 and "--fp8-cache" in capsys.readouterr().err


def test_bench_serve_json(tmp_path, capsys):
    """``bench --serve``: the workload through continuous batching (every request finished at its length) beside
    fused and native static batches of subsets, marked as such, with TTFT / TPOT and the ratio to static batches;
    a Transformers without continuous batching for fused models is a usage error naming the release needed."""
    from mla_fuser import compat

    path = tmp_path / "serve.json"
    if compat.transformers_version() < compat.FEATURE_MIN_VERSION["continuous batching"]:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--serve", "--requests", "2"])
        assert exc.value.code == 2 and "transformers>=5.19" in capsys.readouterr().err
        return
    assert main(["bench", "--serve", "--requests", "6", "--prompt-range", "4", "12", "--output-range", "2", "5",
                 "--static-requests", "3", "--native-requests", "2", "--warmup", "2", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    cb = data["fused_cb"]
    assert (cb["requests"], cb["finished"], cb["failed"], cb["wrong_lengths"]) == (6, 6, 0, 0)
    assert cb["output_tokens"] >= 12 and cb["ttft_s"]["p50"] > 0 and cb["tpot_ms"]["p50"] > 0
    assert cb["warmup_requests"] == 2 and cb["warmup_failed"] == 0
    assert data["fused_static"]["requests"] == 3 and data["fused_static"]["subset_of_workload"]
    assert data["native_static"]["requests"] == 2 and data["native_static"]["subset_of_workload"]
    assert data["cb_over_fused_static"] == pytest.approx(cb["output_tok_per_s"]
                                                         / data["fused_static"]["output_tok_per_s"])


@pytest.mark.parametrize("extra,words", [(["--generate"], "--generate"), (["--fp8-weights"], "--fp8-weights"),
                                         (["--prompt-range", "9", "4"], "MIN is above MAX"),
                                         (["--max-memory-percent", "1.5"], "(0, 1]")])
def test_bench_serve_usage_errors(capsys, extra, words):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serve", *extra])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_bench_compiled_decode_static_paged_cache(tmp_path):
    """``--compile-mode``: decode steps under torch.compile over a static paged cache (here the ``eager``
    backend: tracing only, the CPU stand-in for the CUDA-graph path)."""
    import torch._dynamo

    torch._dynamo.reset()  # compiled frames of other tests' models must not be reused here
    path = tmp_path / "bench.json"
    args = ["bench", "--shapes", "1x8", "--steps", "3", "--compile-mode", "default", "--compile-backend", "eager",
            "--out", str(path)]
    try:
        assert main(args) == 0
    finally:
        torch._dynamo.reset()
    data = json.loads(path.read_text())
    assert data["compile_mode"] == "default" and data["runs"][0]["greedy_tokens_equal"]


# ---- usage errors: exit 2, one ``mla-fuser: error:`` line, before any model is built


@pytest.fixture
def no_model_build(monkeypatch):
    """Make building or loading any model fail the test: usage errors must be found before that."""
    import mla_fuser.loader
    import mla_fuser.presets

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the usage error was reported")

    monkeypatch.setattr(mla_fuser.presets, "build_preset", built)
    monkeypatch.setattr(mla_fuser.loader.AutoModelForCausalLM, "from_pretrained", built)


def usage_error(capsys, argv) -> str:
    """Run ``main(argv)`` expecting a usage error; returns its one stderr line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("mla-fuser: error: ") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""
    return captured.err


USAGE_ERRORS = [  # (argv, part of the error line)
    (["generate", "--max-new-tokens", "-1"], "argument --max-new-tokens: expected a positive integer, got '-1'"),
    (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer, got '0'"),
    (["generate", "--prompt-len", "0"], "argument --prompt-len: expected a positive integer"),
    (["generate", "--prompt-len", "-3"], "argument --prompt-len: expected a positive integer"),
    (["generate", "--prompt-ids", "5", "99999"], "99999 outside the vocabulary of deepseek-v2-lite-tiny: expected "
                                                 "ids from 0 to 1023"),
    (["generate", "--prompt-ids", "-1"], "-1 outside the vocabulary"),
    (["inspect", "--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["bench", "--shapes", "banana"], "argument --shapes: 'banana' is not BATCHxCONTEXT"),
    (["bench", "--shapes", "1x64,0x8"], "argument --shapes: '0x8' is not BATCHxCONTEXT"),
    (["bench", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["bench", "--out", "/nonexistent/dir/x.json"], "argument --out: directory /nonexistent/dir does not exist"),
    (["bench", "--plot", "/nonexistent/dir/x.png"], "argument --plot: directory /nonexistent/dir does not exist"),
    (["inspect", "--device", "banana"], "--device 'banana' is not a device"),
    # a full-size preset without --device would build 15.7B fp32 parameters on the CPU
    (["bench", "--preset", "deepseek-v2-lite", "--generate"], "--preset deepseek-v2-lite is the real DeepSeek-V2-Lite "
                                                              "shape, 15.7B parameters: say where to build it"),
    (["generate", "--preset", "deepseek-v2-lite"], "--device cuda --dtype bf16 on a GPU"),
    (["inspect", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv, expected", USAGE_ERRORS, ids=[" ".join(argv) for argv, _ in USAGE_ERRORS])
def test_usage_error(capsys, no_model_build, argv, expected):
    assert expected in usage_error(capsys, argv)


def test_usage_error_model_dir_without_config(capsys, no_model_build, tmp_path):
    assert "no config.json there" in usage_error(capsys, ["inspect", "--model", str(tmp_path)])


def test_usage_error_prompt_ids_outside_checkpoint_vocab(capsys, no_model_build, tmp_path):
    """A checkpoint's vocabulary comes from its config.json alone (no weights there to load)."""
    from mla_fuser.presets import preset_config

    preset_config(vocab_size=100).save_pretrained(tmp_path)
    err = usage_error(capsys, ["generate", "--model", str(tmp_path), "--prompt-ids", "3", "100"])
    assert "100 outside the vocabulary" in err and "from 0 to 99" in err


def test_usage_error_cuda_unavailable(capsys, no_model_build, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("generate", "inspect", "bench"):
        assert "--device cuda: this torch sees no CUDA device" in usage_error(capsys, [command, "--device", "cuda"])


def test_usage_error_plot_without_matplotlib(capsys, no_model_build, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec answers None: not installed
    assert "--plot needs matplotlib" in usage_error(capsys, ["bench", "--plot", str(tmp_path / "x.png")])


@pytest.mark.parametrize("name, value", [("MLA_FUSER_BACKEND", "cuda"), ("VLLM_MLA_DISABLE", "maybe")])
def test_usage_error_bad_environment_variable(capsys, no_model_build, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert f"{name}={value!r} is not valid" in usage_error(capsys, ["inspect"])


def test_setting_error_inside_a_command_is_one_line(capsys, monkeypatch):
    """A SettingError met while the command runs (not only in the up-front check) is reported the same way."""
    import mla_fuser.presets
    from mla_fuser.envs import SettingError

    def build(*args, **kwargs):
        raise SettingError("MLA_FUSER_BACKEND='cuda' is not valid: expected one of triton, torch (or unset)")

    monkeypatch.setattr(mla_fuser.presets, "build_preset", build)
    assert "MLA_FUSER_BACKEND='cuda' is not valid" in usage_error(capsys, ["inspect"])


def test_console_script_usage_error_has_no_traceback():
    script = os.path.join(os.path.dirname(sys.executable), "mla-fuser")
    if not os.path.exists(script):
        pytest.skip("the mla-fuser console script is not installed next to this Python")
    env = dict(os.environ, MLA_FUSER_BACKEND="cuda")
    proc = subprocess.run([script, "inspect"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == ("mla-fuser: error: MLA_FUSER_BACKEND='cuda' is not valid: expected one of triton, torch "
                           "(or unset)\n")


def test_model_dir_loads_through_the_package_loader(capsys, tmp_path):
    """``--model DIR`` goes through ``mla_fuser.AutoModelForCausalLM``: the checkpoint comes back fused."""
    from mla_fuser.presets import build_preset

    build_preset(fuse=False, attn_implementation="sdpa").save_pretrained(tmp_path)
    assert main(["inspect", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"model: {tmp_path}" in out
    assert re.search(r"layers\.0\.self_attn\s+DeepseekV2Attention\s+mla\s+fused", out)


def test_bench_does_not_import_cli():
    """The model loader is shared through ``presets``, so ``bench`` and ``cli`` form no import cycle."""
    import mla_fuser.bench

    tree = ast.parse(inspect.getsource(mla_fuser.bench))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {"cli", "mla_fuser.cli"} & imported
