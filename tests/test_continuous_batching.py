"""Transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) on fused MLA models: every
request's tokens equal a one-request native ``generate`` of the same prompt, steps mixing prefill chunks and decode
tokens of many requests over latent pages in the engine's own pool."""

import time
import types

import pytest
import torch
from transformers import GenerationConfig

import mla_fuser
from mla_fuser import compat
from mla_fuser.runtime.continuous_batching import MIN_VERSION

from conftest import tiny_deepseek

SUPPORTED = compat.transformers_version() >= MIN_VERSION
needs_cb = pytest.mark.skipif(not SUPPORTED, reason=f"continuous batching of fused MLA needs transformers>={MIN_VERSION}")


def _cb_config(**kw):
    from transformers import ContinuousBatchingConfig

    kw.setdefault("page_size", 16)
    kw.setdefault("num_blocks", 64)
    return ContinuousBatchingConfig(**kw)


def _greedy(new_tokens=6, **kw):
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0, **kw)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def _native_tokens(native, prompt, config):
    with torch.no_grad():
        return native.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()


def _pair(arch="deepseek_v2", **kw):
    native = tiny_deepseek(arch, **kw)
    fused = tiny_deepseek(arch, attn="vllm_mla", **kw)
    mla_fuser.fuse(fused)
    return native, fused


def _check_batch(native, fused, prompts, config, cb_config):
    out = fused.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config,
                               progress_bar=False)
    assert len(out) == len(prompts)
    for i, prompt in enumerate(prompts):
        result = out[f"req_{i}"]
        assert result.error is None, result.error
        assert result.generated_tokens == _native_tokens(native, prompt, config), f"request {i} (prompt {len(prompt)})"
    return out


@needs_cb
@pytest.mark.parametrize("arch,q_lora_rank", [("deepseek_v2", 24), ("deepseek_v2", None), ("deepseek_v3", 24)])
def test_generate_batch_equals_native_per_request(arch, q_lora_rank):
    native, fused = _pair(arch, q_lora_rank=q_lora_rank)
    _check_batch(native, fused, _prompts([1, 3, 17, 40, 5, 63, 2]), _greedy(6), _cb_config())


@needs_cb
def test_chunked_prefill_beside_decodes_equals_native(monkeypatch):
    """At most 16 tokens per step: long prompts arrive in chunks after their own cached tokens (causal from the
    context's end), in steps that also hold other requests' chunks and decode tokens."""
    from mla_fuser.attention_interfaces import ragged

    native, fused = _pair()
    seen = []
    real = ragged._prefill_indices
    monkeypatch.setattr(ragged, "_prefill_indices", lambda group, q, k, device: seen.append(
        [(q[i + 1] - q[i], k[i + 1] - k[i]) for i in group]) or real(group, q, k, device))
    _check_batch(native, fused, _prompts([37, 5, 50, 2, 21], seed=12), _greedy(5), _cb_config(max_batch_tokens=16))
    chunks = [c for group in seen for c in group]
    assert any(k > q > 1 for q, k in chunks), chunks  # a chunk after cached tokens of its own request
    assert any(len(group) > 1 for group in seen), seen  # chunks of several requests batched together


@needs_cb
@pytest.mark.parametrize("path", ["host", "device in pages"])
def test_a_pool_smaller_than_the_workload_queues_requests_and_all_finish(request, path):
    """4 blocks of 16 tokens per layer; 8 requests of up to 40 tokens each fit alone, several times the pool
    together: the scheduler queues them, none fails, every answer equals native (also on the device path reading
    the engine's pages in place, whose slots are reused as requests come and go)."""
    if path != "host":
        request.getfixturevalue("device_path")
    native, fused = _pair(kv_lora_rank=32 if path != "host" else 16)
    _check_batch(native, fused, _prompts([30, 12, 25, 40, 8, 33, 20, 16], seed=1), _greedy(8),
                 _cb_config(num_blocks=4, allow_block_sharing=False))


