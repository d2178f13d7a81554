"""The paged-cache ops on CPU tensors: indexed from the host, one sequence at a time.

Why not the references: ``mla_decode_ref`` and ``paged_append_ref`` never look at the data on the host (with
``MLA_FUSER_BACKEND=torch`` on a GPU, a host read would be a device sync) and so pad every sequence to the block
table's width, gather all of it, mask it and compute positions with a dozen small tensor ops.  On a CPU a host read
is free and each small op costs microseconds of dispatch, which is the whole decode step of a small model.  Here
the lengths and page ids are read as Python ints and each sequence attends exactly its own rows, taken as a view of
the pool (no copy) when its pages are consecutive, as the pages of one growing sequence are; decode costs about a
dozen ops, a step's write one ``cat`` into the rows of each page it touches.

Same math and rounding points as the references (attention in fp32, rows cast to the pool's dtype on write, or
quantised into packed rows for an FP8 pool, :mod:`latent_fp8`);
``tests/test_kernel_mla_decode.py`` checks both against them.  ``mla_decode`` and ``paged_append`` run these for CPU
tensors whenever Triton does not (``dispatch.use_triton``); the paged cache, which keeps the block tables and lengths
on the host anyway, writes an eager CPU step through :func:`append_rows` with its own lists.
"""

from __future__ import annotations

import torch

from .latent_fp8 import dequantise_rows, is_fp8, quantise_rows

__all__ = ["absorbed_decode_cpu", "append_rows", "as_dtype", "mla_decode_cpu", "paged_append_cpu", "sequence_rows"]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when it would do nothing (each call costs host time in an eager step)."""
    return t if t.dtype == dtype else t.to(dtype)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def sequence_rows(kv_pages: torch.Tensor, page_ids: list[int], start: int, end: int):
    """Rows ``[start, end)`` ``[end - start, D]`` of one sequence whose pages are ``page_ids`` (host ints, at least
    ``ceil(end / page_size)`` of them): a view of the pool when the pages are consecutive, else gathered."""
    page_size, width = kv_pages.shape[1], kv_pages.shape[2]
    n = -(-end // page_size)
    first = page_ids[0]
    consecutive = page_ids[n - 1] - first == n - 1 and page_ids[:n] == list(range(first, first + n))
    if consecutive and kv_pages.is_contiguous():
        base = first * page_size
        return kv_pages.view(-1, width)[base + start:base + end]
    pages = kv_pages[first:first + n] if consecutive else kv_pages[torch.tensor(page_ids[:n], device=kv_pages.device)]
    return pages.reshape(n * page_size, width)[start:end]


def mla_decode_cpu(q, kv_pages, block_table, seq_lens, scale, v_dim, starts=None) -> torch.Tensor:
    """:func:`mla_decode_ref` for CPU tensors (same arguments, same result up to fp32 rounding order)."""
    return as_dtype(_attend_sequences(_fp32(q), kv_pages, block_table, seq_lens, starts, scale, v_dim), q.dtype)


def _attend_sequences(q32, kv_pages, block_table, seq_lens, starts, scale, v_dim) -> torch.Tensor:
    """fp32 ``[B, H, v_dim]``: each sequence's fp32 query rows ``q32[b] [H, D]`` over its own latent rows."""
    batch, heads, width = q32.shape
    if batch == 0:
        return q32.new_zeros(batch, heads, v_dim)
    lens = seq_lens.tolist()
    firsts = [0] * batch if starts is None else starts.tolist()
    table = block_table.tolist()
    outs = []
    for b in range(batch):
        length, start = lens[b], max(0, firsts[b])
        if length <= start:
            outs.append(q32.new_zeros(heads, v_dim))
            continue
        rows = sequence_rows(kv_pages, table[b], start, length)  # [T, D] (an FP8 pool: packed [T, W])
        rows = dequantise_rows(rows, v_dim, width) if is_fp8(kv_pages) else _fp32(rows)
        scores = torch.mm(q32[b], rows.t()).mul_(scale)  # [H, T]
        outs.append(torch.mm(torch.softmax(scores, dim=-1), rows[:, :v_dim]))
    return outs[0].unsqueeze(0) if batch == 1 else torch.stack(outs)


