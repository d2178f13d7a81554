"""A decode step's dense linears on ``kernels.skinny_linear``: an ``nn.Linear`` instance's forward bound to one that
takes the skinny GEMM where it runs (a captured step's few 16-bit rows) and is ``F.linear``, ``nn.Linear.forward``
itself, everywhere else.

Which linears: those the MLA and gated-MLP fusers found by structure on a decode step's critical path, an MLA
module's output projection and a gated MLP's down projection (their stacked projections go through
``rewrite.StackedLinear``, which calls the kernel's dispatcher itself).  Only a plain ``nn.Linear`` (no subclass with
a forward of its own, no adapter layer) whose instance has no forward of its own is bound: a block-FP8 linear (bound
before, ``fusers.fp8``) or anything someone else bound keeps its forward.  The module call itself is unchanged, so
hooks (accelerate's device placement and offload, ours) and adapters wrapped around it later (PEFT calls it as its
base layer) still run.
"""

from __future__ import annotations

from torch import nn

from ..kernels.skinny_linear import skinny_linear
from .base import bind_instance_forward


def _skinny_forward(self: nn.Linear, input):
    return skinny_linear(input, self.weight, self.bias)


def bind_skinny_forward(module: nn.Module | None) -> bool:
    """Bind :func:`_skinny_forward` to this plain ``nn.Linear`` instance; False (nothing done) for anything else."""
    if type(module) is not nn.Linear or "base_layer" in module._modules:
        return False
    if getattr(module.forward, "__func__", None) is _skinny_forward:
        return True  # (bound already: a second fusion pass)
    original, _ = bind_instance_forward(module, _skinny_forward)
    return original is not None
