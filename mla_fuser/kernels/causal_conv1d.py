"""Depthwise causal conv1d (the short convolution in front of every Mamba / Mamba-2 mixer).

Why a kernel: transformers' torch fallback runs ``F.conv1d`` on a channel-first copy of the projected
activations, then an activation, then a cast, each a full pass over ``[B, C, L]``; decode concatenates
the cached window with the new token and copies the window back.  Here one launch reads each input
element ``W`` times from cache (once from memory), applies bias + SiLU in registers and writes the output
once; the decode step shifts the cached window in place.

Layout and conventions (identical to transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update`` in
``transformers.models.mamba{,2}.modeling_mamba{,2}`` and to the ``causal_conv1d`` package):

* ``x``: ``[B, C, L]`` with any strides.  The mixers hand in a transposed view of ``in_proj``'s output
  (channel stride 1); the output is allocated in the same channel-last layout so no copy is forced.
* ``weight``: ``[C, W]`` (``conv1d.weight.squeeze(1)``), ``bias``: ``[C]`` or None.
* ``activation``: None, ``"silu"`` or ``"swish"``.
* conv state: transformers' cache keeps the last ``W`` inputs (``conv_kernel_size`` columns, left
  zero-padded when the prompt is shorter), the ``causal_conv1d`` package keeps ``W - 1``.  Both work:
  ``causal_conv1d(..., return_final_states=True)`` returns the last ``final_state_len`` inputs, default
  ``W`` (transformers' convention), and ``causal_conv1d_update`` accepts any state width ``>= W - 1``.
* ``initial_states``: ``[B, C, S]``, ``S >= W - 1``: inputs that precede ``x`` (chunked prefill, or a
  prefill after cached tokens); its last ``W - 1`` columns feed the first outputs.
* variable lengths: left padding needs nothing (the mixers zero padded positions before the conv, and a
  causal conv over leading zeros equals a fresh start).  Packed sequences take ``seq_idx`` ``[B, L]``
  (int32, as in ``causal_conv1d``): a tap only reads inputs of the same sequence; ``initial_states`` is
  read only by positions whose ``seq_idx`` equals ``seq_idx[:, 0]``; the final state holds only inputs of
  the last sequence.

All arithmetic is fp32; outputs and states take ``x``'s dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import LazyJit, cdiv, kernel_op, next_pow2, tl, triton_interpreting, use_triton

__all__ = [
    "causal_conv1d",
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
]

_ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation: Optional[str]) -> bool:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    return activation is not None


# ----------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_state_len: Optional[int] = None,
    seq_idx: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Torch twin of :func:`causal_conv1d`, written tap by tap in fp32 so each rule is visible."""
    silu = _check_activation(activation)
    bsz, channels, seqlen = x.shape
    width = weight.shape[-1]
    hist = width - 1
    w = weight.float()
    init = _history(initial_states, bsz, channels, hist, x.device)
    full = torch.cat([init, x.float()], dim=-1)  # [B, C, W-1+L]; column W-1+t is input t
    out = torch.zeros(bsz, channels, seqlen, dtype=torch.float32, device=x.device)
    pos_t = torch.arange(seqlen, device=x.device)
    for k in range(width):
        shift = hist - k  # tap k reads input t - shift
        tap = full[:, :, k : k + seqlen]
        if seq_idx is not None:
            src = (pos_t - shift).clamp(min=0)  # history columns belong to the sequence at position 0
            same = seq_idx[:, src] == seq_idx  # [B, L]
            tap = tap * same[:, None, :]
        out = out + tap * w[:, k, None]
    if bias is not None:
        out = out + bias.float()[:, None]
    if silu:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    flen = width if final_state_len is None else int(final_state_len)
    final = _final_window(x, initial_states, seq_idx, flen)
    return out, final


def _history(initial_states, bsz, channels, hist, device):
    if initial_states is None or hist == 0:
        return torch.zeros(bsz, channels, hist, dtype=torch.float32, device=device)
    if initial_states.shape[-1] < hist:
        raise ValueError(f"initial_states needs >= {hist} columns, got {initial_states.shape[-1]}")
    return initial_states[..., initial_states.shape[-1] - hist :].float()


