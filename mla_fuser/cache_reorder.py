"""Beam reorder of a static paged latent cache in place, for all its paged layers at once.

Beam search reorders the cache after every step.  Done layer by layer, a reorder cost a 27-layer model ~6 launches
and ~100 µs of host time per layer (3.8 ms per step on an H200, while the GPU waited: the reorder follows the
step's sync).  The layers of one cache hold the same block tables (a static cache reserves the same pages in every
layer's pool, and every change goes to all layers), so the host work is done once, the new block-table rows are
computed once per device and copied to every layer with one multi-tensor copy, and the written rows of the partly
written pages are copied for every layer in two launches (``kernels.page_prefix_copy``; as two indexed copies of
whole pages per layer they cost 0.36 ms per step on an H200).  Nothing waits for the device: the device side works from the indices
where they are, and the host copy of the block tables follows once the indices reach the host
(:class:`PendingTables`), so the reorder's launches queue behind the step instead of starting after it (the step's
sync, which came first in the reorder, came later anyway: beam search checks its stopping criteria).

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
from .kernels.page_prefix_copy import copy_page_prefixes, copy_page_prefixes_ref, pools_fit


class PendingTables:
    """Host block tables that in-place reorders changed while their indices were still on the way to the host.

    Why: a reorder needs the new order on the host only for its host copy of the block tables; the device side
    (block-table rows, the partly written page) works from the indices on the device.  Reading them at once
    (``tolist``) waited for the step that chose them, so the reorder's host work and launches ran while the GPU sat
    idle.  Instead each reorder starts a copy of its indices to pinned host memory behind the step and records it
    here; the tables are worked out when someone reads them (``PagedLatentLayer.host_tables``) or when a later reorder
    finds the copies done.  ``base``: the tables before ``steps`` (never changed in place: layers that read them
    take copies); ``steps``: ``(indices, event, full, home)`` per reorder, in order: host ints (or a pinned tensor
    and the CUDA event after its copy), the whole pages every sequence had then, and the sequences' own pages;
    ``full``: the last reorder's (from that column on, every row names its sequence's own pages)."""

    __slots__ = ("base", "steps", "full")

    def __init__(self, base: list[list[int]], steps: tuple = ()):
        self.base, self.steps = base, steps
        self.full = steps[-1][2] if steps else 0

    def then(self, step: tuple) -> "PendingTables":
        """These tables with one more reorder; the steps whose copies are done are worked in first (no waiting), so
        that the chain stays short over a long beam search."""
        base, steps = self.base, self.steps
        while steps and _copied(steps[0]):
            base, steps = _apply(base, steps[0], wait=False), steps[1:]
        return PendingTables(base, steps + (step,))

    def tables(self) -> list[list[int]]:
        """The tables after every step (waits for copies still in flight; never inside a CUDA graph capture)."""
        if (any(step[1] is not None for step in self.steps) and torch.cuda.is_available()
                and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("paged latent cache: host block tables read inside a CUDA graph capture while a beam "
                               "reorder's indices are still on their way to the host")
        base = self.base
        for step in self.steps:
            base = _apply(base, step)
        self.base, self.steps = base, ()
        return base


class HostTables:
    """A paged layer's ``host_tables``, which in-place reorders may leave pending (:class:`PendingTables`)."""

    pending_tables: "PendingTables | None" = None

    @property
    def host_tables(self) -> list[list[int]]:
        """Per sequence, the page ids of its block-table row (the host's copy); after in-place beam reorders
        (``pending_tables``) worked out on first read, which may wait for their indices."""
        if self.pending_tables is not None:
            self._host_tables = [list(t) for t in self.pending_tables.tables()]
            self.pending_tables = None
        return self._host_tables

    @host_tables.setter
    def host_tables(self, tables: list[list[int]]) -> None:
        self.pending_tables = None
        self._host_tables = tables


def _copied(step: tuple) -> bool:
    return step[1] is None or step[1].query()


def _apply(tables: list[list[int]], step: tuple, wait: bool = True) -> list[list[int]]:
    indices, event, full, home = step
    if wait and event is not None:
        event.synchronize()
    source = indices if isinstance(indices, list) else indices.tolist()
    return [tables[s][:full] + home[i][full:] for i, s in enumerate(source)]


def _indices_on_the_way(beam_idx: torch.Tensor):
    """``(indices, event)``: a CUDA tensor's values copied behind the work queued so far into pinned host memory
    (``event`` marks the copy's end); any other device's as host ints at once."""
    if beam_idx.device.type != "cuda":
        return beam_idx.tolist(), None
    host = torch.empty(beam_idx.shape, dtype=torch.long, pin_memory=True)
    host.copy_(beam_idx, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(beam_idx.device))
    return host, event


def reorder_in_place(layers: list, beam_idx: torch.Tensor) -> bool:
    """Sequence ``i`` of every layer in ``layers`` (``PagedLatentLayer`` of one static cache) continues old sequence
    ``beam_idx[i]``, without waiting for the device (the host tables follow through :class:`PendingTables`).  False,
    with nothing done, when that cannot be done in place: not static, another batch size, unequal lengths, layers
    whose tables differ."""
    first = layers[0]
    lens, home, pending = first.host_lens, first.home, first.pending_tables
    if home is None or beam_idx.shape != (len(lens),) or any(n != lens[0] for n in lens):
        return False
    page = first.pool.page_size
    full, partial = divmod(lens[0], page)
    if pending is not None and pending.full <= full and all(layer.pending_tables is pending for layer in layers):
        # the layers' tables are one object's, made by in-place reorders: equal, and from the last one's `full`
        # (at most this one: lengths that went back are checked below on worked-out tables) on own pages
        if any(layer.host_lens != lens or layer.home != home or layer.pool.page_size != page for layer in layers):
            return False
    else:
        tables = first.host_tables
        if any(t[full:] != h[full:] for t, h in zip(tables, home)):
            return False  # (cannot happen while every change goes through the cache; checked, as it is cheap)
        for layer in layers[1:]:
            if (layer.host_lens != lens or layer.home != home or layer.host_tables != tables
                    or layer.pool.page_size != page):
                return False
        pending = PendingTables([list(t) for t in tables])
    groups: dict[torch.device, list] = {}
    for layer in layers:
        groups.setdefault(layer.block_table.device, []).append(layer)
    for device, group in groups.items():
        _reorder_group(group, beam_idx.to(device=device, dtype=torch.long), full, partial)
    pending = pending.then((*_indices_on_the_way(beam_idx), full, home))
    for layer in layers:
        layer.pending_tables = pending
    return True


def _reorder_group(group: list, index: torch.Tensor, full: int, partial: int) -> None:
    """The device side for the layers of one device (equal block tables): new rows once, one multi-tensor copy of
    them into every layer's block table, and the partly written pages' written rows (every layer at once)."""
    lead = group[0]
    rows = lead.block_table.index_select(0, index)  # old rows, new order
    if partial:  # the partly written page's written rows: old source[i]'s page `full` into i's own page `full`
        home_columns = _home_columns(lead)
        own, theirs = home_columns[full], rows[:, full].long()
        pools = [raw(layer.pool.pages) for layer in group]
        # (every layer in two launches; pools of different shapes through the torch twin, layer by layer)
        (copy_page_prefixes if pools_fit(pools) else copy_page_prefixes_ref)(pools, own, theirs, partial)
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
