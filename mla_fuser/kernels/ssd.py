"""Mamba-2 SSD: chunked scan for prefill and the single-step state update for decode.

Why a kernel: transformers' torch fallback (``mamba2_chunk_scan``) builds ``[B, chunks, Q, Q, H]``
decay and score tensors and several ``[B, chunks, H, P, N]`` fp32 state tensors in memory; each einsum
is a separate launch.  Here a single launch does it all with the state in registers:

one program = one (batch row, head, block of ``BLOCK_P`` head channels); it walks the sequence
``BLOCK_L`` tokens at a time (the SSD "chunked" form), and for each chunk

* ``cs = cumsum(dt * A)`` inside the chunk (the log of the decay from the chunk start),
* intra-chunk (quadratic) term: ``y = ((C B^T) * exp(cs_t - cs_s) * dt_s * [s <= t]) @ x`` with two
  ``tl.dot``\\ s (tensor cores for bf16/fp16),
* inter-chunk term: ``y += exp(cs_t) * (C @ state^T)``, the carried state seen through ``C``,
* ``y += D x``, ``y *= silu(z)``; store,
* state carry: ``state = exp(cs_last) * state + x^T @ (B * exp(cs_last - cs_s) * dt_s)``.

Every decay factor is ``exp`` of a non-positive number (A < 0, dt >= 0), so nothing overflows.  The
result does not depend on the chunk length mathematically; ``chunk_size`` is accepted for API
compatibility and the kernel picks its own tile (``BLOCK_L``, at most 64 tokens) to keep registers in
check.  Groups: head ``h`` reads ``B``/``C`` group ``h // (H / G)``.

Semantics follow ``mamba_ssm``'s ``mamba_chunk_scan_combined`` (what transformers calls when installed):
``dt = dt + dt_bias``, ``softplus`` if asked (identity above 20), clamp to ``dt_limit`` only when it is
not the default ``(0, inf)``; output in x's dtype; final state ``[B, H, P, N]`` fp32; ``seq_idx``
(``[B, L]``, non-decreasing ids of packed sequences) stops state from crossing sequence boundaries, and
``initial_states`` belongs to the sequence at position 0.  Multiplications that feed ``tl.dot`` round
their operands to the input dtype, as mamba_ssm does; for fp32 inputs the dots run in IEEE fp32.

The decode step (``ssd_state_update``) is the generic selective state update of
:mod:`.selective_scan` fed with broadcast views: one exp per (head, row) since A is per head.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import SUM_COMBINE, LazyJit, cdiv, kernel_op, next_pow2, tl, triton_interpreting, use_triton
from .selective_scan import selective_state_update, selective_state_update_ref

__all__ = [
    "mamba_chunk_scan_combined",
    "ssd_chunk_scan",
    "ssd_chunk_scan_ref",
    "ssd_state_update",
    "ssd_state_update_ref",
]

_INF = float("inf")


def _process_dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, _INF):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


# ----------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    initial_states: Optional[torch.Tensor] = None,
    dt_limit: tuple = (0.0, _INF),
    *,
    seq_idx: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Token-by-token fp32 recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``.

    No chunking at all (``chunk_size`` is ignored): the plain definition the chunked kernel must equal.
    Returns ``(y [B, L, H, P] in x's dtype, final_state [B, H, P, N] fp32)``.
    """
    bsz, seqlen, heads, hdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    rep = heads // groups
    d = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, L, H]
    Bh = B.float().repeat_interleave(rep, dim=2)  # [B, L, H, N]
    Ch = C.float().repeat_interleave(rep, dim=2)
    x32 = x.float()
    A32 = A.float()
    if initial_states is not None:
        h = initial_states.float().clone()
    else:
        h = torch.zeros(bsz, heads, hdim, dstate, dtype=torch.float32, device=x.device)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            h = h * (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None, None, None]
        decay = torch.exp(d[:, t] * A32)  # [B, H]
        h = h * decay[:, :, None, None] + (d[:, t, :, None] * x32[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)  # [B, L, H, P]
    if D is not None:
        Dv = D.float() if D.dim() == 2 else D.float()[:, None]
        y = y + x32 * Dv
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), h


