"""Read every request's latent rows out of Transformers' continuous-batching pages, in one launch.

Why: the engine stores a token's latent row ``[kv_c | k_pe]`` as its K half row and V half row, which live in two
different pages of a block (``runtime.continuous_batching``), and lists the rows a step reads in ``read_index``.
Its own read-back gathers K and V separately (two copies) for the *padded* number of rows a captured step was
sized for; joining the halves is a third copy.  Here one program per tile of rows loads both halves and writes the
joined row once, and only for the rows the step really reads: the count is read on the device
(``cu_seq_lens_k[-1]``), so padding costs nothing and the launch can be captured in a CUDA graph.

:func:`latent_gather_ref` is the torch twin (it gathers every listed row; rows past the count are left as they are
in the kernel and filled in the reference, neither is ever attended).
"""

from __future__ import annotations

import torch

from .dispatch import LazyJit, cdiv, next_pow2, tl, use_triton

__all__ = ["latent_gather", "latent_gather_ref", "latent_gather_triton"]

BLOCK_ROWS = 16


def latent_gather_ref(k_rows: torch.Tensor, v_rows: torch.Tensor, index: torch.Tensor, count: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """``out[i] = [k_rows[index[i]] | v_rows[index[i]]]`` for every ``i`` of ``index`` (``count`` unused)."""
    n, half = index.shape[0], k_rows.shape[-1]
    out[:n, :half] = k_rows.index_select(0, index)
    out[:n, half: 2 * half] = v_rows.index_select(0, index)
    return out


@LazyJit
def _latent_gather_kernel(K, V, INDEX, COUNT, OUT, stride_k, stride_v, stride_o, HALF,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    first = tl.program_id(0) * BLOCK_R
    count = tl.load(COUNT)
    if first < count:  # tiles past the rows this step reads do nothing
        rows = first + tl.arange(0, BLOCK_R)
        mask_r = rows < count
        slot = tl.load(INDEX + rows, mask=mask_r, other=0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = mask_r[:, None] & (cols < HALF)[None, :]
        k = tl.load(K + slot[:, None] * stride_k + cols[None, :], mask=mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_v + cols[None, :], mask=mask, other=0.0)
        out = OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(out, k, mask=mask)
        tl.store(out + HALF, v, mask=mask)


def latent_gather_triton(k_rows, v_rows, index, count, out):
    """Triton path of :func:`latent_gather` (no dispatch)."""
    half = k_rows.shape[-1]
    if index.shape[0]:
        block_d = next_pow2(half)
        grid = (cdiv(index.shape[0], BLOCK_ROWS),)
        _latent_gather_kernel[grid](k_rows, v_rows, index, count, out, k_rows.stride(0), v_rows.stride(0),
                                    out.stride(0), half, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d,
                                    num_warps=4 if block_d >= 256 else 2)
    return out


def latent_gather(k_rows: torch.Tensor, v_rows: torch.Tensor, index: torch.Tensor, count: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Join the K and V half rows at ``index`` into ``out [>= len(index), 2 * half]`` (rows ``i < count`` written).

    ``k_rows`` / ``v_rows``: ``[slots, half]`` views of one layer's K and V token rows (unit column stride);
    ``index``: int64 ``[n]`` slots; ``count``: a one-element int tensor on the same device, how many leading
    entries of ``index`` the step reads (the rest is padding).  Returns ``out``."""
    if k_rows.shape[-1] != v_rows.shape[-1] or out.shape[-1] < 2 * k_rows.shape[-1] or out.shape[0] < index.shape[0]:
        raise ValueError(f"latent_gather: halves {tuple(k_rows.shape)} / {tuple(v_rows.shape)} do not fit the "
                         f"output {tuple(out.shape)} for {index.shape[0]} rows")
    if use_triton(k_rows) and k_rows.stride(-1) == 1 and v_rows.stride(-1) == 1 and out.stride(-1) == 1:
        return latent_gather_triton(k_rows, v_rows, index, count, out)
    return latent_gather_ref(k_rows, v_rows, index, count, out)
