"""Beam reorder of a static paged latent cache in place, for all its paged layers at once.

Beam search reorders the cache after every step.  Done layer by layer, a reorder cost a 27-layer model ~6 launches
and ~100 µs of host time per layer (3.8 ms per step on an H200, while the GPU waited: the reorder follows the
step's sync).  The layers of one cache hold the same block tables (a static cache reserves the same pages in every
layer's pool, and every change goes to all layers), so the host work is done once, the new block-table rows are
computed once per device and copied to every layer with one multi-tensor copy; only the partly written page is
copied layer by layer (two launches each).

Why in place: a captured decode step reads the block tables and pages at fixed addresses.  With ``n`` tokens per
sequence and ``full = n // page_size`` pages written whole, new sequence ``i`` takes old ``source[i]``'s first
``full`` block-table entries (written pages, shared and never written again), gets old ``source[i]``'s partly
written page copied into its own page ``full``, and keeps its own pages from there on for what it writes next.  So
column ``j`` of the block table only ever names some sequence's own page ``j``: no sequence's next write lands in a
page another one reads.
"""

from __future__ import annotations

import math

import torch

from .kernels.latent_fp8 import raw


def reorder_in_place(layers: list, beam_idx: torch.Tensor, source: list[int]) -> bool:
    """Sequence ``i`` of every layer in ``layers`` (``PagedLatentLayer`` of one static cache) continues old sequence
    ``source[i]`` (``beam_idx`` on the device, ``source`` the same as host ints).  False, with nothing done, when
    that cannot be done in place: not static, another batch size, unequal lengths, layers whose tables differ."""
    first = layers[0]
    lens, home, tables = first.host_lens, first.home, first.host_tables
    if home is None or len(source) != len(lens) or any(n != lens[0] for n in lens):
        return False
    page = first.pool.page_size
    full, partial = divmod(lens[0], page)
    if any(t[full:] != h[full:] for t, h in zip(tables, home)):
        return False  # (cannot happen while every change goes through the cache; checked, as it is cheap)
    for layer in layers[1:]:
        if (layer.host_lens != lens or layer.home != home or layer.host_tables != tables
                or layer.pool.page_size != page):
            return False
    groups: dict[torch.device, list] = {}
    for layer in layers:
        groups.setdefault(layer.block_table.device, []).append(layer)
    for device, group in groups.items():
        _reorder_group(group, beam_idx.to(device=device, dtype=torch.long), full, partial)
    new_tables = [tables[s][:full] + home[i][full:] for i, s in enumerate(source)]
    for layer in layers:
        layer.host_tables = [list(t) for t in new_tables]
    return True


def _reorder_group(group: list, index: torch.Tensor, full: int, partial: int) -> None:
    """The device side for the layers of one device (equal block tables): new rows once, one multi-tensor copy of
    them into every layer's block table, and the partly written page layer by layer."""
    lead = group[0]
    rows = lead.block_table.index_select(0, index)  # old rows, new order
    if partial:  # the partly written page: old source[i]'s page `full` into i's own page `full`
        home_columns = _home_columns(lead)
        own, theirs = home_columns[full], rows[:, full].long()
        for layer in group:
            pages = raw(layer.pool.pages)
            pages.index_copy_(0, own, pages.index_select(0, theirs))
    if full:  # columns from `full` on stay each sequence's own pages
        rows[:, full:] = lead.block_table[:, full:]
        torch._foreach_copy_([layer.block_table for layer in group], [rows] * len(group))
    starts = [layer.starts for layer in group if layer.starts is not None]
    if starts:
        torch._foreach_copy_(starts, list(torch.stack(starts).index_select(1, index).unbind(0)))


def _home_columns(layer) -> torch.Tensor:
    """``[pages, B]`` long on the layer's device: column ``j`` of every sequence's own pages, a contiguous row."""
    if layer._home_device is None:
        layer._home_device = torch.tensor(layer.home, dtype=torch.long).t().contiguous().to(layer.block_table.device)
    return layer._home_device


def own_pages_from(layer, column: int, lens: list[int]) -> None:
    """Every sequence's block-table entries of ``layer`` (a static cache's ``PagedLatentLayer``) from ``column`` on
    name its own pages again (those that named another sequence's page after a beam reorder get a copy of it, for the
    tokens of ``lens`` they hold): what a crop needs before the sequences write into those columns.  Host tables
    only; the caller uploads them."""
    page = layer.pool.page_size
    src, dst = [], []
    for table, own, n in zip(layer.host_tables, layer.home, lens):
        for j in range(column, min(len(table), math.ceil(n / page))):
            if table[j] != own[j]:
                src.append(table[j])
                dst.append(own[j])
        table[column:] = own[column:]
    if src:  # all reads before any write: a page may be both read (for one sequence) and written (another's own)
        pages = raw(layer.pool.pages)
        index = torch.tensor(dst + src, dtype=torch.long).to(layer.device)
        pages.index_copy_(0, index[: len(dst)], pages.index_select(0, index[len(dst):]))