def _expand_update_args(state, dt, A, D, dt_bias):
    """Compact Mamba-2 decode arguments (dt [B,H], A [H], D [H], dt_bias [H]) -> broadcast views."""
    heads, hdim, dstate = state.shape[1:]
    if dt.dim() == 2:
        dt = dt[..., None].expand(-1, -1, hdim)
    if A.dim() == 1:
        A = A[:, None, None].expand(heads, hdim, dstate)
    if D is not None and D.dim() == 1:
        D = D[:, None].expand(heads, hdim)
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias[:, None].expand(heads, hdim)
    return dt, A, D, dt_bias


def ssd_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Torch twin of :func:`ssd_state_update` (state in place, y in x's dtype)."""
    dt, A, D, dt_bias = _expand_update_args(state, dt, A, D, dt_bias)
    return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


# ----------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------


@LazyJit
def _ssd_chunk_scan_fwd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, init_ptr, seq_ptr, out_ptr, final_ptr,
    L, P, N, HEADS_PER_GROUP, dt_min, dt_max,
    stride_xb, stride_xl, stride_xh, stride_xp,
    stride_db, stride_dl, stride_dh,
    stride_bb, stride_bl, stride_bg, stride_bn,
    stride_cb, stride_cl, stride_cg, stride_cn,
    stride_Dh, stride_Dp,
    stride_zb, stride_zl, stride_zh, stride_zp,
    stride_ib, stride_ih, stride_ip, stride_in,
    stride_sb, stride_sl,
    stride_ob, stride_ol, stride_oh, stride_op,
    stride_fb, stride_fh, stride_fp, stride_fn,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    group = pid_h // HEADS_PER_GROUP
    LOG2E: tl.constexpr = 1.4426950408889634

    a_h = tl.load(A_ptr + pid_h).to(tl.float32) * LOG2E  # decays below are exp2(cs) with cs in log2 units
    if HAS_DT_BIAS:
        dtb = tl.load(dtb_ptr + pid_h).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + pid_h * stride_Dh + offs_p * stride_Dp, mask=mask_p, other=0.0).to(tl.float32)

    x_base = x_ptr + pid_b * stride_xb + pid_h * stride_xh + offs_p[None, :] * stride_xp
    z_base = z_ptr + pid_b * stride_zb + pid_h * stride_zh + offs_p[None, :] * stride_zp
    o_base = out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_p[None, :] * stride_op
    b_base = B_ptr + pid_b * stride_bb + group * stride_bg + offs_n[None, :] * stride_bn
    c_base = C_ptr + pid_b * stride_cb + group * stride_cg + offs_n[None, :] * stride_cn
    dt_base = dt_ptr + pid_b * stride_db + pid_h * stride_dh

    if HAS_INIT:
        state = tl.load(
            init_ptr + pid_b * stride_ib + pid_h * stride_ih + offs_p[:, None] * stride_ip + offs_n[None, :] * stride_in,
            mask=mask_p[:, None] & mask_n[None, :], other=0.0,
        ).to(tl.float32)
    else:
        state = tl.full((BLOCK_P, BLOCK_N), 0.0, tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]
    if HAS_SEQ:
        seq_prev = tl.load(seq_ptr + pid_b * stride_sb)

    for c0 in range(0, L, BLOCK_L):
        t = (c0 + offs_l).to(tl.int64)  # token offsets times strides can pass 2**31
        mask_t = t < L
        dt = tl.load(dt_base + t * stride_dl, mask=mask_t, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += dtb
        if SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        if HAS_DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dt = tl.where(mask_t, dt, 0.0)
        dA = dt * a_h
        cs = tl.associative_scan(dA, 0, SUM_COMBINE)  # [L]
        cs_last = tl.reduce(dA, 0, SUM_COMBINE)

        xc = tl.load(x_base + t[:, None] * stride_xl, mask=mask_t[:, None] & mask_p[None, :], other=0.0)
        in_ty = xc.dtype
        bc = tl.load(b_base + t[:, None] * stride_bl, mask=mask_t[:, None] & mask_n[None, :], other=0.0)
        cc = tl.load(c_base + t[:, None] * stride_cl, mask=mask_t[:, None] & mask_n[None, :], other=0.0)
        # Dot operands are rounded to the input dtype (tensor cores for bf16/fp16).  Triton's
        # interpreter (3.9) multiplies bf16 tiles as their raw uint16 bits, so under it the rounded
        # tiles are widened back to fp32 (UPCAST_DOT): the same numbers as a bf16 -> fp32 dot.
        xd = xc.to(in_ty)
        bd = bc.to(in_ty)
        cd = cc.to(in_ty)
        if UPCAST_DOT:
            xd = xd.to(tl.float32)
            bd = bd.to(tl.float32)
            cd = cd.to(tl.float32)

        if HAS_SEQ:
            seq_t = tl.load(seq_ptr + pid_b * stride_sb + t * stride_sl, mask=mask_t, other=-1)
            last_t = tl.minimum(c0 + BLOCK_L, L) - 1
            seq_last = tl.load(seq_ptr + pid_b * stride_sb + last_t * stride_sl)

        # intra-chunk: scores C_t . B_s, decayed and causally masked
        cb = tl.dot(cd, tl.trans(bd), input_precision=DOT_PREC)  # [L, L] fp32
        keep = causal
        if HAS_SEQ:
            keep = keep & (seq_t[:, None] == seq_t[None, :])
        seg = tl.where(keep, cs[:, None] - cs[None, :], float("-inf"))
        m = cb * tl.exp2(seg) * dt[None, :]
        md = m.to(in_ty)
        if UPCAST_DOT:
            md = md.to(tl.float32)
        y = tl.dot(md, xd, input_precision=DOT_PREC)  # [L, P]

        # inter-chunk: the carried state seen through C, decayed from the chunk start
        sd = state.to(in_ty)
        if UPCAST_DOT:
            sd = sd.to(tl.float32)
        y_off = tl.dot(cd, tl.trans(sd), input_precision=DOT_PREC)  # [L, P]
        row_decay = tl.exp2(cs)
        if HAS_SEQ:
            row_decay = tl.where(seq_t == seq_prev, row_decay, 0.0)
        y += y_off * row_decay[:, None]

        if HAS_D:
            y += xc.to(tl.float32) * Dv[None, :]
        m_lp = mask_t[:, None] & mask_p[None, :]
        if HAS_Z:
            zv = tl.load(z_base + t[:, None] * stride_zl, mask=m_lp, other=0.0).to(tl.float32)
            y = y * zv / (1.0 + tl.exp(-zv))
        tl.store(o_base + t[:, None] * stride_ol, y.to(out_ptr.dtype.element_ty), mask=m_lp)

        # carry the state to the end of the chunk
        w = tl.exp2(cs_last - cs) * dt  # [L]
        state_decay = tl.exp2(cs_last)
        if HAS_SEQ:
            w = tl.where(seq_t == seq_last, w, 0.0)
            state_decay = tl.where(seq_last == seq_prev, state_decay, 0.0)
            seq_prev = seq_last
        bw = (bc.to(tl.float32) * w[:, None]).to(in_ty)
        if UPCAST_DOT:
            bw = bw.to(tl.float32)
        state = state * state_decay + tl.dot(tl.trans(xd), bw, input_precision=DOT_PREC)  # [P, N]

    tl.store(
        final_ptr + pid_b * stride_fb + pid_h * stride_fh + offs_p[:, None] * stride_fp + offs_n[None, :] * stride_fn,
        state, mask=mask_p[:, None] & mask_n[None, :],
    )


def _ssd_launch(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, seq_idx, dt_min, dt_max,
                block_l=None, block_p=None, num_warps=None, num_stages=None):
    bsz, seqlen, heads, hdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    if heads % groups:
        raise ValueError(f"{heads} heads are not divisible into {groups} groups")
    out = torch.empty(bsz, seqlen, heads, hdim, dtype=x.dtype, device=x.device)
    final = torch.empty(bsz, heads, hdim, dstate, dtype=torch.float32, device=x.device)
    block_n = max(16, next_pow2(dstate))
    if triton_interpreting():
        block_l = block_l or 16
        block_p = block_p or 16
    else:
        # H200, 80 heads x 64, N=128, L=2048 (bench --sweep): 64-token tiles over whole heads with 4 warps
        # (0.16 ms) beat splitting heads into 16/32-channel blocks for more programs (0.2-0.5 ms)
        block_l = block_l or 64
        block_p = block_p or 64
    block_p = max(16, min(block_p, next_pow2(hdim)))
    num_warps = num_warps or 4
    upcast_dot = triton_interpreting() and x.dtype != torch.float32
    dot_prec = "ieee" if x.dtype == torch.float32 or upcast_dot else "tf32"
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    D_t = D if D is not None else x[0, 0]
    if D_t.dim() == 1:  # D [H]: same value for all channels of a head
        D_strides = (D_t.stride(0), 0)
    else:
        D_strides = (D_t.stride(0), D_t.stride(1))
    z_t = z if z is not None else x
    init_t = initial_states if initial_states is not None else final
    seq_t = seq_idx if seq_idx is not None else dt[:, :, 0]
    dtb_t = dt_bias if dt_bias is not None else A
    extra = {} if num_stages is None else {"num_stages": num_stages}
    grid = (cdiv(hdim, block_p), heads, bsz)
    _ssd_chunk_scan_fwd_kernel[grid](
        x, dt, A, B, C, D_t, z_t, dtb_t, init_t, seq_t, out, final,
        seqlen, hdim, dstate, heads // groups, float(dt_min), float(dt_max),
        x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2), B.stride(3),
        C.stride(0), C.stride(1), C.stride(2), C.stride(3),
        D_strides[0], D_strides[1],
        z_t.stride(0), z_t.stride(1), z_t.stride(2), z_t.stride(3),
        init_t.stride(0), init_t.stride(1), init_t.stride(2), init_t.stride(3),
        seq_t.stride(0), seq_t.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        final.stride(0), final.stride(1), final.stride(2), final.stride(3),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus),
        HAS_DT_LIMIT=(float(dt_min), float(dt_max)) != (0.0, _INF),
        HAS_INIT=initial_states is not None,
        HAS_SEQ=seq_idx is not None,
        DOT_PREC=dot_prec,
        UPCAST_DOT=upcast_dot,
        BLOCK_L=block_l,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **extra,
    )
    return out, final


