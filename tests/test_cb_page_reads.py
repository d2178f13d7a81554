"""Continuous batching's read index by page: the engine's host preparation lists one slot per page of each request's
context (``LatentPagedAttentionCache.extend_read_and_write_indices``) instead of one per row, and the split-row
kernel finds a page's rows from its first slot (``mla_decode_split_rows(..., page=, page_bases=)``)."""

import pytest
import torch

from test_continuous_batching import _cb_config, _check_batch, _greedy, _pair, _prompts, needs_cb


def _paged_pool(gen, rank, rope, page, pages):
    """``(k_rows, v_rows, firsts)``: K / V half rows of a pool of ``pages`` pages of ``page`` consecutive slots whose
    V halves sit a page after the K halves, and the pages' first slots in scattered order."""
    pool = torch.randn(pages * 2 * page + page, (rank + rope) // 2, generator=gen)
    firsts = torch.tensor([b * 2 * page for b in range(pages)])[torch.randperm(pages, generator=gen)]
    return pool[:-page], pool[page:], firsts


def _step_by_page(gen, requests, page, pages=40, heads=4, rank=32, rope=8):
    """A step of ``requests`` = [(cached rows, new tokens)] laid out as continuous batching lays it out: each request's
    context in its own pages, the query tokens' ``(starts, ends)`` causal within it; returns the pool, the queries,
    the bounds, the slots by page with each token's page base, and the slot of every row (the same rows)."""
    k_rows, v_rows, firsts = _paged_pool(gen, rank, rope, page, pages)
    by_page, row_slots, starts, ends, bases, k0, used = [], [], [], [], [], 0, 0
    for cached, new in requests:
        total = cached + new
        n = -(-total // page)
        mine = firsts[used:used + n]
        used += n
        for t in range(new):
            starts.append(k0)
            ends.append(k0 + cached + t + 1)
            bases.append(len(by_page))
        by_page += mine.tolist()
        row_slots += [int(mine[t // page]) + t % page for t in range(total)]
        k0 += total
    starts += [0, 0]  # two padding tokens, parked on the first row as ``ragged.token_bounds`` parks them
    ends += [1, 1]
    bases += [0, 0]
    as32 = dict(dtype=torch.int32)
    q = torch.randn(len(starts), heads, rank + rope, generator=gen)
    return (k_rows, v_rows, q, torch.tensor(starts, **as32), torch.tensor(ends, **as32), torch.tensor(by_page),
            torch.tensor(bases, **as32), torch.tensor(row_slots))


@pytest.mark.parametrize("page", [4, 6, 16])  # (6: a page size that is no power of two)
@pytest.mark.parametrize("group", [1, 2])
def test_slots_by_page_read_the_same_rows_as_slots_by_row(interp, page, group):
    """Interpreted Triton with slots by page equals the torch twin with one slot per row: decode tokens, prefill
    chunks (served a group of tokens a program), last pages partly filled, padding tokens, several splits; the twin
    by page (``row_slots`` then the twin by row) finds every row's slot."""
    pytest.importorskip("triton")
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows, mla_decode_split_rows_ref, row_slots

    gen = torch.Generator().manual_seed(page + group)
    k_rows, v_rows, q, starts, ends, by_page, bases, by_row = _step_by_page(
        gen, [(40, 6), (14, 1), (3, 1), (page, 1), (0, 9), (2 * page - 1, 1)], page)
    assert torch.equal(row_slots(by_page, starts, ends, page, bases), by_row)
    want = mla_decode_split_rows_ref(q, k_rows, v_rows, by_row, ends, starts, 0.25, 32)
    twin = mla_decode_split_rows_ref(q, k_rows, v_rows, by_page, ends, starts, 0.25, 32, page, bases)
    torch.testing.assert_close(twin, want, rtol=1e-5, atol=1e-5)
    for splits in (1, 3):
        got = mla_decode_split_rows(q, k_rows, v_rows, by_page, ends, starts, 0.25, 32, num_splits=splits,
                                    group=group, page=page, page_bases=bases)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        apart = mla_decode_split_rows(q[..., :32], k_rows, v_rows, by_page, ends, starts, 0.25, 32,
                                      num_splits=splits, q_rope=q[..., 32:], group=group, page=page, page_bases=bases)
        torch.testing.assert_close(apart, want, rtol=1e-5, atol=1e-5)


def test_slots_by_page_need_page_bases():
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows

    rows, slots, bounds = torch.zeros(8, 20), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="need page_bases"):
        mla_decode_split_rows(torch.zeros(2, 4, 40), rows, rows, slots, bounds, bounds * 0, 0.25, 32, page=4)


def test_page_bases_and_context_rows_follow_each_requests_pages():
    """``token_page_bases``: where each query token's request's pages begin (padding tokens: 0); the host path's
    ``context_row_slots`` turns slots by page back into a slot per row, request after request."""
    from mla_fuser.attention_interfaces import ragged
    from mla_fuser.runtime.continuous_batching import context_row_slots

    ragged._DEVICE_PAGES[:] = [None, None]
    cu_q = torch.tensor([0, 3, 4, 6, 6], dtype=torch.int32)  # a 3-token chunk, a decode, a 2-token chunk, padding
    cu_k = torch.tensor([0, 10, 15, 18, 18], dtype=torch.int32)  # contexts of 10, 5 and 3 rows: 3, 2 and 1 pages
    assert ragged.token_page_bases(cu_q, cu_k, 8, 4).tolist() == [0, 0, 0, 3, 5, 5, 0, 0]
    firsts = torch.tensor([100, 40, 8, 60, 0, 20])
    want = [100 + t for t in range(4)] + [40 + t for t in range(4)] + [8, 9] + [60 + t for t in range(4)] + [0] + [
        20, 21, 22]
    assert context_row_slots(firsts, cu_k, 4).tolist() == want


@needs_cb
@pytest.mark.parametrize("arch,q_lora_rank", [("deepseek_v2", 24), ("deepseek_v3", None)])
def test_the_read_index_lists_pages_and_tokens_equal_native(monkeypatch, device_path, arch, q_lora_rank):
    """On the in-place device path the engine's read index gets a slot per page (never one per row), every step's
    attention reads by page, and each request's tokens equal native's: contexts over several pages, chunked prefill
    beside decode tokens."""
    from mla_fuser.attention_interfaces import vllm_mla
    from mla_fuser.runtime import continuous_batching as cbm

    listed, pages_read = [], []
    real_pages, real_kernel = cbm.page_slots, vllm_mla.mla_decode_split_rows
    monkeypatch.setattr(cbm, "page_slots", lambda *a: listed.append(a[2]) or real_pages(*a))
    monkeypatch.setattr(vllm_mla, "mla_decode_split_rows", lambda *a, **k: pages_read.append(k.get("page", 0))
                        or real_kernel(*a, **k))
    native, fused = _pair(arch, q_lora_rank=q_lora_rank, kv_lora_rank=32)
    _check_batch(native, fused, _prompts([37, 5, 50, 2, 21], seed=12), _greedy(6), _cb_config(max_batch_tokens=16))
    assert max(listed) > 16  # contexts of several 16-row pages were listed by page
    assert pages_read and set(pages_read) <= {0, 16} and 16 in pages_read  # (0: fresh prompts, the write index)
    assert set(device_path) == {"pages"}


@needs_cb
def test_rows_are_listed_when_page_reads_are_off_or_the_engines_rows_disagree(monkeypatch, device_path):
    """``READ_BY_PAGE = False`` keeps the engine's slot per row; so does a cache whose pages, checked at the first
    listing against the engine's own row list, do not give the same rows (here: pages made to start one row off),
    before anything was listed by page.  Tokens equal native's either way."""
    from mla_fuser.attention_interfaces import vllm_mla
    from mla_fuser.runtime import continuous_batching as cbm

    pages_read = []
    real_kernel = vllm_mla.mla_decode_split_rows
    monkeypatch.setattr(vllm_mla, "mla_decode_split_rows",
                        lambda *a, **k: pages_read.append(k.get("page", 0)) or real_kernel(*a, **k))
    native, fused = _pair(kv_lora_rank=32)
    prompts = _prompts([37, 5, 20], seed=4)
    monkeypatch.setattr(cbm, "READ_BY_PAGE", False)
    _check_batch(native, fused, prompts, _greedy(4), _cb_config())
    assert pages_read and set(pages_read) == {0}
    pages_read.clear()
    monkeypatch.setattr(cbm, "READ_BY_PAGE", True)
    real_pages = cbm.page_slots
    monkeypatch.setattr(cbm, "page_slots", lambda *a: [s + 1 for s in real_pages(*a)])
    _check_batch(native, fused, prompts, _greedy(4), _cb_config())
    assert pages_read and set(pages_read) == {0}


@needs_cb
def test_pages_of_a_size_that_is_no_power_of_two(monkeypatch, device_path):
    """Pages of 12 rows (the engine takes any page size): contexts over several pages read by page, tokens equal
    native's."""
    from mla_fuser.attention_interfaces import vllm_mla

    pages_read, real_kernel = [], vllm_mla.mla_decode_split_rows
    monkeypatch.setattr(vllm_mla, "mla_decode_split_rows",
                        lambda *a, **k: pages_read.append(k.get("page", 0)) or real_kernel(*a, **k))
    native, fused = _pair(kv_lora_rank=32)
    _check_batch(native, fused, _prompts([30, 7, 13], seed=9), _greedy(5), _cb_config(page_size=12))
    assert 12 in pages_read and set(device_path) == {"pages"}
