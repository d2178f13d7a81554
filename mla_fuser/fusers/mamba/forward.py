"""The fused forward bound to one mixer instance, the kernel ops table it calls, and the cache-state handling.

The bound forward reproduces the original with ``mla_fuser.kernels``: prefill is causal conv + selective scan
(Mamba-1) or SSD chunk scan (Mamba-2) with final states, decode is the single-step conv update + state update,
in place on the cache's tensors (O(1) per token).  States go through the Cache API exactly as the original
mixer uses it (``get/update_conv_state``, ``get/update_recurrent_state``, ``is_recording_past``), so
``generate()`` works unchanged.  Kernels dispatch per call (``MLA_FUSER_BACKEND``, ``kernels/dispatch.py``).
Training mode, packed-sequence arguments (``seq_idx``, ``cu_seqlens``) and caches without that API run the
original forward.  Mamba-1's original ignores the recurrent state for a multi-token step after a cached prefix
(it scans from zero); that is reproduced as is.

``mixer_forward`` takes the ops table as an argument: ``KERNELS`` (dispatching kernels, read at call time from
this module by ``fused_forward``) at run time, ``REFERENCE`` (their torch twins) for the probe in ``match.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache

from ... import compat
from ...kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from ...kernels.selective_scan import (
    selective_scan,
    selective_scan_ref,
    selective_state_update,
    selective_state_update_ref,
)
from ...kernels.ssd import ssd_chunk_scan, ssd_chunk_scan_ref, ssd_state_update, ssd_state_update_ref
from ...plans import plan_of
from .specs import MambaMatch, MambaPlan

_PACKED_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
_CACHE_METHODS = compat.MAMBA_CACHE_METHODS


# ---------------------------------------------------------------------------------------------------------
# kernels: the dispatching ops for the fused forward, their torch twins for the probe


@dataclass(frozen=True)
class _Ops:
    conv: Callable
    conv_update: Callable
    scan: Callable
    scan_update: Callable
    ssd: Callable
    ssd_update: Callable


KERNELS = _Ops(causal_conv1d, causal_conv1d_update, selective_scan, selective_state_update, ssd_chunk_scan,
               ssd_state_update)
REFERENCE = _Ops(causal_conv1d_ref, causal_conv1d_update_ref, selective_scan_ref, selective_state_update_ref,
                 ssd_chunk_scan_ref, ssd_state_update_ref)


# ---------------------------------------------------------------------------------------------------------
# the fused forward


def fused_forward(self: nn.Module, *args, **kwargs):
    """Bound to one mixer instance by ``MambaFuser.apply``: the original's arguments, our kernels."""
    plan: MambaPlan = plan_of(self, "mamba")
    try:
        bound = plan.signature.bind(*args, **kwargs)
    except TypeError:
        return plan.original(*args, **kwargs)
    arguments = dict(bound.arguments)
    first = next(iter(plan.signature.parameters))
    extra = {}
    for name, param in plan.signature.parameters.items():
        if param.kind == param.VAR_KEYWORD:
            extra = arguments.pop(name, {})
    cache = arguments.get(plan.match.cache_arg)
    if (
        self.training
        or any(extra.get(k) is not None for k in _PACKED_KWARGS)
        or any(isinstance(v, Cache) for v in extra.values())  # e.g. a deprecated keyword for the cache
        or (cache is not None and not all(hasattr(cache, m) for m in _CACHE_METHODS))
        or (cache is not None and _keeps_intermediate_states(cache, self.layer_idx))
    ):
        return plan.original(*args, **kwargs)
    mask = arguments.get(plan.match.mask_arg) if plan.match.mask_arg else None
    from ...attention_interfaces.vllm_mla import loaded

    with contextlib.ExitStack() as stack:
        # weights read without calling their module (conv1d, dt_proj): loaded by their offload hooks, if any
        for name in (plan.match.conv1d, getattr(plan.match, "dt_proj", None)):
            if name:
                stack.enter_context(loaded(self.get_submodule(name)))
        return mixer_forward(self, plan.match, KERNELS, arguments[first], cache, mask)


def _recording_past(cache, layer_idx) -> bool:
    """Whether the cache records this layer's past states (for crops after assisted decoding)."""
    recording = getattr(cache, "is_recording_past", None)
    return recording is not None and bool(recording(layer_idx))


def _keeps_intermediate_states(cache, layer_idx) -> bool:
    """Whether the cache records this layer's past states the way Transformers 5.25 does: the original then keeps a
    state per token of a step and updates states out of place, which the fused steps (in place) do not."""
    return hasattr(cache, "get_recurrent_states_to_keep") and _recording_past(cache, layer_idx)


def mixer_forward(module: nn.Module, m: MambaMatch, ops: _Ops, hidden_states, cache=None, mask=None):
    """The mixer's computation with ``ops`` (kernels or their torch twins), states through the Cache API."""
    layer_idx = module.layer_idx if cache is not None else None
    if m.kind == "mamba1":
        return _mamba1(module, m, ops, hidden_states, cache, mask, layer_idx)
    return _mamba2(module, m, ops, hidden_states, cache, mask, layer_idx)


def _masked(hidden_states, mask, enabled):
    """Zero padded positions as the original does: ``(h * mask[:, :, None]).to(h.dtype)``."""
    if mask is None or not enabled:
        return hidden_states
    return (hidden_states * mask[:, :, None]).to(hidden_states.dtype)


