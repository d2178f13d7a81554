"""Transformers' continuous batching (CB) for fused MLA models: ``generate_batch``, ``init_continuous_batching``
(``ContinuousBatchingManager``: ``add_request``, ``get_result``, ``request_id_iter``, ``cancel_request``, ``stop``)
and ``continuous_batching_context_manager``, through Transformers' own engine (scheduler, request states, prefix
sharing, forks, offloading, ``ContinuousBatchingConfig``).

What changes, and how, without patching Transformers' classes:
* **Latent rows in CB's pool.**  CB stores per token and layer one K row and one V row of equal width
  (``num_key_value_heads x head_dim`` each).  Its cache is sized from a view of the config with one KV head and
  ``head_dim = ceil((kv_lora_rank + rope) / 2)``, so a token's K row plus V row is exactly one latent row
  ``[kv_c | k_pe]``: no expanded K/V is ever stored, and every block-level feature stays CB's own.  From 5.25 the
  engine gives a config with ``kv_lora_rank`` its own latent allocator (one row of ``rank + rope`` per token and
  layer, written as two column ranges); the same row then lives there, cut where that allocator cuts it.  The
  engine's cache instance becomes a :class:`LatentPagedAttentionCache` (our subclass), whose ``update`` takes and
  returns the latent, arranged into the pool's row on the way in and joined on the way out.
* **The attention.**  ``vllm_mla`` serves CB steps itself (``attention_interfaces.ragged``); the manager keeps it
  instead of switching the model to a CB-friendly name, and turns off the paths that need CB's own kernels
  (flash block-table decode, its CUDA graphs).
* **The read index by page.**  Where the device path reads the pages in place, the engine's host preparation lists
  one slot per page of each context instead of one per row (:data:`READ_BY_PAGE`): the engine's per-row list, built
  in Python at every step, was most of a serving step's host time.
* **One entry point per instance.**  :func:`extend_continuous_batching` binds ``init_continuous_batching`` to the
  fused model (``generate_batch`` and the context manager call it), returning a :class:`LatentContinuousBatching
  Manager`.

Supported from Transformers 5.19 (the engine's cache API ``update(key, value, layer_idx, kwargs)``); older releases
get a clear error.  Every attention layer must be a fused MLA layer: anything else is refused naming the layer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
import types

import torch

from ..compat import (
    ATTENTION_NAME, FEATURE_MIN_VERSION, attention_implementation, cb_latent_allocator, cb_latent_row_layout,
    cb_latent_rows,
)
from ..attention_interfaces.ragged import (
    LATENT_PAGE, PAGE_READS_KWARG, PAGES_ROWS_ATTR, PagesRows, request_page_bases, runs_on_device,
)
from ..kernels.latent_gather import latent_gather
from ..kernels.mla_decode_split import join_split_rows, split_rows_supported
from ..plans import model_state, plan_of

MIN_VERSION = FEATURE_MIN_VERSION["continuous batching"]
_CONFIG_LOCK = threading.Lock()


def _cb():
    """Transformers' continuous-batching classes (imported on use: a light import for models that never serve)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    return ContinuousBatchingConfig, PagedAttentionCache, ContinuousBatchingManager


def latent_layout(model) -> tuple[int, int]:
    """``(kv_lora_rank, rope)`` shared by the fused MLA layers of ``model``.  CB gives every decoder layer a page of
    one row shape, so every layer's attention must be a fused MLA module of one layout: otherwise a clear error
    naming the layers that are not (hybrid models, fallbacks)."""
    from ..cache import paged_layer_indices

    layouts = {(p.match.kv_lora_rank, p.match.qk_rope_head_dim) for p in
               (plan_of(m, "mla") for m in model.modules()) if p is not None}
    layers = model.config.get_text_config().num_hidden_layers
    missing = sorted(set(range(layers)) - set(paged_layer_indices(model)))
    if missing:
        report = getattr(model, "fusion_report", None)
        rows = [f"{r.qualname} ({r.reason})" for r in report.fallbacks("mla")][:3] if report is not None else []
        raise ValueError(
            f"continuous batching of a fused model needs every decoder layer's attention to be a fused MLA layer (CB "
            f"pages hold one latent row per token); layers {missing} are not" + (f": {'; '.join(rows)}" if rows else "")
        )
    if len(layouts) != 1:
        raise ValueError(f"continuous batching needs one latent layout for all fused MLA layers, found {layouts}")
    return layouts.pop()


