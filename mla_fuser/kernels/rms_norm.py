"""RMSNorm over the last dimension in one launch.

Why a kernel: Transformers' RMSNorm modules are written as plain torch ops (cast to fp32, ``pow``, ``mean``,
add ``eps``, ``rsqrt``, multiply, cast back, multiply by the weight): about seven small kernels per norm, and a
DeepSeek-V2 decoder layer runs four norms, so a decode step spends ~28 launches per layer on them.  Here one
program per row loads the row once, reduces in fp32 in registers and writes the result once.

The math, and *where it rounds*, is that of the module being replaced.  Transformers has two variants:

* **cast then weight** (``weight_in_fp32=False``; Llama, DeepSeek, Mixtral, Qwen, Mamba's plain norms)::

      h = x.float(); h = h * rsqrt(mean(h**2, -1) + eps)
      out = (weight + weight_offset) * h.to(x.dtype)

  the normalised row is rounded to the input dtype first, and the product follows torch's type promotion
  (bf16 weight and bf16 input -> bf16; an fp32 weight on a bf16 input gives an fp32 result);
* **weight in fp32** (``weight_in_fp32=True``; Gemma-style, usually with ``1 + weight``)::

      out = (h * (weight_offset + weight.float())).to(x.dtype)

  one rounding, at the end, always to the input dtype.

``weight_offset`` is 0.0 or 1.0; in the first variant ``weight + 1`` is rounded to the weight's dtype (as
``1 + self.weight`` does in torch), in the second it is added in fp32.

:func:`rms_norm_ref` is the torch twin: the very ops of the modules, so on CPU its result is bitwise equal to
theirs.  The Triton kernel reduces in another order than torch, so on a GPU it may differ by one unit in the
last place of the output dtype.  :func:`rms_norm` dispatches (``dispatch.use_triton``) and is exposed as the
custom op ``mla_fuser::rms_norm`` for torch.compile; plain eager calls skip the dispatcher.  The kernel has no
backward: while autograd records (an input or the weight requires grad), the torch reference runs.
"""

from __future__ import annotations

import functools

import torch

from .dispatch import SUM_COMBINE, LazyJit, kernel_op, next_pow2, tl, use_triton

__all__ = ["KERNEL_DTYPES", "rms_norm", "rms_norm_ref", "rms_norm_triton"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a whole row in registers; rows wider than this run the torch reference instead
# (no RMSNorm in Transformers comes close: hidden sizes stop around 2**14).
MAX_BLOCK = 1 << 16


def output_dtype(x: torch.Tensor, weight: torch.Tensor, weight_in_fp32: bool) -> torch.dtype:
    """The result dtype of the replaced module: the input's, or torch's promotion of weight and input."""
    return x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                 weight_in_fp32: bool = False) -> torch.Tensor:
    """Torch reference: the same ops, in the same order, as the Transformers modules (see the module
    docstring), applied to ``x`` as it is (no copy to a contiguous layout, which could change torch's
    reduction order and with it the last bit)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        w = weight.float()
        if weight_offset:
            w = weight_offset + w
        return (h * w).to(x.dtype)
    w = weight + weight_offset if weight_offset else weight
    return w * h.to(x.dtype)


@LazyJit
def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, N, eps, offset,
                     BLOCK: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, HAS_OFFSET: tl.constexpr):
    # One program per row; all math in fp32, rounding points as in rms_norm_ref.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.reduce(h * h, 0, SUM_COMBINE) / N  # masked columns load 0 and add nothing
    h = h * tl.math.rsqrt(mean_sq + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_FP32:
        if HAS_OFFSET:
            w = offset + w
        out = h * w
    else:
        if HAS_OFFSET:
            w = (w + offset).to(W.dtype.element_ty).to(tl.float32)  # ``weight + 1`` in the weight dtype
        out = h.to(X.dtype.element_ty).to(tl.float32) * w  # the normalised row rounded to x's dtype first
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                    weight_in_fp32: bool = False) -> torch.Tensor:
    """Triton path of :func:`rms_norm` (no dispatch).  Rows are made unit-stride (a copy only when the last
    dimension is strided); the output is a new contiguous tensor of ``x``'s shape."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the row width {width}")
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = rows.new_empty(rows.shape, dtype=output_dtype(x, weight, weight_in_fp32))
    n_rows = rows.shape[0]
    if n_rows and width:
        block, warps = _row_tiles(width)
        _rms_norm_kernel[(n_rows,)](
            rows, weight, out, rows.stride(0), width, width, float(eps), float(weight_offset),
            BLOCK=block, WEIGHT_IN_FP32=bool(weight_in_fp32), HAS_OFFSET=bool(weight_offset),
            num_warps=warps,
        )
    return out.view(x.shape)


@functools.lru_cache(maxsize=256)  # (asked at every call)
def _row_tiles(width: int) -> tuple[int, int]:
    block = next_pow2(width)
    return block, _num_warps(block)


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
                   weight_in_fp32: bool) -> torch.Tensor:
    if (use_triton(x, weight) and x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
            and x.shape[-1] <= MAX_BLOCK):
        return rms_norm_triton(x, weight, eps, weight_offset, weight_in_fp32)
    return rms_norm_ref(x, weight, eps, weight_offset, weight_in_fp32)


@kernel_op("rms_norm", eager=_rms_norm_impl)
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float,
                 weight_in_fp32: bool) -> torch.Tensor:
    # contiguous, as the fake impl promises (the reference keeps x's layout)
    return _rms_norm_impl(x, weight, eps, weight_offset, weight_in_fp32).contiguous()


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, weight_offset, weight_in_fp32):
    return x.new_empty(x.shape, dtype=output_dtype(x, weight, weight_in_fp32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
             weight_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of ``x [..., width]`` with ``weight [width]``, rounded as the replaced module rounds.

    ``weight_in_fp32`` picks the variant (module docstring); ``weight_offset`` is 0.0 or 1.0 (Gemma's
    ``1 + weight``).  Returns x's shape; dtype x's (``weight_in_fp32``) or ``promote(weight, x)``.
    Backend: ``dispatch.use_triton(x, weight)``; float16/bfloat16/float32 only (others run the reference).
    Under torch.compile, or with tensor subclasses, the call is the custom op ``mla_fuser::rms_norm`` (one
    opaque node with a fake impl); plain eager calls run its implementation directly, saving the
    dispatcher's host time on a launch that is itself only a few microseconds.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return rms_norm_ref(x, weight, eps, weight_offset, weight_in_fp32)  # the kernel has no backward
    return _rms_norm_op(x, weight, float(eps), float(weight_offset), bool(weight_in_fp32))
