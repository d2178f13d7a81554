"""Fused MLA attention over a ragged batch: Transformers' continuous batching (CB) packs every request of a step,
prefill chunks and single decode tokens alike, into one row (``query [1, H, Tq, qk]``), hands the latent of all
their contexts the same way (``kv_c [1, 1, Tk, rank]``, ``k_pe [1, 1, Tk, rope]``, read back from its pages) and
says where each request starts in ``cu_seq_lens_q`` / ``cu_seq_lens_k``.

Each request attends only its own context, causally aligned to the context's end (its new tokens are the last
ones).  The requests are computed as what they are:
* the **decode tokens** of all requests together, as one batch of single-token queries over their contexts (right-
  padded to the longest, the padding masked out): absorbed attention, the latent read once, no per-head K/V;
* each **prefill chunk** on its own, attending its own context only: K/V expanded for that context (compute-bound),
  never for the whole step, and no mask wider than the chunk's own ``[q, k]`` is built.
Both go through ``vllm_mla.fused_mla_attention``, so adapters, sinks and the exact fallbacks behave as elsewhere.
That path reads the request bounds on the host (one sync per step) and sizes its work from them: right on a CPU.

On a GPU the step runs **without any host read** (:func:`ragged_mla_attention_on_device`), so the engine can
capture it in a CUDA graph: every query token, prefill or decode, is one absorbed query of the ``mla_decode``
kernel over the step's latent rows, attending the rows ``[start, end)`` of its own request up to its own position
(the kernel's per-row ``starts`` / ``seq_lens``).  Token-to-request bounds are computed on the device from
``cu_seq_lens_q/k``; grid and split count follow from the (padded) shapes only.

Where the rows are read in place (:func:`ragged_mla_attention_in_pages`), the tokens of **fresh prompts** (requests
whose context is their new tokens alone: nothing cached yet) can be computed expanded instead
(:data:`EXPAND_FRESH_PROMPTS`, off by default: whole serving runs were slower with it): per-head K / V of the
step's own new latent rows, then causal varlen attention over the packed new tokens — sizes fixed by the step's
padded token count, as a captured graph needs.  The absorbed kernel reads one row for them (its output there is
dropped).  Decode tokens and chunks after a cached prefix stay absorbed: their contexts' sizes are known on the
device only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

_STEP_MEMO: dict = {}  # what every layer of one step shares, computed once per step (see ``_memo``)
_DEVICE_STEP: list = [None, None]  # (key, per-token bounds) of the latest device step (see ``token_bounds``)
_DEVICE_FRESH: list = [None, None]  # (key, bounds with fresh prompts cut) of the latest device step (``fresh_bounds``)
_DEVICE_PAGES: list = [None, None]  # (key, per-token page bases) of the latest device step (``token_page_bases``)


def _memo(key, make):
    """``make()`` once per ``key``; only the newest few keys are kept (one step's), so nothing goes stale."""
    value = _STEP_MEMO.get(key)
    if value is None:
        if len(_STEP_MEMO) >= 64:
            _STEP_MEMO.clear()
        value = _STEP_MEMO[key] = make()
    return value


def host_bounds(cu: torch.Tensor) -> list[int]:
    """``cu`` as a host list, copied once per change of the tensor: the engine updates its input buffers in place
    (which bumps their version) and every layer of a step reads the same tensors, so one device sync per step."""
    # the memo keeps the tensor itself: an id is only unique while its object lives (a later step's or test's new
    # tensor may get a freed one's id, address and version)
    held, bounds = _memo(("bounds", id(cu), cu._version, cu.data_ptr(), cu.shape[0]),
                         lambda: (cu, [int(v) for v in cu.tolist()]))
    if held is not cu:
        _STEP_MEMO.clear()
        return host_bounds(cu)
    return bounds


def ragged_mla_attention(attend, query, kv_c, k_pe, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         decode=None) -> torch.Tensor:
    """``[1, Tq, H, v]``: each request's queries over its own context.  ``attend(query, kv_c, k_pe, mask)`` is the
    fused attention of one ordinary batch (``vllm_mla.fused_mla_attention`` bound to the module).  ``decode(queries,
    pages, block_table, seq_lens)``, when given, runs the single-token queries with the paged decode kernel over the
    step's latent rows as pages of one token (no padded copy of the contexts)."""
    q_bounds, k_bounds = host_bounds(cu_q), host_bounds(cu_k)
    requests = len(q_bounds) - 1
    if len(k_bounds) != requests + 1:
        raise RuntimeError(f"vllm_mla: {requests} query ranges but {len(k_bounds) - 1} key ranges in a ragged batch")
    if q_bounds[-1] != query.shape[2] or k_bounds[-1] > kv_c.shape[2]:
        raise RuntimeError(
            f"vllm_mla: ragged bounds (queries {q_bounds[-1]}, keys {k_bounds[-1]}) do not fit the query "
            f"({query.shape[2]}) and latent ({kv_c.shape[2]}) of the step"
        )
    out = None

    def place(rows: torch.Tensor, values: torch.Tensor) -> None:  # one copy per group, not one per request
        nonlocal out
        if out is None:
            out = query.new_empty(1, query.shape[2], query.shape[1], values.shape[-1])
        out[0].index_copy_(0, rows, values.to(out.dtype))

    decodes = [i for i in range(requests) if q_bounds[i + 1] - q_bounds[i] == 1]
    if decodes:
        _, _, positions = _memo(("decode", id(q_bounds), id(k_bounds), query.device),
                                lambda: _decode_indices(decodes, q_bounds, k_bounds, query.device))
        batch = (_decode_batch(attend, query, kv_c, k_pe, decodes, q_bounds, k_bounds) if decode is None else
                 _decode_kernel(decode, query, kv_c, k_pe, decodes, q_bounds, k_bounds))
        place(positions, batch[:, 0])
    chunks = [i for i in range(requests) if q_bounds[i + 1] - q_bounds[i] > 1]
    for i in chunks:
        if k_bounds[i + 1] - k_bounds[i] < q_bounds[i + 1] - q_bounds[i]:
            raise RuntimeError(f"vllm_mla: request {i} has {q_bounds[i + 1] - q_bounds[i]} new tokens but a "
                               f"context of {k_bounds[i + 1] - k_bounds[i]}")
    for group in _memo(("groups", id(q_bounds), id(k_bounds)), lambda: _prefill_groups(chunks, q_bounds, k_bounds)):
        q_index, k_index, allowed, rows, valid = _memo(
            ("prefill", id(q_bounds), id(k_bounds), group, query.device),
            lambda group=group: _prefill_indices(group, q_bounds, k_bounds, query.device))
        queries = query[0][:, q_index].transpose(0, 1)  # [P, H, Qmax, qk]
        result = attend(queries, kv_c[0, 0][k_index].unsqueeze(1), k_pe[0, 0][k_index].unsqueeze(1), allowed)
        place(rows, result[valid])  # [P, Qmax, H, v] -> the real query rows
    if out is None:
        raise RuntimeError("vllm_mla: a ragged batch without any query")
    return out


# A group of prefill chunks is computed as one padded batch while padding stays below this share of the real work
# (a long chunk beside many short ones gets a group of its own instead of padding them all to its length).
PREFILL_PADDING_SLACK = 2.0


def _prefill_groups(chunks, q_bounds, k_bounds) -> list[tuple[int, ...]]:
    """The prefill chunks in groups of similar context length (each computed as one padded batch)."""
    by_length = sorted(chunks, key=lambda i: k_bounds[i + 1] - k_bounds[i])
    groups, current, work = [], [], 0
    for i in by_length:
        q_len, k_len = q_bounds[i + 1] - q_bounds[i], k_bounds[i + 1] - k_bounds[i]
        q_max = max([q_bounds[j + 1] - q_bounds[j] for j in current] + [q_len])
        padded = (len(current) + 1) * q_max * k_len  # k_len is the group's longest (sorted)
        if current and padded > PREFILL_PADDING_SLACK * (work + q_len * k_len):
            groups.append(tuple(current))
            current, work = [], 0
        current.append(i)
        work += q_len * k_len
    if current:
        groups.append(tuple(current))
    return groups


def _prefill_indices(group, q_bounds, k_bounds, device):
    """``(q_index [P, Qmax], k_index [P, Kmax], allowed [P, 1, Qmax, Kmax], rows [N], valid [P, Qmax])`` for a group of
    prefill chunks right-padded to the longest: each query row sees its own context's keys up to its own position
    (causal from the context's end); padded rows repeat the chunk's last one and are dropped (``valid``)."""
    q_lens = torch.tensor([q_bounds[i + 1] - q_bounds[i] for i in group], device=device).view(-1, 1)
    k_lens = torch.tensor([k_bounds[i + 1] - k_bounds[i] for i in group], device=device).view(-1, 1)
    q_starts = torch.tensor([q_bounds[i] for i in group], device=device).view(-1, 1)
    k_starts = torch.tensor([k_bounds[i] for i in group], device=device).view(-1, 1)
    q_off = torch.arange(int(q_lens.max()), device=device).view(1, -1)
    k_off = torch.arange(int(k_lens.max()), device=device).view(1, -1)
    q_index = q_starts + torch.minimum(q_off, q_lens - 1)
    k_index = k_starts + torch.minimum(k_off, k_lens - 1)
    position = (k_lens - q_lens + torch.minimum(q_off, q_lens - 1)).unsqueeze(-1)  # [P, Qmax, 1]
    allowed = (k_off.unsqueeze(1) <= position) & (k_off < k_lens).unsqueeze(1)  # [P, Qmax, Kmax]
    valid = q_off < q_lens
    return q_index, k_index, allowed.unsqueeze(1), q_index[valid], valid


def _decode_batch(attend, query, kv_c, k_pe, decodes, q_bounds, k_bounds) -> torch.Tensor:
    """``[D, 1, H, v]``: the single-token queries of ``decodes`` as one batch over their contexts, right-padded to the
    longest (the padding is masked; a query sees every key of its own context)."""
    index, allowed, rows = _memo(("decode", id(q_bounds), id(k_bounds), query.device),
                                 lambda: _decode_indices(decodes, q_bounds, k_bounds, query.device))
    queries = query[0, :, rows].transpose(0, 1).unsqueeze(2)  # [D, H, 1, qk]
    return attend(queries, kv_c[0, 0][index].unsqueeze(1), k_pe[0, 0][index].unsqueeze(1), allowed)


def _decode_indices(decodes, q_bounds, k_bounds, device):
    """``(index [D, L], allowed [D, 1, 1, L], rows [D])``: where each decode request's keys and query are."""
    lengths = [k_bounds[i + 1] - k_bounds[i] for i in decodes]
    longest = max(lengths)
    starts = torch.tensor([k_bounds[i] for i in decodes], device=device).view(-1, 1)
    lens = torch.tensor(lengths, device=device).view(-1, 1)
    offsets = torch.arange(longest, device=device).view(1, -1)
    index = starts + torch.minimum(offsets, (lens - 1).clamp(min=0))  # padding repeats the last key
    allowed = (offsets < lens).view(len(decodes), 1, 1, longest)
    return index, allowed, torch.tensor([q_bounds[i] for i in decodes], device=device)


def _decode_kernel(decode, query, kv_c, k_pe, decodes, q_bounds, k_bounds) -> torch.Tensor:
    """``[D, 1, H, v]`` through ``decode``: the step's latent rows ``[Tk, 1, rank + rope]`` are the pages (one token
    each) and each request's block table lists its own rows, so the kernel reads every context once, in place."""
    rows = latent_pages(kv_c, k_pe).flatten(0, 1).unsqueeze(1)  # [>= Tk, 1, rank + rope]: pages of one row
    index, allowed, positions = _memo(("decode", id(q_bounds), id(k_bounds), query.device),
                                      lambda: _decode_indices(decodes, q_bounds, k_bounds, query.device))
    table, lens = _memo(("table", id(q_bounds), id(k_bounds), query.device),
                        lambda: (index.to(torch.int32), allowed.view(len(decodes), -1).sum(-1).to(torch.int32)))
    queries = query[0, :, positions].transpose(0, 1).unsqueeze(2)  # [D, H, 1, qk]
    return decode(queries, rows, table, lens)


# --------------------------------------------------------------------------------------------------------------------
# The device path: no host read, CUDA-graph capturable
# --------------------------------------------------------------------------------------------------------------------

# The device path on CPU tensors too (tests check it against the host path and native there)
DEVICE_PATH_ON_CPU = False


def runs_on_device(query: torch.Tensor) -> bool:
    """Whether a step takes the device path: on accelerators (the engine may capture it), on a CPU only when asked."""
    return not query.is_cpu or DEVICE_PATH_ON_CPU


def token_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` int32 ``[tokens]``: the latent rows ``[start, end)`` query token ``t`` attends — its own
    request's context (rows ``cu_k[r] .. cu_k[r + 1]``), causally up to its own position (a request's new tokens
    are the last rows of its context).  Computed on the device; tokens past the last request (the engine pads a
    captured step's queries) get the one row ``[0, 1)``, whose output is never read.

    Every layer of a step asks the same question: the answer is kept for the latest step, keyed by the bounds
    tensors' storage and version (the engine rewrites them in place between steps) and by whether a CUDA graph is
    being captured (a capture must record the computation, not reuse what an eager warm-up left)."""
    def make():
        r, valid = _token_requests(cu_q, tokens)
        t = torch.arange(tokens, device=cu_q.device, dtype=torch.int32)
        q_start, q_end, k_start, k_end = cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1]
        ends = k_end - (q_end - q_start) + (t - q_start) + 1  # the context's end, less the request's later queries
        starts = torch.where(valid, k_start, 0).to(torch.int32)
        ends = torch.where(valid, torch.maximum(ends, k_start + 1), 1).to(torch.int32)
        return starts, ends

    return _latest_step(_DEVICE_STEP, cu_q, cu_k, (tokens,), make)


def fresh_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int):
    """``(starts, ends, fresh)``: :func:`token_bounds` with the tokens of fresh prompts (a request whose context is
    its new tokens alone) cut to their context's first row, and ``fresh`` (bool ``[tokens]``) marking them.  Kept
    for the latest step as :func:`token_bounds` is."""
    def make():
        starts, ends = token_bounds(cu_q, cu_k, tokens)
        r, valid = _token_requests(cu_q, tokens)
        fresh = valid & (cu_k[r + 1] - cu_k[r] == cu_q[r + 1] - cu_q[r])
        return starts, torch.where(fresh, starts + 1, ends), fresh

    return _latest_step(_DEVICE_FRESH, cu_q, cu_k, (tokens,), make)


def token_page_bases(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int, page: int) -> torch.Tensor:
    """int32 ``[tokens]``: where query token ``t``'s request's pages begin in a list of every request's pages in
    request order, ``ceil(context / page)`` each (what ``LatentPagedAttentionCache`` hands the attention instead of
    a slot per row); 0 for tokens past the last request.  Computed on the device, kept for the latest step as
    :func:`token_bounds` is."""
    def make():
        r, valid = _token_requests(cu_q, tokens)
        return torch.where(valid, request_page_bases(cu_k, page)[r], 0).to(torch.int32)

    return _latest_step(_DEVICE_PAGES, cu_q, cu_k, (tokens, page), make)


def request_page_bases(cu_k: torch.Tensor, page: int) -> torch.Tensor:
    """``[requests]``: where each request's pages begin in a list of every request's pages in request order,
    ``ceil(context / page)`` each (contexts bounded by ``cu_k``)."""
    pages = (cu_k[1:] - cu_k[:-1] + page - 1) // page
    return torch.cumsum(pages, 0) - pages


def _token_requests(cu_q: torch.Tensor, tokens: int):
    """``(r, valid)``: each query token's request (clamped into range) and whether it has one."""
    requests = cu_q.shape[0] - 1
    t = torch.arange(tokens, device=cu_q.device, dtype=torch.int32)
    r = torch.searchsorted(cu_q[1:].contiguous(), t, right=True, out_int32=True)
    valid = r < requests
    return r.clamp(max=max(requests - 1, 0)).long(), valid


def _latest_step(store: list, cu_q: torch.Tensor, cu_k: torch.Tensor, extra: tuple, make):
    """``make()`` once per step for ``store`` (a ``[key, value]`` pair), see :func:`token_bounds`."""
    capturing = cu_q.is_cuda and torch.cuda.is_current_stream_capturing()
    # keyed by the tensors the bounds are views of, held by the memo (an id or an address is only unique while
    # its object lives), their versions (bumped by every in-place write) and the shapes
    q_base = cu_q if cu_q._base is None else cu_q._base
    k_base = cu_k if cu_k._base is None else cu_k._base
    key = (cu_q.data_ptr(), cu_q._version, cu_q.shape[0], cu_k.data_ptr(), cu_k._version, cu_k.shape[0], extra,
           capturing)
    held = store[0]
    if held is not None and held[0] is q_base and held[1] is k_base and held[2] == key:
        return store[1]
    value = make()
    store[:] = [(q_base, k_base, key), value]
    return value


# Rows per page of the view the decode kernel reads (a captured step's row count is a multiple of it; other counts
# take the largest power of two that divides them).
LATENT_PAGE = 64


def latent_pages(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[rows / P, P, rank + rope]``: the step's latent rows as pages of ``P`` rows, read in place when ``kv_c``
    and ``k_pe`` are the two column ranges of one row tensor (as ``LatentPagedAttentionCache.update`` returns them,
    with room for a whole last page), else joined once."""
    c, p = kv_c[0, 0], k_pe[0, 0]
    rows, width = c.shape[0], c.shape[-1] + p.shape[-1]
    base = c._base
    if (base is not None and p._base is base and c.stride(-1) == 1 and p.stride(-1) == 1
            and c.stride(0) == p.stride(0) and p.data_ptr() == c.data_ptr() + c.shape[-1] * c.element_size()
            and base.dim() == 2 and base.data_ptr() == c.data_ptr() and base.stride(0) == c.stride(0)):
        stride, capacity = c.stride(0), base.shape[0]
    else:
        stride, capacity = width, rows
        joined = torch.cat([c, p.to(c.dtype)], dim=-1)
        c = joined
    page = LATENT_PAGE if capacity % LATENT_PAGE == 0 else (capacity & -capacity)
    page = min(page, LATENT_PAGE)
    pages = max(1, -(-rows // page))
    if pages * page > capacity:
        page, pages = 1, rows
    return c.as_strided((pages, page, width), (page * stride, stride, 1))


def ragged_mla_attention_on_device(decode, query, kv_c, k_pe, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """``[1, Tq, H, v]`` with no host read: ``decode(queries [Tq, H, 1, qk], pages, block_table, seq_lens, starts)``
    (the paged decode kernel with absorbed weights) runs every query token over the rows of its own request.  The
    block table lists the step's pages in order for every token (one row, broadcast)."""
    tokens = query.shape[2]
    starts, ends = token_bounds(cu_q, cu_k, tokens)
    pages = latent_pages(kv_c, k_pe)
    table = torch.arange(pages.shape[0], device=query.device, dtype=torch.int32).expand(tokens, -1)
    queries = query[0].transpose(0, 1).unsqueeze(2)  # [Tq, H, 1, qk]
    return decode(queries, pages, table, ends, starts).transpose(0, 1)  # [Tq, 1, H, v] -> [1, Tq, H, v]


PAGES_ROWS_ATTR = "_mla_fuser_pages_rows"  # set on the kv_c a continuous-batching cache update returns
# set in a step's keyword arguments by that update when the read index lists a slot per page of this many rows
PAGE_READS_KWARG = "mla_fuser_read_index_pages"


class PagesRows(NamedTuple):
    """Where a step's context rows lie in the engine's pages: K / V half rows ``[slots, half]`` of one layer, the slot
    of each context position — or, with ``page > 0``, the slot of the first row of each of a context's pages of
    ``page`` rows, every request's pages in order (``kernels.mla_decode_split``'s slots of whole pages) — and
    ``read()`` -> ``(kv_c, k_pe)`` of every context joined (for the host path)."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    slots: torch.Tensor
    read: Callable
    page: int = 0


# True: fresh prompts of a step whose rows are read in place are attended expanded (``expand`` below).  Off: alone
# the expanded arm is faster (on an H100 4 x 2048-token fresh prefills in 600 us against the absorbed kernel's 1498,
# 16 heads, ``bench_split_rows.py``), but whole serving runs on the H200 were slower with it on (9952 and 10,024
# output tokens/s against 15,924 and 15,535 off, TPOT p50 61 against 37 ms, two rounds of ``bench_serving.py
# --ab-constant ...:EXPAND_FRESH_PROMPTS=1`` in one process).  The likely reason, from the code, not profiled: the
# expansion runs kv_b_proj and the varlen pass over every token of every in-place step with two or more tokens (all
# of the step's padded size: which tokens are fresh is known on the device only), decode-only steps included, and
# keeps only the fresh prompts' rows.  Never read from the environment.
EXPAND_FRESH_PROMPTS = False


def ragged_mla_attention_in_pages(decode_rows, query, cu_q: torch.Tensor, cu_k: torch.Tensor,
                                  page: int = 0, expand=None) -> torch.Tensor:
    """``[1, Tq, H, v]`` with no host read and no copy of the contexts: ``decode_rows(queries [Tq, H, 1, qk], ends,
    starts, page_bases)`` runs every query token over the latent rows of its own request where the engine's pages
    hold them (``kernels.mla_decode_split``; the slots come with ``decode_rows``; ``page_bases`` is None unless they
    are slots of whole pages of ``page`` rows: :func:`token_page_bases`).

    ``expand(cu_q)`` -> ``[Tq, H, v]``, when given (callers pass it only while :data:`EXPAND_FRESH_PROMPTS`), attends
    every request over its own new tokens alone (causal varlen attention on K / V expanded from the step's new latent
    rows): that is the output of the tokens of fresh prompts (:func:`fresh_bounds`), which the absorbed kernel then
    reads one row for."""
    tokens = query.shape[2]
    queries = query[0].transpose(0, 1).unsqueeze(2)  # [Tq, H, 1, qk]
    bases = token_page_bases(cu_q, cu_k, tokens, page) if page else None
    if expand is None:
        starts, ends = token_bounds(cu_q, cu_k, tokens)
        return decode_rows(queries, ends, starts, bases).transpose(0, 1)
    starts, ends, fresh = fresh_bounds(cu_q, cu_k, tokens)
    absorbed = decode_rows(queries, ends, starts, bases)  # [Tq, 1, H, v]
    expanded = expand(cu_q).unsqueeze(1)
    return torch.where(fresh.view(-1, 1, 1, 1), expanded.to(absorbed.dtype), absorbed).transpose(0, 1)
