"""Causal attention of packed sequences (varlen): every sequence of ``cu_seqlens`` attends only its own tokens, each
query up to its own position, with no ``[T, T]`` mask on the GPU.

Why: a continuous-batching step packs the prompts it starts into one row of tokens.  A fresh prompt (nothing of it
cached yet) is its own whole context, so its attention can run on per-head K / V expanded from the step's own new
latent rows — a size fixed by the step's padded token count, which a captured CUDA graph needs — instead of the
absorbed decode kernel, whose prefill does ~3.4x the FLOPs of expanded attention at DeepSeek's widths
(``attention_interfaces.ragged``: fresh prompts).  On CUDA this is Flash Attention's varlen forward
(``aten._flash_attention_forward``: no host read, capturable); :func:`varlen_causal_attention_ref` is the torch twin
(a block-diagonal causal mask: tiny shapes, CPU tests).

Flash Attention takes one head width for Q, K and V: a narrower V (DeepSeek: 128 beside a 192-wide query) is padded
with zeros to the query's width, and the padding cut from the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["varlen_causal_supported", "varlen_causal_attention", "varlen_causal_attention_ref"]

# Flash Attention's widest head (its kernels are built for widths up to 256, multiples of 8)
FLASH_MAX_HEAD_DIM = 256


def varlen_causal_supported(query: torch.Tensor, v_dim: int) -> bool:
    """Whether :func:`varlen_causal_attention` takes a query like ``query`` (``[T, H, D]``, or any layout with the
    head width last) with values ``v_dim`` wide: on CUDA, Flash Attention's conditions (half precision, an Ampere or
    later GPU, a width it is built for); on a CPU always (the twin)."""
    if query.device.type == "cpu":
        return True
    width = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and v_dim <= width
            and width <= FLASH_MAX_HEAD_DIM and width % 8 == 0
            and torch.cuda.get_device_capability(query.device)[0] >= 8)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float) -> torch.Tensor:
    """``[T, H, Dv]``: ``q``/``k`` ``[T, H, D]``, ``v`` ``[T, H, Dv]``; sequence ``i`` holds tokens ``cu_seqlens[i] ..
    cu_seqlens[i + 1]`` (int32, nondecreasing from 0; empty sequences allowed) and attends causally within itself.
    ``max_len`` bounds every sequence's length (a host int: the packed token count will do).  Rows past
    ``cu_seqlens[-1]`` are left undefined: the caller drops them."""
    if q.device.type == "cpu":
        return varlen_causal_attention_ref(q, k, v, cu_seqlens, scale)
    if not varlen_causal_supported(q, v.shape[-1]):
        raise ValueError(f"varlen_causal_attention: Flash Attention cannot take a {tuple(q.shape)} {q.dtype} query "
                         f"with {v.shape[-1]}-wide values on {q.device}")
    v_dim, width = v.shape[-1], q.shape[-1]
    if v_dim < width:
        v = F.pad(v, (0, width - v_dim))
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                  scale=scale)[0]
    return out[..., :v_dim]


def varlen_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Torch twin of :func:`varlen_causal_attention`: SDPA under a block-diagonal causal mask ``[T, T]`` (rows past
    the last sequence attend among themselves, causally: defined, and dropped by the caller all the same)."""
    t = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(t.dtype).contiguous(), t, right=True)
    allowed = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)
