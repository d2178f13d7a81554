"""Does the installed Triton's interpreter run this package's kernels?  Triton 3.6's interpreter (with NumPy 2.x)
cannot take a loaded scalar as a loop bound (``range(..., tl.load(p))``: "only 0-dimensional arrays can be converted
to Python scalars"), and most of our kernels loop up to a length they load.  ``conftest`` reports the tests that fail
that way as skipped, with this reason, where the probe below fails too; the kernels themselves run compiled on a GPU
(and are interpreted in CI with Triton 3.9)."""

from __future__ import annotations

import functools
import os

REASON = ("this Triton's interpreter cannot take a loaded scalar as a loop bound (Triton 3.6 with NumPy 2.x): "
          "the kernel runs compiled on a GPU and interpreted with Triton >= 3.9")
SIGNATURE = "only 0-dimensional arrays can be converted to Python scalars"


def _probe_kernel(p, out, N):
    import triton.language as tl

    n = tl.load(p)
    acc = 0.0
    for _ in range(0, tl.minimum(n, N), 1):
        acc += 1.0
    tl.store(out, acc)


@functools.lru_cache(maxsize=1)
def interpreter_takes_loaded_bounds() -> bool:
    """Run the probe kernel under the interpreter once (True also where Triton is missing: nothing to excuse)."""
    try:
        import torch
        import triton
    except ImportError:
        return True
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # (the test process only; jit reads it at decoration, below)
    try:
        kernel = triton.jit(_probe_kernel)
        out = torch.zeros(1)
        kernel[(1,)](torch.tensor([3], dtype=torch.int32), out, 8)
        return out.item() == 3.0
    except Exception as exc:  # noqa: BLE001 - only the known limitation counts as "no"
        return SIGNATURE not in str(exc)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def is_known_limitation(excinfo) -> bool:
    """An interpreter error of exactly that kind, on a Triton whose interpreter fails the probe."""
    if excinfo is None:
        return False
    exc = excinfo.value
    return (type(exc).__name__ == "InterpreterError" and SIGNATURE in str(exc)
            and not interpreter_takes_loaded_bounds())
