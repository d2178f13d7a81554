"""``block_fp8_linear``: ``y = x @ dequant(W)^T + b`` for a block-FP8 weight, on our own kernels (no Hub download).

Two Triton paths (:mod:`.triton_kernels`), chosen by the number of tokens:

* up to ``FP8_TENSOR_CORE_MIN_TOKENS - 1`` tokens, **weight-only**: activations stay in their dtype, weights are
  widened in the kernel.  Decode GEMMs are bound by reading the weights, which FP8 halves; keeping activations
  unquantised also makes this path the more accurate one;
* from ``FP8_TENSOR_CORE_MIN_TOKENS`` tokens, on GPUs with FP8 tensor cores (compute capability >= 8.9), **FP8
  tensor cores** with the activations quantised per token and ``bk`` features (dynamic scaling), where the GEMM
  is compute-bound and FP8 doubles the tensor-core rate.

Torch references: ``block_fp8_linear_ref`` (weight-only, fp32 math: what a model whose FP8 weights were
dequantised to fp32 computes) and ``block_fp8_linear_act_quant_ref`` (the FP8 path's math, activations quantised
the same way).  CPU tensors run the weight-only reference; ``MLA_FUSER_BACKEND`` forces a backend
(``dispatch.use_triton``).  The op is the custom op ``mla_fuser::block_fp8_linear`` under torch.compile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..dispatch import cdiv, kernel_op, triton_interpreting, use_triton
from .format import FP8_DTYPE, FP8_MAX
from .quant import dequantize_block_fp8, dequantize_token_groups, quantize_token_groups_ref
from .triton_kernels import act_quant_kernel, fp8_gemm_kernel, w8_gemm_kernel

# tokens from which the FP8 tensor-core path runs (benchmarks/bench_fp8_gemm.py measures both paths at every size)
FP8_TENSOR_CORE_MIN_TOKENS = 128
WEIGHT_ONLY, TENSOR_CORE = "weight_only", "fp8_tensor_core"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PER_TENSOR = 1 << 30  # "block" size that puts every element in block 0 (a per-tensor scale)
_TINY_SCALE = 1e-12


def _block(block_n: int, block_k: int) -> tuple[int, int] | None:
    return None if block_n <= 0 else (block_n, block_k)


def block_fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only reference: the weight dequantised in fp32, an fp32 GEMM, the result in ``x``'s dtype."""
    w = dequantize_block_fp8(weight, scale, _block(block_n, block_k), torch.float32)
    out = F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return out.to(x.dtype)


def block_fp8_linear_act_quant_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                                   block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor-core path's math: activations quantised per token and ``block_k`` features, then fp32."""
    rows = x.reshape(-1, x.shape[-1])
    q, s = quantize_token_groups_ref(rows, block_k)
    xd = dequantize_token_groups(q, s, block_k)
    w = dequantize_block_fp8(weight, scale, _block(block_n, block_k), torch.float32)
    out = F.linear(xd, w, None if bias is None else bias.to(torch.float32))
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing ``n``, at most ``cap``."""
    return min(cap, n & -n) if n > 0 else cap


def _has_fp8_tensor_cores(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device) >= (8, 9)
    return triton_interpreting()


def choose_path(tokens: int, x: torch.Tensor, block_n: int, block_k: int) -> str:
    """Weight-only for few tokens; FP8 tensor cores for many, when the weight is block-quantised in K blocks the
    kernel's 64/128-wide K tiles divide, and the GPU has FP8 tensor cores."""
    if tokens < FP8_TENSOR_CORE_MIN_TOKENS or block_n <= 0 or block_k % 64 != 0:
        return WEIGHT_ONLY
    return TENSOR_CORE if _has_fp8_tensor_cores(x) else WEIGHT_ONLY


def triton_supported(x: torch.Tensor, block_n: int, block_k: int) -> bool:
    """The kernels take fp16/bf16/fp32 activations and K blocks with a power-of-two divisor >= 16."""
    return x.dtype in KERNEL_DTYPES and (block_n <= 0 or _pow2_divisor(block_k, 128) >= 16)