def _final_window(x, initial_states, seq_idx, flen):
    """Last ``flen`` inputs of ``concat(initial_states or zeros, x)``, left zero-padded."""
    bsz, channels, seqlen = x.shape
    prev = initial_states if initial_states is not None else x.new_zeros(bsz, channels, 0)
    full = torch.cat([x.new_zeros(bsz, channels, flen), prev.to(x.dtype), x], dim=-1)
    final = full[..., full.shape[-1] - flen :].clone()
    if seq_idx is not None and flen > 0:
        pos = torch.arange(seqlen - flen, seqlen, device=x.device)
        src = seq_idx[:, pos.clamp(min=0)]
        final = final * (src == seq_idx[:, -1:])[:, None, :].to(final.dtype)
    return final


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    **kwargs,
) -> torch.Tensor:
    """Torch twin of :func:`causal_conv1d_update` (shifts ``conv_state`` in place)."""
    silu = _check_activation(activation)
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    seqlen = xs.shape[-1]
    state_len = conv_state.shape[-1]
    width = weight.shape[-1]
    if state_len < width - 1:
        raise ValueError(f"conv_state needs >= {width - 1} columns, got {state_len}")
    full = torch.cat([conv_state.float(), xs.float()], dim=-1)  # [B, C, S+T]
    out = torch.zeros(xs.shape, dtype=torch.float32, device=x.device)
    for k in range(width):
        start = state_len - (width - 1) + k
        out = out + full[:, :, start : start + seqlen] * weight.float()[:, k, None]
    if bias is not None:
        out = out + bias.float()[:, None]
    if silu:
        out = F.silu(out)
    conv_state.copy_(full[:, :, seqlen:].to(conv_state.dtype))
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------


@LazyJit
def _causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, seq_ptr, out_ptr, final_ptr,
    C, L, S_INIT,
    stride_xb, stride_xc, stride_xl,
    stride_wc, stride_wk,
    stride_ib, stride_ic, stride_il,
    stride_sb, stride_sl,
    stride_ob, stride_oc, stride_ol,
    stride_fb, stride_fc, stride_fl,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    SILU: tl.constexpr,
    FINAL_LEN: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program: BLOCK_L positions x BLOCK_C channels of one batch row.  The W shifted loads of
    # the same tile hit L1/L2, so memory sees each input about once.
    pid_c = tl.program_id(0)
    pid_l = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_l = (pid_l * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)  # token offsets can pass 2**31
    mask_c = offs_c < C
    mask_l = offs_l < L
    x_base = x_ptr + pid_b * stride_xb + offs_c[None, :] * stride_xc
    if HAS_SEQ:
        seq_t = tl.load(seq_ptr + pid_b * stride_sb + offs_l * stride_sl, mask=mask_l, other=-1)
    acc = tl.full((BLOCK_L, BLOCK_C), 0.0, tl.float32)
    for k in tl.static_range(W):
        pos = offs_l - (W - 1 - k)
        m = mask_l[:, None] & mask_c[None, :]
        v = tl.load(x_base + pos[:, None] * stride_xl, mask=m & (pos >= 0)[:, None], other=0.0).to(tl.float32)
        if HAS_INIT:
            iv = tl.load(
                init_ptr + pid_b * stride_ib + offs_c[None, :] * stride_ic + (S_INIT + pos)[:, None] * stride_il,
                mask=m & (pos < 0)[:, None],
                other=0.0,
            ).to(tl.float32)
            v += iv
        if HAS_SEQ:
            seq_s = tl.load(seq_ptr + pid_b * stride_sb + tl.maximum(pos, 0) * stride_sl, mask=mask_l, other=-2)
            v = tl.where((seq_s == seq_t)[:, None], v, 0.0)
        wk = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c, other=0.0).to(tl.float32)
        acc += v * wk[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    o_ptrs = out_ptr + pid_b * stride_ob + offs_c[None, :] * stride_oc + offs_l[:, None] * stride_ol
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_l[:, None] & mask_c[None, :])

    if FINAL_LEN > 0:
        if pid_l == 0:
            # The conv state for the next call: the last FINAL_LEN inputs of concat(init, x).
            offs_f = tl.arange(0, BLOCK_F)
            pos_f = (L - FINAL_LEN + offs_f).to(tl.int64)
            mf = (offs_f < FINAL_LEN)[:, None] & mask_c[None, :]
            fv = tl.load(x_base + pos_f[:, None] * stride_xl, mask=mf & (pos_f >= 0)[:, None], other=0.0)
            if HAS_INIT:
                fi = tl.load(
                    init_ptr + pid_b * stride_ib + offs_c[None, :] * stride_ic + (S_INIT + pos_f)[:, None] * stride_il,
                    mask=mf & ((pos_f < 0) & (pos_f >= -S_INIT))[:, None],
                    other=0.0,
                )
                fv = fv.to(tl.float32) + fi.to(tl.float32)
            if HAS_SEQ:
                seq_last = tl.load(seq_ptr + pid_b * stride_sb + (L - 1) * stride_sl)
                seq_f = tl.load(seq_ptr + pid_b * stride_sb + tl.maximum(pos_f, 0) * stride_sl, mask=offs_f < FINAL_LEN, other=-2)
                fv = tl.where((seq_f == seq_last)[:, None], fv, 0.0)
            f_ptrs = final_ptr + pid_b * stride_fb + offs_c[None, :] * stride_fc + offs_f[:, None] * stride_fl
            tl.store(f_ptrs, fv.to(final_ptr.dtype.element_ty), mask=mf)


