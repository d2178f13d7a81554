"""The fused MoE Triton kernels: alignment, expert-grouped GEMM, K-sum combine, decode down-projection GEMV.

Launched from :mod:`.launch`, which picks the path and the tiles.  Interpreter note (checked on Triton 3.9):
``triton.jit`` decides interpreter vs compiler when it *wraps* a function (reading ``TRITON_INTERPRET`` through
``triton.knobs``), and Triton's own helpers ``tl.sum``/``tl.cumsum``/``tl.cdiv``/``tl.zeros`` are wrapped when
``triton`` is imported -- compiled ones raise "Cannot call @triton.jit'd outside of the scope of a kernel"
inside an interpreted kernel.  So these kernels are wrapped lazily at their first launch, once per mode
(``dispatch.LazyJit``), and use only builtins plus ``tl.reduce``/``tl.associative_scan`` with Triton's standard
sum combine function (``dispatch.SUM_COMBINE``, which the interpreter recognises by identity and runs in numpy).
Setting ``TRITON_INTERPRET=1`` before the first call is then enough, whatever was imported before.
Interpreter-only deviations: its ``tl.dot`` multiplies bf16 bit patterns as integers, so bf16 operands are
upcast to fp32 there (``UPCAST``, off when compiled), and its fp32->bf16 conversions truncate instead of
rounding to nearest (tests allow for it).
"""

from __future__ import annotations

from ..dispatch import SUM_COMBINE, LazyJit, tl


@LazyJit
def moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_post_ptr,
    NP,
    E,
    MAX_PADDED,
    NUM_BLOCKS,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per expert; no sort.  Every program histograms all ids (cheap: a few hundred KB
    from L2 at most) to learn where its padded group starts, then writes its pairs in ascending order
    (rank = running count + in-chunk prefix sum), its padding, and its blocks' expert id.  Program 0
    also writes the total and marks the unused tail.  One launch, deterministic."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_POW2)
    counts = tl.full([E_POW2], 0, tl.int32)
    for start in range(0, NP, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < NP, other=-1).to(tl.int32)
        valid = (offs < NP) & (ids >= 0) & (ids < E)
        # invalid ids and the chunk's tail go to the spare bin E (E_POW2 > E), ignored below; no `mask=`
        # argument so older Triton releases (no masked histogram) compile this too
        counts += tl.histogram(tl.where(valid, ids, E), E_POW2)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    my_start = tl.reduce(tl.where(bins < e, padded, 0), 0, SUM_COMBINE)
    my_count = tl.reduce(tl.where(bins == e, counts, 0), 0, SUM_COMBINE)
    my_padded = tl.reduce(tl.where(bins == e, padded, 0), 0, SUM_COMBINE)
    cursor = my_start
    for start in range(0, NP, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < NP, other=-1).to(tl.int32)
        hit = ((offs < NP) & (ids == e)).to(tl.int32)
        rank = tl.associative_scan(hit, 0, SUM_COMBINE) - 1
        tl.store(sorted_ptr + cursor + rank, offs, mask=hit > 0)
        cursor += tl.reduce(hit, 0, SUM_COMBINE)
    pad = my_count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + my_start + pad, tl.full([BLOCK_M], 0, tl.int32) + NP, mask=pad < my_padded)
    first_block = my_start // BLOCK_M
    n_blocks = my_padded // BLOCK_M
    for b in range(0, n_blocks, CHUNK):
        bo = b + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + first_block + bo, tl.full([CHUNK], 0, tl.int32) + e, mask=bo < n_blocks)
    if e == 0:
        total = tl.reduce(padded, 0, SUM_COMBINE)
        tl.store(num_post_ptr, total)
        for b in range(total // BLOCK_M, NUM_BLOCKS, CHUNK):
            bo = b + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + bo, tl.full([CHUNK], -1, tl.int32), mask=bo < NUM_BLOCKS)
        for s in range(total, MAX_PADDED, CHUNK):
            so = s + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + so, tl.full([CHUNK], 0, tl.int32) + NP, mask=so < MAX_PADDED)