@needs_cb
@pytest.mark.parametrize("path", ["host", "device in pages"])
def test_prefix_sharing_and_forks_give_the_same_tokens(request, path):
    if path != "host":  # shared blocks and forked blocks read in place through the engine's slots
        request.getfixturevalue("device_path")
    native, fused = _pair(kv_lora_rank=32 if path != "host" else 16)
    shared = _prompts([40], seed=2)[0]
    prompts = [shared + tail for tail in _prompts([3, 5, 1], seed=3)]
    _check_batch(native, fused, prompts, _greedy(5), _cb_config(allow_block_sharing=True))
    # forks need sampling; top_k=1 samples the argmax, so both children of a prompt are native's greedy answer
    forked = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2, eos_token_id=-1,
                              pad_token_id=0)
    forks = fused.generate_batch(prompts[:2], generation_config=forked, continuous_batching_config=_cb_config(),
                                 progress_bar=False)
    assert len(forks) == 4 and all(r.error is None for r in forks.values())
    expected = {tuple(_native_tokens(native, p, _greedy(5))) for p in prompts[:2]}
    assert {tuple(r.generated_tokens) for r in forks.values()} == expected


@needs_cb
def test_the_manager_api_with_per_request_lengths_and_a_cancellation():
    native, fused = _pair()
    prompts = _prompts([9, 21, 4, 30], seed=4)
    lengths = [3, 7, 5, 6]
    # (no prefix sharing: finished requests' full blocks would otherwise stay cached for reuse)
    manager = fused.init_continuous_batching(generation_config=_greedy(8),
                                             continuous_batching_config=_cb_config(allow_block_sharing=False))
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        doomed = manager.add_request(_prompts([50], seed=5)[0], max_new_tokens=64)
        manager.cancel_request(doomed)
        results = {}
        for _ in range(200):
            if all(i in results for i in ids):
                break
            result = manager.get_result(timeout=0.5)
            if result is not None and result.request_id in ids:
                results[result.request_id] = result
        for request_id, prompt, n in zip(ids, prompts, lengths):
            assert results[request_id].generated_tokens == _native_tokens(native, prompt, _greedy(n))
        cache = manager.batch_processor.cache
        for allocator in cache.cache_allocators.values():  # one latent row per token and layer, never expanded K/V
            assert allocator.bytes_per_page == allocator.tokens_per_page * sum(manager.latent) * fused.dtype.itemsize
        # from 5.25 the engine's own latent allocator holds the rows (K / V half rows of its full-attention pool before)
        assert cache.latent_allocator == (compat.transformers_version() >= (5, 25))
        for _ in range(100):  # the cancelled request's pages come back too (the loop handles cancels between steps)
            if cache.compute_free_capacity(relative=True) == 1:
                break
            time.sleep(0.05)
        assert cache.compute_free_capacity(relative=True) == 1
    finally:
        manager.stop(block=True, timeout=30)


@needs_cb
def test_trl_call_shape_on_a_peft_policy_and_after_an_optimizer_step():
    """TRL's GRPO: ``generate_batch(prompt_ids, generation_config=..., continuous_batching_config=
    ContinuousBatchingConfig(max_memory_percent=0.5), progress_bar=False)`` on a LoRA policy (adapters on the
    attention projections), generation between optimizer steps."""
    peft = pytest.importorskip("peft")
    from transformers import ContinuousBatchingConfig

    def policy(attn):
        torch.manual_seed(7)
        model = peft.get_peft_model(tiny_deepseek(attn=attn), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]))
        return model

    native, fused = policy("sdpa"), policy("vllm_mla")
    mla_fuser.fuse(fused)
    prompts = _prompts([6, 11, 3], seed=6)
    config = _greedy(5)

    def check():
        out = fused.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=0.5),
                                   progress_bar=False)
        for i, p in enumerate(prompts):
            assert out[f"req_{i}"].error is None
            assert out[f"req_{i}"].generated_tokens == _native_tokens(native, p, config)

    check()
    for model in (native, fused):  # the same "optimizer step" on both adapters
        torch.manual_seed(8)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.3 * torch.randn_like(param))
    check()