@LazyJit
def _causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr,
    C,
    stride_xb, stride_xc, stride_xl,
    stride_sb, stride_sc, stride_sl,
    stride_wc, stride_wk,
    stride_ob, stride_oc, stride_ol,
    W: tl.constexpr,
    S: tl.constexpr,
    T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program: BLOCK_C channels of one batch row.  Every read of the old window happens before
    # the barrier, every write of the new window after it, so threads that share a channel (Triton
    # may replicate small tiles) never see a half-shifted window.
    pid_c = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    x_base = x_ptr + pid_b * stride_xb + offs_c * stride_xc
    s_base = state_ptr + pid_b * stride_sb + offs_c * stride_sc

    # New window: column j takes concat(state, x)[j + T].
    offs_s = tl.arange(0, BLOCK_S)
    src = offs_s + T
    ms = (offs_s < S)[None, :] & mask_c[:, None]
    new_state = tl.load(s_base[:, None] + src[None, :] * stride_sl, mask=ms & (src < S)[None, :], other=0.0)
    new_state += tl.load(x_base[:, None] + (src - S)[None, :] * stride_xl, mask=ms & (src >= S)[None, :], other=0.0)

    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        acc = tl.full((BLOCK_C,), 0.0, tl.float32)
        for k in tl.static_range(W):
            j = S + t - (W - 1) + k  # index into concat(state, x)
            if j < S:
                v = tl.load(s_base + j * stride_sl, mask=mask_c, other=0.0)
            else:
                v = tl.load(x_base + (j - S) * stride_xl, mask=mask_c, other=0.0)
            wk = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c, other=0.0)
            acc += v.to(tl.float32) * wk.to(tl.float32)
        if HAS_BIAS:
            acc += b
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + pid_b * stride_ob + offs_c * stride_oc + t * stride_ol,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_c)

    tl.debug_barrier()
    tl.store(s_base[:, None] + offs_s[None, :] * stride_sl, new_state.to(state_ptr.dtype.element_ty), mask=ms)


