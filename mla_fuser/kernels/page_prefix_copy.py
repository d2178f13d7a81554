"""The first rows of some pages copied onto other pages, in every layer's page pool at once: a beam reorder's
partly written pages.

Why a kernel: after a beam-search step, sequence ``i`` continues old sequence ``source[i]``, so the page that
``source[i]`` was still writing is copied into ``i``'s own page (``cache_reorder``).  In torch that is an
``index_select`` of whole pages and an ``index_copy_`` per layer: 54 launches per step on a 27-layer model, each
moving whole 64-row pages for every sequence, also those that continue themselves.  Measured on an H200 (DeepSeek-
V2-Lite shape, 4 beams x 4 prompts, L=1024): 0.36 ms of GPU time per beam step, 4% of the step.  Here two launches
cover every layer (a table of the pools' base addresses): the first gathers the ``rows`` written rows of each
source page into a scratch buffer, the second writes them into the destination pages (all reads before any write:
a sequence's source page may be another sequence's destination), and sequences whose source is their own page are
skipped by a mask.

Rows are copied as raw bytes (4-byte words where the row width allows), so any page dtype works, the FP8 cache's
packed rows included.  :func:`copy_page_prefixes_ref` is the torch twin (the two indexed copies per pool).
"""

from __future__ import annotations

import torch

from .dispatch import cdiv, lazy_jit, tl, use_triton

__all__ = ["copy_page_prefixes", "copy_page_prefixes_ref", "pools_fit"]

BLOCK = 1024  # words per program
_TABLES: dict = {}  # (device, base addresses) -> that table on the device (pools of a sized cache never move)


def copy_page_prefixes_ref(pools: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    """Torch twin: ``pool[dst[i], :rows] = pool[src[i], :rows]`` for every pool, all reads of a pool first."""
    for pages in pools:
        head = pages[:, :rows]
        head.index_copy_(0, dst, head.index_select(0, src))


@lazy_jit(do_not_specialize=("n_words", "page_words"))
def _prefix_copy_kernel(BASES, SRC, DST, SCRATCH, n_words, page_words, B, WORDS32: tl.constexpr,
                        GATHER: tl.constexpr, BLOCK: tl.constexpr):
    # program (pool, sequence, block of words); GATHER: page src -> scratch, else scratch -> page dst
    pool = tl.program_id(0)
    b = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(SRC + b)
    d = tl.load(DST + b)
    mask = (offs < n_words) & (s + offs * 0 != d)  # (a vector: a scalar condition in a mask trips the interpreter)
    if WORDS32:
        base = tl.load(BASES + pool).to(tl.pointer_type(tl.int32))
    else:
        base = tl.load(BASES + pool).to(tl.pointer_type(tl.int8))
    scratch = SCRATCH + (pool * B + b).to(tl.int64) * n_words + offs
    if GATHER:
        tl.store(scratch, tl.load(base + s.to(tl.int64) * page_words + offs, mask=mask), mask=mask)
    else:
        tl.store(base + d.to(tl.int64) * page_words + offs, tl.load(scratch, mask=mask), mask=mask)


def _bases(pools: list[torch.Tensor], device) -> torch.Tensor:
    key = (device, tuple(p.data_ptr() for p in pools))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key[1], dtype=torch.int64).to(device)
    return table


def copy_page_prefixes_triton(pools: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    """Triton path of :func:`copy_page_prefixes` (no dispatch; the pools checked there)."""
    first = pools[0]
    row_bytes = first.shape[-1] * first.element_size()
    words32 = row_bytes % 4 == 0
    n_words = rows * row_bytes // (4 if words32 else 1)
    page_words = first.shape[1] * row_bytes // (4 if words32 else 1)
    B = dst.shape[0]
    scratch = torch.empty(len(pools) * B * n_words, dtype=torch.int32 if words32 else torch.int8, device=first.device)
    bases = _bases(pools, first.device)
    grid = (len(pools), B, cdiv(n_words, BLOCK))
    for gather in (True, False):
        _prefix_copy_kernel[grid](bases, src, dst, scratch, n_words, page_words, B, WORDS32=words32, GATHER=gather,
                                  BLOCK=BLOCK, num_warps=4)


def pools_fit(pools: list[torch.Tensor]) -> bool:
    """Whether :func:`copy_page_prefixes` takes these pools: one page shape, dtype and device, each contiguous."""
    first = pools[0]
    return all(p.shape[1:] == first.shape[1:] and p.dtype == first.dtype and p.device == first.device
               and p.is_contiguous() for p in pools)


def copy_page_prefixes(pools: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    """In every pool of ``pools`` (``[pages, page_size, width]`` tensors of one shape, dtype and device, each
    contiguous), the first ``rows`` rows of page ``src[i]`` are copied onto page ``dst[i]`` for every ``i`` (``src``,
    ``dst``: int64 ``[B]`` on that device), as if every source were read before any destination was written.  The
    Triton kernels where ``dispatch.use_triton`` says so, else :func:`copy_page_prefixes_ref`."""
    if not pools or rows <= 0 or dst.numel() == 0:
        return
    first = pools[0]
    if not 0 < rows <= first.shape[1] or dst.shape != src.shape or dst.dim() != 1:
        raise ValueError(f"rows={rows}, dst {tuple(dst.shape)}, src {tuple(src.shape)} do not fit pages "
                         f"{tuple(first.shape)}")
    if not pools_fit(pools):
        raise ValueError("copy_page_prefixes: the pools differ in page shape, dtype or device, or are not contiguous")
    if use_triton(first):
        copy_page_prefixes_triton(pools, dst.to(torch.int64), src.to(torch.int64), rows)
    else:
        copy_page_prefixes_ref(pools, dst, src, rows)