@needs_cb
def test_a_bad_request_fails_alone_with_a_clear_error():
    native, fused = _pair()
    good = _prompts([7, 12], seed=9)
    manager = fused.init_continuous_batching(generation_config=_greedy(4),
                                             continuous_batching_config=_cb_config(num_blocks=4))
    manager.start()
    try:
        ids = [manager.add_request(p) for p in good]
        too_long = manager.add_request(list(range(3, 3 + 16 * 4 + 5)))  # more than the whole pool ever holds
        results = {}
        for _ in range(200):
            if len(results) == 3:
                break
            result = manager.get_result(timeout=0.5)
            if result is not None:
                results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
    assert results[too_long].error, "the oversized request must fail"
    for request_id, prompt in zip(ids, good):
        assert results[request_id].error is None
        assert results[request_id].generated_tokens == _native_tokens(native, prompt, _greedy(4))
    out = fused.generate_batch([[], good[0]], generation_config=_greedy(4), continuous_batching_config=_cb_config(),
                               progress_bar=False)
    assert out["req_0"].error, "an empty prompt must fail"
    assert out["req_1"].error is None and out["req_1"].generated_tokens == _native_tokens(native, good[0], _greedy(4))
    print("empty prompt:", out["req_0"].error, "| too long:", results[too_long].error)


