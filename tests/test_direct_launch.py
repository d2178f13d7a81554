"""Direct launches of compiled Triton kernels (``kernels.direct_launch``): the kernel variant launched is always the
one Triton chose for the same specialisation, and anything unusual goes through Triton's own ``JITFunction.run``.

On a CPU the launcher runs against a stand-in for a ``JITFunction`` (binder, kernel cache, compiled kernels that
record their launches): what is checked is the bookkeeping (which calls miss, what is remembered under which key,
what a direct launch hands the compiled kernel).  With a GPU, a real kernel is launched directly over arguments that
change Triton's specialisation (alignment, integers that are 1 or multiples of 16, a constexpr) and compared with
the reference, and the number of variants remembered equals the number Triton compiled.
"""

from __future__ import annotations

import pytest
import torch

from mla_fuser.kernels import direct_launch
from mla_fuser.kernels.direct_launch import DirectLauncher


class _Compiled:
    """A compiled kernel's stand-in: ``run`` records what a launch hands it."""

    def __init__(self, name):
        self.name = name
        self.function = f"function-{name}"
        self.packed_metadata = f"metadata-{name}"
        self.launches = []

    def run(self, *launch):
        self.launches.append(launch)


class _Jit:
    """A ``JITFunction``'s stand-in with a binder whose specialisation is the arguments' ``repr`` classes."""

    def __init__(self):
        self.compiled = {}  # specialisation key -> _Compiled (what Triton's kernel cache would hold)
        self.slow_launches = 0
        self.device_caches = {}

    def binder(self, x, n, BLOCK=16, **options):
        specialization = [("tensor", x % 16 == 0), ("int", n == 1), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, specialization, options

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_launches += 1
            self.device_caches.setdefault(0, ({}, {}, None, None, self.binder))
            _, specialization, options = self.binder(*args, **kwargs)
            key = repr((specialization, sorted(options.items())))
            return self.compiled.setdefault(key, _Compiled(f"v{len(self.compiled)}"))
        return run


@pytest.fixture
def launcher(monkeypatch):
    jit = _Jit()
    direct = DirectLauncher(jit)
    monkeypatch.setattr(direct_launch, "_hooks_installed", lambda: False)
    direct.stream_of = lambda device: f"stream-{device}"
    return jit, direct


def test_a_variant_is_launched_directly_once_triton_has_launched_it(launcher):
    jit, direct = launcher
    first = direct._launch(0, (4,), (32, 7), {"num_warps": 4})
    assert jit.slow_launches == 1 and first.launches == []  # (the miss: Triton launched it)
    again = direct._launch(0, (4,), (48, 9), {"num_warps": 4})  # (same classes: 48 % 16 == 0, 9 != 1)
    assert again is first and jit.slow_launches == 1
    assert first.launches == [(4, 1, 1, "stream-0", "function-v0", "metadata-v0", None, None, None, 48, 9, 16)]


def test_a_new_specialisation_or_option_misses_and_gets_triton_s_own_variant(launcher):
    jit, direct = launcher
    base = direct._launch(0, (1,), (32, 7), {"num_warps": 4})
    for args, kwargs in [((33, 7), {"num_warps": 4}),  # (alignment class)
                         ((32, 1), {"num_warps": 4}),  # (an integer equal to 1)
                         ((32, 7, 32), {"num_warps": 4}),  # (a constexpr)
                         ((32, 7), {"num_warps": 8})]:  # (a launch option)
        misses = jit.slow_launches
        kernel = direct._launch(0, (1,), args, kwargs)
        assert jit.slow_launches == misses + 1 and kernel is not base
        assert direct._launch(0, (1,), args, kwargs) is kernel and jit.slow_launches == misses + 1
    assert len(direct.kernels[0]) == len(jit.compiled) == 5


def test_grids_are_padded_to_three_dimensions_and_callable_grids_see_the_bound_arguments(launcher):
    jit, direct = launcher
    kernel = direct._launch(0, (2, 3), (32, 7), {})
    direct._launch(0, (2, 3), (32, 7), {})
    direct._launch(0, lambda bound: (bound["n"], 5, 6), (32, 7), {})
    assert [launch[:3] for launch in kernel.launches] == [(2, 3, 1), (7, 5, 6)]


def test_unusual_launches_go_through_triton(launcher, monkeypatch):
    jit, direct = launcher
    direct._launch(0, (1,), (32, 7), {})
    monkeypatch.setenv("MLA_FUSER_DIRECT_LAUNCH", "0")
    direct._launch(0, (1,), (32, 7), {})
    direct._launch(0, (1,), (33, 1), {})  # (a new variant: Triton's path only, nothing remembered)
    assert jit.slow_launches == 3 and len(direct.kernels[0]) == 1
    monkeypatch.delenv("MLA_FUSER_DIRECT_LAUNCH")
    monkeypatch.setattr(direct_launch, "_hooks_installed", lambda: True)  # (a profiler hooks launches)
    direct._launch(0, (1,), (32, 7), {})
    assert jit.slow_launches == 4
    monkeypatch.setattr(direct_launch, "_hooks_installed", lambda: False)
    direct._launch(0, (1,), (32, 7), {})
    assert jit.slow_launches == 4
    direct._launch(1, (1,), (32, 7), {})  # (a device Triton has not built a binder for)
    assert jit.slow_launches == 5 and 1 not in direct.kernels
    kernel = direct._launch(0, (1,), (32, 7), {"hint": [1]})  # (an unhashable option: never remembered)
    assert jit.slow_launches == 6 and direct._launch(0, (1,), (32, 7), {"hint": [1]}) is kernel
    assert jit.slow_launches == 7


def test_without_a_cuda_tensor_triton_decides():
    calls = []

    class Jit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    DirectLauncher(Jit()).launch((3,), torch.ones(2), 5, BLOCK=4)
    assert calls and calls[0][0] == (3,) and calls[0][2] == {"BLOCK": 4}


def test_interpreted_kernels_get_no_direct_launcher():
    assert direct_launch.direct_launcher(object()) is None
    assert direct_launch.direct_launcher(lambda: None) is None


def test_an_empty_hook_chain_is_no_hook():
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or direct_launch._knobs is None:
        pytest.skip("this Triton has no knobs")
    assert not direct_launch._hooks_installed()
    chain = knobs.runtime.launch_enter_hook

    def hook(metadata):
        pass

    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert direct_launch._hooks_installed()
        finally:
            chain.remove(hook)
    assert not direct_launch._hooks_installed()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: compiled kernels")
def test_on_a_gpu_direct_launches_compute_what_triton_s_do_with_the_same_variants():
    from mla_fuser.kernels.rms_norm import _rms_norm_kernel, rms_norm_ref, rms_norm_triton

    torch.manual_seed(0)
    jit = _rms_norm_kernel.get()
    direct = _rms_norm_kernel._direct[id(jit)]
    assert isinstance(direct, DirectLauncher)
    store = torch.randn(4096 + 1, device="cuda", dtype=torch.bfloat16)
    runs = []
    real_getitem = type(jit).__getitem__
    # (count the launches that go through Triton's own run: only the first of each variant may)
    type(jit).__getitem__ = lambda self, grid: runs.append(grid) or real_getitem(self, grid)
    try:
        for repeat in range(3):
            for offset, rows, width in [(0, 16, 64), (1, 16, 64), (0, 1, 64), (0, 7, 48), (1, 3, 40)]:
                x = store[offset:offset + rows * width].view(rows, width)  # (offset 1: not 16-byte aligned)
                weight = torch.randn(width, device="cuda", dtype=torch.bfloat16)
                out = rms_norm_triton(x, weight, 1e-6)
                torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), rtol=2 ** -7, atol=1e-2)
            if repeat == 0:
                first_pass = len(runs)
        assert len(runs) == first_pass  # (the second and third passes launched every call directly)
    finally:
        type(jit).__getitem__ = real_getitem
    device = torch.cuda.current_device()
    assert len(direct.kernels[device]) == len({id(k) for k in direct.kernels[device].values()})
    assert set(map(id, direct.kernels[device].values())) <= set(map(id, jit.device_caches[device][0].values()))
