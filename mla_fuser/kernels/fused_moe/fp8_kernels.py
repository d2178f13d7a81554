"""The block-FP8 expert-grouped GEMM: ``moe_gemm_kernel`` (:mod:`.triton_kernels`) with e4m3 weights and per-expert
block scales, weight-only or (``ACT_QUANT``, from a few tokens: ``fp8_launch.choose_act_quant``) W8A8; for decode
(up to ``launch.GEMV_DOWN_MAX_TOKENS`` tokens) the bf16 op's two GEMVs run instead, with ``SCALED``
(:mod:`.triton_kernels`: ``moe_up_gemv_kernel``, GEMM1 with the activation, and ``moe_down_gemv_kernel``, GEMM2 with
the routing weights and the combine), two launches for the whole experts forward.

Why weight-only: an MoE layer at decode reads six or eight experts' weights for a handful of tokens, so it is bound
by the bytes of weights it reads, which e4m3 halves; the activations stay in their dtype (no quantisation error
added, and no quantisation kernel launched).  Each ``[BLOCK_K, BLOCK_N]`` weight tile is loaded as e4m3 (one byte
per weight), widened to the activations' dtype (exact: every e4m3 value is a bf16/fp16 value), multiplied on the
tensor cores, and the fp32 partial product is scaled per output column by ``scale[e, row(n), k0 // QBK]``
(``BLOCK_K`` divides the quantisation block's ``bk``, so one K tile lies in one scale column).  The gate/up rows'
scale rows follow the stack's layout (``kernels.fp8.experts``): gate row ``n`` -> ``n // QBN``, up row ``n`` ->
``UP_SCALE_BASE + (n + UP_ROW_SHIFT) // QBN``.

Everything else (aligned and small-batch grids, the pair compaction, the fused ``act(gate) * up``, the routing
weight in GEMM2's epilogue, rows written at their pair index) is the bf16 kernel's; see its docstring.  No biases
(Transformers' FP8 experts have none).  Interpreter notes as in :mod:`.triton_kernels` and
:mod:`..fp8.triton_kernels`: it loads e4m3 tiles and widens them correctly; its ``tl.dot`` multiplies bf16 bit
patterns as integers, so ``UPCAST`` widens both operands to fp32 there.  Its fp32 -> e4m3 conversion drops the carry
when rounding crosses a power of two, so under ``UPCAST`` the W8A8 variant rounds to the e4m3 grid in fp32 instead
(as ``fp8.triton_kernels.act_quant_kernel``'s ``ROUND_FIRST``) and multiplies in fp32.
"""

from __future__ import annotations

from ..dispatch import MAX_COMBINE, SUM_COMBINE, LazyJit, tl


