"""Mamba-1 selective scan (prefill) and the selective state update (one decode step, Mamba-1 and -2).

Why a kernel: transformers' torch fallback materialises ``exp(delta * A)`` and ``delta * B * u`` as
``[B, I, L, N]`` fp32 tensors and then loops over ``L`` in Python, one small launch per token.  Here one
program owns ``BLOCK_I`` channels of one batch row and walks the sequence with the ``[BLOCK_I, N]``
state in fp32 registers; nothing of size ``N`` per token ever reaches memory.  Inside the program the
sequence is taken ``BLOCK_T`` tokens at a time: the tile's ``(decay, input)`` pairs are combined with
``tl.associative_scan`` (the recurrence ``h_t = a_t h_{t-1} + b_t`` is associative in ``(a, b)``), then
the carried state enters as ``h_t = A_t h_prev + B_t``.  That keeps the loads of a tile independent of
the carry, so memory latency is paid once per tile rather than once per token.

Semantics follow ``mamba_ssm``'s ``selective_scan_fn`` (what transformers calls when it is installed):

* ``u, delta, z: [B, I, L]``; ``A: [I, N]`` (real); ``B, C: [B, N, L]`` or grouped ``[B, G, N, L]``;
  ``D, delta_bias: [I]``.  Any strides (the mixer passes transposed views).
* ``delta = softplus(delta + delta_bias)`` in fp32 (softplus is the identity above 20, as in torch);
  ``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``, ``y_t = C_t . h_t + D u_t``, ``y *= silu(z)``.
* output in ``u``'s dtype; ``last_state [B, I, N]`` in fp32 (``return_last_state``).
* extra (not in ``selective_scan_fn``): ``seq_idx [B, L]`` restarts the state where the sequence id
  changes (packed variable-length rows).

``selective_state_update`` is ``mamba_ssm``'s function of the same name: both layouts (Mamba-1
``state [B, I, N]``, Mamba-2 ``state [B, H, P, N]``) run one kernel, with broadcast (stride-0) ``dt``,
``A``, ``D``, ``dt_bias`` costing nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import SUM_COMBINE, LazyJit, cdiv, kernel_op, next_pow2, tl, triton, triton_interpreting, use_triton

__all__ = [
    "selective_scan",
    "selective_scan_ref",
    "selective_state_update",
    "selective_state_update_ref",
]


# ----------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------


def _expand_groups(BC: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, N, L] or [B, G, N, L] -> [B, I, N, L] (each group serves I / G consecutive channels)."""
    if BC.dim() == 3:
        return BC[:, None].expand(BC.shape[0], dim, BC.shape[1], BC.shape[2])
    groups = BC.shape[1]
    return BC.repeat_interleave(dim // groups, dim=1)


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    seq_idx: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Plain sequential fp32 scan, one token at a time: the definition the kernel is checked against."""
    dtype_in = u.dtype
    bsz, dim, seqlen = u.shape
    u32 = u.float()
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if delta_softplus:
        dt = F.softplus(dt)  # threshold 20, like mamba_ssm
    A32 = A.float()
    B32 = _expand_groups(B.float(), dim)
    C32 = _expand_groups(C.float(), dim)
    h = torch.zeros(bsz, dim, A.shape[-1], dtype=torch.float32, device=u.device)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None, None]
            h = h * keep
        dA = torch.exp(dt[:, :, t, None] * A32)
        h = dA * h + (dt[:, :, t] * u32[:, :, t])[:, :, None] * B32[:, :, :, t]
        ys.append((h * C32[:, :, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u32 * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype_in)
    return (y, h) if return_last_state else y


def _state_update_views(state, x, dt, A, B, C, D, z, dt_bias):
    """Bring both mamba_ssm layouts to the 4-D one: state [B,H,P,N], x/dt/z [B,H,P], A [H,P,N],
    B/C [B,G,N], D/dt_bias [H,P] (views only)."""
    if state.dim() == 3:  # Mamba-1: heads = 1, P = I
        state = state[:, None]
        x, dt = x[:, None], dt[:, None]
        z = z[:, None] if z is not None else None
        A = A[None]
        B, C = B[:, None], C[:, None]
        D = D[None] if D is not None else None
        dt_bias = dt_bias[None] if dt_bias is not None else None
    return state, x, dt, A, B, C, D, z, dt_bias


def selective_state_update_ref(
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
    """One recurrence step in fp32; writes the new state into ``state`` (its dtype), returns y (x's dtype)."""
    squeeze = state.dim() == 3
    s4, x4, dt4, A4, B4, C4, D4, z4, bias4 = _state_update_views(state, x, dt, A, B, C, D, z, dt_bias)
    heads = s4.shape[1]
    groups = B4.shape[1]
    d = dt4.float()
    if bias4 is not None:
        d = d + bias4.float()
    if dt_softplus:
        d = F.softplus(d)
    Bh = B4.float().repeat_interleave(heads // groups, dim=1)[:, :, None, :]  # [B, H, 1, N]
    Ch = C4.float().repeat_interleave(heads // groups, dim=1)[:, :, None, :]
    new = s4.float() * torch.exp(d[..., None] * A4.float()) + (d * x4.float())[..., None] * Bh
    s4.copy_(new.to(s4.dtype))
    y = (new * Ch).sum(-1)
    if D4 is not None:
        y = y + x4.float() * D4.float()
    if z4 is not None:
        y = y * F.silu(z4.float())
    y = y.to(x.dtype)
    return y[:, 0] if squeeze else y


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------

if triton is not None:
    # A combine function, not a launched kernel: tl.associative_scan needs it jitted already, so it is built
    # at import (hence the guard) rather than wrapped in LazyJit.

    @triton.jit
    def _linear_recurrence_combine(a_l, b_l, a_r, b_r):
        # (a_l, b_l) then (a_r, b_r):  h -> a_r (a_l h + b_l) + b_r
        return a_l * a_r, a_r * b_l + b_r


@LazyJit
def _selective_scan_fwd_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, seq_ptr, out_ptr, last_ptr,
    DIM, L, N, CH_PER_GROUP,
    stride_ub, stride_ui, stride_ul,
    stride_db, stride_di, stride_dl,
    stride_ai, stride_an,
    stride_bb, stride_bg, stride_bn, stride_bl,
    stride_cb, stride_cg, stride_cn, stride_cl,
    stride_zb, stride_zi, stride_zl,
    stride_sb, stride_sl,
    stride_ob, stride_oi, stride_ol,
    stride_hb, stride_hi, stride_hn,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    STORE_LAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_i = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_i = offs_i < DIM
    mask_n = offs_n < N
    group = (pid_i * BLOCK_I) // CH_PER_GROUP  # the launcher keeps a block inside one group

    LOG2E: tl.constexpr = 1.4426950408889634
    A = tl.load(A_ptr + offs_i[:, None] * stride_ai + offs_n[None, :] * stride_an,
                mask=mask_i[:, None] & mask_n[None, :], other=0.0).to(tl.float32) * LOG2E
    if HAS_D:
        Dv = tl.load(D_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dtb = tl.load(dtb_ptr + offs_i, mask=mask_i, other=0.0).to(tl.float32)

    u_base = u_ptr + pid_b * stride_ub + offs_i[:, None] * stride_ui
    dt_base = dt_ptr + pid_b * stride_db + offs_i[:, None] * stride_di
    z_base = z_ptr + pid_b * stride_zb + offs_i[:, None] * stride_zi
    o_base = out_ptr + pid_b * stride_ob + offs_i[:, None] * stride_oi
    b_base = B_ptr + pid_b * stride_bb + group * stride_bg + offs_n[:, None] * stride_bn
    c_base = C_ptr + pid_b * stride_cb + group * stride_cg + offs_n[:, None] * stride_cn

    h = tl.full((BLOCK_I, BLOCK_N), 0.0, tl.float32)
    if HAS_SEQ:
        seq_prev = tl.load(seq_ptr + pid_b * stride_sb)
    if PREFETCH:  # tile 0's raw inputs; inside the loop the next tile's loads overlap this one's math
        m0_it = mask_i[:, None] & (offs_t < L)[None, :]
        m0_nt = mask_n[:, None] & (offs_t < L)[None, :]
        u_nx = tl.load(u_base + offs_t[None, :] * stride_ul, mask=m0_it, other=0.0)
        dt_nx = tl.load(dt_base + offs_t[None, :] * stride_dl, mask=m0_it, other=0.0)
        b_nx = tl.load(b_base + offs_t[None, :] * stride_bl, mask=m0_nt, other=0.0)
        c_nx = tl.load(c_base + offs_t[None, :] * stride_cl, mask=m0_nt, other=0.0)
    for t0 in range(0, L, BLOCK_T):
        t = (t0 + offs_t).to(tl.int64)  # token offsets times strides can pass 2**31
        mask_t = t < L
        m_it = mask_i[:, None] & mask_t[None, :]
        m_nt = mask_n[:, None] & mask_t[None, :]
        if PREFETCH:
            u = u_nx.to(tl.float32)
            dt = dt_nx.to(tl.float32)
            Bt = b_nx.to(tl.float32)
            Ct = c_nx.to(tl.float32)
            tn = t + BLOCK_T
            mn_it = mask_i[:, None] & (tn < L)[None, :]
            mn_nt = mask_n[:, None] & (tn < L)[None, :]
            u_nx = tl.load(u_base + tn[None, :] * stride_ul, mask=mn_it, other=0.0)
            dt_nx = tl.load(dt_base + tn[None, :] * stride_dl, mask=mn_it, other=0.0)
            b_nx = tl.load(b_base + tn[None, :] * stride_bl, mask=mn_nt, other=0.0)
            c_nx = tl.load(c_base + tn[None, :] * stride_cl, mask=mn_nt, other=0.0)
        else:
            u = tl.load(u_base + t[None, :] * stride_ul, mask=m_it, other=0.0).to(tl.float32)
            dt = tl.load(dt_base + t[None, :] * stride_dl, mask=m_it, other=0.0).to(tl.float32)
            Bt = tl.load(b_base + t[None, :] * stride_bl, mask=m_nt, other=0.0).to(tl.float32)
            Ct = tl.load(c_base + t[None, :] * stride_cl, mask=m_nt, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += dtb[:, None]
        if SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        dt = tl.where(m_it, dt, 0.0)  # padded tokens: decay 1, input 0 -> state unchanged

        dA = tl.exp2(dt[:, None, :] * A[:, :, None])  # [I, N, T]
        dBu = (dt * u)[:, None, :] * Bt[None, :, :]
        if HAS_SEQ:
            seq_t = tl.load(seq_ptr + pid_b * stride_sb + t * stride_sl, mask=mask_t, other=0)
            seq_before = tl.load(seq_ptr + pid_b * stride_sb + (t - 1) * stride_sl, mask=mask_t & (t > 0), other=0)
            seq_before = tl.where(offs_t == 0, seq_prev, seq_before)
            restart = (seq_t != seq_before) & mask_t
            dA = tl.where(restart[None, None, :], 0.0, dA)
            seq_prev = tl.load(seq_ptr + pid_b * stride_sb + tl.minimum(t0 + BLOCK_T, L).to(tl.int64) * stride_sl - stride_sl)
        a_cum, b_cum = tl.associative_scan((dA, dBu), axis=2, combine_fn=_linear_recurrence_combine)
        hs = a_cum * h[:, :, None] + b_cum  # state after each token of the tile
        y = tl.reduce(hs * Ct[None, :, :], 1, SUM_COMBINE)  # [I, T]
        h = tl.reduce(tl.where((offs_t == BLOCK_T - 1)[None, None, :], hs, 0.0), 2, SUM_COMBINE)
        if HAS_D:
            y += u * Dv[:, None]
        if HAS_Z:
            zv = tl.load(z_base + t[None, :] * stride_zl, mask=m_it, other=0.0).to(tl.float32)
            y = y * zv / (1.0 + tl.exp(-zv))
        tl.store(o_base + t[None, :] * stride_ol, y.to(out_ptr.dtype.element_ty), mask=m_it)

    if STORE_LAST:
        tl.store(last_ptr + pid_b * stride_hb + offs_i[:, None] * stride_hi + offs_n[None, :] * stride_hn,
                 h, mask=mask_i[:, None] & mask_n[None, :])


@LazyJit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, out_ptr,
    P, N, HEADS_PER_GROUP,
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xh, stride_xp,
    stride_db, stride_dh, stride_dp,
    stride_ah, stride_ap, stride_an,
    stride_bb, stride_bg, stride_bn,
    stride_cb, stride_cg, stride_cn,
    stride_Dh, stride_Dp,
    stride_zb, stride_zh, stride_zp,
    stride_tbh, stride_tbp,
    stride_ob, stride_oh, stride_op,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    A_PER_HEAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program: BLOCK_P rows of one head's [P, N] state; read, update in fp32, write back.
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    m_pn = mask_p[:, None] & mask_n[None, :]
    group = pid_h // HEADS_PER_GROUP

    s_ptrs = state_ptr + pid_b * stride_sb + pid_h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    s = tl.load(s_ptrs, mask=m_pn, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * stride_xb + pid_h * stride_xh + offs_p * stride_xp, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * stride_db + pid_h * stride_dh + offs_p * stride_dp, mask=mask_p, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dtb_ptr + pid_h * stride_tbh + offs_p * stride_tbp, mask=mask_p, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if A_PER_HEAD:  # Mamba-2: one scalar A per head -> one exp per row
        a = tl.load(A_ptr + pid_h * stride_ah).to(tl.float32)
        dA = tl.exp(dt * a)[:, None]
    else:
        A = tl.load(A_ptr + pid_h * stride_ah + offs_p[:, None] * stride_ap + offs_n[None, :] * stride_an,
                    mask=m_pn, other=0.0).to(tl.float32)
        dA = tl.exp(dt[:, None] * A)
    Bv = tl.load(B_ptr + pid_b * stride_bb + group * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * stride_cb + group * stride_cg + offs_n * stride_cn, mask=mask_n, other=0.0).to(tl.float32)
    s = s * dA + (dt * x)[:, None] * Bv[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_pn)
    y = tl.reduce(s * Cv[None, :], 1, SUM_COMBINE)
    if HAS_D:
        y += x * tl.load(D_ptr + pid_h * stride_Dh + offs_p * stride_Dp, mask=mask_p, other=0.0).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + pid_b * stride_zb + pid_h * stride_zh + offs_p * stride_zp, mask=mask_p, other=0.0).to(tl.float32)
        y = y * zv / (1.0 + tl.exp(-zv))
    tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_p * stride_op, y.to(out_ptr.dtype.element_ty), mask=mask_p)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _scan_out_like(u):
    """Output [B, I, L] in u's layout when u is channel-last (the mixer's view), else contiguous."""
    bsz, dim, seqlen = u.shape
    if u.stride(1) == 1 and dim > 1:
        return torch.empty(bsz, seqlen, dim, dtype=u.dtype, device=u.device).transpose(1, 2)
    return torch.empty(bsz, dim, seqlen, dtype=u.dtype, device=u.device)


def _scan_launch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, return_last_state, block_i=None,
                 block_t=None, num_warps=None, prefetch=True):
    bsz, dim, seqlen = u.shape
    dstate = A.shape[-1]
    B4 = B if B.dim() == 4 else B[:, None]
    C4 = C if C.dim() == 4 else C[:, None]
    groups = B4.shape[1]
    ch_per_group = dim // groups
    out = _scan_out_like(u)
    last = torch.empty(bsz, dim, dstate, dtype=torch.float32, device=u.device) if return_last_state else out
    block_n = next_pow2(dstate)
    if triton_interpreting():
        block_i = block_i or 4
        block_t = block_t or 8
    else:
        # H200, I=4096, N=16, L=2048 (bench --sweep): [4 ch x 16 N x 32 tokens] tiles, 4 warps were best
        block_t = block_t or (32 if block_n <= 16 else 16)
        block_i = block_i or max(1, min(16, 2048 // (block_n * block_t)))
    block_i = _largest_pow2_divisor(ch_per_group, block_i)  # a block never straddles two groups
    num_warps = num_warps or 4
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    dummy = u
    seq_t = seq_idx if seq_idx is not None else u
    z_t = z if z is not None else u
    grid = (cdiv(dim, block_i), bsz)
    _selective_scan_fwd_kernel[grid](
        u, delta, A, B4, C4, D if D is not None else dummy, z_t,
        delta_bias if delta_bias is not None else dummy, seq_t, out, last,
        dim, seqlen, dstate, ch_per_group,
        u.stride(0), u.stride(1), u.stride(2),
        delta.stride(0), delta.stride(1), delta.stride(2),
        A.stride(0), A.stride(1),
        B4.stride(0), B4.stride(1), B4.stride(2), B4.stride(3),
        C4.stride(0), C4.stride(1), C4.stride(2), C4.stride(3),
        z_t.stride(0), z_t.stride(1), z_t.stride(2),
        seq_t.stride(0), seq_t.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        last.stride(0), last.stride(1), last.stride(2),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_SEQ=seq_idx is not None,
        STORE_LAST=return_last_state,
        PREFETCH=bool(prefetch),
        BLOCK_I=block_i,
        BLOCK_N=block_n,
        BLOCK_T=block_t,
        num_warps=num_warps,
    )
    return out, last


def _update_launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    squeeze = state.dim() == 3
    s4, x4, dt4, A4, B4, C4, D4, z4, bias4 = _state_update_views(state, x, dt, A, B, C, D, z, dt_bias)
    bsz, heads, hdim, dstate = s4.shape
    groups = B4.shape[1]
    y = torch.empty(bsz, heads, hdim, dtype=x.dtype, device=x.device)
    a_per_head = A4.stride(1) == 0 and A4.stride(2) == 0
    block_n = next_pow2(dstate)
    if triton_interpreting():
        block_p = 16
    else:
        block_p = max(1, min(next_pow2(hdim), 4096 // block_n, 64))
    z_t = z4 if z4 is not None else x4
    D_t = D4 if D4 is not None else s4[0, :, :, 0]
    b_t = bias4 if bias4 is not None else s4[0, :, :, 0]
    grid = (cdiv(hdim, block_p), heads, bsz)
    _state_update_kernel[grid](
        s4, x4, dt4, A4, B4, C4, D_t, z_t, b_t, y,
        hdim, dstate, heads // groups,
        s4.stride(0), s4.stride(1), s4.stride(2), s4.stride(3),
        x4.stride(0), x4.stride(1), x4.stride(2),
        dt4.stride(0), dt4.stride(1), dt4.stride(2),
        A4.stride(0), A4.stride(1), A4.stride(2),
        B4.stride(0), B4.stride(1), B4.stride(2),
        C4.stride(0), C4.stride(1), C4.stride(2),
        D_t.stride(0), D_t.stride(1),
        z_t.stride(0), z_t.stride(1), z_t.stride(2),
        b_t.stride(0), b_t.stride(1),
        y.stride(0), y.stride(1), y.stride(2),
        HAS_D=D4 is not None,
        HAS_Z=z4 is not None,
        HAS_DT_BIAS=bias4 is not None,
        SOFTPLUS=bool(dt_softplus),
        A_PER_HEAD=a_per_head,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=4 if block_p * block_n >= 2048 else 2,
    )
    return y[:, 0] if squeeze else y


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile / dynamo; fake impls give shapes; eager calls skip the dispatcher)
# ----------------------------------------------------------------------------------------------------


@kernel_op("selective_scan_fwd")
def _selective_scan_fwd_op(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    delta_bias: Optional[torch.Tensor],
    delta_softplus: bool,
    seq_idx: Optional[torch.Tensor],
    return_last_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, last = _scan_launch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, return_last_state)
    if not return_last_state:
        last = u.new_empty(0, dtype=torch.float32)
    return out, last


@_selective_scan_fwd_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx, return_last_state):
    last = u.new_empty(u.shape[0], u.shape[1], A.shape[-1], dtype=torch.float32) if return_last_state \
        else u.new_empty(0, dtype=torch.float32)
    return _scan_out_like(u), last


@kernel_op("selective_state_update", mutates_args=("state",))
def _selective_state_update_op(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
) -> torch.Tensor:
    return _update_launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


@_selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    seq_idx: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Mamba-1 selective scan, ``mamba_ssm.selective_scan_fn`` semantics (module docstring).

    Same positional order as transformers' ``mamba_selective_scan(hidden_states, dt, A, B, C, D, z,
    delta_bias, delta_softplus, return_last_state, ...)``; its torch-only keywords (``use_mambapy``,
    ``use_associative_scan``) are accepted and ignored.  Returns ``out`` or ``(out, last_state)``.
    Inference only (no autograd).
    """
    if A.is_complex():
        raise NotImplementedError("complex A is not supported")
    if use_triton(u, delta, A, B, C):
        out, last = _selective_scan_fwd_op(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), seq_idx,
                                           bool(return_last_state))
        return (out, last) if return_last_state else out
    return selective_scan_ref(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, seq_idx=seq_idx
    )


def selective_state_update(
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
    """One decode step of the selective SSM, ``mamba_ssm.selective_state_update`` semantics; ``state``
    is updated in place (computed in fp32, stored in its own dtype), ``y`` comes back in x's dtype.

    Layouts: Mamba-1 ``state [B, I, N], x/dt/z [B, I], A [I, N], B/C [B, N], D/dt_bias [I]``;
    Mamba-2 ``state [B, H, P, N], x/dt/z [B, H, P], A [H, P, N], B/C [B, G, N], D/dt_bias [H, P]``
    (broadcast views, as the Mamba2 mixer passes them, are read without copies).  Keyword-compatible
    with transformers' ``mamba_selective_state_update`` / ``mamba2_selective_state_update``.
    """
    if use_triton(state, x, dt, A, B, C):
        return _selective_state_update_op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus))
    return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
