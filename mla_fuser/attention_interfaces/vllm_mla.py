"""The ``vllm_mla`` attention function.

Once a model uses ``vllm_mla`` every attention call of that model reaches this function:
* a **fused** MLA instance (``plans.plan_of(module, "mla")`` set by the fuser) passes the compressed latent:
  ``key`` = ``kv_c_normed`` [B, 1, T, rank], ``value`` = ``k_pe`` [B, 1, T, rope]; we run absorbed MLA;
* anything else (unfused MLA instances, non-MLA layers of hybrid models, ``VLLM_MLA_DISABLE=1``) passes
  expanded K/V; we run padded full attention (V padded to the q/k head dim, SDPA, output sliced).

Both paths honour the mask (left padding, static-cache padding; float masks too), ``indices`` (DSA top-k
selection), ``s_aux`` (attention sinks), ``sliding_window``, an ``is_causal`` keyword (else the module's
attribute) and ``softcap``; masked scores use the dtype minimum so fully padded rows stay finite.  What the
absorbed kernel cannot do exactly (additive biases other than 0 / -inf, softcapping, training dropout, a
``kv_b_proj`` that adapters such as PEFT's LoRA wrap) runs on K/V expanded from the latent instead, never
approximately.  ``position_bias`` is refused loudly.

Multi-device: the head count is never taken from the match (traced once, possibly on another layout) but from the
query of each call and the rows of ``kv_b_proj``'s weight this process holds.  Under tensor parallelism
(``q_b_proj``/``q_proj`` and ``kv_b_proj`` column-wise by head, ``o_proj`` row-wise) that is the local heads: a
DTensor weight is read through ``to_local()``, the latent is replicated.  Under accelerate's big-model
``device_map`` with offload, ``kv_b_proj``'s weight lives on ``meta`` until its own hook loads it: the expansion
calls the module (its hook runs), the absorbed path loads the weight through the hook for the call and offloads it
again (``kv_b_params``).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
import torch.nn.functional as F

from ..cache import PAGED_ATTR
from ..plans import plan_of
from ..graph import is_plain_linear
from .paged import MAX_STEP_TOKENS, absorbed_decode, gathered_latent, in_mask_free_steps, paged_decode
from . import ragged
from ..kernels.fp8.format import FP8_DTYPE, SCALE_NAME  # FP8 kv_b_proj (issue 15)
from ..kernels.fp8.quant import compute_dtype, dequantized_weight
from ..kernels.mla_attention import masked_softmax, mla_attention
from ..kernels.mla_decode_split import mla_decode_split_rows
from ..kernels.varlen_attention import varlen_causal_attention, varlen_causal_supported

try:  # tensor parallelism shards parameters as DTensors
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None


def local_tensor(t):
    """This process's part of ``t``: a DTensor's local shard (tensor parallelism), anything else unchanged."""
    if _DTensor is not None and isinstance(t, _DTensor):
        return t.to_local()
    return t


@contextlib.contextmanager
def loaded(module):
    """Within the block, ``module``'s own parameters hold data even when accelerate offloads them.

    Under a big-model ``device_map`` with cpu/disk offload, accelerate puts a hook on every module with
    parameters; the weights stay on ``meta`` until that module is *called*.  Code that reads a weight without
    calling its module (the absorbed ``W_UK``/``W_UV``) runs the hook's pre-forward here (loads the weights onto
    the execution device) and its post-forward on exit (offloads them again), exactly as a call would."""
    hook = getattr(module, "_hf_hook", None)
    load = hook is not None and any(p.device.type == "meta" for p in module.parameters(recurse=False))
    if load:
        hook.pre_forward(module, torch.empty(0))
    try:
        yield module
    finally:
        if load:
            hook.post_forward(module, None)


@contextlib.contextmanager
def kv_b_params(linear):
    """``(weight, bias)`` of ``linear`` as plain tensors this process computes with: loaded if offloaded
    (``loaded``), and a DTensor (tensor-parallel shard) as its local shard."""
    with loaded(linear):
        if linear.weight.device.type == "meta":
            raise RuntimeError(f"vllm_mla: {type(linear).__name__} weight is on the meta device and no hook loads it")
        yield local_tensor(linear.weight), local_tensor(linear.bias)


# kv_b_proj module -> ((weight, bias), key, views): the absorbed views of a plain kv_b_proj, made again when the
# weight's storage, shape or dtype changes (``.to()``, a load that assigns) or the head count does
_ABSORBED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plain_params(linear):
    """``(weight, bias)`` of a linear that nothing loads or shards (no accelerate hook, no DTensor, not on meta), read
    without the ``kv_b_params`` context; None otherwise."""
    if "_hf_hook" in linear.__dict__:
        return None
    weight = linear._parameters.get("weight")
    if weight is None or weight.is_meta or (_DTensor is not None and isinstance(weight, _DTensor)):
        return None
    return weight, linear._parameters.get("bias")


def with_absorbed_weights(kv_b, m, heads: int, fn):
    """``fn(w_uk, w_uv, b_v)`` on the absorbed views of ``kv_b``'s weight (``absorbed_weights``), inside
    ``kv_b_params`` when a hook loads the weight or it is a shard; a plain weight's views are made once and reused
    (an eager decode step spends host time, not compute, on such small ops)."""
    plain = None if torch.compiler.is_compiling() else _plain_params(kv_b)
    if plain is None:
        with kv_b_params(kv_b) as (weight, bias):
            # FP8 (issue 15): a block-FP8 kv_b_proj's weight is dequantised (here per call: nothing to cache by)
            return fn(*absorbed_weights(dequantized_weight(kv_b, weight), bias, m, heads))
    weight, bias = plain
    key = (weight.data_ptr(), weight.shape, weight.dtype, None if bias is None else bias.data_ptr(), heads)
    if weight.dtype == FP8_DTYPE:  # FP8 (issue 15): its scales and the dtype it is dequantised into count too
        scale = getattr(kv_b, SCALE_NAME, None)
        key += (None if scale is None else scale.data_ptr(), compute_dtype(kv_b))
    cached = _ABSORBED.get(kv_b)
    if cached is None or cached[0][0] is not weight or cached[0][1] is not bias or cached[1] != key:
        # FP8: W_UK/W_UV come from the weight dequantised once (here, at the first absorbed call) and kept
        cached = _ABSORBED[kv_b] = ((weight, bias), key,
                                    absorbed_weights(dequantized_weight(kv_b, weight), bias, m, heads))
    return fn(*cached[2])


def absorbed_weights(weight, bias, m, heads: int):
    """``W_UK [H, nope, rank]``, ``W_UV [H, v, rank]`` (views of ``kv_b_proj``'s weight) and ``b_v [H, v]`` or None,
    for the ``heads`` heads this process holds (all of them, or the local ones under tensor parallelism)."""
    per_head = m.qk_nope_head_dim + m.v_head_dim
    if weight.ndim != 2 or weight.shape[0] != heads * per_head or weight.shape[1] != m.kv_lora_rank:
        raise RuntimeError(
            f"vllm_mla: kv_b_proj weight {tuple(weight.shape)} does not hold {heads} heads x "
            f"(nope {m.qk_nope_head_dim} + v {m.v_head_dim}) rows of width {m.kv_lora_rank} (the query's heads); "
            f"a tensor-parallel plan must split q_b_proj/q_proj and kv_b_proj column-wise by whole heads"
        )
    w = weight.view(heads, per_head, m.kv_lora_rank)
    b_v = None if bias is None else bias.view(heads, per_head)[:, m.qk_nope_head_dim:]
    return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:], b_v


def _allowed_mask(attention_mask, batch, heads, q_len, kv_len, device, indices=None, sliding_window=None,
                  is_causal=True):
    """Boolean ``[B, 1|H, S, T]`` of attendable positions (True) or None when everything is allowed.

    Also returns an additive float bias when the mask is a float mask (None otherwise)."""
    allowed, bias = None, None
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            bias = mask
    elif q_len > 1 and is_causal:
        # same semantics as SDPA's ``is_causal`` that Transformers relies on when it skips the mask:
        # upper-left aligned (equal to lower-right when S == T, and right for an empty static cache)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril().view(1, 1, q_len, kv_len)
    if sliding_window is not None and attention_mask is None and kv_len > sliding_window:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device).view(-1, 1)
        k_pos = torch.arange(kv_len, device=device).view(1, -1)
        window = (q_pos - k_pos < sliding_window).view(1, 1, q_len, kv_len)
        allowed = window if allowed is None else allowed & window
    if indices is not None:
        # DSA top-k: ``[B, S, K]`` (shared by all heads) or ``[B, H, S, K]``; entries < 0 (and, defensively,
        # >= T) select nothing
        idx = indices.long()
        idx = torch.where((idx >= 0) & (idx < kv_len), idx, torch.full_like(idx, kv_len))
        counts = torch.zeros(*idx.shape[:-1], kv_len + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(-1, idx, torch.ones_like(idx, dtype=torch.int32))
        selected = (counts[..., :kv_len] > 0)
        selected = selected.unsqueeze(1) if selected.ndim == 3 else selected
        allowed = selected if allowed is None else allowed & selected
    return allowed, bias


def _boolean_mask(allowed, bias):
    """Fold a float 0 / very-negative mask into a boolean one; anything else cannot be folded (None)."""
    if bias is None:
        return allowed
    keep = bias > torch.finfo(bias.dtype).min / 2
    if not bool(((bias == 0) | ~keep).all()):
        return None
    return keep if allowed is None else allowed & keep


def left_padding_starts(attention_mask, kv_len: int, ends=None):
    """For a one-token query's mask ``[B, 1, 1, >=T]`` that allows exactly the keys ``>= s_b`` of each row (left
    padding; a float mask of 0 / very negative values counts), ``s`` as int32 ``[B]``; None for any other mask.
    ``ends``: see :func:`left_padding_of`.  Costs one host sync (the check), which an eager decode step of a padded
    batch pays anyway."""
    mask = attention_mask[..., :kv_len]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[-1] != kv_len:
        return None
    mask = mask[:, 0, 0]
    if mask.dtype == torch.bool:
        return left_padding_of(mask, ends=ends)
    allowed = mask > torch.finfo(mask.dtype).min / 2
    return left_padding_of(allowed, exact=(mask == 0) | ~allowed, ends=ends)


def left_padding_of(allowed: torch.Tensor, exact=True, ends=None):
    """int32 ``[B]``: how many leading keys each row of the boolean ``allowed [B, T]`` leaves out, when every row
    allows exactly the keys from there on (and ``exact`` holds everywhere); None otherwise.  One host sync.
    ``ends`` (int ``[B]``, a compileable cache's lengths): each row's keys end there instead of at ``T``, the mask
    covering the whole cache (the keys from ``ends`` on must not be allowed)."""
    length = allowed.shape[-1]
    count = allowed.sum(-1)
    end = length if ends is None else ends.to(device=allowed.device, dtype=count.dtype).view(-1)
    starts = end - count
    keys = torch.arange(length, device=allowed.device).view(1, -1)
    expected = keys >= starts.view(-1, 1)
    if ends is not None:
        expected &= keys < end.view(-1, 1)
    is_left_padding = ((allowed == expected) & exact).all()
    if torch.compiler.is_compiling() or (allowed.is_cuda and torch.cuda.is_current_stream_capturing()):
        # a traced or captured step cannot branch on the data (Transformers 5.17 hands such decode steps a mask
        # even without padding): assume left padding and assert it on the device, so any other mask fails loudly
        torch._assert_async(is_left_padding, "vllm_mla: a compiled decode step got a mask that is not left padding")
        return starts.to(torch.int32)
    return starts.to(torch.int32) if bool(is_left_padding) else None


def _expand_latent(kv_c, k_pe, kv_b, m, heads: int):
    """Per-head K/V from the latent: ``kv_c`` [B, 1, T, rank], ``k_pe`` [B, 1, T, rope] → key ``[B, H, T, qk]``,
    value ``[B, H, T, v]``, exactly as the module's own expansion (``kv_b_proj`` per head ``[k_nope | v]``, the
    rotary key shared by all heads)."""
    return _expand_rows(kv_c[:, 0], k_pe[:, 0], kv_b, m, heads, heads_first=True)


def _expand_rows(kv_c, k_pe, kv_b, m, heads: int, heads_first: bool = False):
    """Per-head K/V of latent rows ``kv_c`` [..., T, rank], ``k_pe`` [..., T, rope], token-major: key ``[..., T, H,
    qk]``, value ``[..., T, H, v]`` (``heads_first``: ``[..., H, T, .]``, the key contiguous as SDPA's prefill has
    always had it).  ``kv_b_proj`` is *called*, as the module's own expansion does, so whatever wraps it runs:
    accelerate's offload hooks load its weight, a tensor-parallel plan returns the local heads."""
    kv = local_tensor(kv_b(kv_c))
    per_head = m.qk_nope_head_dim + m.v_head_dim
    if kv.shape[-1] != heads * per_head:
        raise RuntimeError(
            f"vllm_mla: kv_b_proj gives {kv.shape[-1]} features, the query has {heads} heads x {per_head}"
        )
    kv = kv.view(*kv.shape[:-1], heads, per_head)
    if heads_first:
        kv = kv.transpose(-3, -2)
    k_nope, value = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    k_pe = k_pe.to(device=k_nope.device, dtype=k_nope.dtype).unsqueeze(-3 if heads_first else -2)
    key = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], -1)], dim=-1)
    return key, value


