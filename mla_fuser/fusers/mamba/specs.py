"""The Mamba match records: ``MambaMatch`` (roles and sizes read off the traced mixer) and ``MambaPlan`` (what the
bound forward needs).

Plain data with no behaviour beyond ``describe``, kept apart so that the analysis (which builds a match), the
fused forward (which reads one) and the fuser (which ties them together) all import it without importing each
other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class MambaMatch:
    """Roles (submodule / parameter names) and sizes read from the graph.

    Pieces: ``in_split`` are the widths of the input projection's output pieces (feature axis) and
    ``x_piece`` / ``z_piece`` / ``dt_piece`` which piece is the conv input, the gate and (Mamba-2) ``dt``.
    ``x_split`` / ``pieces``: Mamba-1, the widths of ``x_proj``'s pieces and which are (dt, B, C);
    Mamba-2, the widths of the conv output's pieces and which are (x, B, C).
    """

    kind: str  # "mamba1" | "mamba2"
    in_proj: str
    conv1d: str
    out_proj: str
    a_log: str
    d: str | None
    in_split: tuple[int, ...]
    x_piece: int
    z_piece: int
    dt_piece: int | None
    x_split: tuple[int, ...]
    pieces: tuple[int, int, int]  # Mamba-1: (dt, B, C) of x_proj's output; Mamba-2: (x, B, C) of the conv output
    intermediate_size: int
    state_size: int
    conv_width: int
    activation: str | None
    dt_softplus: bool
    mask_arg: str | None  # the forward argument holding the 2-D padding mask
    mask_input: bool  # padded positions zeroed before the input projection
    mask_conv: bool  # ... and after the conv
    cache_arg: str = "cache"
    # Mamba-1
    x_proj: str | None = None
    dt_proj: str | None = None
    dt_norm: str | None = None
    b_norm: str | None = None
    c_norm: str | None = None
    dt_rank: int | None = None
    dt_proj_bias: bool = False
    # Mamba-2
    dt_bias: str | None = None
    norm: str | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    n_groups: int | None = None
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    def describe(self) -> str:
        if self.kind == "mamba1":
            norms = [r for r, n in (("dt", self.dt_norm), ("B", self.b_norm), ("C", self.c_norm)) if n]
            return (f"Mamba-1: inner {self.intermediate_size}, state {self.state_size}, dt rank {self.dt_rank}, "
                    f"conv {self.conv_width}" + (f", {'/'.join(norms)} RMSNorms" if norms else ""))
        return (f"Mamba-2: {self.num_heads} heads x {self.head_dim}, {self.n_groups} groups, state {self.state_size}, "
                f"conv {self.conv_width}, dt limit {self.dt_limit}")


@dataclass
class MambaPlan:
    """What the bound forward needs: the match, the original forward and its signature."""

    match: MambaMatch
    original: Callable
    signature: inspect.Signature

