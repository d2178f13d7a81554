"""The per-op backend choice (``kernels.dispatch.use_triton``) as a compiled forward traces it.

Every fused op asks ``use_triton`` which implementation to run, so a forward the caller compiles traces it at each op.
On a GPU a compiled forward printed Dynamo's warning about tracing a ``functools.lru_cache`` function (the cached
``triton_available``) at the first compile; the choice now reads a constant.  A CPU cannot take the CUDA branch; it
traces the forced Triton backend's branch (under the interpreter), which asked the cached function the same way.
"""

import warnings

import pytest
import torch

from mla_fuser.kernels import dispatch

pytestmark = pytest.mark.skipif(not dispatch.HAS_TRITON, reason="triton not installed")


def test_the_backend_choice_traces_whole_and_without_dynamo_warnings(monkeypatch):
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # (each message warns once per process)
    torch._dynamo.reset()

    def step(x):
        return x + 1 if dispatch.use_triton(x) else x - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(3))
    torch._dynamo.reset()
    assert torch.equal(out, torch.ones(3))  # (the forced backend was read while tracing)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
