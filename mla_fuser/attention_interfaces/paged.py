"""Fused MLA attention over the paged latent cache (``mla_fuser.cache``).

* decode (one new token per sequence, no mask or a left-padding mask, no indices / sinks): absorbed attention
  with the ``mla_decode`` kernel straight from the pages — the latent is read once, no per-head K/V exists;
* everything else (prefill, chunked prefill, other masks, DSA indices, sinks, a ``kv_b_proj`` wrapped by adapters,
  whose weight is not what it computes):
  the latent is gathered from the pages (contiguous ``[B, T, rank + rope]``) and the contiguous fused path
  runs on it, which expands K/V for prefill (compute-bound) and absorbs for single-token steps.

An FP8 cache (``PagedLatentCache(..., dtype=torch.float8_e4m3fn)``): decode runs ``mla_decode_fp8`` (per-token scales
applied in the kernel); the gathered latent is dequantised to the latent's dtype (``PagedLatentLayer.gather``), and a
prompt's own prefill attends its unquantised latent, as with any cache (only later steps read the rounded rows).

Steps of a few tokens per sequence (assisted and prompt-lookup verification, replayed from a CUDA graph by
``runtime.DecodeGraph``) take the same kernel: each query token is one row of the kernel's batch, attending its own
sequence's pages up to its own position (the block-table row repeated, the length counted back from the end).  Their
causality therefore comes from the lengths on the device, not from a mask, which is what a captured step needs (a
mask built at capture time would be stale at every replay); this path is only taken inside ``mask_free_steps()``,
where the caller guarantees that the only padding is the cache's own left padding.
"""

from __future__ import annotations

import torch

from ..context_flags import ContextFlag
from ..kernels.dispatch import on_device, use_triton
from ..kernels.latent_fp8 import is_fp8
from ..kernels.mla_decode import mla_decode
from ..kernels.mla_decode_fp8 import mla_decode_fp8
from ..kernels.paged_cpu import absorbed_decode_cpu, as_dtype as _as
from ..kernels.skinny_linear import skinny_bmm


# at most this many new tokens per sequence go through the paged decode kernel in one step (= the absorbed path's
# own limit for short queries, vllm_mla.ABSORBED_MAX_QUERY)
MAX_STEP_TOKENS = 16

_MASK_FREE = ContextFlag("mask_free_steps", False)


def mask_free_steps():
    """Within it, a step of several tokens per sequence over the paged cache ignores the attention mask and attends
    causally with the cache's own left padding (see the module docstring).  ``runtime.DecodeGraph`` runs its steps
    in it: they take no mask, so the one the model builds is plain causal."""
    return _MASK_FREE.set_to(True)


def in_mask_free_steps() -> bool:
    return _MASK_FREE.get()


def paged_decode(query, view, scaling, w_uk, w_uv, b_v, m, starts=None):
    """``query`` [B, H, T, nope+rope] → ``[B, T, H, v]`` via the decode kernel over the pages (T new tokens per
    sequence, already written: token ``t`` attends up to ``seq_lens - (T - 1 - t)``).

    ``w_uk [H, nope, rank]``, ``w_uv [H, v, rank]``, ``b_v [H, v]`` (or None) are the views of ``kv_b_proj`` for
    the heads of ``query`` (``vllm_mla.absorbed_weights``): all heads, or this rank's under tensor parallelism.
    The pages hold the (replicated) latent on the layer's own device.  ``starts`` (int ``[B]``): left padding,
    tokens before ``starts[b]`` are not attended."""
    pages = view.pages
    fp8 = is_fp8(pages)  # an FP8 cache: q stays in the latent's dtype, the kernel converts the e4m3 rows to it
    block_table, seq_lens, tokens = view.block_table, view.seq_lens, query.shape[2]
    if tokens == 1 and pages.is_cpu and not torch.compiler.is_compiling() and not use_triton(pages):
        # an eager CPU step (what every decode step on a CPU is): the op's CPU twin with the absorption around it, in
        # one function; the general path below costs more host time in dispatch than the CPU spends computing
        return absorbed_decode_cpu(query.select(2, 0), w_uk, w_uv, b_v, pages, block_table, seq_lens, scaling,
                                   view.new_kv_c.dtype if fp8 else pages.dtype, starts).unsqueeze(1)
    if tokens > 1:  # one kernel row per token: its sequence's pages, its own end (all on the device, no sync)
        back = torch.arange(tokens - 1, -1, -1, device=seq_lens.device, dtype=seq_lens.dtype)
        seq_lens = (seq_lens.view(-1, 1) - back).reshape(-1)
        block_table = block_table.repeat_interleave(tokens, dim=0)
        starts = None if starts is None else starts.repeat_interleave(tokens)
    if fp8:
        def attend(q_lat, q_pe):
            return mla_decode_fp8(joined(q_lat, q_pe), pages, block_table, seq_lens, scaling, m.kv_lora_rank,
                                  starts=starts)
    else:  # the bf16 kernel reads the latent and rope parts where they are: no joined copy
        def attend(q_lat, q_pe):
            return mla_decode(q_lat, pages, block_table, seq_lens, scaling, m.kv_lora_rank, starts=starts, q_rope=q_pe)
    return absorbed_decode(query, w_uk, w_uv, b_v, m, view.new_kv_c.dtype if fp8 else pages.dtype, attend)