def _like_layout(x: torch.Tensor) -> torch.Tensor:
    """Empty ``[B, C, L]`` tensor with x's layout when x is channel-last, else contiguous."""
    bsz, channels, seqlen = x.shape
    if x.stride(1) == 1 and channels > 1:
        return torch.empty(bsz, seqlen, channels, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(bsz, channels, seqlen, dtype=x.dtype, device=x.device)


def _conv_fwd_launch(x, weight, bias, initial_states, seq_idx, silu, final_len):
    bsz, channels, seqlen = x.shape
    width = weight.shape[-1]
    out = _like_layout(x)
    final = torch.empty(bsz, channels, max(final_len, 0), dtype=x.dtype, device=x.device)
    if initial_states is not None and initial_states.shape[-1] < width - 1:
        raise ValueError(f"initial_states needs >= {width - 1} columns, got {initial_states.shape[-1]}")
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
    init_t = initial_states if initial_states is not None else x
    seq_t = seq_idx if seq_idx is not None else x
    block_c = 64 if x.stride(1) == 1 else 32
    block_l = 64 if x.stride(1) == 1 else 128
    if triton_interpreting():
        block_c, block_l = 16, 16
    grid = (cdiv(channels, block_c), cdiv(seqlen, block_l), bsz)
    _causal_conv1d_fwd_kernel[grid](
        x, weight, bias if bias is not None else x, init_t, seq_t, out, final,
        channels, seqlen, initial_states.shape[-1] if initial_states is not None else 0,
        x.stride(0), x.stride(1), x.stride(2),
        weight.stride(0), weight.stride(1),
        init_t.stride(0), init_t.stride(1), init_t.stride(2),
        seq_t.stride(0), seq_t.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        final.stride(0), final.stride(1), final.stride(2),
        W=width,
        HAS_BIAS=bias is not None,
        HAS_INIT=initial_states is not None,
        HAS_SEQ=seq_idx is not None,
        SILU=silu,
        FINAL_LEN=max(final_len, 0),
        BLOCK_F=next_pow2(max(final_len, 1)),
        BLOCK_L=block_l,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out, final


def _conv_update_launch(x, conv_state, weight, bias, silu):
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    bsz, channels, seqlen = xs.shape
    width = weight.shape[-1]
    state_len = conv_state.shape[-1]
    if state_len < width - 1:
        raise ValueError(f"conv_state needs >= {width - 1} columns, got {state_len}")
    out = torch.empty(bsz, channels, seqlen, dtype=x.dtype, device=x.device)
    block_c = 16 if triton_interpreting() else 256
    grid = (cdiv(channels, block_c), bsz)
    _causal_conv1d_update_kernel[grid](
        xs, conv_state, weight, bias if bias is not None else x, out,
        channels,
        xs.stride(0), xs.stride(1), xs.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        W=width,
        S=state_len,
        T=seqlen,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_S=next_pow2(state_len),
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out.squeeze(-1) if squeeze else out


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile / dynamo; fake impls give shapes; eager calls skip the dispatcher)
# ----------------------------------------------------------------------------------------------------


@kernel_op("causal_conv1d_fwd")
def _causal_conv1d_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    initial_states: Optional[torch.Tensor],
    seq_idx: Optional[torch.Tensor],
    silu: bool,
    final_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _conv_fwd_launch(x, weight, bias, initial_states, seq_idx, silu, final_len)


@_causal_conv1d_fwd_op.register_fake
def _(x, weight, bias, initial_states, seq_idx, silu, final_len):
    return _like_layout(x), x.new_empty(x.shape[0], x.shape[1], max(final_len, 0))


@kernel_op("causal_conv1d_update", mutates_args=("conv_state",))
def _causal_conv1d_update_op(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    silu: bool,
) -> torch.Tensor:
    return _conv_update_launch(x, conv_state, weight, bias, silu)


@_causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    *,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_state_len: Optional[int] = None,
    seq_idx: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Depthwise causal conv1d over ``x [B, C, L]`` with ``weight [C, W]``: ``out[t] = act(bias +
    sum_k weight[:, k] * x[t - (W - 1) + k])`` (inputs before 0 come from ``initial_states`` or are 0).

    Returns ``out [B, C, L]`` (x's dtype and layout), plus ``final_state [B, C, final_state_len]``
    (default ``W``, transformers' conv-cache width) when ``return_final_states``.  Positional arguments
    match transformers' ``causal_conv1d_fn(hidden_states, weight, bias, activation, **kwargs)``; unknown
    keyword arguments are ignored, as transformers' hook wrapper filters them.
    """
    silu = _check_activation(activation)
    final_len = (weight.shape[-1] if final_state_len is None else int(final_state_len)) if return_final_states else 0
    if use_triton(x, weight):
        out, final = _causal_conv1d_fwd_op(x, weight, bias, initial_states, seq_idx, silu, final_len)
        return (out, final) if return_final_states else out
    return causal_conv1d_ref(
        x, weight, bias, activation,
        initial_states=initial_states, return_final_states=return_final_states,
        final_state_len=final_state_len, seq_idx=seq_idx,
    )


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_states_out: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    **kwargs,
):
    """Drop-in for the ``causal_conv1d`` package's ``causal_conv1d_fn`` (its positional order; transformers
    calls it as ``causal_conv1d_fn(x, weight, bias, activation=...)``, which fits both orders).

    The final state, when asked for, follows that package: ``W - 1`` columns, copied into
    ``final_states_out`` when given.
    """
    result = causal_conv1d(
        x, weight, bias, activation,
        initial_states=initial_states, return_final_states=return_final_states,
        final_state_len=weight.shape[-1] - 1, seq_idx=seq_idx,
    )
    if return_final_states and final_states_out is not None:
        final_states_out.copy_(result[1])
        return result[0], final_states_out
    return result


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    **kwargs,
) -> torch.Tensor:
    """One decode step (or a few): ``x [B, C]`` or ``[B, C, T]``, ``conv_state [B, C, S]`` with
    ``S >= W - 1`` (transformers keeps ``S = W``).  Returns the conv output shaped like ``x`` and
    shifts the newest ``S`` inputs into ``conv_state`` in place.  Same signature as transformers'
    ``causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)``.
    """
    silu = _check_activation(activation)
    if use_triton(x, conv_state, weight):
        return _causal_conv1d_update_op(x, conv_state, weight, bias, silu)
    return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