@LazyJit
def moe_w8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, c_ptr, ids_ptr, rw_ptr, sorted_ptr, block_expert_ptr, num_post_ptr,
    NP, N, K, NUM_M_BLOCKS,
    stride_am, stride_ak, stride_asm, stride_ask, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_cm, stride_cn,
    QBN, QBK, UP_SCALE_BASE, UP_ROW_SHIFT,
    A_ROW_DIV: tl.constexpr, ALIGNED: tl.constexpr, GATED: tl.constexpr, MUL_ROUTING: tl.constexpr,
    ACT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, SCAN_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT_QUANT: tl.constexpr, A_FP8: tl.constexpr, W_TMA: tl.constexpr = False,
):
    """``C[pair, n] = epilogue(A[pair // A_ROW_DIV, :] @ dequant(W[e])[n, :])``; grids as ``moe_gemm_kernel``.

    ``ACT_QUANT`` (the W8A8 variant; ``BLOCK_K`` is then the quantisation block's ``bk``): each ``[BLOCK_M,
    BLOCK_K]`` activation tile is quantised in registers, one max-abs e4m3 scale per row (the token groups of
    DeepSeek's inference code and of the FP8 linear's tensor-core path, computed where they are used: no extra
    launch), and the e4m3 weight tile goes to the FP8 tensor cores as loaded, never widened.  The product is
    computed transposed, ``W_tile @ A_tile^T`` (``[BLOCK_N, BLOCK_M]``), so that weight rows fill the MMA's 64-row
    side and a handful of tokens its narrow one (Hopper's ``wgmma`` takes 64 rows; a 16-token tile there would pad
    to 64).  ``A_FP8`` (with ``ACT_QUANT``): ``A`` is already e4m3, quantised the same way by a launch of its own
    (``fp8.linear.quantize_token_groups``), its scales at ``as_ptr[row, k0 // BLOCK_K]``: at prefill sizes every
    weight-column tile would otherwise quantise the same activation tile again (``as_ptr`` is unused without it).
    ``W_TMA`` (with ``ACT_QUANT``): ``w_ptr`` is a tensor descriptor of ``[1, BLOCK_N, BLOCK_K]`` boxes over the
    weights ``[E, rows, K]``, and the weight tiles arrive by the Tensor Memory Accelerator (no address per element in
    registers; rows past the stack and a K past the last tile read as zeros, gate rows past ``N`` as up rows, whose
    products the store drops)."""
    if ALIGNED:
        pid = tl.program_id(0)
        num_n = (N + BLOCK_N - 1) // BLOCK_N
        per_group = GROUP_M * num_n
        group = pid // per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(NUM_M_BLOCKS - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m)
        n_chunks = 1
    else:
        e = tl.program_id(0)
        pid_n = tl.program_id(1)
        cnt = tl.program_id(0) * 0
        for s0 in range(0, NP, SCAN_P):
            q = s0 + tl.arange(0, SCAN_P)
            ids = tl.load(ids_ptr + q, mask=q < NP, other=-1).to(tl.int32)
            cnt += tl.reduce((ids == e).to(tl.int32), 0, SUM_COMBINE)
        if cnt == 0:
            return
        n_chunks = (cnt + BLOCK_M - 1) // BLOCK_M

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    g_rows = offs_n
    u_rows = offs_n + N if GATED else offs_n
    offs_k = tl.arange(0, BLOCK_K)
    if not W_TMA:
        w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    sg_rows = s_base + (offs_n // QBN) * stride_sn
    su_rows = s_base + (UP_SCALE_BASE + (offs_n + UP_ROW_SHIFT) // QBN) * stride_sn

    for c in range(0, n_chunks):
        if ALIGNED:
            rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            row_ok = rows < NP
        else:  # the pairs of this expert ranked [c*BM, (c+1)*BM), as in moe_gemm_kernel
            j = c * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = tl.full([BLOCK_M], 0, tl.int32)
            seen = cnt * 0
            for s0 in range(0, NP, SCAN_P):
                q = s0 + tl.arange(0, SCAN_P)
                ids = tl.load(ids_ptr + q, mask=q < NP, other=-1).to(tl.int32)
                hit = (ids == e).to(tl.int32)
                rank = seen + tl.associative_scan(hit, 0, SUM_COMBINE) - 1
                sel = (rank[None, :] == j[:, None]) & (hit[None, :] > 0)
                rows += tl.reduce(tl.where(sel, q[None, :], 0), 1, SUM_COMBINE)
                seen += tl.reduce(hit, 0, SUM_COMBINE)
            row_ok = j < cnt
        a_rows = (rows // A_ROW_DIV).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        if not W_TMA:
            wg_ptrs = w_base + g_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
            wu_ptrs = w_base + u_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        if ACT_QUANT:
            acc_t = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
            acc_ut = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                if A_FP8:
                    aq = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    a_scale = tl.load(as_ptr + a_rows * stride_asm + (k0 // BLOCK_K) * stride_ask, mask=row_ok,
                                      other=0.0)
                    aq_t = tl.trans(aq.to(tl.float32)) if UPCAST else tl.trans(aq)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    # e4m3's largest value 448; a row of zeros keeps a finite scale (as ``fp8.quant``)
                    a_scale = tl.maximum(tl.reduce(tl.abs(a), 1, MAX_COMBINE) / 448.0, 1e-12)
                    aq = a / a_scale[:, None]  # (|aq| <= FP8_MAX: no clamp)
                    if UPCAST:  # interpreter only: round to e4m3 in fp32 (as act_quant_kernel's ROUND_FIRST)
                        exponent = ((aq.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
                        magic = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
                        aq_t = tl.trans((aq + magic) - magic)
                    else:
                        aq_t = tl.trans(aq.to(tl.float8e4nv))
                if W_TMA:  # ([BLOCK_N, BLOCK_K] tiles, as the transposed product takes them)
                    wg_t = w_ptr.load([e, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                else:
                    wg_t = tl.trans(tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0))
                sg = tl.load(sg_rows + (k0 // QBK) * stride_sk, mask=n_ok, other=0.0)
                if UPCAST:
                    part = tl.dot(wg_t.to(tl.float32), aq_t, input_precision="ieee")
                else:
                    part = tl.dot(wg_t, aq_t)
                acc_t += part * sg[:, None] * a_scale[None, :]
                if GATED:
                    if W_TMA:
                        wu_t = w_ptr.load([e, N + pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
                    else:
                        wu_t = tl.trans(tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0))
                    su = tl.load(su_rows + (k0 // QBK) * stride_sk, mask=n_ok, other=0.0)
                    if UPCAST:
                        part_u = tl.dot(wu_t.to(tl.float32), aq_t, input_precision="ieee")
                    else:
                        part_u = tl.dot(wu_t, aq_t)
                    acc_ut += part_u * su[:, None] * a_scale[None, :]
                a_ptrs += BLOCK_K * stride_ak
                if not W_TMA:
                    wg_ptrs += BLOCK_K * stride_wk
                    wu_ptrs += BLOCK_K * stride_wk
            acc = tl.trans(acc_t)
            acc_u = tl.trans(acc_ut)
        else:
            acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
            acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                sg = tl.load(sg_rows + (k0 // QBK) * stride_sk, mask=n_ok, other=0.0)
                if UPCAST:  # interpreter only
                    a = a.to(tl.float32)
                    part = tl.dot(a, wg.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    part = tl.dot(a, wg.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, wg.to(a.dtype))
                acc += part * sg[None, :]
                if GATED:
                    wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    su = tl.load(su_rows + (k0 // QBK) * stride_sk, mask=n_ok, other=0.0)
                    if UPCAST or IEEE:
                        part_u = tl.dot(a, wu.to(tl.float32), input_precision="ieee")
                    else:
                        part_u = tl.dot(a, wu.to(a.dtype))
                    acc_u += part_u * su[None, :]
                a_ptrs += BLOCK_K * stride_ak
                wg_ptrs += BLOCK_K * stride_wk
                wu_ptrs += BLOCK_K * stride_wk

        if GATED:
            if ACT == 0:
                acc = acc / (1.0 + tl.exp(-acc))
            elif ACT == 1:
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            elif ACT == 2:
                inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))
            else:
                acc = tl.maximum(acc, 0.0)
            acc = acc * acc_u
        if MUL_ROUTING:
            rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