# ----------------------------------------------------------------------------------------------------
# custom op (opaque to torch.compile / dynamo; fake impl gives shapes; eager calls skip the dispatcher)
# ----------------------------------------------------------------------------------------------------


@kernel_op("ssd_chunk_scan_fwd")
def _ssd_chunk_scan_fwd_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
    initial_states: Optional[torch.Tensor],
    seq_idx: Optional[torch.Tensor],
    dt_min: float,
    dt_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ssd_launch(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, seq_idx, dt_min, dt_max)


@_ssd_chunk_scan_fwd_op.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, seq_idx, dt_min, dt_max):
    bsz, seqlen, heads, hdim = x.shape
    return x.new_empty(bsz, seqlen, heads, hdim), x.new_empty(bsz, heads, hdim, B.shape[-1], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    initial_states: Optional[torch.Tensor] = None,
    dt_limit: tuple = (0.0, _INF),
    *,
    seq_idx: Optional[torch.Tensor] = None,
):
    """Mamba-2 SSD prefill: ``x [B, L, H, P]``, ``dt [B, L, H]``, ``A [H]``, ``B, C [B, L, G, N]``,
    ``D [H] | [H, P]``, ``z [B, L, H, P]``, ``dt_bias [H]``, ``initial_states [B, H, P, N]``.

    Returns ``(y [B, L, H, P] in x's dtype, final_state [B, H, P, N] fp32)``.  Inference only.
    """
    if use_triton(x, dt, A, B, C):
        return _ssd_chunk_scan_fwd_op(x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), initial_states, seq_idx,
                                      float(dt_limit[0]), float(dt_limit[1]))
    return ssd_chunk_scan_ref(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states, dt_limit, seq_idx=seq_idx
    )


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: tuple = (0.0, _INF),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    **kwargs,
):
    """Drop-in for ``mamba_ssm``'s ``mamba_chunk_scan_combined`` and transformers' ``mamba2_chunk_scan``
    (same parameter names and order): returns ``out`` or ``(out, final_states)``.

    ``return_varlen_states`` (per-sequence final states of a packed row) is not implemented.
    """
    if return_varlen_states:
        raise NotImplementedError("return_varlen_states is not supported by mla_fuser's SSD kernel")
    out, final = ssd_chunk_scan(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states, dt_limit, seq_idx=seq_idx
    )
    return (out, final) if return_final_states else out


def ssd_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Mamba-2 decode step: ``state [B, H, P, N]`` (updated in place), ``x, z [B, H, P]``, ``dt [B, H]``
    (or ``[B, H, P]``), ``A [H]`` (or ``[H, P, N]``), ``B, C [B, G, N]``, ``D [H] | [H, P]``,
    ``dt_bias [H]`` (or ``[H, P]``).  Returns ``y [B, H, P]`` in x's dtype."""
    dt, A, D, dt_bias = _expand_update_args(state, dt, A, D, dt_bias)
    return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