def w8_linear_triton(x2: torch.Tensor, weight, scale, bias, block_n: int, block_k: int, splits: int | None = None,
                     tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Weight-only Triton GEMM on ``x2 [M, K]``; ``splits``/``tiles`` override the heuristics (tests, benchmarks)."""
    m, k = x2.shape
    n = weight.shape[0]
    qbn, qbk = (block_n, block_k) if block_n > 0 else (_PER_TENSOR, _PER_TENSOR)
    if tiles is None:
        bk = _pow2_divisor(qbk, 128)
        tiles = (16, 64, bk) if m <= 16 else (32, 64, bk) if m <= 32 else (64, 64, bk) if m <= 64 else \
            (64, 128, min(bk, 64))
    bm, bn, bk = tiles
    if qbk % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the quantisation block {qbk}")
    grid_mn = cdiv(m, bm) * cdiv(n, bn)
    if splits is None:
        splits = 1
        if x2.is_cuda:
            splits = max(1, min(cdiv(2 * _sm_count(x2.device.index or 0), grid_mn), cdiv(k, bk) // 4, 16))
    k_per_split = cdiv(cdiv(k, splits), bk) * bk
    splits = cdiv(k, k_per_split)
    out_dtype = x2.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, m, n), dtype=out_dtype, device=x2.device)
    scale2 = scale.reshape(1, 1) if scale.ndim == 0 else scale
    fused_bias = bias is not None and splits == 1
    w8_gemm_kernel[(cdiv(m, bm), cdiv(n, bn), splits)](
        x2, weight, scale2, bias if fused_bias else scale2, out,
        m, n, k, k_per_split,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        scale2.stride(0) if scale.ndim else 0, scale2.stride(1) if scale.ndim else 0,
        out.stride(0), out.stride(1), out.stride(2),
        qbn, qbk, scale2.shape[1] - 1 if scale.ndim else 0,
        HAS_BIAS=fused_bias, UPCAST=triton_interpreting(), IEEE=x2.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4 if bn * bm <= 64 * 64 else 8, num_stages=4 if m <= 64 else 3,
    )
    if splits == 1:
        return out[0]
    total = out.sum(0)
    if bias is not None:
        total += bias.to(torch.float32)
    return total.to(x2.dtype)


def quantize_token_groups(x2: torch.Tensor, group: int):
    """Triton per-token-group activation quantisation (``quantize_token_groups_ref``'s twin)."""
    m, k = x2.shape
    groups = cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
    if m:
        act_quant_kernel[(m, groups)](
            x2, q, s, k, groups, x2.stride(0), x2.stride(1), q.stride(0), s.stride(0),
            FP8_MAX=FP8_MAX, TINY=_TINY_SCALE, GROUP=group, GROUP_POW2=1 << (group - 1).bit_length(),
            ROUND_FIRST=triton_interpreting(),
        )
    return q, s


def fp8_linear_triton(x2: torch.Tensor, weight, scale, bias, block_n: int, block_k: int,
                      tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """FP8 tensor-core Triton GEMM on ``x2 [M, K]`` (activations quantised per token and ``block_k`` features)."""
    m, k = x2.shape
    n = weight.shape[0]
    q, s = quantize_token_groups(x2, block_k)
    bm, bn, bk = tiles or ((64 if m <= 64 else 128), 128, _pow2_divisor(block_k, 128))
    if block_k % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the quantisation block {block_k}")
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    fp8_gemm_kernel[grid](
        q, s, weight, scale, bias if bias is not None else scale, out,
        m, n, k,
        q.stride(0), s.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        block_n, block_k,
        HAS_BIAS=bias is not None, UPCAST=triton_interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3,
    )
    return out


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block_n: int, block_k: int) -> torch.Tensor:
    shape = (*x.shape[:-1], weight.shape[0])
    if x.is_meta or weight.is_meta:
        return x.new_empty(shape)
    if not (use_triton(x, weight) and triton_supported(x, block_n, block_k)):
        return block_fp8_linear_ref(x, weight, scale, block_n, block_k, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if choose_path(x2.shape[0], x, block_n, block_k) == TENSOR_CORE:
        out = fp8_linear_triton(x2, weight, scale, bias, block_n, block_k)
    else:
        out = w8_linear_triton(x2, weight, scale, bias, block_n, block_k)
    return out.view(shape)


@kernel_op("block_fp8_linear", eager=_linear_impl)
def _linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               block_n: int, block_k: int) -> torch.Tensor:
    return _linear_impl(x, weight, scale, bias, block_n, block_k).contiguous()


@_linear_op.register_fake
def _linear_fake(x, weight, scale, bias, block_n, block_k):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K], scale)^T (+ bias)`` in ``x``'s dtype; ``block`` = ``(bn, bk)``, or
    None for a per-tensor scale.  While autograd records (``x`` needs a gradient) the torch reference runs: the
    kernels have no backward."""
    block_n, block_k = block if block is not None else (0, 0)
    if torch.is_grad_enabled() and x.requires_grad:
        return block_fp8_linear_ref(x, weight, scale, block_n, block_k, bias)
    return _linear_op(x, weight, scale, bias, int(block_n), int(block_k))