@contextlib.contextmanager
def latent_rows(config, width: int):
    """Within the block ``config`` says one KV head of ``ceil(width / 2)`` values, so the engine sizes K plus V rows
    as one latent row.  The engine reads these two numbers while it builds its cache and resolves its config; the
    values are put back on exit (under a lock: one manager builds at a time)."""
    names = ("num_key_value_heads", "head_dim")
    with _CONFIG_LOCK:
        saved = {n: config.__dict__[n] for n in names if n in config.__dict__}
        missing = [n for n in names if n not in config.__dict__]
        config.num_key_value_heads, config.head_dim = 1, math.ceil(width / 2)
        try:
            yield
        finally:
            for n in missing:
                config.__dict__.pop(n, None)
            for n, v in saved.items():
                config.__dict__[n] = v


# Padding of a captured step (each padded size is one CUDA graph of the engine): query tokens to multiples of this
# many, and the rows read to the whole pool (their gather is sized by the real count on the device, so one size
# serves every step; see ``kernels.latent_gather``).  Applied only where the caller left the engine's defaults.
Q_PADDING_INTERVAL = 256
KV_PADDING_INTERVAL = 1 << 40


# Whether the device path reads the latent rows in place from the engine's pages (split-row kernel) rather than
# gathering them into one contiguous copy first (``latent_gather`` + ``mla_decode``); chosen by measurement
# (``benchmarks/bench_serving.py --cb-read``).
READ_PAGES_IN_PLACE = True

# Whether, on that in-place path, the engine's host preparation lists one slot per page of each request's context
# instead of one per row (``LatentPagedAttentionCache.extend_read_and_write_indices``): Transformers builds its read
# index as a Python list of every context row of every request at every step, then converts it into a tensor, which
# made most of a serving step's host time at full load (``profile_serving_host_full_*.txt``); a page's rows are
# consecutive slots, so the kernel finds them from the page's first (``kernels.mla_decode_split``, ``page``).  Read
# when the engine builds its cache (benchmarks flip it for an A/B).
READ_BY_PAGE = True


def steps_graphs(config, model) -> None:
    """Let the engine capture its steps in CUDA graphs (varlen path) on a GPU when every fused MLA layer attends on
    the device path (``attention_interfaces.ragged``: no host read); the caller's explicit ``use_cuda_graph=False``
    is kept.  Adapters on ``kv_b_proj`` need the host-bounded path: no graphs then."""
    from ..graph.queries import is_plain_linear

    on_gpu = any(p.is_cuda for p in model.parameters())
    capturable = on_gpu and all(is_plain_linear(p.kv_b(m)) for m in model.modules()
                                if (p := plan_of(m, "mla")) is not None)
    asked = config.use_cuda_graph
    varlen = (asked if isinstance(asked, bool) else asked[0]) if asked is not None else True
    varlen = bool(varlen) and capturable
    # (releases whose config has no per-path switch take one boolean; block-table decode is off either way)
    config.use_cuda_graph = (varlen, False) if hasattr(config, "cuda_graph_booleans") else varlen
    if varlen:
        for name, default in (("q_padding_interval_size", Q_PADDING_INTERVAL),
                              ("kv_padding_interval_size", KV_PADDING_INTERVAL)):
            if getattr(config, name, None) == 0:
                setattr(config, name, default)
        if getattr(config, "use_async_batching", False) is None:
            config.use_async_batching = True  # the host prepares the next step while the graph runs