def absorbed_decode_cpu(q, w_uk, w_uv, b_v, kv_pages, block_table, seq_lens, scale, latent_dtype, starts=None):
    """One decode token per sequence of absorbed MLA over CPU pages, in one function: ``q [B, H, nope + rope]`` →
    ``[B, H, v]`` in ``q``'s dtype, with ``w_uk [H, nope, rank]``, ``w_uv [H, v, rank]``, ``b_v [H, v]`` or None.

    Why: on a CPU an eager decode step's cost is the host time of its small ops, and the general path
    (``attention_interfaces.paged.absorbed_decode`` around the ``mla_decode`` op) spends more of it on dispatch,
    device contexts and a strided output for CUDA than on the maths.  Same maths and rounding points: the absorbed
    query ``[q_nope @ W_UK | q_pe]`` in ``latent_dtype`` (the latent's: an FP8 pool's rows are dequantised to fp32 as
    :func:`mla_decode_cpu` does), attention in fp32 rounded back to ``latent_dtype``, then ``W_UV`` in its dtype."""
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    q_nope, q_pe = q.narrow(-1, 0, nope), q.narrow(-1, nope, q.shape[-1] - nope)
    q_lat = torch.bmm(q_nope.transpose(0, 1), as_dtype(w_uk, q.dtype)).transpose(0, 1)  # [B, H, rank]
    q_abs = torch.cat([as_dtype(q_lat, latent_dtype), as_dtype(q_pe, latent_dtype)], dim=-1)
    out_lat = as_dtype(_attend_sequences(_fp32(q_abs), kv_pages, block_table, seq_lens, starts, scale, rank),
                       latent_dtype)
    out = torch.bmm(as_dtype(out_lat.transpose(0, 1), w_uv.dtype), w_uv.transpose(1, 2))  # [H, B, v]
    if b_v is not None:
        out = out + b_v.unsqueeze(1)
    return as_dtype(out.transpose(0, 1), q.dtype)


def paged_append_cpu(kv_pages, block_table, seq_lens, kv_c, k_pe) -> None:
    """:func:`paged_append_ref` for CPU tensors: token ``t`` of sequence ``b`` lands at position ``seq_lens[b] + t``,
    written by one ``cat`` into the page's rows per page the step touches (two copies when the dtypes differ)."""
    append_rows(kv_pages, block_table.tolist(), seq_lens.tolist(), kv_c, k_pe)


def append_rows(kv_pages, tables: list[list[int]], lens: list[int], kv_c, k_pe) -> None:
    """:func:`paged_append_cpu` with the block table and the lengths as host lists (a cache that keeps them there
    passes its own: no tensor read at all)."""
    if is_fp8(kv_pages):  # packed rows (values and their scales, see latent_fp8), written whole
        kv_c, k_pe = quantise_rows(kv_c, k_pe), None
    batch, new, v_dim = kv_c.shape
    page_size = kv_pages.shape[1]
    rope = 0 if k_pe is None else k_pe.shape[-1]
    if v_dim + rope != kv_pages.shape[-1]:
        raise ValueError(f"kv_c ({v_dim}) + k_pe ({rope}) columns != cache row width {kv_pages.shape[-1]}")
    one_cat = rope and kv_c.dtype == k_pe.dtype == kv_pages.dtype
    for b in range(batch):
        position, t = lens[b], 0
        while t < new:
            offset = position % page_size
            n = min(new - t, page_size - offset)
            page = tables[b][position // page_size]
            rows = kv_pages[page:page + 1, offset:offset + n]  # [1, n, D]
            whole = batch == 1 and n == new  # (a decode step of one sequence: no slicing)
            c = kv_c if whole else kv_c[b:b + 1, t:t + n]
            if one_cat:
                torch.cat([c, k_pe if whole else k_pe[b:b + 1, t:t + n]], dim=-1, out=rows)
            else:
                rows[..., :v_dim] = c
                if rope:  # k_pe rounded through kv_c's dtype first, as the reference does
                    rows[..., v_dim:] = k_pe[b:b + 1, t:t + n].to(kv_c.dtype)
            position += n
            t += n