@needs_cb
def test_a_model_with_unfused_attention_layers_is_refused_naming_them(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    model = tiny_deepseek(attn="vllm_mla")
    report = mla_fuser.fuse(model)
    assert not report.fused("mla")
    # nothing fused as MLA: Transformers' own continuous batching stands (it refuses vllm_mla itself)
    assert "init_continuous_batching" not in model.__dict__
    monkeypatch.delenv("VLLM_MLA_DISABLE")
    from mla_fuser.runtime.continuous_batching import latent_layout

    fused = tiny_deepseek(attn="vllm_mla")
    mla_fuser.fuse(fused)
    from mla_fuser.plans import clear_plan

    clear_plan(fused.model.layers[1].self_attn, "mla")
    from mla_fuser.plans import model_state

    model_state(fused).paged_layers = None
    with pytest.raises(ValueError, match=r"layers \[1\] are not"):
        latent_layout(fused)


@pytest.mark.skipif(SUPPORTED, reason="the refusal is for releases before the engine API we use")
def test_older_transformers_refuse_clearly():
    _, fused = _pair()
    with pytest.raises(NotImplementedError, match="needs transformers>=5.19"):
        fused.init_continuous_batching(generation_config=_greedy(2))


@pytest.mark.skipif(compat.transformers_version() < (5, 25), reason="Transformers' latent allocator is new in 5.25")
def test_a_latent_allocator_of_another_layout_is_refused_naming_the_version():
    """Transformers sizes its latent allocator's rows from the config; rows that cannot hold the fused layers' latent
    are refused with an error naming the release, before any step writes into them."""
    from transformers.generation.continuous_batching.cache_allocators import MLACacheAllocator

    from mla_fuser.runtime.continuous_batching import latent_allocator_of

    def cache(rank, width):
        allocator = object.__new__(MLACacheAllocator)
        allocator.kv_lora_rank, allocator.row_numel = rank, width
        return types.SimpleNamespace(cache_allocators={"full_attention": allocator})

    assert latent_allocator_of(cache(16, 20), (16, 4))
    with pytest.raises(ValueError, match=r"latent cache allocator of transformers 5\.2\d.*rank 16 \+ rope 4"):
        latent_allocator_of(cache(16, 24), (16, 4))


@needs_cb
def test_decode_tokens_through_the_triton_decode_kernel(monkeypatch):
    """The decode tokens of a step go through the paged ``mla_decode`` kernel with the step's latent rows as pages of
    one token (Triton's interpreter here)."""
    pytest.importorskip("triton")
    from mla_fuser.kernels import mla_decode as md

    native, fused = _pair()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    launches = []
    real = md.mla_decode_triton
    monkeypatch.setattr(md, "mla_decode_triton", lambda *a, **k: launches.append(a[1].shape[1]) or real(*a, **k))
    _check_batch(native, fused, _prompts([3, 9, 5], seed=11), _greedy(3), _cb_config())
    assert 1 in launches  # pages of one token: the ragged decode path, not only the engine-free ones


# ---- the device path (no host read; what a GPU runs and the engine captures in CUDA graphs) --------------------------

@needs_cb
@pytest.mark.parametrize("arch,q_lora_rank,rank,path", [
    ("deepseek_v2", 24, 16, "joined"),  # latent halves of 8 + 2: rows joined by the gather, then mla_decode
    ("deepseek_v3", None, 16, "joined"),
    ("deepseek_v2", 24, 32, "pages"),  # halves of 16 + 2: read in place from the engine's pages
    ("deepseek_v3", None, 32, "pages"),
])
def test_device_path_equals_native_per_request(device_path, arch, q_lora_rank, rank, path):
    native, fused = _pair(arch, q_lora_rank=q_lora_rank, kv_lora_rank=rank)
    _check_batch(native, fused, _prompts([1, 3, 17, 40, 5, 63, 2], seed=3), _greedy(6), _cb_config())
    assert set(device_path) == {path}


@needs_cb
def test_split_latent_layout_reads_back_for_the_host_path():
    """The split K / V half layout (rank 32) read back and joined for the host-bounded path equals native."""
    native, fused = _pair(kv_lora_rank=32)
    _check_batch(native, fused, _prompts([37, 5, 50, 2, 21], seed=12), _greedy(5), _cb_config(max_batch_tokens=16))


@needs_cb
def test_in_pages_path_through_the_triton_kernel(monkeypatch, device_path):
    """The split-row decode kernel (Triton's interpreter) reading the engine's pages in place serves whole steps."""
    pytest.importorskip("triton")
    from mla_fuser.kernels import mla_decode_split as ms

    native, fused = _pair(kv_lora_rank=32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    launches = []
    real = ms.mla_decode_split_rows_triton
    monkeypatch.setattr(ms, "mla_decode_split_rows_triton", lambda *a, **k: launches.append(1) or real(*a, **k))
    _check_batch(native, fused, _prompts([3, 9, 5], seed=11), _greedy(3), _cb_config())
    assert launches


def _half_row_pool(gen, rank, rope, rows, page=16, blocks=12):
    """``(k_rows, v_rows, slots)``: K / V half rows of a pool whose V halves sit a page after the K halves (as the
    engine's blocks hold them), and ``rows`` context positions in scattered slots."""
    pool = torch.randn(blocks * 2 * page, (rank + rope) // 2, generator=gen)
    slots = torch.tensor([b * 2 * page + p for b in range(blocks) for p in range(page)])
    return pool[:-page], pool[page:], slots[torch.randperm(len(slots), generator=gen)][:rows]


@pytest.mark.parametrize("rope", [8, 0])
def test_split_row_kernel_equals_its_reference(interp, rope):
    """Interpreted Triton vs the torch twin: rows in scattered slots of a pool whose V halves sit a page after the K
    halves, several tiles and splits, per-row starts and ends."""
    pytest.importorskip("triton")
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows, mla_decode_split_rows_ref

    gen = torch.Generator().manual_seed(1)
    rank, heads = 32, 3
    k_rows, v_rows, slots = _half_row_pool(gen, rank, rope, 150)
    q = torch.randn(4, heads, rank + rope, generator=gen)
    starts = torch.tensor([0, 5, 70, 149], dtype=torch.int32)
    ends = torch.tensor([150, 66, 140, 150], dtype=torch.int32)
    want = mla_decode_split_rows_ref(q, k_rows, v_rows, slots, ends, starts, 0.25, rank)
    for splits in (1, 3):
        got = mla_decode_split_rows(q, k_rows, v_rows, slots, ends, starts, 0.25, rank, num_splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("group", [2, 4])
def test_grouped_split_row_kernel_equals_its_reference(interp, rope, group):
    """Runs of query tokens with one start (a request's prefill chunk) are served ``group`` tokens a program, the
    other tokens one a program: a step of two chunks, decode tokens of other requests, a group cut by the end of the
    tokens and padding tokens, with the rope part passed apart or joined; equal to the torch twin, every split."""
    pytest.importorskip("triton")
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows, mla_decode_split_rows_ref

    gen = torch.Generator().manual_seed(2)
    rank, heads = 32, 4
    k_rows, v_rows, slots = _half_row_pool(gen, rank, rope, 170)
    # request 0: 6-token chunk after 40 cached rows (rows 0..46); requests 1-3: one decode token each (rows 46..90);
    # request 4: 9-token chunk after 70 rows (rows 90..169); then two padding tokens parked on the last row
    starts, ends = [], []
    for k_start, cached, new in ((0, 40, 6), (46, 14, 1), (61, 20, 1), (82, 7, 1), (90, 70, 9)):
        for t in range(new):
            starts.append(k_start)
            ends.append(k_start + cached + t + 1)
    starts += [168, 168]
    ends += [169, 169]
    starts = torch.tensor(starts, dtype=torch.int32)
    ends = torch.tensor(ends, dtype=torch.int32)
    q = torch.randn(len(starts), heads, rank + rope, generator=gen)
    want = mla_decode_split_rows_ref(q, k_rows, v_rows, slots, ends, starts, 0.25, rank)
    for splits in (1, 3):
        got = mla_decode_split_rows(q, k_rows, v_rows, slots, ends, starts, 0.25, rank, num_splits=splits,
                                    group=group)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        apart = mla_decode_split_rows(q[..., :rank], k_rows, v_rows, slots, ends, starts, 0.25, rank,
                                      num_splits=splits, q_rope=q[..., rank:], group=group)
        torch.testing.assert_close(apart, want, rtol=1e-5, atol=1e-5)


def test_split_row_kernel_refuses_a_rope_part_that_does_not_fit():
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows

    rows = torch.zeros(8, 20)
    slots, bounds = torch.arange(8, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not go with a latent query"):
        mla_decode_split_rows(torch.zeros(2, 4, 32), rows, rows, slots, bounds, bounds * 0, 0.25, 32,
                              q_rope=torch.zeros(3, 4, 8))


def test_tokens_per_program_fills_a_wide_tile():
    from mla_fuser.kernels.mla_decode_split import tokens_per_program

    assert [tokens_per_program(h) for h in (4, 16, 20, 32, 64, 128)] == [16, 4, 2, 2, 1, 1]


@needs_cb
def test_device_path_chunked_prefill_beside_decodes_equals_native(device_path):
    native, fused = _pair()
    _check_batch(native, fused, _prompts([37, 5, 50, 2, 21], seed=12), _greedy(5), _cb_config(max_batch_tokens=16))


def test_token_bounds_cover_each_requests_context_causally_and_park_padding():
    """Three requests (a 3-token chunk after 2 cached rows, a decode token after 4, a fresh 2-token prompt), then two
    padding sequences of length 0 and two padding query tokens, as a captured step of the engine has them."""
    from mla_fuser.attention_interfaces import ragged

    cu_q = torch.tensor([0, 3, 4, 6, 6, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 10, 12, 12, 12], dtype=torch.int32)
    ragged._DEVICE_STEP[:] = [None, None]
    starts, ends = ragged.token_bounds(cu_q, cu_k, tokens=8)
    assert starts.tolist() == [0, 0, 0, 5, 10, 10, 0, 0]
    assert ends.tolist() == [3, 4, 5, 10, 11, 12, 1, 1]
    again = ragged.token_bounds(cu_q, cu_k, tokens=8)
    assert again[0] is starts  # one computation per step, shared by the layers
    cu_q[1] = 2  # the engine rewrites its bounds in place for the next step
    assert ragged.token_bounds(cu_q, cu_k, tokens=8)[0] is not starts


def test_latent_pages_read_the_cache_rows_in_place_and_join_otherwise():
    from mla_fuser.attention_interfaces import ragged

    latent = torch.randn(128, 10)
    kv_c, k_pe = latent[None, None, :70, :8], latent[None, None, :70, 8:]
    pages = ragged.latent_pages(kv_c, k_pe)
    assert pages.data_ptr() == latent.data_ptr() and pages.shape == (2, 64, 10)
    assert torch.equal(pages.reshape(-1, 10)[:70], latent[:70])
    apart = ragged.latent_pages(torch.randn(1, 1, 24, 8), torch.randn(1, 1, 24, 2))
    assert apart.shape == (3, 8, 10)


@needs_cb
def test_without_page_views_the_engines_own_read_back_is_joined(monkeypatch):
    from mla_fuser.runtime import continuous_batching as cbm

    native, fused = _pair()
    asked = []
    monkeypatch.setattr(cbm, "page_views", lambda allocator, layer: asked.append(layer))
    _check_batch(native, fused, _prompts([9, 2, 30], seed=5), _greedy(4), _cb_config(max_batch_tokens=16))
    assert asked


@needs_cb
def test_latent_gather_kernel_equals_its_reference_and_skips_padding(interp):
    """The Triton kernel (interpreted) joins K and V halves of the listed slots; rows past the step's count stay
    untouched (a captured step's padding costs nothing)."""
    pytest.importorskip("triton")
    from mla_fuser.kernels.latent_gather import latent_gather, latent_gather_ref

    gen = torch.Generator().manual_seed(0)
    k_rows, v_rows = torch.randn(50, 9, generator=gen), torch.randn(50, 9, generator=gen)
    index = torch.randint(0, 50, (37,), generator=gen)
    out = torch.full((40, 18), 7.0)
    latent_gather(k_rows, v_rows, index, torch.tensor([30], dtype=torch.int32), out)
    want = latent_gather_ref(k_rows, v_rows, index, None, torch.zeros(40, 18))
    assert torch.equal(out[:30], want[:30])
    assert torch.all(out[30:] == 7.0)


@needs_cb
def test_adapters_on_the_split_layout_read_the_rows_back(monkeypatch):
    """A LoRA on kv_b_proj keeps a layer off the decode kernels: on the device path with the split layout its rows,
    only written by the cache, are read back and joined; tokens equal the native model with the same adapters."""
    peft = pytest.importorskip("peft")
    from mla_fuser.attention_interfaces import ragged
    from mla_fuser.runtime import continuous_batching as cbm

    monkeypatch.setattr(ragged, "DEVICE_PATH_ON_CPU", True)
    joins = []
    join = cbm.join_split_rows
    monkeypatch.setattr(cbm, "join_split_rows", lambda *a: joins.append(1) or join(*a))

    def policy(attn):
        torch.manual_seed(7)
        return peft.get_peft_model(tiny_deepseek(attn=attn, kv_lora_rank=32), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["kv_b_proj"]))

    native, fused = policy("sdpa"), policy("vllm_mla")
    mla_fuser.fuse(fused)
    prompts, config = _prompts([6, 11, 3], seed=6), _greedy(5)
    out = fused.generate_batch(prompts, generation_config=config, continuous_batching_config=_cb_config(),
                               progress_bar=False)
    for i, p in enumerate(prompts):
        assert out[f"req_{i}"].error is None, out[f"req_{i}"].error
        assert out[f"req_{i}"].generated_tokens == _native_tokens(native, p, config)
    assert joins  # the written-only rows were read back for the adapter-wrapped layers


@needs_cb
def test_a_latent_that_lost_its_rows_fails_loudly(monkeypatch, device_path):
    """If what reaches the attention is the step's new rows without the tag saying where every context's rows lie
    (model code between the cache update and the attention rebuilt the tensor), the step fails with a clear error
    instead of attending only the new tokens."""
    from mla_fuser.attention_interfaces import ragged

    native, fused = _pair(kv_lora_rank=32)
    real = ragged.PAGES_ROWS_ATTR
    monkeypatch.setattr(ragged, "PAGES_ROWS_ATTR", real + "_not_there")  # the tag is looked up under another name
    out = fused.generate_batch(_prompts([9, 4], seed=2), generation_config=_greedy(3), continuous_batching_config=
                               _cb_config(), progress_bar=False)
    errors = [r.error for r in out.values()]
    assert all(e and "changed between the cache update and the attention" in e for e in errors), errors
    device_path.append("(refused)")