def _states(cache, layer_idx):
    if cache is None:
        return None, None
    return cache.get_conv_state(layer_idx, state_idx=0), cache.get_recurrent_state(layer_idx, state_idx=0)


def _conv(module, m, ops, x, cache, conv_state, layer_idx):
    """Causal conv over ``x [B, C, L]``: one-step update in place on the cached window when decoding, else
    the full conv over what the cache returns (the new tokens, left-padded or behind the cached window)."""
    seq_len = x.shape[-1]
    conv = module.get_submodule(m.conv1d)
    weight, bias = conv.weight.squeeze(1), conv.bias
    recording = cache is not None and _recording_past(cache, layer_idx)
    if conv_state is not None and seq_len == 1 and not recording:
        count = getattr(cache, "increase_count", None)  # (5.25: a step the cache does not see is counted)
        if count is not None:
            count(layer_idx, 0)
        return ops.conv_update(x, conv_state, weight, bias, m.activation)
    if cache is not None:
        x = cache.update_conv_state(x, layer_idx, conv_kernel_size=m.conv_width)
    out = ops.conv(x, weight, bias, m.activation)
    return out[:, :, -seq_len:] if cache is not None else out


def _norm(module, name, x):
    return module.get_submodule(name)(x) if name else x


def _mamba1(module, m, ops, hidden_states, cache, mask, layer_idx):
    seq_len, dtype = hidden_states.shape[1], hidden_states.dtype
    conv_state, ssm_state = _states(cache, layer_idx)
    hidden_states = _masked(hidden_states, mask, m.mask_input)
    pieces = module.get_submodule(m.in_proj)(hidden_states).transpose(1, 2).split(m.in_split, dim=1)
    x, z = pieces[m.x_piece], pieces[m.z_piece]  # [B, I, L] each
    x = _conv(module, m, ops, x, cache, conv_state, layer_idx)
    x = _masked(x.transpose(1, 2), mask, m.mask_conv)  # [B, L, I]
    parts = module.get_submodule(m.x_proj)(x).split(m.x_split, dim=-1)
    dt, B, C = (parts[i] for i in m.pieces)
    dt, B, C = _norm(module, m.dt_norm, dt), _norm(module, m.b_norm, B), _norm(module, m.c_norm, C)
    dt_proj = module.get_submodule(m.dt_proj)
    dt = dt_proj.weight @ dt.transpose(1, 2)  # [B, I, L]; the bias is added inside the scan
    dt_bias = dt_proj.bias.float() if m.dt_proj_bias else None
    A = -torch.exp(module.get_parameter(m.a_log).float())
    D = module.get_parameter(m.d) if m.d else None
    if ssm_state is not None and seq_len == 1:
        y = ops.scan_update(ssm_state, x[:, 0], dt[..., 0], A, B[:, 0], C[:, 0], D, z=z[..., 0], dt_bias=dt_bias,
                            dt_softplus=m.dt_softplus).unsqueeze(-1)
    else:
        D = D.float() if D is not None else None
        y = ops.scan(x.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), D, z, dt_bias, m.dt_softplus,
                     cache is not None)
        if cache is not None:
            y, last_state = y
            cache.update_recurrent_state(last_state, layer_idx)
    return module.get_submodule(m.out_proj)(y.transpose(1, 2).to(dtype))


def _mamba2(module, m, ops, hidden_states, cache, mask, layer_idx):
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, state = m.num_heads, m.head_dim, m.n_groups, m.state_size
    conv_state, ssm_state = _states(cache, layer_idx)
    hidden_states = _masked(hidden_states, mask, m.mask_input)
    pieces = module.get_submodule(m.in_proj)(hidden_states).split(m.in_split, dim=-1)
    gate, xbc, dt = pieces[m.z_piece], pieces[m.x_piece], pieces[m.dt_piece]
    xbc = _conv(module, m, ops, xbc.transpose(1, 2), cache, conv_state, layer_idx)
    xbc = _masked(xbc.transpose(1, 2), mask, m.mask_conv)
    parts = xbc.split(m.x_split, dim=-1)
    x, B, C = (parts[i] for i in m.pieces)
    A = -torch.exp(module.get_parameter(m.a_log).float())
    D = module.get_parameter(m.d) if m.d else None
    dt_bias = module.get_parameter(m.dt_bias) if m.dt_bias else None
    if ssm_state is not None and seq_len == 1:
        # decode: no dt clamp, as in the original's (and mamba_ssm's) step
        y = ops.ssd_update(ssm_state, x.view(batch, heads, head_dim), dt[:, 0], A, B.view(batch, groups, state),
                           C.view(batch, groups, state), D, z=None, dt_bias=dt_bias, dt_softplus=m.dt_softplus)
        y = y.view(batch, 1, -1)
    else:
        y, final_state = ops.ssd(
            x.view(batch, seq_len, heads, head_dim), dt, A, B.view(batch, seq_len, groups, state),
            C.view(batch, seq_len, groups, state), 256, D, None, dt_bias, m.dt_softplus, ssm_state, m.dt_limit,
        )
        if cache is not None:
            cache.update_recurrent_state(final_state, layer_idx)
        y = y.reshape(batch, seq_len, -1)
    y = module.get_submodule(m.norm)(y, gate)
    return module.get_submodule(m.out_proj)(y.to(dtype))
