"""torch.compile of a fused q-LoRA model after its weights changed (dtype move, assigning load) with no eager call
in between: the compiled forward must use the weights the model holds now, as the native model does."""

import pytest
import torch
import torch._dynamo

import mla_fuser

from conftest import tiny_deepseek

BACKENDS = ["eager", "aot_eager"]
DENSE = dict(first_k_dense_replace=2)  # no MoE layer: Transformers' grouped-mm experts have no float64 kernel


def _ids(batch=2, seq=6, seed=1):
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _close(a, b, tol=1e-4):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item() <= tol


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_logits(step, ids):
    with torch.no_grad():
        return step(input_ids=ids).logits


def _native_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_after_dtype_move(backend):
    native = tiny_deepseek(**DENSE)
    fused = tiny_deepseek(attn="vllm_mla", **DENSE)
    mla_fuser.fuse(fused)
    ids = _ids()
    step = torch.compile(fused, backend=backend)
    assert _close(_native_logits(native, ids), _compiled_logits(step, ids))
    for model in (native, fused):
        model.to(torch.float64)
    got = _compiled_logits(step, ids)  # recompiled for float64 weights, no eager call in between
    assert got.dtype == torch.float64
    assert _close(_native_logits(native, ids), got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_after_assigning_load(backend):
    fused = tiny_deepseek(attn="vllm_mla", seed=1)
    mla_fuser.fuse(fused)
    ids = _ids()
    step = torch.compile(fused, backend=backend)
    _compiled_logits(step, ids)
    other = tiny_deepseek(seed=2)
    fused.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    assert _close(_native_logits(other, ids), _compiled_logits(step, ids))
    # and eager calls after that re-stack the new weights
    assert _close(_native_logits(other, ids), _native_logits(fused, ids))


def test_compiled_first_call_after_dtype_move():
    """Compiled for the first time after the move: nothing eager ever ran on the new weights."""
    native = tiny_deepseek()
    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    for model in (native, fused):
        model.to(torch.bfloat16).to(torch.float32)  # new storage for every parameter, same values on both
    ids = _ids()
    assert _close(_native_logits(native, ids), _compiled_logits(torch.compile(fused, backend="eager"), ids))
