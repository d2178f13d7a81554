"""A linear layer at decode sizes (a few rows against a whole weight matrix), read at the weight's bandwidth.

Why: a decode step's dense linears multiply 1 to 16 rows by a ``[N, K]`` weight, so each is a weight read, and
cuBLAS leaves a lot of it on the table at these shapes.  On an H100 (``bench_skinny_linear.py``, CUDA-graph replay,
weights cycled past L2; ``benchmarks/results/skinny_linear_h100.json``) DeepSeek-V2-Lite's ``o_proj`` (2048 ->
2048) and shared-expert down projection (2816 -> 2048) ran at 2.0x their weight-read floor and the stacked q + kv
down-projection (2048 -> 3648) at 1.5x: the chosen kernels' 64-column tiles give 32 to 57 programs, too few to keep
132 SMs streaming.

Design (``_skinny_linear_kernel``): one program per ``BLOCK_N`` output columns (16 by default: 128 programs for a
2048-wide output), all rows at once (``BLOCK_M``, the rows padded to the 16 a tensor-core MMA needs), looping over K
in ``BLOCK_K`` tiles with a software pipeline (``num_stages`` weight tiles in flight per program).  Weight rows are
contiguous in K, so each tile is ``BLOCK_N`` runs of ``BLOCK_K`` elements: wide, coalesced loads.  fp32 accumulation,
one rounding to the output dtype, the bias added in fp32 before it (as cuBLAS's epilogue does).  The result equals
``F.linear`` up to the order of the fp32 sums (cuBLAS sums in its own order, split-K included): a rounding of the
output dtype at most, which the tests bound.

Batched (:func:`skinny_bmm`, ``torch.bmm``'s twin): the same kernel with one group of programs per batch entry, for
absorbed MLA's per-head products at decode (``q_nope @ W_UK`` and ``lat @ W_UV^T`` in ``attention_interfaces.paged``:
16 heads of 128 x 512 at DeepSeek-V2-Lite's shape, 2 MB each, ~3.5 us in cuBLAS's batched GEMM on an H100).  Weights
contiguous along K take the default tiles; weights contiguous along N (``W_UK`` as stored, ``[H, nope, rank]``) take
``N_CONTIGUOUS_CONFIG``, 64 columns per program, so a tile's K rows are 128-byte runs.

Measured (H100, Triton 3.6, CUDA-graph replay; why it stays off): alone, against cuBLAS at 1 / 16 rows, the best
config gained on q + kv (8.95 vs 9.73 us at 1 row), the shared down projection (8.6 / 9.1 vs 10.0 / 10.2) and the
per-head products (W_UK 3.40 vs 3.79 us, W_UV 3.79 vs 3.99) but not on ``o_proj`` (7.4 / 7.7 vs 7.3 / 7.4) nor the
gate + up and dense down projections (11.7 vs 11.5, 23.3 vs 21.2).  In the whole V2-Lite-shaped bf16 step the switch
gained nothing: 10.29 against 10.18 ms per replay at B=16 L=1024, 2.97 against 3.01 at B=1 L=512, and ``generate``
within the noise either way (greedy B=16 11.00 / 11.02 against 10.84 / 10.77 ms per step, beam 4 11.00 / 11.10
against 11.01 / 10.94, B=1 3.27 / 3.32 against 3.31 / 3.31; two alternating runs each).

When it runs (:func:`skinny_linear`, and alike :func:`skinny_bmm`): 16-bit CUDA tensors of at most ``MAX_ROWS`` rows,
weights contiguous in K, no autograd recording, outside torch.compile, while launches are free (a CUDA-graph capture
and its warm-up step: ``dispatch.launches_are_free``; an eager call keeps cuBLAS, whose launch costs less host time
than a Triton one), and ``MLA_FUSER_SKINNY_LINEAR`` on.  Otherwise ``F.linear``, which is also the torch twin
(``skinny_linear_ref``).  Under ``TRITON_INTERPRET=1`` with ``MLA_FUSER_BACKEND=triton`` the same calls run the kernel
on CPU tensors (the tests: inside ``dispatch.graph_warmup``, where launches count as free).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import envs
from .dispatch import LazyJit, cdiv, launches_are_free, tl, triton_interpreting, use_triton

__all__ = ["MAX_ROWS", "SkinnyConfig", "skinny_bmm", "skinny_bmm_fits", "skinny_bmm_ref", "skinny_bmm_triton",
           "skinny_fits", "skinny_linear", "skinny_linear_ref", "skinny_linear_triton"]

# rows up to which the kernel runs (one MMA tile of rows: beyond it cuBLAS's own tiles start to pay)
MAX_ROWS = 16
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class SkinnyConfig(NamedTuple):
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = SkinnyConfig()


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: ``F.linear``."""
    return F.linear(x, weight, bias)


@LazyJit
def _skinny_linear_kernel(X, W, BIAS, Y, M, N, K, stride_xg, stride_xm, stride_wg, stride_wn, stride_wk,
                          stride_yg, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # y[g] = x[g] @ w[g]^T for the group g = program_id(1) (one group: a linear; a head each: skinny_bmm)
    g = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = rows < M
    n_ok = cols < N
    # weight rows past N read the last valid row (the store is masked): no mask on the streamed loads
    x_ptr = X + g * stride_xg + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + g * stride_wg + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k0, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptr + k0 * stride_wk)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + k0 * stride_wk, mask=k_ok[None, :], other=0.0)
        if UPCAST:  # (the interpreter multiplies 16-bit floats wrongly: fp32 there, exact products either way)
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc=acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
    out = Y + g * stride_yg + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The operands the kernel takes: ``x [..., K]`` of at most ``MAX_ROWS`` rows, a ``[N, K]`` weight contiguous in K,
    both (and a bias) of one 16-bit dtype (fp32 under the interpreter, for the CPU tests) on one device."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or weight.stride(1) != 1:
        return False
    dtype = x.dtype
    if weight.dtype != dtype or (bias is not None and (bias.dtype != dtype or bias.dim() != 1)):
        return False
    if dtype not in KERNEL_DTYPES and not (dtype == torch.float32 and not x.is_cuda):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and weight.device == x.device


