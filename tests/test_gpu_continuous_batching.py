"""Continuous batching of a fused model on a GPU, steps captured in the engine's CUDA graphs (skipped without CUDA).

In float32 (Triton's dots in IEEE precision) every request's tokens equal a one-request native ``generate`` of the
same prompt; the steps take the device path (no host read) and the engine replays captured graphs.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import mla_fuser  # noqa: E402
from mla_fuser import compat  # noqa: E402
from mla_fuser.runtime.continuous_batching import MIN_VERSION  # noqa: E402

from conftest import tiny_deepseek  # noqa: E402

if compat.transformers_version() < MIN_VERSION:
    pytest.skip(f"continuous batching of fused MLA needs transformers>={MIN_VERSION}", allow_module_level=True)


def _pair(arch):
    native = tiny_deepseek(arch, layers=3).cuda()
    fused = tiny_deepseek(arch, attn="vllm_mla", layers=3).cuda()
    mla_fuser.fuse(fused)
    return native, fused


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_captured_steps_equal_native_per_request(monkeypatch, arch):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from mla_fuser.attention_interfaces import ragged

    native, fused = _pair(arch)
    steps, replays = [], []
    real = ragged.ragged_mla_attention_on_device
    monkeypatch.setattr(ragged, "ragged_mla_attention_on_device", lambda *a: steps.append(1) or real(*a))
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 3, 63, 9, 28)]
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32)
    out = fused.generate_batch(prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False)
    for i, prompt in enumerate(prompts):
        result = out[f"req_{i}"]
        assert result.error is None, result.error
        with torch.no_grad():
            want = native.generate(torch.tensor([prompt], device="cuda"), generation_config=config)
        assert result.generated_tokens == want[0, len(prompt):].tolist(), f"request {i} (prompt {len(prompt)})"
    assert steps, "no step took the device path"
    assert replays, "no step was replayed from a CUDA graph"