# a few new tokens over a long cached prefix (assisted / speculative decoding, small chunks) stay absorbed:
# expanding the prefix costs O(T x heads x (nope + v)) per step, the absorbed path reads the latent once
ABSORBED_MAX_QUERY = 16
ABSORBED_MIN_PREFIX_RATIO = 4


def _prefer_expanded(q_len: int, kv_len: int) -> bool:
    """Expanded K/V + SDPA for prefill-like calls, absorbed attention for decode-like ones."""
    if q_len == 1:
        return False
    return q_len > ABSORBED_MAX_QUERY or kv_len < ABSORBED_MIN_PREFIX_RATIO * q_len


def fused_mla_attention(module, query, kv_c, k_pe, attention_mask, scaling, indices=None, s_aux=None,
                        sliding_window=None, is_causal=None, dropout=0.0, softcap=None):
    plan = plan_of(module, "mla")
    m = plan.match
    batch, heads, q_len, qk_dim = query.shape
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else qk_dim ** -0.5
    if qk_dim != m.qk_nope_head_dim + m.qk_rope_head_dim:
        raise RuntimeError(f"vllm_mla: query shape {tuple(query.shape)} does not fit the matched head layout")
    s_aux = local_tensor(s_aux)
    kv_b = plan.kv_b(module)
    absorbable = is_plain_linear(kv_b)  # else adapters (PEFT) wrap it: only calling it computes what it does
    view = getattr(kv_c, PAGED_ATTR, None)
    if view is not None:  # the paged latent cache: decode straight from the pages, else read them back
        plain = (absorbable and indices is None and s_aux is None and sliding_window is None and softcap is None
                 and not (dropout and module.training))
        if plain and 1 < q_len <= MAX_STEP_TOKENS and is_causal and in_mask_free_steps():
            # a replayed step of a few tokens per sequence (assisted / prompt-lookup verification): causal by the
            # lengths on the device, the cache's left padding only; the mask (built at capture) is not read
            return with_absorbed_weights(kv_b, m, heads, lambda w_uk, w_uv, b_v: paged_decode(
                query, view, scale, w_uk, w_uv, b_v, m, view.starts))
        if plain and q_len == 1:
            # the cache's own left padding (if any), and a mask's only if it is left padding: both restrict the
            # keys to "from s on", so together they keep the later start
            starts = view.starts
            if attention_mask is not None:
                ends = view.seq_lens if view.layer.is_compileable else None  # (its mask covers the whole cache)
                from_mask = left_padding_starts(attention_mask, kv_c.shape[2], ends)
                starts = from_mask if starts is None or from_mask is None else torch.maximum(starts, from_mask)
            if attention_mask is None or starts is not None:
                return with_absorbed_weights(kv_b, m, heads, lambda w_uk, w_uv, b_v: paged_decode(
                    query, view, scale, w_uk, w_uv, b_v, m, starts))
        kv_c, k_pe = gathered_latent(view, m.kv_lora_rank)
    if kv_c.ndim != 4 or kv_c.shape[1] != 1 or kv_c.shape[-1] != m.kv_lora_rank:
        raise RuntimeError(
            f"vllm_mla: fused module {type(module).__name__} passed a latent of shape {tuple(kv_c.shape)}, "
            f"expected [B, 1, T, {m.kv_lora_rank}]"
        )
    if k_pe.ndim != 4 or k_pe.shape[1] != 1 or k_pe.shape[-1] != m.qk_rope_head_dim:
        raise RuntimeError(
            f"vllm_mla: fused module {type(module).__name__} passed a rotary key of shape {tuple(k_pe.shape)}, "
            f"expected [B, 1, T, {m.qk_rope_head_dim}]"
        )
    kv_len = kv_c.shape[2]
    expand = (not absorbable or _prefer_expanded(q_len, kv_len) or softcap is not None
              or bool(dropout and module.training))
    if not expand:  # the mask is only built for the absorbed path (a causal prefill mask would be T x T)
        allowed, bias = _allowed_mask(attention_mask, batch, heads, q_len, kv_len, query.device, indices,
                                      sliding_window, is_causal)
        folded = _boolean_mask(allowed, bias)
        expand = bias is not None and folded is None
    if expand:
        # prefill is compute-bound: expanding K/V (for the tokens attended to) and running ordinary attention
        # costs fewer FLOPs than attending in the 576-wide absorbed space.  The same exact path serves what the
        # absorbed kernel does not do: additive biases other than 0 / -inf, softcapping, training dropout, and a
        # kv_b_proj wrapped by adapters (its weight is not what it computes; calling it is).
        key, value = _expand_latent(kv_c, k_pe, kv_b, m, heads)
        return padded_attention(module, query, key, value, attention_mask, dropout, scale, indices, s_aux,
                                sliding_window, is_causal, softcap)
    q_nope, q_pe = query.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    return with_absorbed_weights(kv_b, m, heads, lambda w_uk, w_uv, b_v: mla_attention(
        q_nope, q_pe, kv_c[:, 0], k_pe[:, 0], w_uk, w_uv, scale, folded, b_v, s_aux))