def page_views(allocator, layer_idx: int):
    """``(k_rows, v_rows)``: one layer's K and V half rows ``[slots, half]`` where the engine's pages hold them (same
    strides, addressed by the engine's slot indices), or None where the release's allocator offers no such views.
    Up to 5.24 they are the block-table page views of the K / V pool; from 5.25 (a latent allocator, one row per
    token) the two halves of each row — None when the row's width is odd (no two halves of one width)."""
    rows = cb_latent_rows(allocator, layer_idx)
    if rows is not None:
        half, odd = divmod(rows.shape[-1], 2)
        return None if odd else (rows[:, :half], rows[:, half:])
    views = getattr(allocator, "get_cache_for_block_table", None)
    if views is None:
        return None
    k_pages, v_pages = views(layer_idx)
    half = k_pages.shape[-2] * k_pages.shape[-1]
    return k_pages.reshape(-1, half), v_pages.reshape(-1, half)


@functools.cache
def latent_cache_class():
    """Our subclass of the engine's cache (made once, on first use: the engine is imported lazily)."""
    _, PagedAttentionCache, _ = _cb()

    class LatentPagedAttentionCache(PagedAttentionCache):
        """CB's paged cache holding one latent row per token and layer.

        Up to Transformers 5.24 the engine's pool keeps a token's row as a K half row and a V half row (two pages of
        a block); from 5.25 a config with ``kv_lora_rank`` gets a latent allocator whose pages hold one row of
        ``rank + rope`` per token (``compat.cb_latent_allocator``).  Either way the row is ours to arrange: where the
        layout allows (``kernels.mla_decode_split.split_rows_supported``) its halves are ``[kv_c[:r/2] | k_pe[:p/2]]``
        and ``[kv_c[r/2:] | k_pe[p/2:]]``, so a decode kernel reads them in place; otherwise the row is ``[kv_c |
        k_pe]`` (zero-padded to even width in the K / V pool).  The arranged row goes through the engine's own update
        cut where that allocator cuts it (K / V halves, or the latent allocator's two column ranges), so writes,
        index bookkeeping and read-back stay the engine's.  ``update`` takes the latent (``kv_c [1, 1, T, rank]``,
        ``k_pe [1, 1, T, rope]``) and returns that of every request's whole context — or, on the device path with
        the split layout, only writes and returns the new tokens' latent tagged with where the contexts' rows lie
        (``ragged.PAGES_ROWS_ATTR``)."""

        rank: int
        rope: int
        latent_allocator: bool  # the pool's pages hold whole latent rows (5.25+), not K / V half rows
        page_reads: int = 0  # rows per page when the read index lists a slot per page (READ_BY_PAGE), else 0
        page_reads_checked: bool = False

        def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
            """The engine's, except that with :attr:`page_reads` each request's read index is the first slot of
            each page of its context (``ceil(context / page)`` entries, not one per row).  The first call checks the
            pages against the engine's own row list and turns page reads off for good where they differ (nothing
            was listed by page yet)."""
            if self.page_reads and read_index is not None and not self.page_reads_checked:
                self.page_reads_checked = True
                if not all(self._row_list_matches(a, request_id, past_length + query_length)
                           for a in self.cache_allocators.values()):
                    self.page_reads = 0
            if not self.page_reads or read_index is None:
                return super().extend_read_and_write_indices(request_id, past_length, query_length, read_index,
                                                             write_index)
            total = past_length + query_length
            for allocator, writes, reads in zip(self.cache_allocators.values(), write_index, read_index):
                writes.extend(allocator.get_write_indices(request_id, past_length, query_length))
                reads.extend(page_slots(allocator, request_id, total))
            return None

        def _row_list_matches(self, allocator, request_id, total) -> bool:
            rows = allocator.get_read_indices(request_id, total, 0)
            pages, page = page_slots(allocator, request_id, total), self.page_reads
            return rows == [pages[t // page] + t % page for t in range(total)]

        @property
        def split(self) -> bool:
            return split_rows_supported(self.rank, self.rope)

        def reads_in_place(self, tensor: torch.Tensor) -> bool:
            """Whether a step on ``tensor``'s device reads the pages in place (the split-row kernel): the device
            path, the split layout, :data:`READ_PAGES_IN_PLACE` (the release's page views are asked apart)."""
            return READ_PAGES_IN_PLACE and self.split and runs_on_device(tensor)

        def _rows(self, kv_c, k_pe):
            """The new tokens' arranged rows ``[1, 1, T, row width]`` cut in the two parts the engine's update writes
            (views of one row tensor): the K and V halves, or the latent allocator's key and value column ranges."""
            rank, width = self.rank, self.rank + self.rope
            half = math.ceil(width / 2)
            row = kv_c.new_empty(kv_c.shape[2], width if self.latent_allocator else 2 * half)
            if self.split:
                r, p = rank // 2, self.rope // 2
                row[:, :r], row[:, r:half] = kv_c[0, 0, :, :r], k_pe[0, 0, :, :p]
                row[:, half:half + r], row[:, half + r:] = kv_c[0, 0, :, r:], k_pe[0, 0, :, p:]
            else:
                row[:, :rank], row[:, rank:width] = kv_c[0, 0], k_pe[0, 0]
                if width < row.shape[1]:
                    row[:, width:] = 0
            cut = rank if self.latent_allocator else half
            return row[None, None, :, :cut], row[None, None, :, cut:]

        def _latent(self, first, second):
            """``(kv_c, k_pe)`` ``[1, 1, N, .]`` of rows the engine read back as the two parts :meth:`_rows` cut."""
            rank, width = self.rank, self.rank + self.rope
            if self.latent_allocator and not self.split:
                return first, second  # the row is [kv_c | k_pe], cut at rank: the parts are the latent's
            rows = torch.cat([first[0, 0], second[0, 0]], dim=-1)
            half = math.ceil(width / 2)
            latent = join_split_rows(rows[:, :half], rows[:, half:], rank) if self.split else rows
            return latent[None, None, :, :rank], latent[None, None, :, rank:width]

        def _write_only(self, first, second, layer_idx, kwargs):
            """The engine's update with nothing to read back (its read indices emptied): the rows are written, and
            ``kwargs`` gets this layer's key bounds as the engine's update narrows them."""
            written = dict(kwargs, read_index=[i[:0] for i in kwargs["read_index"]])
            super().update(first, second, layer_idx, written)
            kwargs["cu_seq_lens_k"], kwargs["max_length_k"] = written["cu_seq_lens_k"], written["max_length_k"]

        def _written_in_place(self, key_states, value_states, layer_idx, kwargs):
            """Write the step's rows and return the new tokens' latent tagged with where every context's rows lie
            (``ragged.PagesRows``: the split-row kernel reads them in place, nothing is read back here); None where
            the layout, the release or the device do not allow it."""
            allocator = self.layer_to_allocator[layer_idx]
            views = page_views(allocator, layer_idx) if self.reads_in_place(key_states) else None
            if views is None:
                return None
            read_index = kwargs["read_index"]
            self._write_only(*self._rows(key_states, value_states), layer_idx, kwargs)
            index = read_index[allocator.index]
            # nothing cached is read (fresh prompts only): the context is the step's own rows, where they were written
            # (the write index: a slot per row)
            slots = index if index.numel() else kwargs["write_index"][allocator.index]
            page = kwargs[PAGE_READS_KWARG] = self.page_reads if index.numel() else 0  # (the attention checks it)
            (k_rows, v_rows), rank, cu_k = views, self.rank, kwargs["cu_seq_lens_k"]

            def read():  # every context's latent, joined (for a layer that cannot take the kernel; host reads)
                at = slots if not page else context_row_slots(slots, cu_k, page)
                latent = join_split_rows(k_rows.index_select(0, at), v_rows.index_select(0, at), rank)
                return latent[None, None, :, :rank], latent[None, None, :, rank:]

            rows = PagesRows(k_rows, v_rows, slots, read, page)
            kv_c, k_pe = key_states.view_as(key_states), value_states.view_as(value_states)
            setattr(kv_c, PAGES_ROWS_ATTR, rows)
            return kv_c, k_pe

        def update(self, key_states, value_states, layer_idx, kwargs):
            if kwargs.get("block_table") is not None:
                raise RuntimeError("latent pages cannot take CB's block-table (flash) decode path")
            in_place = self._written_in_place(key_states, value_states, layer_idx, kwargs)
            if in_place is not None:
                return in_place
            if self.page_reads and kwargs.get("read_index") and kwargs["read_index"][0].numel():
                raise RuntimeError("continuous batching: this step's read index lists pages (READ_BY_PAGE), which "
                                   "only the in-place device path reads; the engine's own read-back needs rows")
            rank, width = self.rank, self.rank + self.rope
            first, second = self._rows(key_states, value_states)
            allocator = self.layer_to_allocator[layer_idx]
            views = None if self.split else page_views(allocator, layer_idx)
            if views is None:  # the engine's own read-back (or the step's rows when nothing is read), joined
                return self._latent(*super().update(first, second, layer_idx, kwargs))
            read_index = kwargs["read_index"]
            self._write_only(first, second, layer_idx, kwargs)
            index = read_index[allocator.index]
            if index.numel() == 0:  # nothing cached is read (fresh prompts only): the new rows are the context
                return key_states, value_states
            # every context's rows joined once, with room for a whole last page of the decode kernel's view
            # (``ragged.latent_pages`` reads it in place); only the rows the step reads are gathered
            k_rows, v_rows = views
            rows = index.shape[0]
            latent = key_states.new_empty(-(-rows // LATENT_PAGE) * LATENT_PAGE, 2 * k_rows.shape[-1])
            latent_gather(k_rows, v_rows, index, kwargs["cu_seq_lens_k"][-1:], latent)
            return latent[None, None, :rows, :rank], latent[None, None, :rows, rank:width]

    return LatentPagedAttentionCache


def page_slots(allocator, request_id: str, total: int) -> list[int]:
    """The slot of the first row of each page of ``request_id``'s first ``total`` rows in ``allocator``'s pool, as
    the engine's ``get_read_indices`` addresses them (a page's rows follow its first slot)."""
    table = allocator.block_table.get(request_id)
    pages = -(-total // allocator.tokens_per_page)
    if table is None or len(table) < pages:
        raise ValueError(f"continuous batching: request {request_id} holds {0 if table is None else len(table)} "
                         f"pages for {total} rows")
    stride = allocator.block_physical_stride
    return [block * stride for block in table[:pages]]


def context_row_slots(slots: torch.Tensor, cu_k: torch.Tensor, page: int) -> torch.Tensor:
    """The slot of every context row, in request order, from slots of whole pages (``PagesRows.page``): for the
    host path, which reads the bounds on the host."""
    from ..kernels.mla_decode_split import row_slots

    return row_slots(slots, cu_k[:-1], cu_k[1:], page, request_page_bases(cu_k, page))


def page_reads_of(cache, model) -> int:
    """Rows per page where the read index may list pages (:data:`READ_BY_PAGE`): every layer reads in place on the
    device path (the split layout, the engine's page views, the model on an accelerator or the device path forced
    on a CPU), and the allocators address rows as ``block_table[page] * block_physical_stride + row``; else 0."""
    device = next(model.parameters()).device
    allocators = list(cache.cache_allocators.values())
    if not (READ_BY_PAGE and cache.reads_in_place(torch.empty(0, device=device))
            and allocators and all(hasattr(a, n) for a in allocators
                                   for n in ("block_table", "block_physical_stride", "tokens_per_page"))):
        return 0
    if any(page_views(a, i) is None for a in allocators for i in getattr(a, "layer_indices", ())):
        return 0
    pages = {a.tokens_per_page for a in allocators}
    return pages.pop() if len(pages) == 1 else 0


def latent_allocator_of(cache, latent: tuple[int, int]) -> bool:
    """Whether the engine's pool holds whole latent rows (Transformers 5.25+ for a config with ``kv_lora_rank``) rather
    than K / V half rows; a latent allocator whose rows are not exactly this model's latent is refused clearly (its
    columns would not hold what the fused layers write)."""
    import transformers

    kinds = {cb_latent_allocator(a) for a in cache.cache_allocators.values()}
    if kinds != {False}:
        rank, rope = latent
        layouts = {cb_latent_row_layout(a) for a in cache.cache_allocators.values() if cb_latent_allocator(a)}
        if len(kinds) != 1 or layouts != {(rank, rank + rope)}:
            raise ValueError(
                f"continuous batching: the latent cache allocator of transformers {transformers.__version__} sizes "
                f"rows as (kv_lora_rank, kv_lora_rank + qk_rope_head_dim) = {sorted(layouts)} from the config, but "
                f"the fused MLA layers write latents of rank {rank} + rope {rope}"
            )
    return kinds == {True}


@functools.cache
def manager_class():
    """Our subclass of the engine's manager (made once, on first use)."""
    _, _, ContinuousBatchingManager = _cb()
    latent_cache = latent_cache_class()

    class LatentContinuousBatchingManager(ContinuousBatchingManager):
        """Transformers' manager over latent pages, attending with ``vllm_mla`` (see the module docstring)."""

        def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None):
            self.latent = latent_layout(model)
            config = copy.copy(continuous_batching_config)  # (the caller's object stays as it was)
            config.max_blocks_per_request = 0  # CB's block-table decode runs flash kernels, not ours
            steps_graphs(config, model)
            with latent_rows(model.config.get_text_config(), sum(self.latent)):
                super().__init__(model, generation_config, config, workload_hints)
            self.continuous_batching_config.max_blocks_per_request = 0

        def add_request(self, input_ids, request_id=None, *args, **kwargs):
            """As the engine's, except that an empty prompt fails alone, at once, with a clear error (the engine
            would run it with nothing to attend)."""
            if len(input_ids) or not self.is_tp_driver:
                return super().add_request(input_ids, request_id, *args, **kwargs)
            from transformers.generation.continuous_batching.requests import RequestState

            if request_id is None:
                with self._request_lock:
                    request_id = f"req_{self._request_counter}"
                    self._request_counter += 1
            self.output_router.fail_and_deliver(RequestState(request_id=request_id, initial_tokens=[]),
                                                ValueError("empty prompt: a request needs at least one token"))
            return request_id

        def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash=True):
            if attention_implementation(model) == ATTENTION_NAME:
                return  # vllm_mla serves continuous-batching steps itself (attention_interfaces.ragged)
            super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

        def _create_batch_processor(self):
            with latent_rows(self.model.config.get_text_config(), sum(self.latent)):
                processor = super()._create_batch_processor()
            cache = processor.cache
            if not isinstance(cache, latent_cache):
                # the engine builds its cache by name; the instance becomes ours (same state, latent-aware update)
                cache.__class__ = latent_cache
            cache.rank, cache.rope = self.latent
            cache.latent_allocator = latent_allocator_of(cache, self.latent)
            cache.page_reads, cache.page_reads_checked = page_reads_of(cache, self.model), False
            return processor

    return LatentContinuousBatchingManager


def extend_continuous_batching(model) -> list[str]:
    """Bind ``init_continuous_batching`` to a fused MLA ``model`` (once); report notes.  On a Transformers release
    without the engine API we need, the bound method raises a clear error instead of the engine's crash."""
    from ..compat import transformers_version

    state = model_state(model)
    if state.continuous_batching_extended or not hasattr(model, "init_continuous_batching"):
        return []
    if not any(plan_of(m, "mla") is not None for m in model.modules()):
        return []  # Mamba/MoE-only fused models keep whatever Transformers' CB does for them
    supported = transformers_version() >= MIN_VERSION

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None):
        if not supported:
            import transformers

            raise NotImplementedError(
                f"continuous batching of fused MLA models needs transformers>={'.'.join(map(str, MIN_VERSION))} "
                f"(installed: {transformers.__version__})"
            )
        ContinuousBatchingConfig, _, ContinuousBatchingManager = _cb()
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):  # a persistent manager (ours) is reused by the class
            return type(self).init_continuous_batching(self, generation_config, continuous_batching_config,
                                                       workload_hints)
        generation_config = generation_config if generation_config is not None else self.generation_config
        if generation_config.eos_token_id is None:
            generation_config.eos_token_id = -1  # (as the class does: no EOS, stop at max_new_tokens)
        continuous_batching_config = continuous_batching_config or ContinuousBatchingConfig()
        return manager_class()(self, generation_config, continuous_batching_config, workload_hints)

    model.init_continuous_batching = types.MethodType(init_continuous_batching, model)
    state.continuous_batching_extended = True
    return ["init_continuous_batching() / generate_batch() serve this model over latent pages"
            + ("" if supported else " (needs transformers>=5.19: refused with a clear error here)")]
