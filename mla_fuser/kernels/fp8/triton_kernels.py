"""The block-FP8 GEMM Triton kernels (launched from :mod:`.linear`, which picks the path, the tiles and the split).

``w8_gemm_kernel`` (weight-only, the small-batch path): ``out = x @ dequant(W)^T`` with ``x`` in its own dtype.
Each weight tile is read as e4m3 (one byte per weight: the memory-bound decode GEMM reads half of bf16's bytes) in
its natural ``[BLOCK_N, BLOCK_K]`` layout (rows of ``W [N, K]`` are contiguous in K: wide, coalesced loads), widened
(exact: every e4m3 value is a bf16/fp16 value) and either transposed into a tensor-core MMA (``DOT``) or, for one to
a few tokens, multiplied and summed in fp32 on the CUDA cores (a GEMV: no MMA padding of one row to 16, no shared
memory round trip).  The fp32 partial product is scaled per output row (``BLOCK_K`` divides the quantisation
block's ``bk``, so one K tile lies in one scale column).  Split-K over ``grid[2]`` programs fills the GPU when
``N`` alone gives few tiles; each split writes its fp32 partial sums to ``[SPLITS, M, N]`` and the split that
finishes a tile last adds them in split order, adds the bias and casts (``FIXUP``, unless ``MLA_FUSER_SPLITK_FIXUP=0``:
deterministic, one atomic ticket per program), or ``splitk_reduce_kernel`` does the same in a second launch.

``w8_gemv_kernel`` (the decode path, up to ``linear.GEMV_MAX_TOKENS`` tokens): one launch per GEMM, the scales folded
into the activations (see its docstring); it needs ``BLOCK_N`` to divide the quantisation block's ``bn``.

``act_quant_kernel`` + ``fp8_gemm_kernel`` (the large-batch path): the activations are quantised per token and
``bk`` features (dynamic max-abs scaling, like DeepSeek's inference code), then both operands go to the FP8 tensor
cores and each K tile's product is scaled by ``x_scale[m] * w_scale[n]`` (one fused multiply-add per accumulator
element when the N tile lies in one weight-scale row, ``SCALAR_B``).  Activation scales are stored group-major
(``[groups, M]``) so that a tile's ``BLOCK_M`` scales are one contiguous load.

Weight rows past ``N`` (and, in the tensor-core GEMM, activation rows past ``M``) are clamped to the last valid row
instead of masked (the store is masked); the weight-only GEMM masks activation rows past ``M`` instead (at one
token, 15 of the 16 rows an MMA needs: zero-filled, not fetched).  K is masked only when ``K`` is not a multiple
of ``BLOCK_K`` (``EVEN_K``).

Compiled for sm_90 (Triton 3.9, on a CPU): the MMA variant's loads are pipelined (``cp.async``),
the GEMV's are not (occupancy hides their latency: few registers, little shared memory); the tensor-core GEMM
waits for each K tile's ``wgmma`` before scaling it, so one CTA never overlaps MMA and scaling -- two CTAs per SM
do (64x128 tiles on 4 warps fit twice), and 128x128 on 4 warps or 128x256 on 8 spill registers.  Loaded from
pointers, even its 128x128 tile on 8 warps holds a register per address and prefetched element: 255 registers and
408 stack bytes of spills (Triton 3.6; 904 in 3.9), where its tiles by TMA (``TMA``: host tensor descriptors, bulk
tensor copies into shared memory) take 156 registers and no stack.

Interpreter notes (Triton 3.9, checked): it loads and stores ``float8e4nv`` and multiplies e4m3 tiles in
``tl.dot``, but multiplies bf16 bit patterns as integers, so ``UPCAST`` widens the operands to fp32 there (off
when compiled).  Wrapped lazily (``dispatch.LazyJit``): builtins and ``tl.reduce`` only.
"""

from __future__ import annotations

from ..dispatch import MAX_COMBINE, SUM_COMBINE, LazyJit, tl


