"""``kernels.page_prefix_copy``: a beam reorder's partly written pages, the written rows of every layer's page copied
in two launches, against its torch twin (Triton interpreted), and a static cache's reorder through it."""

import pytest
import torch

import mla_fuser
from conftest import left_padded_prompts, tiny_deepseek
from mla_fuser.cache import PagedLatentCache
from mla_fuser.compat import cache_keyword
from mla_fuser.kernels.page_prefix_copy import copy_page_prefixes, copy_page_prefixes_ref

pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()


@pytest.fixture
def kernel_device(monkeypatch):
    """Where the kernel tests run: compiled on a GPU when there is one, else under Triton's interpreter."""
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cuda" if ON_GPU else "cpu"


def _pools(dtype, width, count=3, pages=6, page_size=4, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pages + i, page_size, width, generator=g).mul(40).to(device, dtype) for i in range(count)]


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 10), (torch.float32, 3), (torch.uint8, 5)])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_kernel_equals_its_twin(kernel_device, dtype, width, rows):
    """Rows as 4-byte words (bf16 x 10, fp32 x 3) or bytes (5 uint8: FP8 packed rows are not word-sized); sources
    that are other sequences' destinations (a cycle), one sequence continuing itself, two taking one source."""
    pools = _pools(dtype, width, device=kernel_device)
    want = [p.clone() for p in pools]
    dst = torch.tensor([0, 1, 2, 3, 4], device=kernel_device)
    src = torch.tensor([1, 2, 0, 3, 1], device=kernel_device)  # 0<-1, 1<-2, 2<-0 (a cycle), 3 itself, 4<-1 (1 also a destination)
    copy_page_prefixes(pools, dst, src, rows)
    copy_page_prefixes_ref(want, dst, src, rows)
    for got, ref, before in zip(pools, want, _pools(dtype, width, device=kernel_device)):
        assert torch.equal(got, ref)
        assert torch.equal(got[:, rows:], before[:, rows:])  # rows past the prefix untouched
        assert torch.equal(got[0, :rows], before[1, :rows]) and torch.equal(got[2, :rows], before[0, :rows])


def test_bad_operands_are_refused(interp):
    pools = _pools(torch.float32, 4)
    with pytest.raises(ValueError, match="do not fit"):
        copy_page_prefixes(pools, torch.tensor([0]), torch.tensor([1]), 5)
    with pytest.raises(ValueError, match="differ"):
        copy_page_prefixes(pools + [torch.zeros(3, 4, 5)], torch.tensor([0]), torch.tensor([1]), 2)
    before = [p.clone() for p in pools]
    copy_page_prefixes(pools, torch.tensor([0]), torch.tensor([1]), 0)  # nothing to copy
    assert all(torch.equal(a, b) for a, b in zip(pools, before))


@pytest.mark.parametrize("layers", [2, 5])
def test_a_static_caches_reorder_copies_partial_pages_in_two_launches(monkeypatch, layers):
    """A static cache's beam reorder on the Triton path: every layer's sequences in the new order, the partly written
    pages copied by two launches whatever the layer count."""
    import mla_fuser.kernels.page_prefix_copy as ppc

    fused = tiny_deepseek(attn="vllm_mla", layers=layers, first_k_dense_replace=0)
    mla_fuser.fuse(fused)
    ids, mask = left_padded_prompts([6, 5, 6, 3], seed=3)  # 6 tokens: one whole page of 4 and 2 rows of the next
    cache = PagedLatentCache(fused, page_size=4, static=True, max_seq_len=16, max_cache_tokens=4 * 16)
    cache.set_left_padding(6 - mask.sum(1))
    with torch.no_grad():
        fused(input_ids=ids, attention_mask=mask, **{cache_keyword(fused): cache}, use_cache=True)
    before = [layer.gather().clone() for layer in cache.paged]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    launches = []
    real = ppc._prefix_copy_kernel.get

    def counted():
        kernel = real()
        return type("K", (), {"__getitem__": lambda self, grid: (launches.append(grid) or kernel[grid])})()

    monkeypatch.setattr(ppc._prefix_copy_kernel, "get", counted)
    beam_idx = torch.tensor([3, 3, 0, 1])
    cache.reorder_cache(beam_idx)
    assert len(launches) == 2 and launches[0][0] == layers
    for layer, rows in zip(cache.paged, before):
        assert torch.equal(layer.gather(), rows[beam_idx])
