"""Launching a compiled Triton kernel again without Triton's per-call bookkeeping.

Why: an eager fused decode step launches hundreds of Triton kernels, and on an H200 host one launch through
``JITFunction.run`` costs tens of microseconds of Python (issue 14: one eager ``mla_decode`` call, two launches,
179 us; one ``rms_norm`` call, one launch, 50 us).  Most of that is bookkeeping that gives the same answer on every
launch of a kernel variant already compiled: knob reads from the environment, the driver proxy's device and stream
lookups, the options dict turned into a string for the cache key, a walk over the kernel's global values, a
launch-metadata object built (in Triton 3.6 even when no hook wants it: its hook chain is never ``None``) and two
empty hook chains called from C.

What stays exact: the kernel variant.  :class:`DirectLauncher` asks Triton's own binder for the call's
specialisation (the very list Triton keys its compiled kernels on, computed in C), keys on that list and the launch
options, and finds the ``CompiledKernel`` that Triton itself returned the first time it saw that key.  A key never
seen before, a device whose binder Triton has not built yet, launch hooks someone installed (profilers), or anything
else unusual goes through ``JITFunction.run`` (compiling if needed), whose kernel is then remembered.  What is
skipped: the check that the kernel's global values are unchanged (this package's kernels read none that change) and
Triton's instrumentation knob read per launch (a change of ``TRITON_INSTRUMENTATION_MODE`` after a variant's first
launch is not seen by it).  ``MLA_FUSER_DIRECT_LAUNCH=0`` launches everything through ``JITFunction.run``.

The interface used (``device_caches`` entries ending in the binder, ``CompiledKernel.run(grid..., stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``) is the one ``JITFunction.run`` itself uses in
Triton 3.6 through 3.9; a Triton without it gets no direct launcher (:func:`direct_launcher` returns ``None``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import envs

try:  # pragma: no cover - depends on the installation
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # noqa: BLE001 - no Triton, or one without knobs: no direct launches
    _knobs = _JITFunction = None


def _hooks_installed() -> bool:
    """True when someone (a profiler) hooks Triton's launches: those launches keep Triton's own path."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # (3.6+: an empty HookChain is no hook)
            return True
    return False


def launch_device(args) -> int | None:
    """The CUDA device index of a launch's first tensor argument; None when that tensor is not on CUDA or there is
    none.  A launch's tensors all live on one device (a kernel cannot read another's memory), so the first one tells
    where Triton must launch (on the *current* device)."""
    for a in args:  # (a loop, not next() over a generator: this runs for every launch of an eager step)
        if isinstance(a, Tensor):
            return a.device.index if a.is_cuda else None
    return None


class DirectLauncher:
    """Launches of one compiled ``JITFunction``: Triton's kernel for a call's exact specialisation, launched directly.

    ``self.kernels[device][key]`` holds the ``CompiledKernel`` that ``JITFunction.run`` returned for a call whose
    binder key was ``key``: ``(tuple(specialisation), tuple(options.items()))`` on that device.  Options are the
    launch keywords that are not kernel parameters (``num_warps``, ``num_stages``), in the caller's order: a caller
    passing them in another order only misses once more, never launches the wrong variant.
    """

    def __init__(self, jit):
        self.jit = jit
        self.kernels: dict[int, dict] = {}
        self.stream_of = None  # (Triton's driver's current-stream query, bound at the first launch)

    def launch(self, grid, /, *args, **kwargs):
        """Launch ``jit[grid](*args, **kwargs)`` on the device of the first tensor argument (Triton launches on the
        current device; a model split over GPUs runs layers elsewhere)."""
        device = launch_device(args)
        if device is None:  # (no CUDA tensor among the positional arguments: Triton decides, as it always did)
            return self.jit[grid](*args, **kwargs)
        if device != torch.cuda.current_device():
            with torch.cuda.device(device):
                return self._launch(device, grid, args, kwargs)
        return self._launch(device, grid, args, kwargs)

    def _launch(self, device, grid, args, kwargs):
        if not envs.get("MLA_FUSER_DIRECT_LAUNCH") or _hooks_installed():
            return self.jit[grid](*args, **kwargs)  # (Triton's own path, nothing more: nothing remembered)
        known = self.kernels.get(device)
        if known is None:
            return self._through_triton(device, grid, args, kwargs)
        bound, key = self._binder_key(device, args, kwargs)
        try:
            kernel = known.get(key)
        except TypeError:  # (an unhashable constexpr: leave it to Triton)
            return self._through_triton(device, grid, args, kwargs)
        if kernel is None:
            return self._through_triton(device, grid, args, kwargs, key)
        if callable(grid):
            grid = grid(bound)
        size = len(grid)
        kernel.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, self.stream_of(device),
                   kernel.function, kernel.packed_metadata, None, None, None, *bound.values())
        return kernel

    def _binder_key(self, device, args, kwargs):
        """``(bound arguments, key)``: Triton's binder on ``device`` (built there already) and the key its kernels are
        remembered under (hashable unless a constexpr or option is not)."""
        bound, specialization, options = self.jit.device_caches[device][-1](*args, **kwargs)
        return bound, (tuple(specialization), tuple(options.items()))

    def _through_triton(self, device, grid, args, kwargs, key=None):
        """``JITFunction.run`` (compiles a new variant); its kernel is remembered under ``key`` (the binder's key,
        computed here when the caller had none)."""
        kernel = self.jit[grid](*args, **kwargs)
        if kernel is None or not hasattr(kernel, "packed_metadata") or getattr(kernel, "function", None) is None:
            return kernel  # (an asynchronous compile's future, or a Triton that changed shape: nothing remembered)
        if key is None:
            caches = self.jit.device_caches.get(device)
            if caches is None:
                return kernel
            _, key = self._binder_key(device, args, kwargs)
            try:
                hash(key)
            except TypeError:
                return kernel
        if self.stream_of is None:
            from triton.runtime import driver  # (resolved once Triton's driver is active: a launch just ran)

            self.stream_of = driver.active.get_current_stream
        self.kernels.setdefault(device, {})[key] = kernel
        return kernel


def direct_launcher(jit) -> DirectLauncher | None:
    """A :class:`DirectLauncher` for a compiled ``JITFunction``; ``None`` for the interpreter's functions or a Triton
    whose ``JITFunction`` lacks the interface (its launches keep ``kernel[grid]``)."""
    if _JITFunction is None or not isinstance(jit, _JITFunction) or not hasattr(jit, "device_caches"):
        return None
    return DirectLauncher(jit)