@LazyJit
def moe_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    ids_ptr,
    rw_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_post_ptr,
    NP,
    N,
    K,
    NUM_M_BLOCKS,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,
    ALIGNED: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTING: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    SCAN_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Expert-grouped GEMM ``C[pair, n] = epilogue(A[pair // A_ROW_DIV, :] @ W[e, n, :])``.

    GEMM1 (``GATED``): A = hidden (row = pair // K), W = gate_up_w; two accumulators (gate and up rows
    of the same N-tile) so ``act(gate) * up`` is formed in registers and only ``[pairs, I]`` is written.
    GEMM2: A = the intermediate (row = pair), W = down_w, routing weight multiplied in the epilogue.
    Rows are written at their pair index (not their padded position), so no padded buffers exist.

    ``ALIGNED``: grid = (tiles of the padded pair list) x (N-tiles), in GROUP_M super-rows.
    otherwise (small batch): grid = (E, N-tiles); the program compacts the pairs of its expert from the
    ids (one-hot rank match) and loops over them BLOCK_M at a time (one chunk in the common case, so each
    weight tile is read from HBM once for every token that picked the expert).
    """
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
        cnt = tl.program_id(0) * 0  # int32 scalar 0
        for s0 in range(0, NP, SCAN_P):
            q = s0 + tl.arange(0, SCAN_P)
            ids = tl.load(ids_ptr + q, mask=q < NP, other=-1).to(tl.int32)
            cnt += tl.reduce((ids == e).to(tl.int32), 0, SUM_COMBINE)
        if cnt == 0:
            return
        n_chunks = (cnt + BLOCK_M - 1) // BLOCK_M

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if GATED:
        if INTERLEAVED:
            g_rows = 2 * offs_n
            u_rows = 2 * offs_n + 1
        else:
            g_rows = offs_n
            u_rows = offs_n + N
    else:
        g_rows = offs_n
        u_rows = offs_n
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we

    for c in range(0, n_chunks):
        if ALIGNED:
            rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            row_ok = rows < NP
        else:
            # Rows of this chunk = the pairs whose rank among this expert's pairs is in [c*BM, (c+1)*BM):
            # a one-hot match of ranks against slots, SCAN_P ids at a time (the ids are tiny and hit L1/L2),
            # which keeps the [BLOCK_M, SCAN_P] temporaries small (registers) whatever the batch size.
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
        wg_ptrs = w_base + g_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = w_base + u_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, wg, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wg, acc)
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    wu = wu.to(tl.float32)
                if IEEE:
                    acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
                else:
                    acc_u = tl.dot(a, wu, acc_u)
            a_ptrs += BLOCK_K * stride_ak
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk

        if HAS_BIAS:
            b_base = bias_ptr + e.to(tl.int64) * stride_be
            acc += tl.load(b_base + g_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_base + u_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            if ACT == 0:
                acc = acc / (1.0 + tl.exp(-acc))
            elif ACT == 1:
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            elif ACT == 2:
                inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))  # 0.5 * (1 + tanh(inner)) * acc
            else:
                acc = tl.maximum(acc, 0.0)
            acc = acc * acc_u
        if MUL_ROUTING:
            rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@LazyJit
def moe_combine_kernel(
    src_ptr,
    ids_ptr,
    out_ptr,
    H,
    E,
    stride_sp,
    stride_sh,
    stride_ot,
    stride_oh,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k src[t*K + k] in fp32, skipping pairs whose id is outside [0, E) (their rows were
    never written).  Deterministic replacement for atomics / index_add."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.full([BLOCK_H], 0.0, tl.float32)
    for k in tl.static_range(TOPK):
        pair = t * TOPK + k
        eid = tl.load(ids_ptr + pair)
        limit = tl.where((eid >= 0) & (eid < E), H, 0)  # scalar; invalid pair -> nothing loaded
        v = tl.load(src_ptr + pair.to(tl.int64) * stride_sp + offs * stride_sh, mask=offs < limit, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


@LazyJit
def moe_down_gemv_kernel(
    h_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    rw_ptr,
    N,
    K,
    E,
    stride_hp,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_ot,
    stride_on,
    s_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    QBN,
    QBK,
    TOPK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Decode-size GEMM2 + combine: ``out[t, n] = sum_k w[t,k] * (down_w[e_k, n, :] . h[t*K+k, :] + b[e_k, n])``.

    One program per (token, N-tile).  The K experts are unrolled inside each step over I, so K
    independent weight-tile loads are in flight at once (bandwidth), and the routing weight is folded
    into h, so one [BLOCK_N, BLOCK_K] fp32 accumulator serves all K experts and is reduced once at the end.
    Deterministic (no atomics).  Pairs with an id outside [0, E) load nothing.

    ``SCALED``: block-FP8 down stacks (e4m3 ``w``, fp32 scales ``s[e, n // QBN, k // QBK]``).  ``BLOCK_N`` divides
    ``QBN`` (the launcher's business), so a tile's rows share one scale row, the scales vary along K only and are
    folded into ``h`` with the routing weight; e4m3 widens exactly to fp32 (one ``cvt.f32.f16`` per weight after one
    ``cvt.rn.f16x2.e4m3x2`` per two).  Widening without those conversions was slower on an H200, whether by fp16
    tensor-core dots on power-of-two-scaled rows (3x, ``fp8_experts_variants.json``) or by integer ops (1.4-1.6x,
    ``fp8_experts_int.json``): the conversions are not what bounds this GEMV."""
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        for j in tl.static_range(TOPK):
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair)
            limit = tl.where((e >= 0) & (e < E), K, 0)  # scalar: K for a valid expert, 0 masks everything
            e_safe = tl.where(limit > 0, e, 0).to(tl.int64)
            wgt = tl.load(rw_ptr + pair).to(tl.float32)
            if SCALED:
                s = tl.load(s_ptr + e_safe * stride_se + (n0 // QBN) * stride_sn + (kk // QBK) * stride_sk,
                            mask=kk < limit, other=0.0)
                wgt = s * wgt
            h = tl.load(h_ptr + pair.to(tl.int64) * stride_hp + kk * stride_hk, mask=kk < limit, other=0.0)
            w = tl.load(
                w_ptr + e_safe * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk,
                mask=n_ok[:, None] & (kk[None, :] < limit),
                other=0.0,
            )
            acc += w.to(tl.float32) * (h.to(tl.float32) * wgt)[None, :]
    out = tl.reduce(acc, 1, SUM_COMBINE)
    if HAS_BIAS:
        for j in tl.static_range(TOPK):
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair)
            limit = tl.where((e >= 0) & (e < E), N, 0)
            e_safe = tl.where(limit > 0, e, 0).to(tl.int64)
            wgt = tl.load(rw_ptr + pair).to(tl.float32)
            b = tl.load(bias_ptr + e_safe * stride_be + offs_n * stride_bn, mask=offs_n < limit, other=0.0)
            out += wgt * b.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n * stride_on, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@LazyJit
def moe_up_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, c_ptr, ids_ptr,
    N, K, E,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_cm, stride_cn,
    s_ptr, stride_se, stride_sn, stride_sk, QBN, QBK, UP_SCALE_BASE, UP_ROW_SHIFT,
    TOPK: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode-size GEMM1 as a GEMV: ``C[p, n] = act(x[p // TOPK] . G[e_p, n] + bg) * (x[p // TOPK] . U[e_p, n] + bu)``,
    one program per (pair, ``BLOCK_N`` rows).  Gate row ``n`` and up row ``N + n`` of the ``[E, 2N, K]`` stack, or
    rows ``2n`` and ``2n + 1`` (``INTERLEAVED``).  No tensor cores: at one to a few tokens an MMA pads each pair's
    row to 16, and the GEMV reads the same bytes with every row tile's loads in flight.  A pair whose id is outside
    ``[0, E)`` gets zeros.

    ``SCALED``: block-FP8 gate/up stacks (e4m3 ``w``, fp32 scales ``s[e, row // QBN, k // QBK]``; the up half's scale
    rows start at ``UP_SCALE_BASE`` and its row ``n`` sits ``UP_ROW_SHIFT`` rows into them; not interleaved, no
    bias).  ``BLOCK_N`` divides ``QBN`` and ``UP_ROW_SHIFT`` (the launcher's business), so the gate tile and the up
    tile each lie in one scale row and their scales vary along K only: they are folded into two copies of the
    activation vector (``x[k] * s[row, k // QBK]``), and ``BLOCK_K`` may span several quantisation blocks."""
    p = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + p)
    limit = tl.where((e >= 0) & (e < E), K, 0)  # scalar: K for a valid expert, 0 masks every load
    e_safe = tl.where(limit > 0, e, 0).to(tl.int64)
    if INTERLEAVED:
        g_rows = 2 * offs_n
        u_rows = 2 * offs_n + 1
    else:
        g_rows = offs_n
        u_rows = offs_n + N
    w_base = w_ptr + e_safe * stride_we
    wg_rows = w_base + g_rows[:, None].to(tl.int64) * stride_wn
    wu_rows = w_base + u_rows[:, None].to(tl.int64) * stride_wn
    if SCALED:
        s_base = s_ptr + e_safe * stride_se
        sg_row = s_base + (n0 // QBN) * stride_sn
        su_row = s_base + (UP_SCALE_BASE + (n0 + UP_ROW_SHIFT) // QBN) * stride_sn
    x_row = x_ptr + (p // TOPK).to(tl.int64) * stride_xm
    acc_g = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < limit
        w_mask = n_ok[:, None] & k_ok[None, :]
        x = tl.load(x_row + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(wg_rows + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(wu_rows + offs_k[None, :] * stride_wk, mask=w_mask, other=0.0)
        if SCALED:
            sg = tl.load(sg_row + (offs_k // QBK) * stride_sk, mask=k_ok, other=0.0)
            su = tl.load(su_row + (offs_k // QBK) * stride_sk, mask=k_ok, other=0.0)
            acc_g += wg.to(tl.float32) * (x * sg)[None, :]
            acc_u += wu.to(tl.float32) * (x * su)[None, :]
        else:
            acc_g += wg.to(tl.float32) * x[None, :]
            acc_u += wu.to(tl.float32) * x[None, :]
    g = tl.reduce(acc_g, 1, SUM_COMBINE)
    u = tl.reduce(acc_u, 1, SUM_COMBINE)
    if HAS_BIAS:
        b_ok = offs_n < tl.where(limit > 0, N, 0)  # (nothing for an invalid expert)
        b_base = bias_ptr + e_safe * stride_be
        g += tl.load(b_base + g_rows * stride_bn, mask=b_ok, other=0.0).to(tl.float32)
        u += tl.load(b_base + u_rows * stride_bn, mask=b_ok, other=0.0).to(tl.float32)
    if ACT == 0:
        g = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        g = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        g = g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * inner)))
    else:
        g = tl.maximum(g, 0.0)
    tl.store(c_ptr + p.to(tl.int64) * stride_cm + offs_n * stride_cn, (g * u).to(c_ptr.dtype.element_ty), mask=n_ok)
