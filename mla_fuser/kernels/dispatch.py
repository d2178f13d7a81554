"""What every kernel in this package shares: the Triton import, the backend choice, the lazy JIT and the custom op.

Kernel files take this plumbing from here, never from each other (a kernel file imports another only to
compose its public op, as ``ssd`` does with ``selective_scan``).  One module rather than a separate
``triton_utils``: the backend choice was already here and callers outside the package (``kernels.__init__``,
``fusers.norm``, ``decode_graph``) import it from here, so nothing outside had to move; what joined it is
small and used by the same files.

Every op in ``mla_fuser.kernels`` has a torch reference (``*_ref``) and, where it pays, a Triton
implementation.  Which one runs is decided here, once per call, from the input tensors and the
``MLA_FUSER_BACKEND`` environment variable (read, never written):

* unset: Triton for CUDA tensors when Triton imports, torch otherwise (CPU);
* ``triton``: always Triton.  On CPU this only works under ``TRITON_INTERPRET=1`` (how the tests run
  the kernels on tiny shapes); without it a clear error is raised instead of a crash deep in Triton;
* ``torch``: always the torch reference.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .. import envs
from ..context_flags import ContextFlag
from .direct_launch import direct_launcher, launch_device

VALID_BACKENDS = envs.VARIABLES["MLA_FUSER_BACKEND"].choices


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


# Whether Triton is there, for the per-op backend choice (``use_triton``): a constant, not the cached function, because
# a compiled forward traces that choice and Dynamo warns about every ``functools.lru_cache`` function it traces.
HAS_TRITON = triton_available()

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover - depends on the installation
    # Nothing launches without Triton; kernel files annotate with ``tl.constexpr`` under
    # ``from __future__ import annotations``, so their definitions never evaluate ``tl``.
    triton = None
    tl = None


def triton_interpreting() -> bool:
    return envs.triton_interpreting()


def requested_backend() -> str | None:
    """The backend forced through ``MLA_FUSER_BACKEND``, or None for automatic choice (``envs.SettingError``
    for a value outside ``VALID_BACKENDS``)."""
    return envs.kernel_backend()


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton implementation should run for these inputs."""
    forced = envs.kernel_backend()  # (requested_backend(), one call less: this runs for every op of an eager step)
    if forced == "torch":
        return False
    on_cuda = False
    for t in tensors:  # (a loop, not any() over a generator: this runs for every op of an eager step)
        if t is not None and t.is_cuda:
            on_cuda = True
            break
    if forced == "triton":
        if not HAS_TRITON:
            raise RuntimeError("MLA_FUSER_BACKEND=triton but Triton is not installed")
        if not on_cuda and not envs.triton_interpreting():
            raise RuntimeError(
                "MLA_FUSER_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)"
            )
        return True
    return on_cuda and HAS_TRITON


def cuda_index(x: torch.Tensor) -> int:
    """The CUDA device index of ``x`` (a tensor on CUDA), the current device for an unnumbered ``cuda``."""
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def capability_major(device_index: int) -> int:
    """The compute capability's major version of CUDA device ``device_index`` (9: Hopper), asked once per device:
    kernels pick tiles and paths by it on every eager call."""
    return torch.cuda.get_device_capability(device_index)[0]


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``): ``tl.arange`` tiles must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, without Triton: torch references size their buffers with it too."""
    return -(-a // b)


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap`` (``cap`` for ``n <= 0``): a tile that must lie inside
    one quantisation block of ``n``."""
    return min(cap, n & -n) if n > 0 else cap


# ----------------------------------------------------------------------------------------------------------------------
# Triton: lazy JIT and combine functions


class LazyJit:
    """``triton.jit`` applied at a kernel's first launch, once per interpreter mode.

    ``triton.jit`` decides at *decoration* time whether it builds a compiled ``JITFunction`` or an
    ``InterpretedFunction`` (it reads ``TRITON_INTERPRET`` then, in triton 3.x).  Decorating lazily, keyed by
    the mode at call time, means the interpreter flag only has to be set before the first call (e.g. with
    ``monkeypatch.setenv`` inside a test), not before the kernel module — or triton — was imported.  Kernels
    wrapped this way must avoid triton's own ``@jit`` helpers (``tl.sum``, ``tl.zeros``, …), which triton
    decorates when it is imported; they use builtins and ``tl.reduce`` with :data:`SUM_COMBINE` /
    :data:`MAX_COMBINE`.  Launching (``kernel[grid](...)``) makes the first tensor argument's device current
    (:func:`on_tensor_device`).
    """

    def __init__(self, fn, do_not_specialize: tuple[str, ...] = ()):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = fn.__doc__
        params = inspect.signature(fn).parameters
        unknown = [name for name in do_not_specialize if name not in params]
        if unknown:
            raise ValueError(f"{self.__name__} has no parameter {', '.join(unknown)} (do_not_specialize)")
        self.do_not_specialize = tuple(do_not_specialize)
        self._by_mode = {}
        self._direct = {}  # id(compiled kernel) -> its DirectLauncher (None for interpreted ones)

    def get(self):
        mode = envs.triton_interpreting()  # (read at every launch: the mode may change between calls)
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = self._by_mode[mode] = triton.jit(self.fn, do_not_specialize=self.do_not_specialize or None)
            self._direct[id(kernel)] = direct_launcher(kernel)
        return kernel

    def __getitem__(self, grid):
        """``kernel[grid](...)``: compiled kernels launch through :mod:`.direct_launch` (Triton's kernel for the
        call's exact specialisation, without ``JITFunction.run``'s per-call bookkeeping), interpreted ones through
        Triton, with the first tensor argument's device current."""
        kernel = self.get()
        direct = self._direct.get(id(kernel))  # (None: interpreted, or whatever a test's mock of get() returned)
        if direct is None:
            return on_tensor_device(kernel[grid])
        return functools.partial(direct.launch, grid)