def joined(q_lat, q_pe):
    """``[q_lat | q_pe]``, contiguous: the absorbed query as one tensor, for kernels that read it so."""
    return torch.cat([q_lat, q_pe], dim=-1).contiguous()


def absorbed_decode(query, w_uk, w_uv, b_v, m, q_dtype, attend):
    """``query`` [B, H, T, nope+rope] → ``[B, T, H, v]``: the query absorbed into the latent (``q_nope @ W_UK``
    and ``q_pe``, in ``q_dtype``), ``attend(q_lat [B * T, H, rank], q_pe [B * T, H, rope]) -> [B * T, H, rank]`` (a
    decode kernel over the latent, wherever it is kept; row ``b * T + t`` is token ``t`` of sequence ``b``; ``q_lat``
    is a strided view, :func:`joined` makes one tensor of both), then ``W_UV`` and the value bias."""
    nope = m.qk_nope_head_dim
    batch, _, tokens, _ = query.shape
    if tokens == 1:
        q = query.select(2, 0)  # (views by method calls: indexing with slices and Tensor.split cost more host time)
    else:
        q = query.transpose(1, 2).reshape(batch * tokens, query.shape[1], query.shape[3])
    q_nope, q_pe = q.narrow(-1, 0, nope), q.narrow(-1, nope, q.shape[-1] - nope)
    # [H, B, nope] x [H, nope, rank] -> [H, B, rank]
    # (skinny_bmm: cuBLAS's bmm, or in a captured step with MLA_FUSER_SKINNY_LINEAR on, a kernel with more programs)
    q_lat = _as(skinny_bmm(q_nope.transpose(0, 1), _as(w_uk, q_nope.dtype)).transpose(0, 1), q_dtype)
    with on_device(q_lat):
        out_lat = attend(q_lat, _as(q_pe, q_dtype))
    # [H, B, rank] x [H, rank, v] -> [H, B, v]
    out = _value_projection(_as(out_lat.transpose(0, 1), w_uv.dtype), w_uv.transpose(1, 2))
    if b_v is not None:
        out = out + b_v
    out = out.unsqueeze(1) if tokens == 1 else out.view(batch, tokens, *out.shape[1:])
    return _as(out, query.dtype)


def _value_projection(lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """``[B, H, v]`` contiguous: ``lat [H, B, rank] @ w_uv_t [H, rank, v]`` per head, written by the batched GEMM
    straight into the token-major layout (cuBLAS takes the transposed view as a strided output), so the modeling
    code's ``reshape(batch, tokens, -1)`` of the attention output is a view instead of a copy kernel per layer.
    While autograd records (``out=`` has no backward) or under ``torch.compile`` (Dynamo does not trace a strided
    ``out=``; the compiler lays the copy out itself) the product is returned as a transposed view, as before."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (lat.requires_grad or w_uv_t.requires_grad)):
        return torch.bmm(lat, w_uv_t).transpose(0, 1)
    dest = lat.new_empty((lat.shape[1], lat.shape[0], w_uv_t.shape[2]))  # (bmm takes one dtype: the caller cast)
    skinny_bmm(lat, w_uv_t, out=dest.transpose(0, 1))
    return dest


def gathered_latent(view, rank: int):
    """``(kv_c [B, 1, T, rank], k_pe [B, 1, T, rope])``: read back from the pages, or, when this call's tokens are
    all the cache holds (a prompt's prefill), the call's own latent (no copy of what was just written)."""
    if view.layer.get_seq_length() == view.query_len:
        return view.new_kv_c, view.new_k_pe
    latent = view.gather()
    return latent[..., :rank].unsqueeze(1), latent[..., rank:].unsqueeze(1)