@LazyJit
def w8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, final_ptr, tickets_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_os, stride_om,
    QBN, QBK,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIXUP: tl.constexpr,
    ACT_QUANT: tl.constexpr, W_TMA: tl.constexpr = False,
):
    """``ACT_QUANT`` (W8A8; ``BLOCK_K`` is the quantisation block's ``bk``): each ``[BLOCK_M, BLOCK_K]`` activation
    tile is quantised in registers, one max-abs e4m3 scale per token and ``bk`` features (the tensor-core path's
    groups, ``block_fp8_linear_act_quant_ref``), and the e4m3 weight tile goes to the FP8 tensor cores as loaded; the
    product is computed transposed (``W_tile @ X_tile^T``, ``[BLOCK_N, BLOCK_M]``) so that weight rows fill the MMA's
    64-row side and a few tokens its narrow side, as in ``fused_moe.fp8_kernels``.

    ``FIXUP`` (K split over ``grid[2]``): the split that finishes an output tile last adds the tile's partial sums
    in split order, adds the bias and writes ``final_ptr`` (``splitk_reduce_kernel``'s sums, bit for bit), instead of
    a second launch.  Each split stores its fp32 partial, waits for all its threads (a CTA barrier), then takes a
    ticket from the tile's counter in ``tickets_ptr`` (an atomic add, acquire-release at GPU scope: the release
    publishes the CTA's stores, as in a cooperative grid sync); the split that draws the last ticket reads the
    partials past L1 (``.cg``) and sets the counter back to 0 for the next launch.  Counters start at 0 and no two
    launches in flight share them (``linear.split_tickets``).

    ``W_TMA``: ``w_ptr`` is a tensor descriptor of ``[BLOCK_N, BLOCK_K]`` boxes, and the weight tiles arrive by the
    Tensor Memory Accelerator (rows past ``N`` and a K past the tensor read as zeros)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (rows < M)[:, None]
    x_rows = x_ptr + rows[:, None] * stride_xm
    if not W_TMA:
        w_rows = w_ptr + tl.minimum(cols, N - 1)[:, None] * stride_wn
    s_rows = s_ptr + (tl.minimum(cols, N - 1) // QBN) * stride_sn
    if ACT_QUANT:
        acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    else:
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    k_start = pid_s * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok, other=0.0)
        else:
            k_ok = offs_k[None, :] < K
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok & k_ok, other=0.0)
        if W_TMA:
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            w = tl.load(w_rows + offs_k[None, :] * stride_wk)
        else:
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=k_ok, other=0.0)
        scale = tl.load(s_rows + (k0 // QBK) * stride_sk)
        if ACT_QUANT:
            xf = x.to(tl.float32)
            # e4m3's largest value 448; a row of zeros keeps a finite scale (as ``fp8.quant``)
            x_scale = tl.maximum(tl.reduce(tl.abs(xf), 1, MAX_COMBINE) / 448.0, 1e-12)
            xq = xf / x_scale[:, None]  # (|xq| <= 448: no clamp)
            if UPCAST:  # interpreter only: round to e4m3 in fp32 (as act_quant_kernel's ROUND_FIRST), fp32 dots
                exponent = ((xq.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
                magic = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
                part_t = tl.dot(w.to(tl.float32), tl.trans((xq + magic) - magic), input_precision="ieee")
            else:
                part_t = tl.dot(w, tl.trans(xq.to(tl.float8e4nv)))
            acc += part_t * (scale[:, None] * x_scale[None, :])
        elif not DOT:
            part = tl.reduce(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2, SUM_COMBINE)
        elif UPCAST:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if not ACT_QUANT:
            acc += part * scale[None, :]
    if ACT_QUANT:
        acc = tl.trans(acc)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tile = rows[:, None] * stride_om + cols[None, :]
    if FIXUP:
        tl.store(out_ptr + pid_s * stride_os + tile, acc, mask=ok)
        tl.debug_barrier()  # (every thread's partial stored before the ticket)
        counter = tickets_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
            total = tl.load(out_ptr + tile, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, tl.num_programs(2)):
                total += tl.load(out_ptr + s * stride_os + tile, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
            tl.store(final_ptr + tile, total.to(final_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(counter, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
        tl.store(out_ptr + pid_s * stride_os + tile, acc.to(out_ptr.dtype.element_ty), mask=ok)


@LazyJit
def w8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
    QBN, QBK,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The decode GEMV (one to a few tokens): ``out[m, cols] = x[m] @ dequant(W[cols])^T``, one program per (token,
    ``BLOCK_N`` rows), the whole of K in one launch (no split, no reduction launch).

    ``BLOCK_N`` divides ``QBN``, so a tile's rows share one scale row: the scales then vary along K only and are
    folded into the activation vector (``x[k] * s[k // QBK]``, ``BLOCK_K`` values) instead of the weight tile, which
    lets ``BLOCK_K`` span several quantisation blocks (long, coalesced rows of e4m3).  The fp32 ``[BLOCK_N,
    BLOCK_K]`` products accumulate elementwise and are summed once at the end.  Widening e4m3 to fp32 costs a
    ``cvt.f32.f16`` per weight (after a ``cvt.rn.f16x2.e4m3x2`` per two) at a sixteenth of the FMA rate on sm_90; fp16
    tensor-core dots on a power-of-two-scaled row avoid it but lost on an H200 at every tile swept
    (``fp8_gemv_sweep_mma.json``)."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    s_row = s_ptr + (tl.program_id(1) * BLOCK_N // QBN) * stride_sn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_row + offs_k * stride_xk).to(tl.float32)
            scale = tl.load(s_row + (offs_k // QBK) * stride_sk)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K
            x = tl.load(x_row + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            scale = tl.load(s_row + (offs_k // QBK) * stride_sk, mask=k_ok, other=0.0)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * (x * scale)[None, :]
    out = tl.reduce(acc, 1, SUM_COMBINE)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@LazyJit
def splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum_s part[s] (+ bias)`` over contiguous ``part [SPLITS, M, N]`` fp32 and ``out [M, N]``, in split
    order (the same result every run)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@LazyJit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    K, GROUPS,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sg,
    FP8_MAX: tl.constexpr, TINY: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr,
    BLOCK_G: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    """One program per (token, ``BLOCK_G`` groups of ``GROUP`` features): max-abs scale, e4m3 values.
    ``ROUND_FIRST`` (the interpreter only) rounds to the e4m3 grid in fp32 before the conversion: the interpreter's
    own fp32 -> e4m3 conversion drops the carry when rounding crosses a power of two (126.8 becomes 64, not 128)."""
    row = tl.program_id(0)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP_POW2)
    offs = groups[:, None] * GROUP + cols[None, :]
    ok = (offs < K) & (cols < GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=ok, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 1, MAX_COMBINE)
    scale = tl.maximum(amax / FP8_MAX, TINY)
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)
    if ROUND_FIRST:
        # nearest-even on the e4m3 grid, in fp32: the spacing at q is 2**(max(exponent, -6) - 3) (3 mantissa
        # bits, subnormals below 2**-6); adding then subtracting 1.5 * 2**23 spacings makes fp32 round there
        exponent = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        spacing = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        magic = spacing * 12582912.0
        q = (q + magic) - magic
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < GROUPS)


@LazyJit
def fp8_gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
    QBN, QBK,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SCALAR_B: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """``out = (xq * xs) @ (W * ws)^T`` on FP8 tensor cores; activation groups are ``QBK`` wide (= the weight's
    ``bk``), so one K tile has one activation scale per row and one weight scale per column (one per tile when
    ``SCALAR_B``: ``BLOCK_N`` divides ``QBN``).  Programs walk ``GROUP_M`` row tiles per column tile (L2 reuse).
    With ``TMA``, ``xq_ptr`` and ``w_ptr`` are tensor descriptors of ``[BLOCK_M, BLOCK_K]`` and ``[BLOCK_N, BLOCK_K]``
    boxes: the tiles arrive by the Tensor Memory Accelerator (no address per element in registers; rows and columns
    past the tensor read as zeros)."""
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if not TMA:
        a_rows = xq_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm
        b_rows = w_ptr + tl.minimum(cols, N - 1)[:, None] * stride_wn
    a_scales = xs_ptr + tl.minimum(rows, M - 1) * stride_xsm
    if SCALAR_B:
        b_scales = s_ptr + (pid_n * BLOCK_N // QBN) * stride_sn
    else:
        b_scales = s_ptr + (tl.minimum(cols, N - 1) // QBN) * stride_sn
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if TMA:
            a = xq_ptr.load([pid_m * BLOCK_M, k0])
            b = w_ptr.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            a = tl.load(a_rows + offs_k[None, :])
            b = tl.load(b_rows + offs_k[None, :] * stride_wk)
        else:
            k_ok = offs_k[None, :] < K
            a = tl.load(a_rows + offs_k[None, :], mask=k_ok, other=0.0)
            b = tl.load(b_rows + offs_k[None, :] * stride_wk, mask=k_ok, other=0.0)
        group = k0 // QBK
        a_scale = tl.load(a_scales + group * stride_xsk)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        if SCALAR_B:
            acc += part * (a_scale * tl.load(b_scales + group * stride_sk))[:, None]
        else:
            acc += part * a_scale[:, None] * tl.load(b_scales + group * stride_sk)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])