@functools.lru_cache(maxsize=256)
def _plan(m: int, n: int, k: int, groups: int, config: SkinnyConfig, has_bias: bool, interpreting: bool):
    block_m = max(16, 1 << (m - 1).bit_length())
    block_k = min(config.block_k, max(16, 1 << (k - 1).bit_length()))
    meta = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, HAS_BIAS=has_bias, EVEN_K=k % block_k == 0,
                UPCAST=interpreting, num_warps=config.num_warps, num_stages=config.num_stages)
    return (cdiv(n, config.block_n), groups), meta


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: SkinnyConfig | None = None) -> torch.Tensor:
    """The kernel (no dispatch); ``config`` overrides the tiles.  ``ValueError`` for operands it cannot take."""
    if not skinny_fits(x, weight, bias):
        raise ValueError(f"skinny_linear takes [<= {MAX_ROWS} rows, K] x [N, K] of one 16-bit dtype; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid, meta = _plan(m, n, k, 1, config or DEFAULT_CONFIG, bias is not None, triton_interpreting())
    _skinny_linear_kernel[grid](x2, weight, weight if bias is None else bias, y, m, n, k, 0, x2.stride(0),
                                0, weight.stride(0), 1, 0, y.stride(0), **meta)
    return y.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------------------------------
# batched: one small GEMM per head (absorbed MLA's W_UK and W_UV products)

# tiles of a batched product whose weight is contiguous along N rather than K (``q_nope @ W_UK``: [nope, rank] per
# head, rank contiguous): 64 output columns per program, so each K row of a tile is one 128-byte run
N_CONTIGUOUS_CONFIG = SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=2)


def skinny_bmm_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: ``torch.bmm``."""
    return torch.bmm(x, w) if out is None else torch.bmm(x, w, out=out)


def skinny_bmm_fits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """The operands :func:`skinny_bmm_triton` takes: ``x [G, M, K]`` (at most ``MAX_ROWS`` rows, unit stride along
    K) and ``w [G, K, N]`` with unit stride along N or K, of one 16-bit dtype (fp32 under the interpreter) on one
    device, and ``out`` (if given) ``[G, M, N]`` of that dtype with unit stride along N."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        return False
    g, m, k = x.shape
    n = w.shape[2]
    if not (0 < m <= MAX_ROWS and g > 0 and k > 0 and n > 0) or x.stride(2) != 1:
        return False
    if w.stride(2) != 1 and w.stride(1) != 1:
        return False
    dtype = x.dtype
    if w.dtype != dtype or w.device != x.device:
        return False
    if dtype not in KERNEL_DTYPES and not (dtype == torch.float32 and not x.is_cuda):
        return False
    if out is not None and (out.shape != (g, m, n) or out.dtype != dtype or out.device != x.device
                            or out.stride(2) != 1):
        return False
    return True


def skinny_bmm_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                      config: SkinnyConfig | None = None) -> torch.Tensor:
    """``torch.bmm(x, w)`` (into ``out``, any strides with a unit last one, when given) on the kernel, one group of
    programs per batch entry; ``ValueError`` for operands it cannot take."""
    if not skinny_bmm_fits(x, w, out):
        raise ValueError(f"skinny_bmm takes [G, <= {MAX_ROWS} rows, K] x [G, K, N] of one 16-bit dtype; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")
    g, m, k = x.shape
    n = w.shape[2]
    if out is None:
        out = torch.empty((g, m, n), dtype=x.dtype, device=x.device)
    n_contiguous = w.stride(2) == 1 and w.stride(1) != 1
    config = config or (N_CONTIGUOUS_CONFIG if n_contiguous else DEFAULT_CONFIG)
    grid, meta = _plan(m, n, k, g, config, False, triton_interpreting())
    xs, ws, ys = x.stride(), w.stride(), out.stride()
    # (w[g] as a linear's [N, K] weight: its N stride is w's last one, its K stride w's middle one)
    _skinny_linear_kernel[grid](x, w, w, out, m, n, k, xs[0], xs[1], ws[0], ws[2], ws[1], ys[0], ys[1], **meta)
    return out


def _may_take_kernel(x: torch.Tensor) -> bool:
    """Whether a skinny product of ``x`` may run on its kernel at all (its shapes and the switch asked after):
    CUDA or the interpreter, outside Dynamo, launches free (a captured step) and the Triton backend chosen.  A CPU
    call outside the interpreter, as every eager decode step on a CPU makes, is answered at the first check: asking
    ``launches_are_free()`` alone cost more host time than the CPU's tiny GEMM.  Dynamo comes next: it does not trace
    ``launches_are_free``'s context variable."""
    if not (x.is_cuda or envs.triton_interpreting()) or torch.compiler.is_compiling():
        return False
    return launches_are_free() and (x.is_cuda or use_triton(x))


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.bmm(x, w, out=out)``, on the kernel where it pays (as :func:`skinny_linear`), else ``torch.bmm``."""
    if (_may_take_kernel(x) and skinny_bmm_fits(x, w, out) and envs.skinny_linear()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return skinny_bmm_triton(x, w, out)
    return skinny_bmm_ref(x, w, out)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the kernel where it pays (module docstring), else ``F.linear`` itself."""
    if (_may_take_kernel(x) and skinny_fits(x, weight, bias) and envs.skinny_linear()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
