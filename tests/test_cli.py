"""The CLI on the embedded default preset."""

import json

from mla_fuser.cli import main


def test_generate_check(capsys):
    assert main(["generate", "--check", "--max-new-tokens", "6", "--prompt-len", "5"]) == 0
    out = capsys.readouterr().out
    assert "fused" in out and "tokens/s" in out and "EQUALS" in out


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
