"""Absorbed MLA attention over a contiguous latent (the form Transformers' own caches hold).

Why absorbed: the cached latent ``[kv_c | k_pe]`` is read once and never expanded per head.  With
``W_UK``/``W_UV`` the per-head slices of ``kv_b_proj.weight``::

    q_lat   = q_nope · W_UK            (per head: [nope] → [rank])
    score   = scale · (q_lat · kv_c + q_pe · k_pe)
    o_lat   = softmax(score) · kv_c    ([rank])
    out     = o_lat · W_UV^T (+ b_v)   ([v_head_dim])

A bias on ``kv_b_proj`` only adds ``q_nope · b_k`` to every score of a query (cancels in the softmax) and
``b_v`` to every output (the weights sum to one), so it is handled exactly.

``mla_attention_ref`` is the torch reference (fp32 accumulation); ``mla_attention`` dispatches (only the
torch path exists for the contiguous layout; the paged Triton kernels live in ``mla_decode.py``).
"""

from __future__ import annotations

import torch


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, nope] x [H, nope, rank] → [B, H, S, rank]``."""
    return torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)


def expand_output(o_lat: torch.Tensor, w_uv: torch.Tensor, b_v: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, S, rank] x [H, v, rank] → [B, S, H, v]``."""
    out = torch.einsum("bhsr,hvr->bshv", o_lat, w_uv)
    if b_v is not None:
        out = out + b_v.to(out.dtype)
    return out


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None, sinks: torch.Tensor | None = None):
    """Softmax over the last dim in fp32.  Masked scores get the dtype minimum, not -inf, so a fully
    masked row gives a uniform (finite) distribution instead of NaN.  ``sinks`` [H]: per-head logits that
    join the normaliser only (attention sinks)."""
    scores = scores.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    return torch.softmax(both, dim=-1)[..., :-1]


def mla_attention_ref(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed=None, b_v=None, sinks=None):
    """Reference absorbed MLA.

    q_nope [B, H, S, nope], q_pe [B, H, S, rope], kv_c [B, T, rank], k_pe [B, T, rope], w_uk [H, nope, rank],
    w_uv [H, v, rank], ``allowed`` bool broadcastable to [B, H, S, T] (True = attend).  Returns [B, S, H, v]
    in q's dtype.
    """
    dtype = q_nope.dtype
    q_lat = absorb_query(q_nope.float(), w_uk.float())
    scores = torch.einsum("bhsr,btr->bhst", q_lat, kv_c.float())
    if q_pe.shape[-1]:
        scores = scores + torch.einsum("bhsd,btd->bhst", q_pe.float(), k_pe.float())
    probs = masked_softmax(scores * scale, allowed, sinks)
    o_lat = torch.einsum("bhst,btr->bhsr", probs, kv_c.float())
    return expand_output(o_lat, w_uv.float(), None if b_v is None else b_v.float()).to(dtype)


def mla_attention(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed=None, b_v=None, sinks=None):
    """Absorbed MLA over a contiguous latent; see ``mla_attention_ref`` for shapes."""
    return mla_attention_ref(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed, b_v, sinks)
