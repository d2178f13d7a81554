"""Counting where a cache's buffers move, so that a captured decode step can tell in a few attribute reads.

A CUDA graph replays on fixed addresses: before each replay, ``runtime.decode_graph`` must know whether any buffer a
step reads or writes was replaced since the capture.  Reading every buffer's data pointer (six per layer, 27 layers)
cost ~50 us of host time per step on an H200 host, time the GPU waits for (``profile_generate_gaps.py``).  The
paged cache's classes count their moves instead, as they happen; the cache knows nothing of graphs.
"""

from __future__ import annotations

import torch


def address(value):
    """Where ``value`` lies, for :class:`CountsMoves`: a tensor's data pointer, a tuple of those, else identity."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, (tuple, list)):
        return tuple(address(v) for v in value)
    return id(value)


class CountsMoves:
    """``moves`` counts the assignments to the attributes in ``_WATCHED`` that put other memory there (another data
    pointer; a new view of the same memory is not a move).  A captured decode step compares these counts instead of
    reading every buffer's address before each replay (``layout_key``).  The cache's classes never move memory in
    place (``set_``, ``resize_``), so every move is an assignment."""

    _WATCHED: frozenset = frozenset()
    moves = 0

    def __setattr__(self, name, value):
        if name in self._WATCHED and address(self.__dict__.get(name)) != address(value):
            object.__setattr__(self, "moves", self.moves + 1)
        object.__setattr__(self, name, value)
