"""The page pool of one paged latent layer: one tensor of fixed-size pages and a free list (``cache.PagedLatentCache``
holds one per fused MLA layer, or shares them between caches)."""

from __future__ import annotations

import torch

from .cache_moves import CountsMoves


class CachePoolExhausted(RuntimeError):
    """The page pool of a paged latent cache cannot hold the requested tokens."""


class PagePool(CountsMoves):
    """Pages of one layer: one tensor and a free list (page ids).  ``moves``: how often ``pages`` was replaced.

    A ``growable`` pool (the automatic cache of ``generate``) doubles instead of raising when it runs out;
    a sized pool (``max_cache_tokens`` / ``memory_fraction``) never moves, so its addresses stay fixed."""

    _WATCHED = frozenset({"pages"})

    def __init__(self, num_pages: int, page_size: int, width: int, dtype, device, growable: bool = False):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page (got {num_pages})")
        self.page_size = page_size
        self.width = width
        self.growable = growable
        self.pages = torch.zeros(num_pages, page_size, width, dtype=dtype, device=device)
        self.free: list[int] = list(range(num_pages - 1, -1, -1))

    def _grow(self, at_least: int) -> None:
        old = self.num_pages
        new = max(old, at_least)
        extra = torch.zeros(new, self.page_size, self.width, dtype=self.pages.dtype, device=self.pages.device)
        self.pages = torch.cat([self.pages, extra])
        self.free = list(range(old + new - 1, old - 1, -1)) + self.free

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free) and self.growable:
            self._grow(n - len(self.free))
        if n > len(self.free):
            raise CachePoolExhausted(
                f"paged latent cache: {n} more pages of {self.page_size} tokens needed, only {len(self.free)} of "
                f"{self.num_pages} free; raise max_cache_tokens / memory_fraction or shorten the batch"
            )
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))