def padded_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, indices=None,
                     s_aux=None, sliding_window=None, is_causal=None, softcap=None, return_weights=False):
    """Full attention on expanded K/V: V padded to the q/k head dim, SDPA, output sliced; ``[B, S, H, Dv]``.

    ``return_weights``: ``(out, probabilities [B, H, S, T])`` from explicit scores (``output_attentions``), as
    Transformers' eager attention returns them (in the query's dtype, after dropout)."""
    batch, heads, q_len, qk_dim = query.shape
    kv_heads, kv_len, v_dim = key.shape[1], key.shape[2], value.shape[-1]
    s_aux = local_tensor(s_aux)
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else qk_dim ** -0.5
    mask_args = (attention_mask, batch, heads, q_len, kv_len, query.device, indices, sliding_window, is_causal)
    if s_aux is not None or softcap is not None or return_weights:
        allowed, bias = _allowed_mask(*mask_args)
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = (scores + bias.float()).clamp(min=torch.finfo(torch.float32).min)
        probs = masked_softmax(scores, allowed, s_aux)
        if dropout and module.training:
            probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, value.float()).to(query.dtype).transpose(1, 2).contiguous()
        return (out, probs.to(query.dtype)) if return_weights else out
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    if attention_mask is None and indices is None and (sliding_window is None or kv_len <= sliding_window):
        # no mask to build: SDPA's own (upper-left) causal flag is exactly what ``_allowed_mask`` would build,
        # and keeps flash/memory-efficient kernels eligible (a 32k prefill mask would be gigabytes)
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout if module.training else 0.0, scale=scale,
            is_causal=bool(is_causal and q_len > 1),
        )
        return out[..., :v_dim].transpose(1, 2).contiguous()
    allowed, bias = _allowed_mask(*mask_args)
    additive = None
    if allowed is not None or bias is not None:
        minimum = torch.finfo(query.dtype).min
        additive = torch.zeros(1, dtype=query.dtype, device=query.device)
        if bias is not None:
            additive = (additive + bias.to(query.dtype)).clamp(min=minimum)
        if allowed is not None:
            additive = additive.masked_fill(~allowed, minimum)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=additive, dropout_p=dropout if module.training else 0.0, scale=scale,
    )
    return out[..., :v_dim].transpose(1, 2).contiguous()


