"""Paged latent KV cache for fused MLA layers, as a Transformers ``Cache`` subclass.

Why pages: Transformers' ``DynamicLayer`` concatenates the whole history at every step (an O(T) copy per
layer per token) and keeps one contiguous tensor per layer.  Here each fused MLA layer owns a pool of
fixed-size pages ``[num_pages, page_size, kv_lora_rank + rope]`` (row = ``[kv_c | k_pe]``, the layout the
decode kernel reads, V being the first ``kv_lora_rank`` columns of the same rows), and each sequence a block
table and a length.  Writing a step costs O(new tokens); nothing of the history is copied.

* Sizing: ``max_cache_tokens`` (per layer) or ``memory_fraction`` of the device memory free when the first
  layer is initialised (split across the paged layers).  When the pool cannot hold a step, a
  ``CachePoolExhausted`` error says how many pages were needed and how many are free; the step writes
  nothing, so other sequences (also other caches sharing the pool) are untouched.
* Pools can be shared by several caches (``PagedLatentCache(..., share_pools_with=other)``): one budget for
  concurrent requests.
* ``static=True`` allocates every sequence's pages up front (for ``max_seq_len`` tokens), so a decode step
  only does device-side index arithmetic: the shapes and addresses a CUDA graph needs stay fixed.
* ``dtype`` (default: the latent's own) sets the pages' dtype; ``torch.float8_e4m3fn`` halves the cache: rows of e4m3
  values with one fp32 scale per token for ``kv_c`` and one for ``k_pe`` (``kernels.latent_fp8``, which says why).
* Non-MLA layers (hybrid models), DSA layers with indexer caches and unfused MLA layers keep the layer
  Transformers' ``DynamicCache`` would give them.
* ``generate()``: beam search (``reorder_cache``), ``crop`` (assisted decoding), ``batch_select_indices``
  and ``batch_repeat_interleave`` are supported; pages live on each layer's own device.  A static cache reorders
  beams in place (block-table rows and one partly written page per sequence, nothing moves), so a captured decode
  step stays valid across reorders; ``move_padding_left`` turns right or inner padding into left padding after a
  prefill, so steps without a mask can skip it.

``update`` returns stand-in tensors of the right shape ``[B, 1, T, *]`` (stride-0 views of a NaN row, no
memory) that carry a ``PagedView`` handle; the ``vllm_mla`` attention function reads the pages through the
handle.  Code that consumed the returned states in any other way (e.g. cross-layer KV sharing into an
unfused layer) would see NaNs, never plausible garbage.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

from .cache_moves import CountsMoves
from .cache_pool import CachePoolExhausted, PagePool
from .cache_reorder import HostTables, own_pages_from, reorder_in_place
from .kernels.dispatch import on_device, use_triton
from .kernels.latent_fp8 import FP8_DTYPE, dequantise_rows, is_fp8, packed_width, raw
from .kernels.paged_cpu import append_rows
from .kernels.paged_cache_ops import paged_append
from .plans import model_state, plan_of

PAGED_ATTR = "_mla_fuser_paged"


def _upload(host: torch.Tensor, device, current: torch.Tensor | None) -> torch.Tensor:
    """``host`` on ``device``, written into ``current`` when it has the same shape (fixed addresses for CUDA
    graphs).  A CUDA copy goes through pinned memory so it is asynchronous: a copy from pageable memory waits for
    every kernel queued so far, which in a prefill would stall the host once per layer."""
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    if current is not None and current.shape == host.shape and current.device == device:
        current.copy_(host, non_blocking=True)
        return current
    return host.to(device, non_blocking=True)


class PagedView:
    """Handle the attention function receives (attached to the stand-in key tensor)."""

    __slots__ = ("layer", "new_kv_c", "new_k_pe", "query_len")

    def __init__(self, layer: "PagedLatentLayer", new_kv_c, new_k_pe):
        self.layer, self.new_kv_c, self.new_k_pe = layer, new_kv_c, new_k_pe
        self.query_len = new_kv_c.shape[2]

    @property
    def pages(self):
        return self.layer.pool.pages

    @property
    def block_table(self):
        return self.layer.block_table

    @property
    def seq_lens(self):
        return self.layer.seq_lens

    @property
    def starts(self):
        """int32 ``[B]`` left-padding starts (tokens before them are not attended) or None."""
        return self.layer.starts

    def gather(self) -> torch.Tensor:
        """The whole cached latent of every sequence, contiguous: ``[B, T, width]`` (prefill, torch paths)."""
        return self.layer.gather()


class PagedLatentLayer(HostTables, CountsMoves, CacheLayerMixin):
    """One fused MLA layer's paged latent: per sequence a block table (page ids) and a length."""

    _WATCHED = frozenset({"pool", "tables", "block_table", "seq_lens", "starts", "_nan_rows"})
    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: "PagedLatentCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.pool: PagePool | None = None
        self.host_tables: list[list[int]] = []  # (a property: see HostTables)
        self.host_lens: list[int] = []
        self._nan_rows = None  # the stand-ins' rows (see _stand_ins)
        self.starts: torch.Tensor | None = None  # int32 [B]: left padding (PagedLatentCache.set_left_padding)
        self.tables: torch.Tensor | None = None  # int32 [B * max_pages + B]: the two views below
        self.block_table: torch.Tensor | None = None  # int32 [B, max_pages]
        self.seq_lens: torch.Tensor | None = None  # int32 [B]
        self.rank = None
        # a static cache's own pages per sequence (its first reservation): what each sequence writes to, and what
        # the cache owns, while block-table rows may share other sequences' written pages (see cache_reorder)
        self.home: list[list[int]] | None = None
        self._home_device: torch.Tensor | None = None

    # ------------------------------------------------------------------ what native MLA caches expose
    @property
    def keys(self) -> torch.Tensor | None:
        """The cached latent ``kv_c`` ``[B, 1, T, kv_lora_rank]``, as Transformers' own MLA caches hold it; read back
        from the pages at each access (a copy: writing to it changes nothing).  None while nothing is cached."""
        return self.keys_and_values()[0]

    @property
    def values(self) -> torch.Tensor | None:
        """The cached rotary key ``k_pe`` ``[B, 1, T, rope]`` (see ``keys``)."""
        return self.keys_and_values()[1]

    def keys_and_values(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` from one read-back of the pages (each property reads them back on its own)."""
        latent = self._read_back()
        if latent is None:
            return None, None
        return latent[..., : self.rank].unsqueeze(1), latent[..., self.rank:].unsqueeze(1)

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    @staticmethod
    def _refuse_assignment(name: str, value) -> None:
        if value is not None:  # (the base class initialises both to None)
            raise AttributeError(f"PagedLatentLayer.{name} is read back from the pages and cannot be assigned")

    def _read_back(self) -> torch.Tensor | None:
        if self.pool is None or not self.host_lens or self.get_seq_length() == 0:
            return None
        return self.gather()

    def offload(self) -> None:
        """Pages stay on the layer's device (the base class would move ``keys``/``values``, which are views here)."""

    def prefetch(self) -> None:
        """See ``offload``."""

    # ------------------------------------------------------------------ what a replayed step needs
    # (the cache knows nothing of graphs: this is all ``runtime.decode_graph`` reads or changes)
    @property
    def lengths(self) -> list[int]:
        """Tokens cached per sequence, as the host knows them (a copy)."""
        return list(self.host_lens)

    def buffers(self) -> list[torch.Tensor]:
        """The device memory a decode step of this layer reads or writes (pool, tables, starts, stand-in rows):
        what a captured step holds the addresses of."""
        pages = None if self.pool is None else self.pool.pages
        held = (pages, self.tables, self.block_table, self.seq_lens, self.starts, *(self._nan_rows or ()))
        return [t for t in held if t is not None]

    def layout_key(self) -> tuple[int, int]:
        """Changes whenever the memory :meth:`buffers` names moves (this layer's or its pool's ``moves``): what a
        captured step checks before each replay, in two attribute reads."""
        pool = self.pool
        return self.moves, -1 if pool is None else pool.moves

    def advance(self, tokens: int = 1) -> None:
        """Record on the host that every sequence grew by ``tokens`` (a replayed or compiled step did it on the
        device)."""
        self.host_lens = [n + tokens for n in self.host_lens]

    def rewind(self, lengths: list[int]) -> None:
        """Put the host lengths back to ``lengths`` (after a capture, which runs the Python of a step but no kernel)."""
        self.host_lens = list(lengths)

    # ------------------------------------------------------------------ set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.rank, self.dtype = key_states.shape[-1], key_states.dtype  # (reads of an FP8 pool dequantise to dtype)
        self.width = width = key_states.shape[-1] + value_states.shape[-1]
        first_pages = key_states.shape[0] * math.ceil(key_states.shape[2] / self.cache.page_size)
        dtype = self.cache.latent_dtype or key_states.dtype
        self.pool = self.cache._pool_for(self.layer_idx, packed_width(width) if is_fp8(dtype) else width, dtype,
                                         key_states.device, first_pages)
        self.is_initialized = True

    def _ensure_batch(self, batch: int) -> bool:
        """Set the layer up for ``batch`` sequences on its first write; True when its new tables still have to be
        uploaded (the caller's reservation does it when it moves pages, else the caller must)."""
        if self.block_table is not None and self.block_table.shape[0] == batch:
            return False
        if self.host_tables and len(self.host_tables) != batch:
            raise ValueError(f"paged latent cache holds {len(self.host_tables)} sequences, got a batch of {batch}")
        self.host_tables = [[] for _ in range(batch)]
        self.host_lens = [0] * batch
        moved = self.cache.static and self._reserve([self.cache.max_seq_len] * batch)  # (uploads when it moves)
        self._load_starts()
        return not moved

    def _load_starts(self) -> None:
        starts = self.cache.padding_starts
        if starts is None or not self.host_tables:
            self.starts = None
            return
        if starts.shape != (len(self.host_tables),):
            raise ValueError(f"left-padding starts {tuple(starts.shape)} do not fit a batch of {len(self.host_tables)}")
        # (a copy of its own: layers permute their starts in place, and a CPU upload would alias the cache's tensor)
        self.starts = _upload(starts.to(torch.int32, copy=True), self.device, self.starts)

    def _sync_tables(self) -> None:
        """Upload the host block tables and lengths: one buffer ``[block table (B x W) | lengths (B)]``, one copy;
        ``block_table`` and ``seq_lens`` are views of it (the same addresses while the shape holds)."""
        batch = len(self.host_tables)
        width = max([len(t) for t in self.host_tables] + [1])
        if self.cache.static:
            width = max(width, math.ceil(self.cache.max_seq_len / self.pool.page_size))
        rows = [pages + [0] * (width - len(pages)) for pages in self.host_tables]
        host = torch.tensor([v for row in rows for v in row] + list(self.host_lens), dtype=torch.int32)
        self.tables = _upload(host, self.device, self.tables)
        self.block_table = self.tables[: batch * width].view(batch, width)
        self.seq_lens = self.tables[batch * width:]

    def _reserve(self, target_lens: list[int]) -> bool:
        """Make every sequence hold pages for ``target_lens`` tokens; all-or-nothing.  True if pages moved."""
        page = self.pool.page_size
        needs = [max(0, math.ceil(n / page) - len(t)) for n, t in zip(target_lens, self.host_tables)]
        total = sum(needs)
        if total == 0:
            return False
        if self.cache.static and any(self.host_tables):
            raise CachePoolExhausted(
                f"static paged latent cache sized for {self.cache.max_seq_len} tokens per sequence; "
                f"a sequence needs {max(target_lens)}"
            )
        fresh = self.pool.allocate(total)  # raises before anything changed
        for t, n in zip(self.host_tables, needs):
            t.extend(fresh[:n])
            fresh = fresh[n:]
        if self.cache.static:  # the one reservation of a static cache: each sequence's own pages from now on
            self.home, self._home_device = [list(t) for t in self.host_tables], None
        self._sync_tables()
        return True

    # ------------------------------------------------------------------ the Cache layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states`` (kv_c [B,1,S,rank]) and ``value_states`` (k_pe [B,1,S,rope]) into pages.

        A step traced by ``torch.compile`` over a compileable (static) cache writes and advances the lengths on the
        device only and returns stand-ins as long as the cache (one shape at every step, as Transformers'
        ``StaticLayer`` keeps them): a host list read there would trace the step again for every length.  Whoever
        runs such steps advances the host lengths after each (:meth:`advance`), as a replayed step's caller does."""
        fixed = self.is_compileable and torch.compiler.is_compiling()
        batch, _, new, _ = key_states.shape
        if not fixed:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if len(self.host_lens) == batch and self.block_table is not None and self._holds(new):
                target = [self.host_lens[0] + new] * batch  # a step inside pages already held (most decode steps)
            else:
                target = self._prepare(batch, new)
        pages = self.pool.pages
        kv_c, k_pe = key_states.select(1, 0), value_states.select(1, 0)
        if (kv_c.dtype != pages.dtype or k_pe.dtype != pages.dtype) and not is_fp8(pages):  # (FP8: quantised)
            kv_c, k_pe = kv_c.to(pages.dtype), k_pe.to(pages.dtype)
        # destinations from the block table and the lengths, in the kernel: one launch, no index arithmetic; on the
        # layer's device (device_map splits), not the current one
        # (the lengths move past the step inside the append: for one token, in its kernel)
        if pages.is_cuda:
            with on_device(pages):
                paged_append(pages, self.block_table, self.seq_lens, kv_c, k_pe, advance=True)
        elif not torch.compiler.is_compiling() and not use_triton(pages):
            # what the op runs on CPU (paged_cpu), from the host lists this layer keeps: no tensor read, no dispatch
            append_rows(pages, self.host_tables, self.host_lens, kv_c, k_pe)
            self.seq_lens += new
        else:
            paged_append(pages, self.block_table, self.seq_lens, kv_c, k_pe, advance=True)
        if fixed:
            return self._stand_ins(key_states, value_states, self.cache.max_seq_len)
        self.host_lens = target
        return self._stand_ins(key_states, value_states, target[0] if target else 0)

    def _holds(self, new: int) -> bool:
        """Whether every sequence (all of one length) already holds the pages for ``new`` more tokens."""
        # (rows of tables that in-place reorders left pending are as long as each sequence's own pages: not worked
        # out here, where a replayed step's capture may be running)
        lens, tables = self.host_lens, self.home if self.pending_tables is not None else self.host_tables
        first = lens[0]
        if len(tables) != len(lens) or lens.count(first) != len(lens):  # (C loops: asked at every step of a layer)
            return False
        return first + new <= min(map(len, tables)) * self.pool.page_size

    def _prepare(self, batch: int, new: int) -> list[int]:
        """The lengths after writing ``new`` tokens, with the pages for them reserved (and the batch set up on a first
        write); raises before anything changed when the pool cannot hold them."""
        first_write = not self.host_tables
        try:
            unsynced = self._ensure_batch(batch)
            if any(n != self.host_lens[0] for n in self.host_lens):
                raise RuntimeError("paged latent cache: sequences of one batch must advance together")
            target = [n + new for n in self.host_lens]
            if not self._reserve(target) and unsynced:
                self._sync_tables()
        except CachePoolExhausted:
            if first_write:  # the cache's first forward failed: leave the whole cache as new (any batch may follow)
                self.cache.forget_failed_first_forward()
            raise
        return target

    def _stand_ins(self, key_states, value_states, total):
        # stride-0 views of one NaN row: no memory, the right shape for code that asks for sizes, and loud
        # (NaN outputs) rather than silently wrong if anything but the vllm_mla function computes with them.
        # The rows are made once per layer (nothing ever writes to them), not at every step.
        rows = self._nan_rows
        if rows is None or rows[0].dtype != key_states.dtype or rows[0].device != key_states.device:
            fill = float("nan") if key_states.is_floating_point() else 0
            rows = self._nan_rows = (key_states.new_full((1, 1, 1, key_states.shape[-1]), fill),
                                     value_states.new_full((1, 1, 1, value_states.shape[-1]), fill))
        kv = rows[0].expand(key_states.shape[0], 1, total, -1)
        pe = rows[1].expand(value_states.shape[0], 1, total, -1)
        setattr(kv, PAGED_ATTR, PagedView(self, key_states, value_states))
        return kv, pe

    def gather(self) -> torch.Tensor:
        """Every sequence's latent ``[B, T, rank + rope]`` (an FP8 pool's rows dequantised to the latent's dtype)."""
        rows = self._rows()
        return dequantise_rows(rows, self.rank, self.width, self.dtype) if is_fp8(rows) else rows

    def _rows(self) -> torch.Tensor:
        """The rows as the pages hold them ``[B, T, pool width]``."""
        total = max(self.host_lens) if self.host_lens else 0
        pages_needed = math.ceil(total / self.pool.page_size)
        table = self.block_table[:, :pages_needed].long()
        data = raw(self.pool.pages)[table].view(self.pool.pages.dtype)  # [B, n, P, W]
        return data.reshape(table.shape[0], -1, self.pool.width)[:, :total]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.is_compileable:  # (a compileable cache's masks cover all of it, one shape at every step)
            return self.cache.max_seq_len, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.is_compileable and torch.compiler.is_compiling():  # (on the device, as StaticLayer's: no host int)
            return self.seq_lens[0]
        return max(self.host_lens) if self.host_lens else 0

    def get_max_length(self) -> int:
        return self.cache.max_seq_len if self.cache.static else -1

    def _owned(self) -> list[list[int]]:
        """The pages this layer holds, each once (block-table rows of a static cache may share written pages)."""
        return self.home if self.home is not None else self.host_tables

    def reset(self) -> None:
        if self.pool is not None:
            for t in self._owned():
                self.pool.release(t)
        self.host_tables, self.host_lens = [], []
        self.tables = self.block_table = self.seq_lens = self.starts = None
        self.home = self._home_device = None

    def restart(self) -> None:
        """Hold no tokens again, every buffer kept where it is (:meth:`PagedLatentCache.restart`)."""
        if self.home is not None:
            self.host_tables, self.host_lens = [list(t) for t in self.home], [0] * len(self.home)
            self._sync_tables()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.host_lens:
            return
        keep = [max(0, n + tokens_to_remove) for n in self.host_lens]
        self._shrink(keep)

    def _shrink(self, keep: list[int]) -> None:
        page = self.pool.page_size
        if self.home is not None:  # what is written next must land in each sequence's own pages again
            own_pages_from(self, min(keep) // page, keep)
        for t, n in zip(self.host_tables, keep):
            extra = len(t) - math.ceil(n / page)
            if extra > 0 and not self.cache.static:
                self.pool.release(t[-extra:])
                del t[-extra:]
        self.host_lens = keep
        self._sync_tables()

    def _copy_sequences(self, source: list[int]) -> None:
        """Sequence i becomes a copy of old sequence ``source[i]`` (beam reorder, selection, repetition)."""
        total = self.get_seq_length()
        if total == 0:
            self.host_tables = [[] for _ in source] if len(source) != len(self.host_tables) else self.host_tables
            self.host_lens = [0] * len(source)
            if self.pool is not None:
                self._sync_tables()
            return
        lens = [self.host_lens[s] for s in source]
        page = self.pool.page_size
        needed = sum(max(math.ceil(n / page), math.ceil(self.cache.max_seq_len / page) if self.cache.static else 0)
                     for n in lens)
        available = len(self.pool.free) + sum(len(t) for t in self._owned())
        if needed > available and not self.pool.growable:
            # checked before anything is released: a failed copy leaves the cache as it was
            raise CachePoolExhausted(
                f"paged latent cache: copying sequences {source} needs {needed} pages of {page} tokens, the pool "
                f"has {available} (free plus this cache's own); raise max_cache_tokens / memory_fraction"
            )
        data = raw(self._rows())[torch.as_tensor(source, device=self.device)]  # [B', T, W]
        old = self._owned()
        self.host_tables = [[] for _ in source]
        self.host_lens = [0] * len(source)
        self.home = self._home_device = None  # (a static cache's _reserve below makes the new one)
        for t in old:
            self.pool.release(t)
        # also rebuilds the block table for the new batch; a static cache keeps every sequence's full reservation
        self._reserve([max(n, self.cache.max_seq_len) for n in lens] if self.cache.static else lens)
        positions = torch.arange(total, device=self.device)
        page_ids = self.block_table.long()[:, positions // page]
        slots = (page_ids * page + positions % page).reshape(-1)
        raw(self.pool.pages).view(-1, self.pool.width).index_copy_(0, slots, data.reshape(-1, self.pool.width))
        self.host_lens = lens
        self._sync_tables()
        if self.starts is not None:  # each sequence keeps its own padding (in place while the batch size holds)
            rows = self.starts.index_select(0, torch.as_tensor(source, device=self.device))
            self.starts = self.starts.copy_(rows) if rows.shape == self.starts.shape else rows

    def reorder_cache(self, beam_idx: torch.LongTensor, source: list[int] | None = None) -> None:
        """Sequence i continues old sequence ``beam_idx[i]`` (``source``: the same as host ints, when the caller has
        them).  A static cache whose sequences all hold the same number of tokens (beam search) does it in place
        without waiting for the device (``cache_reorder``); anything else copies the sequences."""
        if self.get_seq_length() == 0:
            return
        if not reorder_in_place([self], beam_idx):
            self._copy_sequences(beam_idx.tolist() if source is None else source)

    def move_positions(self, order: torch.Tensor) -> None:
        """Position ``p < T`` of sequence ``b`` takes what position ``order[b, p]`` held (``order``: long ``[B, T]``,
        each row a permutation of ``range(T)``, ``T`` at most the cached length): one gather and one scatter over the
        pages.  Rows that share written pages (beams of one prompt) move them identically."""
        if self.pool is None or not self.host_lens:
            return
        page, width = self.pool.page_size, self.pool.width
        table = self.block_table.long()
        positions = torch.arange(order.shape[1], device=self.device).expand_as(order)

        def slots(pos):
            return (table.gather(1, pos // page) * page + pos % page).reshape(-1)

        flat = raw(self.pool.pages).view(-1, width)
        flat.index_copy_(0, slots(positions), flat.index_select(0, slots(order.to(self.device))))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._copy_sequences([b for b in range(len(self.host_lens)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._copy_sequences(torch.as_tensor(indices).tolist())


class PagedLatentCache(DynamicCache):
    """``DynamicCache`` whose fused-MLA layers are paged latent layers.

    Args:
        model: the fused model (its fused MLA layer indices decide which layers are paged).
        page_size: tokens per page (default 64).
        max_cache_tokens: tokens each paged layer's pool holds (all sequences together).
        memory_fraction: alternatively, the fraction of free device memory all pools may take.
        static: allocate ``max_seq_len`` tokens per sequence up front (fixed addresses for CUDA graphs).
        share_pools_with: another ``PagedLatentCache`` of the same model whose pools (budget) to share.
        dtype: the pages' dtype (default: the latent's); ``torch.float8_e4m3fn``: e4m3 rows with per-token scales
            (half the bytes; decode and prefill dequantise; not for continuous batching's cache).
    """

    def __init__(self, model=None, *, config=None, paged_layers=None, page_size: int = 64,
                 max_cache_tokens: int | None = None, memory_fraction: float | None = None, static: bool = False,
                 max_seq_len: int | None = None, share_pools_with: "PagedLatentCache | None" = None,
                 growable: bool | None = None, dtype: torch.dtype | None = None):
        if model is not None:
            config = model.config
            paged_layers = paged_layer_indices(model) if paged_layers is None else paged_layers
        if config is None:
            raise ValueError("PagedLatentCache needs the model (or config= and paged_layers=)")
        super().__init__(config=config.get_text_config(decoder=True))
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        if max_cache_tokens is not None and memory_fraction is not None:
            raise ValueError("give max_cache_tokens or memory_fraction, not both")
        if memory_fraction is not None and not 0 < memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        if static and max_seq_len is None:
            raise ValueError("static=True needs max_seq_len")
        if dtype is not None and (not dtype.is_floating_point or (dtype.itemsize == 1 and dtype != FP8_DTYPE)):
            raise ValueError(f"PagedLatentCache dtype must be a floating dtype or torch.float8_e4m3fn, got {dtype}")
        self.page_size, self.latent_dtype = page_size, dtype
        self.padding_starts: torch.Tensor | None = None  # see set_left_padding
        self._moved_padding = None  # (order, previous starts) while move_padding_left holds
        self.max_cache_tokens = max_cache_tokens
        self.memory_fraction = memory_fraction
        self.static = static
        self.max_seq_len = max_seq_len
        # unsized and not static: start small and grow (the automatic cache of generate)
        self.growable = (max_cache_tokens is None and memory_fraction is None and not static) if growable is None \
            else growable
        self._pools: dict[int, PagePool] = share_pools_with._pools if share_pools_with is not None else {}
        self.paged_layers = sorted(paged_layers or [])
        for idx in self.paged_layers:
            if idx < len(self.layers) and type(self.layers[idx]) is DynamicLayer:
                self.layers[idx] = PagedLatentLayer(self, idx)
            elif idx >= len(self.layers):
                raise ValueError(f"layer {idx} is not a layer of this model's cache")

    def forget_failed_first_forward(self) -> None:
        """Undo what a first forward that failed part way (``CachePoolExhausted``) left behind: paged layers hold no
        sequence again, and plain dynamic layers that an earlier layer of that forward filled are made new.  Without
        this, the cache stays fixed at the failed batch size and every later request of another size fails."""
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, PagedLatentLayer):
                layer.reset()
            elif type(layer) is DynamicLayer and layer.is_initialized:
                self.layers[idx] = DynamicLayer()

    def set_compileable(self, on: bool) -> None:
        """Report ``is_compileable`` (a static cache only), as Transformers' ``StaticCache`` does: Transformers then
        builds each step's mask at the cache's full length, and a step traced by ``torch.compile`` reads and changes
        no host state (``PagedLatentLayer.update``), so one compiled graph serves every step.  Off by
        default: our own replayed steps need neither, and Transformers compiles ``generate``'s steps itself for a
        compileable cache on a GPU unless ``disable_compile`` is set."""
        if on and not self.static:
            raise ValueError("only a static PagedLatentCache can be compileable: its pages never move")
        for layer in self.paged:
            layer.is_compileable = bool(on)

    def set_left_padding(self, starts) -> None:
        """Sequence ``b`` holds ``starts[b]`` padding tokens at its beginning: decode steps without an attention
        mask (``DecodeGraph``, graphed ``generate``) attend from there on, in the decode kernel.  Set it before the
        prefill (layers pick it up with the batch) or after (initialised layers are updated); None clears it."""
        self.padding_starts = None if starts is None else torch.as_tensor(starts, dtype=torch.int32).cpu()
        for layer in self.layers:
            if isinstance(layer, PagedLatentLayer) and layer.is_initialized:
                layer._load_starts()

    def move_padding_left(self, mask) -> None:
        """After the prefill of a batch whose padding is not all on the left (``mask [B, T]``, 1 = token, 0 =
        padding, ``T`` = tokens cached per sequence): move each sequence's tokens, in order, behind its padding and
        record the padding as left padding (:meth:`set_left_padding`), so decode steps without a mask (a replayed
        step) attend exactly the tokens the mask keeps, from the decode kernel.  Attention does not depend on where
        a cached row sits (the position is in its rotary key), so only the layout changes; steps must not pass the
        original mask meanwhile (it describes the old layout).  :meth:`restore_padding` moves the tokens back."""
        mask = torch.as_tensor(mask).bool()
        order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices  # padding first, tokens in order
        for layer in self.paged:
            layer.move_positions(order)
        self._moved_padding = (order, self.padding_starts)
        self.set_left_padding((~mask).sum(1))

    def restore_padding(self) -> None:
        """Undo :meth:`move_padding_left` (tokens back where the prompt had them, the previous left padding); the
        cache then reads as a native cache of the same call would.  Nothing to do when nothing was moved."""
        if self._moved_padding is None:
            return
        order, starts = self._moved_padding
        back = torch.argsort(order, dim=1)
        for layer in self.paged:
            layer.move_positions(back)
        self._moved_padding = None
        self.set_left_padding(starts)

    def restart(self) -> bool:
        """Empty again for another call of the same batch, every buffer where it is (a kept graph reads them:
        ``runtime.kept_steps``; the left padding is the next call's to set).  False, nothing done, unless static,
        every layer paged and no padding moved."""
        if not self.static or self._moved_padding is not None or len(self.paged) != len(self.layers):
            return False
        for layer in self.layers:
            layer.restart()
        self.padding_starts = None
        return True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reorder of every layer: a static cache's paged layers in place all at once, without waiting for the
        device (``cache_reorder``); otherwise the indices are read on the host once and each layer copies."""
        paged = []
        for layer in self.layers:
            if isinstance(layer, PagedLatentLayer):
                if layer.get_seq_length():
                    paged.append(layer)
            else:
                layer.reorder_cache(beam_idx)
        if not paged:
            return
        if not reorder_in_place(paged, beam_idx):
            source = beam_idx.tolist()
            for layer in paged:
                layer.reorder_cache(beam_idx, source)

    @property
    def paged(self) -> list[PagedLatentLayer]:
        """The paged latent layers (the others are Transformers' own)."""
        return [layer for layer in self.layers if isinstance(layer, PagedLatentLayer)]

    def next_positions(self, batch: int) -> torch.Tensor:
        """``[batch, 1]`` long, on the device: each sequence's next token position (cached tokens less its left
        padding), read from device memory, so a replayed step computes it without the host."""
        layer = self.paged[0]
        position = layer.seq_lens.view(batch, 1).long()
        return position if layer.starts is None else position - layer.starts.view(batch, 1).long()

    @classmethod
    def static_for(cls, model, batch: int, max_seq_len: int, page_size: int = 64, dtype=None) -> "PagedLatentCache":
        """A static cache holding exactly ``batch`` sequences of up to ``max_seq_len`` tokens (whole pages)."""
        pages = math.ceil(max_seq_len / page_size)
        return cls(model, page_size=page_size, static=True, max_seq_len=max_seq_len,
                   max_cache_tokens=batch * pages * page_size, dtype=dtype)

    def _pool_for(self, layer_idx: int, width: int, dtype, device, first_pages: int | None = None) -> PagePool:
        pool = self._pools.get(layer_idx)
        if pool is not None:
            if pool.width != width or pool.pages.dtype != dtype or pool.pages.device != torch.device(device):
                raise ValueError("shared page pool does not fit this layer (width/dtype/device differ)")
            return pool
        tokens = self.max_cache_tokens
        if tokens is None and self.memory_fraction is None:
            if not (self.growable or self.static):
                raise ValueError("PagedLatentCache needs max_cache_tokens or memory_fraction to size its pools")
            # static: sized when the batch is known (see below); growable: the pages of the first write (else 1024
            # tokens), doubled when they run out: zero-filling pages a short generation never uses costs more than
            # the rare doubling (measured: a quarter of a small model's prefill on a CPU with 1024 tokens per layer)
            tokens = 0 if self.static else (1024 if first_pages is None else first_pages * self.page_size)
        if tokens is None:
            if torch.device(device).type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
            else:
                import psutil  # pragma: no cover - CPU memory budget

                free = psutil.virtual_memory().available
            per_layer = free * self.memory_fraction / max(1, len(self.paged_layers))
            tokens = int(per_layer // (width * torch.empty((), dtype=dtype).element_size()))
        num_pages = max(1, tokens // self.page_size)
        pool = PagePool(num_pages, self.page_size, width, dtype, device, growable=self.growable or (
            self.static and self.max_cache_tokens is None and self.memory_fraction is None))
        self._pools[layer_idx] = pool
        return pool

    @property
    def pools(self) -> dict[int, PagePool]:
        return self._pools


def paged_layer_indices(model) -> list[int]:
    """Layer indices of the fused MLA modules of ``model`` (those get paged layers); remembered once fusion is
    done (scanning a few thousand modules costs a few ms per ``generate``)."""
    state = model_state(model)
    if state.paged_layers is not None:
        return list(state.paged_layers)
    found = sorted({module.layer_idx for module in model.modules()
                    if plan_of(module, "mla") is not None and isinstance(getattr(module, "layer_idx", None), int)})
    if state.fused:
        state.paged_layers = tuple(found)
    return found
