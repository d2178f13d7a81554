"""The block-FP8 GEMM Triton kernels (launched from :mod:`.linear`, which picks the path and the tiles).

``w8_gemm_kernel`` (weight-only, any token count, the small-batch path): ``out = x @ dequant(W)^T`` with ``x`` in
its own dtype; each ``[BLOCK_K, BLOCK_N]`` weight tile is read as e4m3 (one byte per weight: the memory-bound
decode GEMM reads half of bf16's bytes), widened to ``x``'s dtype (exact: every e4m3 value is a bf16/fp16 value),
multiplied on the tensor cores and the fp32 partial product scaled per output row (``BLOCK_K`` divides the
quantisation block's ``bk``, so one K tile lies in one scale column).  Split-K over ``SPLITS`` programs fills the
GPU when ``N`` alone gives few tiles; the partial sums go to an fp32 ``[SPLITS, M, N]`` buffer summed by the
caller (deterministic, no atomics).

``act_quant_kernel`` + ``fp8_gemm_kernel`` (the large-batch path): the activations are quantised per token and
``bk`` features (dynamic max-abs scaling, like DeepSeek's inference code), then both operands go to the FP8 tensor
cores and each K tile's product is scaled by ``x_scale[m] * w_scale[n]``.

Interpreter notes (Triton 3.9, checked): it loads and stores ``float8e4nv`` and multiplies e4m3 tiles in
``tl.dot``, but multiplies bf16 bit patterns as integers, so ``UPCAST`` widens the operands to fp32 there (off
when compiled).  Wrapped lazily (``dispatch.LazyJit``): builtins and ``tl.reduce`` only.
"""

from __future__ import annotations

from ..dispatch import MAX_COMBINE, LazyJit, tl


@LazyJit
def w8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_os, stride_om, stride_on,
    QBN, QBK, LAST_SK,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    scale_rows = s_ptr + (offs_n // QBN) * stride_sn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    k_start = pid_s * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        # (a split's last tiles may lie past K: x and w load zeros there, the clamped scale column is harmless)
        scale = tl.load(scale_rows + tl.minimum(k0 // QBK, LAST_SK) * stride_sk, mask=n_ok, other=0.0)
        if UPCAST:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            part = tl.dot(x, w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@LazyJit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    K, GROUPS,
    stride_xm, stride_xk, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr, TINY: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    """One program per (token, group of ``GROUP`` features): max-abs scale, e4m3 values.  ``ROUND_FIRST`` (the
    interpreter only) rounds to the e4m3 grid in fp32 before the conversion: the interpreter's own fp32 -> e4m3
    conversion drops the carry when rounding crosses a power of two (126.8 becomes 64, not 128)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP_POW2)
    ok = (offs < K) & (tl.arange(0, GROUP_POW2) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=ok, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 0, MAX_COMBINE)
    scale = tl.maximum(amax / FP8_MAX, TINY)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    if ROUND_FIRST:
        # nearest-even on the e4m3 grid, in fp32: the spacing at q is 2**(max(exponent, -6) - 3) (3 mantissa
        # bits, subnormals below 2**-6); adding then subtracting 1.5 * 2**23 spacings makes fp32 round there
        exponent = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        spacing = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        magic = spacing * 12582912.0
        q = (q + magic) - magic
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale)


@LazyJit
def fp8_gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, stride_om, stride_on,
    QBN, QBK,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``out = (xq * xs) @ (W * ws)^T`` on FP8 tensor cores; activation groups are ``QBK`` wide (= the weight's
    ``bk``), so one K tile has one activation scale per row and one weight scale per column."""
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        group = k0 // QBK
        a_scale = tl.load(xs_ptr + offs_m * stride_xsm + group, mask=m_ok, other=0.0)
        b_scale = tl.load(s_ptr + (offs_n // QBN) * stride_sn + group * stride_sk, mask=n_ok, other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