def _ragged(module, query, kv_c, k_pe, scaling, dropout, softcap, extra, kwargs, fused):
    """A ragged batch of continuous batching (``cu_seq_lens_q/k``, no mask): each request over its own context."""
    if not fused:
        raise NotImplementedError(
            f"vllm_mla: {type(module).__name__} is not a fused MLA module and cannot attend a continuous-batching "
            f"step (only fused MLA layers read latent pages)"
        )
    if extra.get("indices") is not None:
        raise NotImplementedError("vllm_mla: DSA top-k selection (indices) under continuous batching is not supported")
    sinks, window = extra.get("s_aux"), extra.get("sliding_window")
    plan = plan_of(module, "mla")
    kv_b = plan.kv_b(module)
    kernel = (is_plain_linear(kv_b) and sinks is None and window is None and softcap is None
              and not (dropout and module.training))  # the absorbed decode kernels can serve the step
    device_path = kernel and ragged.runs_on_device(query)  # no host read: the engine may capture the step
    cb_cache = kwargs.get("cache")
    if cb_cache is not None:  # Transformers 5.19-5.23: the attention function writes the engine's cache itself
        kv_c, k_pe = cb_cache.update(kv_c, k_pe, module.layer_idx, kwargs)  # (narrows cu_seq_lens_k in kwargs)
    rows = getattr(kv_c, ragged.PAGES_ROWS_ATTR, None)  # the rows were only written: they lie in the engine's pages
    if rows is not None and not device_path:
        kv_c, k_pe = rows.read()
    read_index = kwargs.get("read_index")
    by_page = kwargs.get(ragged.PAGE_READS_KWARG, 0)  # (the read index lists pages: only tagged rows can be read)
    if (rows is None and isinstance(read_index, (list, tuple)) and read_index
            and all(r.numel() and (by_page or r.shape[0] != kv_c.shape[2]) for r in read_index)):
        # (shapes only, no sync) what reached us is neither every context's rows nor tagged new rows: the model's
        # code changed the latent between the cache update and the attention, and attending it would be wrong
        raise RuntimeError(
            f"vllm_mla: a continuous-batching step of {type(module).__name__} received {kv_c.shape[2]} latent rows "
            f"for contexts of {read_index[0].shape[0]} {'pages' if by_page else 'rows'}: the latent was changed "
            f"between the cache update and the attention (set ContinuousBatchingConfig(use_cuda_graph=False) and "
            f"report the model)"
        )
    cu_k = kwargs["cu_seq_lens_k"]
    if not isinstance(cu_k, torch.Tensor):
        raise RuntimeError("vllm_mla: a continuous-batching step reached the attention without its layer's key bounds")
    cu_q = kwargs["cu_seq_lens_q"]

    def attend(q, c, p, mask):
        return fused_mla_attention(module, q, c, p, mask, scaling, s_aux=sinks, sliding_window=window,
                                   is_causal=True, dropout=dropout, softcap=softcap)

    if not kernel:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"vllm_mla: {type(module).__name__} cannot attend a captured continuous-batching step (its kv_b_proj "
                f"carries adapters or it uses sinks / a window / softcapping, which need the host-bounded path)"
            )
        return ragged.ragged_mla_attention(attend, query, kv_c, k_pe, cu_q, cu_k, None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    heads = query.shape[1]

    def decode(queries, pages, block_table, seq_lens, starts=None):  # the paged kernel over the step's rows
        view = types.SimpleNamespace(pages=pages, block_table=block_table, seq_lens=seq_lens)
        return with_absorbed_weights(kv_b, plan.match, heads, lambda w_uk, w_uv, b_v: paged_decode(
            queries, view, scale, w_uk, w_uv, b_v, plan.match, starts=starts))

    if rows is not None and device_path:
        def decode_rows(queries, ends, starts, bases):  # the split-row kernel over the engine's pages, in place
            return with_absorbed_weights(kv_b, plan.match, heads, lambda w_uk, w_uv, b_v: _split_rows_decode(
                queries, rows, ends, starts, bases, scale, w_uk, w_uv, b_v, plan.match))

        expand = _fresh_prompts_expanded(kv_b, plan.match, query, kv_c, k_pe, scale)
        return ragged.ragged_mla_attention_in_pages(decode_rows, query, cu_q, cu_k, rows.page, expand)
    if device_path:
        return ragged.ragged_mla_attention_on_device(decode, query, kv_c, k_pe, cu_q, cu_k)
    return ragged.ragged_mla_attention(attend, query, kv_c, k_pe, cu_q, cu_k, decode)


def _fresh_prompts_expanded(kv_b, m, query, kv_c, k_pe, scale):
    """``expand(cu_q)`` -> ``[Tq, H, v]`` for ``ragged.ragged_mla_attention_in_pages``: the step's new latent rows
    (``kv_c`` / ``k_pe`` ``[1, 1, Tq, .]``, what the in-place cache update returns) expanded through ``kv_b_proj``,
    then causal varlen attention of every request over its own new tokens (exact for fresh prompts: their new tokens
    are their whole context); None while ``ragged.EXPAND_FRESH_PROMPTS`` is off or where the varlen kernel cannot take
    the shapes (the absorbed kernel serves all: nothing of this runs, per layer, per step)."""
    if not ragged.EXPAND_FRESH_PROMPTS or query.shape[2] < 2 or not varlen_causal_supported(query, m.v_head_dim):
        return None

    def expand(cu_q):
        key, value = _expand_rows(kv_c[0, 0], k_pe[0, 0], kv_b, m, query.shape[1])  # [Tq, H, qk], [Tq, H, v]
        return varlen_causal_attention(query[0].transpose(0, 1), key, value, cu_q, query.shape[2], scale)

    return expand


def _split_rows_decode(query, rows, ends, starts, bases, scale, w_uk, w_uv, b_v, m):
    """``query [T, H, 1, nope+rope]`` → ``[T, 1, H, v]``: absorbed attention with ``mla_decode_split_rows`` over the
    latent rows ``rows`` (``ragged.PagesRows``) kept as K / V half rows in the engine's pages, named a slot per row or
    a slot per page (``bases``: where each token's request's pages begin); the absorbed query's latent and rope parts
    are read where they lie (joining them cost ~6% of a serving run's GPU time)."""
    return absorbed_decode(query, w_uk, w_uv, b_v, m, rows.k_rows.dtype, lambda q_lat, q_pe: mla_decode_split_rows(
        q_lat, rows.k_rows, rows.v_rows, rows.slots, ends, starts, scale, m.kv_lora_rank, q_rope=q_pe,
        page=rows.page, page_bases=bases))


def _expanded_for_weights(module, query, kv_c, k_pe):
    """Per-head K/V of a fused module's call (its latent, or the paged cache's read back)."""
    plan = plan_of(module, "mla")
    view = getattr(kv_c, PAGED_ATTR, None)
    if view is not None:
        kv_c, k_pe = gathered_latent(view, plan.match.kv_lora_rank)
    return _expand_latent(kv_c, k_pe, plan.kv_b(module), plan.match, query.shape[1])


# keyword arguments whose value changes the result and that this function honours; any *other* keyword that
# Transformers documents as changing the math (``position_bias``...) makes the call fail loudly instead of being
# dropped.  ``position_ids``, ``cu_seq_lens_*`` / ``max_length_*`` (packed sequences reach us as a mask built by
# the registered mask function, exactly as for ``sdpa``) and cache bookkeeping are ignored; ``output_attentions``
# returns the weights (see ``vllm_mla_attention``).
_HONOURED = ("indices", "s_aux", "sliding_window", "is_causal")
_UNSUPPORTED = ("position_bias",)


def vllm_mla_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Entry point registered as ``vllm_mla`` in ``AttentionInterface``; returns ``(out [B,S,H,Dv], weights)``, the
    weights ``[B, H, S, T]`` when ``output_attentions`` asks for them, else None."""
    if isinstance(query, torch.fx.Proxy):  # traced while the model already uses vllm_mla
        from ..graph import _tracing_attention_interface

        return _tracing_attention_interface(module, query, key, value, attention_mask, **kwargs)
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"vllm_mla: the '{name}' attention argument is not supported")
    extra = {k: kwargs.get(k) for k in _HONOURED}
    softcap = kwargs.get("softcap")
    fused = plan_of(module, "mla") is not None
    if not fused and getattr(key, PAGED_ATTR, None) is not None:
        raise RuntimeError(f"vllm_mla: {type(module).__name__} is not fused but reads a paged latent cache")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is not None and cu_k is not None:
        return _ragged(module, query, key, value, scaling, dropout, softcap, extra, kwargs, fused), None
    if kwargs.get("output_attentions"):
        # the weights are asked for: explicit scores over expanded K/V (the absorbed scores are the same
        # probabilities, but neither kernel materialises them)
        if fused:
            key, value = _expanded_for_weights(module, query, key, value)
        return padded_attention(module, query, key, value, attention_mask, dropout, scaling, softcap=softcap,
                                return_weights=True, **extra)
    if fused:
        return fused_mla_attention(module, query, key, value, attention_mask, scaling, dropout=dropout,
                                   softcap=softcap, **extra), None
    return padded_attention(module, query, key, value, attention_mask, dropout, scaling, softcap=softcap,
                            **extra), None
