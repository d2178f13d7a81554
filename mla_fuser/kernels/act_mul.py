"""``act(gate) * up`` in one launch: the middle of a gated MLP.

Why a kernel: a gated MLP (``down(act(gate(x)) * up(x))``) runs, between its GEMMs, one launch for the activation
and one for the product, each reading and writing the whole intermediate row.  In a graphed decode step those two
small launches cost about as much as a GEMM (DeepSeek-V2-Lite, batch 1: SiLU 1.8 us + mul 1.3 us next to ~6 us
per GEMM).  Here one program per (row, column block) loads both halves once and writes the product once.

The rounding is that of the native ops, for every input dtype::

    a = act(gate)   # torch computes in fp32 ("opmath") and rounds to gate's dtype
    out = a * up    # the product of two gate-dtype tensors: fp32 math, rounded

so the kernel computes ``a = act(g.float()).to(dtype)`` and ``out = (a.float() * u.float()).to(dtype)``.  The
activations are written with the same formulas as the fused-MoE kernels (``silu`` as ``g / (1 + exp(-g))``,
``gelu`` with ``erf``, ``gelu_tanh`` through ``exp``, ``relu``); Triton's ``exp`` / ``erf`` are not torch's, so
in fp32 a result may move by a few units in the last place, and a 16-bit result rarely by one.

``gate`` and ``up`` usually are the two halves of one stacked ``[T, 2I]`` GEMM output (views whose rows are ``2I``
apart): rows are read in place through their own strides, only a strided last dimension (or leading dimensions
that cannot be merged into rows) costs a copy.  The output is a new contiguous tensor of ``gate``'s shape.

:func:`act_mul_ref` is the torch twin (the native ops).  :func:`act_mul` dispatches (``dispatch.use_triton``: the
kernel on CUDA, or forced with ``MLA_FUSER_BACKEND=triton``, e.g. under ``TRITON_INTERPRET=1``; the twin on CPU) and
is the custom op ``mla_fuser::act_mul`` under torch.compile.  No host syncs, one allocation (the output): CUDA-graph
capturable.  The kernel has no backward: while autograd records, the twin runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .dispatch import LazyJit, cdiv, kernel_op, next_pow2, tl, use_triton

__all__ = ["ACTIVATIONS", "KERNEL_DTYPES", "TORCH_ACTIVATIONS", "act_mul", "act_mul_ref", "act_mul_triton"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# kernel code per activation name (the names of ``fusers.moe.mlp.activation_name``)
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
MAX_BLOCK = 1024  # columns per program: wide rows take several programs (a decode step has one row)


# the torch op of each activation name: what the kernel computes, and what a module's activation is compared with to
# be named (``fusers.moe.mlp.activation_name``) or vouched for (``fusers.gated_mlp``)
TORCH_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    fn = TORCH_ACTIVATIONS.get(activation)
    if fn is None:
        raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    return fn(x)


def act_mul_ref(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Torch reference: the native ops, ``act(gate) * up`` (bitwise what a gated MLP's forward computes)."""
    return _activation(gate, activation) * up


@LazyJit
def _act_mul_kernel(G, U, OUT, stride_g, stride_u, stride_o, N,
                    BLOCK: tl.constexpr, ACT: tl.constexpr):
    # program (row, column block); fp32 math, rounded where the native ops round (module docstring)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:
        # torch's formula, 0.5 * g * (1 + tanh(inner)), with tanh through exp of a non-positive argument (no
        # overflow): 1 + tanh cancels to exactly 0 in the far negative tail, as torch's does
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(inner))
        t = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(inner < 0.0, -t, t))
    else:
        a = tl.where(g < 0.0, 0.0, g)  # (NaN stays NaN, as in torch.relu)
    a = a.to(OUT.dtype.element_ty).to(tl.float32)  # act(gate) rounded to the input dtype, as torch stores it
    tl.store(OUT + row * stride_o + cols, (a * u).to(OUT.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=256)  # (asked at every call)
def _tiles(width: int) -> tuple[int, int, int]:
    block = min(MAX_BLOCK, next_pow2(width))
    return block, cdiv(width, block), max(1, min(8, block // 256))


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit-stride rows, a view where the strides allow it, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, width)
    except RuntimeError:  # leading dimensions that do not merge into one row stride
        return t.contiguous().view(-1, width)


def act_mul_triton(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Triton path of :func:`act_mul` (no dispatch)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    width = gate.shape[-1] if gate.ndim else 1
    g, u = _rows(gate, width), _rows(up, width)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0] and width:
        block, column_blocks, warps = _tiles(width)
        _act_mul_kernel[(g.shape[0], column_blocks)](
            g, u, out, g.stride(0), u.stride(0), out.stride(0), width,
            BLOCK=block, ACT=ACTIVATIONS[activation], num_warps=warps,
        )
    return out.view(gate.shape)


def _act_mul_impl(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if (use_triton(gate, up) and gate.dtype in KERNEL_DTYPES and gate.dtype == up.dtype
            and gate.shape == up.shape and gate.ndim and gate.device == up.device):
        return act_mul_triton(gate, up, activation)
    return act_mul_ref(gate, up, activation)


@kernel_op("act_mul", eager=_act_mul_impl)
def _act_mul_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    # contiguous, as the fake impl promises
    return _act_mul_impl(gate, up, activation).contiguous()


@_act_mul_op.register_fake
def _act_mul_fake(gate, up, activation):
    return torch.empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=torch.promote_types(gate.dtype, up.dtype),
                       device=gate.device)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up``, rounded as the native ops round (module docstring).

    ``gate`` and ``up``: same shape and dtype, any layout (unit-stride rows are read in place); ``activation``: one
    of :data:`ACTIVATIONS`.  Backend: ``dispatch.use_triton(gate, up)``; float16/bfloat16/float32 only (others, and
    mismatched shapes or dtypes, run the reference with torch's broadcasting and promotion).  Under torch.compile,
    or with tensor subclasses, the call is the custom op ``mla_fuser::act_mul``; plain eager calls run its
    implementation directly (``dispatch.KernelOp``).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return act_mul_ref(gate, up, activation)  # the kernel has no backward
    return _act_mul_op(gate, up, activation)