def lazy_jit(do_not_specialize: tuple[str, ...] = ()):
    """``@lazy_jit(do_not_specialize=(...))``: :class:`LazyJit` with integer parameters Triton must not specialize.

    Triton compiles a variant per class of each integer argument (1, a multiple of 16, other).  Arguments that change
    class as a sequence grows or a step's size changes (split counts, a block table's row stride, the lse strides
    that follow the split count, a step's token count) would otherwise compile new variants mid-generation (seconds
    each on a GPU host) for no gain: none of them addresses vector loads.  Strides of the tiles a kernel streams stay
    specialized."""
    return lambda fn: LazyJit(fn, do_not_specialize)


def on_device(t: torch.Tensor):
    """Make ``t``'s CUDA device current for the launches inside the block (Triton launches on the *current* device,
    and a model split over GPUs with ``device_map`` runs layers on other devices than the current one); no-op off
    CUDA.  ``on_tensor_device`` does the same for one launcher.  (Nothing to switch, the usual case, costs no context:
    entering the current device's would change nothing.)"""
    if not t.is_cuda:
        return _NO_SWITCH
    device = t.device
    return _NO_SWITCH if device.index == torch.cuda.current_device() else torch.cuda.device(device)


_NO_SWITCH = contextlib.nullcontext()  # (stateless: one instance serves every block)


def on_tensor_device(launcher):
    """Wrap a Triton launcher so it runs with its first tensor argument's device current.

    Triton launches on the *current* device; a model split over GPUs (``device_map``) runs layers whose
    tensors live elsewhere; ``direct_launch.launch_device`` says which.  Costs one device query per CUDA launch;
    nothing changes off CUDA.
    """

    def launch(*args, **kwargs):
        device = launch_device(args)
        if device is not None and device != torch.cuda.current_device():
            with torch.cuda.device(device):
                return launcher(*args, **kwargs)
        return launcher(*args, **kwargs)

    return launch


def _sum_combine(a, b):
    return a + b


def _max_combine(a, b):
    return tl.maximum(a, b)


# Combine functions for ``tl.reduce`` / ``tl.associative_scan`` in :class:`LazyJit` kernels.  Triton's own are
# reused because the interpreter recognises them by identity and reduces with numpy without calling them (fast
# interpreted runs); ours stand in (slow under the interpreter, identical when compiled) if a Triton release
# renames them.
if triton is not None:
    SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or triton.jit(_sum_combine)
    MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None) or triton.jit(_max_combine)
else:  # pragma: no cover - depends on the installation
    SUM_COMBINE = MAX_COMBINE = None


# ----------------------------------------------------------------------------------------------------------------------
# custom ops


class KernelOp:
    """A kernel's ``torch.library`` custom op ``mla_fuser::<name>``, called with the eager shortcut.

    Under torch.compile, and with tensor subclasses (FakeTensor, ...) as first argument, a call is the op
    itself: one opaque node whose output shapes come from the fake implementation (:meth:`register_fake`).
    Plain eager calls (a ``torch.Tensor`` first argument) run the implementation directly instead: the
    dispatcher's round trip costs ~10-25 us of host time per call (measured on a dev CPU), which a small
    decode step cannot hide.  ``eager`` replaces the op's body in that shortcut when the two must differ
    (``rms_norm``: only the op makes its output contiguous, as its fake implementation promises).
    """

    def __init__(self, name: str, fn, mutates_args=(), eager=None):
        self._def = torch.library.custom_op(f"mla_fuser::{name}", mutates_args=mutates_args)(fn)
        self._op = getattr(torch.ops.mla_fuser, name)
        self._eager = eager or fn

    def register_fake(self, fake):
        self._def.register_fake(fake)
        return fake

    def __call__(self, *args):
        if type(args[0]) is torch.Tensor and not torch.compiler.is_compiling():
            return self._eager(*args)
        return self._op(*args)


def kernel_op(name: str, *, mutates_args=(), eager=None):
    """Decorator: the function (typed, as ``torch.library`` infers the schema) becomes a :class:`KernelOp`."""
    return lambda fn: KernelOp(name, fn, mutates_args, eager)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA graphs: are launches free?

_GRAPH_WARMUP = ContextFlag("graph_warmup", False)


def graph_warmup():
    """Context for the eager step that precedes a CUDA-graph capture: code that picks kernels by whether launches
    are free (:func:`launches_are_free`) picks what the capture will, so every kernel it uses is compiled before
    capturing starts."""
    return _GRAPH_WARMUP.set_to(True)


def launches_are_free() -> bool:
    """True while a CUDA graph is captured (or its warm-up step runs) or torch.compile traces: kernel launches cost
    no host time at replay, so fewer, fused kernels always pay."""
    if torch.compiler.is_compiling() or _GRAPH_WARMUP.get():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
