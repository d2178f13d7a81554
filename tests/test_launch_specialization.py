"""Triton compiles a kernel variant per class of each integer argument (1, a multiple of 16, other).  A decode that
runs on must not meet new classes as its sequences grow: each would be a compile of seconds in the middle of a
generation.  ``dispatch.lazy_jit(do_not_specialize=...)`` names the arguments that change with the length (split
counts, block-table and lse strides); this checks, with every launch of a growing paged decode recorded (launches
mocked, nothing runs), that no other integer argument changes class, and that the named ones do change (so the check
has something to catch)."""

from __future__ import annotations

import collections

import pytest
import torch

from mla_fuser.kernels import dispatch

pytest.importorskip("triton")


def _class(value):
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return "1" if value == 1 else ("16" if value % 16 == 0 else "other")


@pytest.fixture
def recorded_launches(monkeypatch):
    """kernel name -> parameter -> (classes seen, whether the kernel leaves it unspecialized)."""
    import inspect

    seen = collections.defaultdict(dict)
    real_get = dispatch.LazyJit.get

    class Recorder:
        def __init__(self, lazy):
            self.lazy = lazy
            self.names = list(inspect.signature(lazy.fn).parameters)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for name, value in zip(self.names, args):
                    cls = _class(value)
                    if cls is not None:
                        classes, _ = seen[self.lazy.__name__].setdefault(
                            name, (set(), name in self.lazy.do_not_specialize))
                        classes.add(cls)
            return launch

        def warmup(self, *args, **kwargs):
            pass

    def get(self):
        real_get(self)  # (the real lookup still runs)
        return Recorder(self)

    monkeypatch.setattr(dispatch.LazyJit, "get", get)
    return seen


def test_a_growing_paged_decode_meets_no_new_specialization(monkeypatch, recorded_launches):
    from transformers import AutoModelForCausalLM

    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.fusion import fuse
    from mla_fuser.presets import preset_config

    torch.manual_seed(0)
    config = preset_config("deepseek-v2-lite-tiny", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="vllm_mla", dtype=torch.float32).eval()
    fuse(model)
    key = cache_keyword(model)
    B, prompt, steps = 3, 5, 70
    cache = PagedLatentCache(model, page_size=4, max_cache_tokens=B * (prompt + steps + 8))
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (B, prompt)), use_cache=True, **{key: cache})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")  # (every launch is recorded, none runs)
    token = torch.randint(3, 100, (B, 1))
    for step in range(steps):  # 5 -> 75 tokens: 2 -> 19 pages of 4
        with torch.no_grad():
            model(input_ids=token, attention_mask=torch.ones(B, prompt + step + 1, dtype=torch.long),
                  use_cache=True, **{key: cache})
    assert "_mla_decode_stage1" in recorded_launches and "_paged_append_kernel" in recorded_launches
    changing = {(kernel, name): sorted(classes) for kernel, params in recorded_launches.items()
                for name, (classes, unspecialized) in params.items() if len(classes) > 1 and not unspecialized}
    assert not changing, f"integer arguments that change class as the decode grows: {changing}"
    named = recorded_launches["_mla_decode_stage1"]
    assert len(named["NUM_SPLITS"][0]) > 1 and len(named["stride_btb"][0]) > 1  # (what the names are there for)


def test_lazy_jit_checks_the_names_and_hands_them_to_triton(monkeypatch):
    def kernel(X, n, BLOCK):
        pass

    with pytest.raises(ValueError, match="kernel has no parameter m"):
        dispatch.lazy_jit(do_not_specialize=("m",))(kernel)
    lazy = dispatch.lazy_jit(do_not_specialize=("n",))(kernel)
    captured = {}
    monkeypatch.setattr(dispatch.triton, "jit", lambda fn, **kw: captured.update(kw) or fn)
    assert lazy.get() is kernel and captured == {"do_not_specialize": ("n",)}
    captured.clear()
    dispatch.LazyJit(kernel).get()
    assert captured == {"do_not_specialize": None}
