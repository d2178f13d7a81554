"""FP8 latent cache (``PagedLatentCache(..., dtype=torch.float8_e4m3fn)``): the packed row format, the writes and the
decode kernel against their torch twins (Triton under ``TRITON_INTERPRET=1``: the interpreter loads and converts
float8; the write kernel rounds to the e4m3 grid in fp32 there, see ``latent_fp8``), and a fused tiny DeepSeek-V2
generating over an FP8 cache against the same model over an fp32 cache.

Accuracy bound used below.  e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most half a
spacing, 2**-4 of its magnitude; values below 2**-6 (subnormals) move by at most 2**-10 in absolute terms.  With the
per-token scale ``s = max|x| / 448`` a stored entry is ``x / s`` rounded, so each cached entry carries an error of at
most ``2**-4 |x| + 2**-10 s`` (``s`` is 1/448 of the row's largest entry).  That per-entry bound is what the format test
asserts.  For the model, every latent row a step reads is perturbed by at most 2**-4 relatively (in norm), so each
attention layer's output (a convex combination of value rows, with scores perturbed by the same relative amount of
``|q||k|``) moves by at most about 2**-4 of its own size, and the logits by at most that fraction of the attention
layers' contribution to them: we assert ``||logits_fp8 - logits_fp32|| <= 2**-4 ||logits_fp32||`` per step (measured:
about 1 %; the bound is the worst case of a single rounding, not a tuned number).  Tokens: a greedy token can only
change where the fp32 top-2 margin is below twice the step's largest logit change, so we assert agreement at every
step whose margin is above that, and report the overall agreement (a floor of 75 % over teacher-forced steps).
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

import mla_fuser
from mla_fuser.cache import PagedLatentCache
from mla_fuser.compat import cache_keyword
from mla_fuser.kernels import latent_fp8
from mla_fuser.kernels.latent_fp8 import FP8_DTYPE, dequantise_rows, packed_width, quantise_rows
from mla_fuser.kernels.mla_decode import MLADecodeConfig, default_config, mla_decode_ref
from mla_fuser.kernels.mla_decode_fp8 import (
    MLADecodeFP8Config, default_fp8_config, mla_decode_fp8, mla_decode_fp8_ref, mla_decode_fp8_triton,
)
from mla_fuser.kernels.paged_cache_ops import paged_append, paged_append_ref, paged_write, paged_write_ref
from mla_fuser.kernels.paged_cpu import mla_decode_cpu

from conftest import left_padded_prompts, tiny_deepseek

KW = cache_keyword(tiny_deepseek())


def _interpreter_runs_these_kernels() -> bool:
    """Triton 3.6's interpreter (the GPU image's release) stops in these kernels with ``InterpreterError:
    TypeError('only 0-dimensional arrays can be converted to Python scalars')`` (seen on an H200 host, for the first
    FP8 kernel and this one alike); 3.9's, which CI installs, runs them.  On 3.6 the compiled kernels are checked on
    the GPU instead (``bench_mla_decode_kernel.py --fp8-cache`` against the twin, ``test_gpu_fp8.py``)."""
    try:
        import triton
    except ImportError:
        return True
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


@pytest.fixture
def interp(monkeypatch):
    if not _interpreter_runs_these_kernels():
        pytest.skip("this Triton's interpreter cannot run the FP8 cache kernels (needs 3.9; see the helper above)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _bytes(t):
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# format


def test_packed_row_layout_and_per_entry_error_bound():
    assert packed_width(576) == 592  # DeepSeek: 512 + 64 e4m3, two fp32 scales, 16-byte rows (vs 1152 in bf16)
    assert packed_width(20) == 32 and packed_width(48) == 64
    gen = torch.Generator().manual_seed(0)
    kv_c = torch.randn(7, 32, generator=gen) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different sizes
    k_pe = torch.randn(7, 16, generator=gen) * 0.01
    kv_c[3] = 0  # an all-zero part: scale clamped, entries exactly 0
    rows = quantise_rows(kv_c, k_pe)
    assert rows.dtype == FP8_DTYPE and rows.shape == (7, 64)
    scales = _bytes(rows)[:, 48:56].contiguous().view(torch.float32)
    torch.testing.assert_close(scales[:, 0], (kv_c.abs().amax(-1) / 448).clamp(min=1e-12))
    torch.testing.assert_close(scales[:, 1], k_pe.abs().amax(-1) / 448)
    back = dequantise_rows(rows, 32, 48)
    x = torch.cat([kv_c, k_pe], -1)
    s = torch.cat([scales[:, :1].expand(-1, 32), scales[:, 1:].expand(-1, 16)], -1)
    assert ((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * s + 1e-6 * x.abs()).all()
    assert torch.equal(back[3, :32], torch.zeros(32))
    assert dequantise_rows(rows, 32, 48, torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------------
# writes


@pytest.mark.parametrize("rope", [16, 0])
def test_fp8_write_kernels_match_reference(interp, rope):
    gen = torch.Generator().manual_seed(rope)
    v, ps, B, S = 32, 8, 3, 5
    width = packed_width(v + rope)
    kv_c = torch.randn(B, S, v, generator=gen) * 5
    k_pe = torch.randn(B, S, rope, generator=gen) if rope else None
    table = torch.tensor([[3, 7], [1, 0], [5, 9]], dtype=torch.int32)
    lens = torch.tensor([2, 7, 0], dtype=torch.int32)
    ref, out = (torch.zeros(12, ps, width, dtype=FP8_DTYPE) for _ in range(2))
    paged_append_ref(ref, table, lens, kv_c, k_pe)
    latent_fp8.paged_append_fp8_triton(out, table, lens, kv_c,
                                       k_pe if rope else kv_c.new_empty(B, S, 0))
    assert torch.equal(_bytes(out), _bytes(ref))  # same bytes: values and scales
    slots = torch.tensor([5, -1, 17, 40, 90], dtype=torch.int64)
    ref, out = (torch.zeros(12, ps, width, dtype=FP8_DTYPE) for _ in range(2))
    paged_write_ref(ref, slots, kv_c[0], None if k_pe is None else k_pe[0])
    latent_fp8.paged_write_fp8_triton(out, slots, kv_c[0], k_pe[0] if rope else kv_c.new_empty(S, 0))
    assert torch.equal(_bytes(out), _bytes(ref))
    assert (_bytes(ref).view(-1, width) != 0).any(-1).sum() == 4  # (slot -1 wrote nothing)


def test_fp8_writes_dispatch_to_triton_and_cpu(monkeypatch, interp):
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 16, generator=gen)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32)
    want = torch.zeros(4, 8, 64, dtype=FP8_DTYPE)
    paged_append_ref(want, table, lens, kv_c, k_pe)
    cpu = torch.zeros_like(want)
    paged_append(cpu, table, lens, kv_c, k_pe)  # the CPU path (paged_cpu.append_rows)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    tri = torch.zeros_like(want)
    paged_append(tri, table, lens, kv_c, k_pe)
    written = torch.zeros_like(want)
    paged_write(written, torch.tensor([0, 1, 2]), kv_c[0], k_pe[0])
    assert torch.equal(_bytes(cpu), _bytes(want)) and torch.equal(_bytes(tri), _bytes(want))
    assert torch.equal(_bytes(written)[0, :3], _bytes(quantise_rows(kv_c[0], k_pe[0])))


# ----------------------------------------------------------------------------------------------------------------
# decode


def _pool(gen, pages, ps, v, rope, magnitude=1.0):
    latent = torch.randn(pages, ps, v + rope, generator=gen) * magnitude
    return quantise_rows(latent[..., :v], latent[..., v:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps,splits", [(16, 1), (16, 3), (8, 2)])  # page 8 < 16-token tiles: rows look pages up
@pytest.mark.parametrize("with_starts", [False, True])
def test_fp8_decode_kernel_matches_its_twin(interp, dtype, ps, splits, with_starts):
    gen = torch.Generator().manual_seed(ps + splits)
    v, rope, H, B = 32, 16, 5, 3
    pages = _pool(gen, 14, ps, v, rope, magnitude=3.0)
    table = torch.tensor([[3, 7, 2, 12], [1, 0, 4, 6], [5, 9, 11, 13]], dtype=torch.int32)
    lens = torch.tensor([3 * ps + 5, 3, 0], dtype=torch.int32)
    starts = torch.tensor([4, 1, 0], dtype=torch.int32) if with_starts else None
    q = (torch.randn(B, H, v + rope, generator=gen) * 0.5).to(dtype)
    ref = mla_decode_fp8_ref(q, pages, table, lens, 0.3, v, starts)
    # the twin is the bf16/fp32 reference over the dequantised rows
    dense = mla_decode_ref(q.float(), dequantise_rows(pages, v, v + rope), table, lens, 0.3, v, starts)
    torch.testing.assert_close(ref.float(), dense.to(dtype).float(), atol=0, rtol=0)
    out = mla_decode_fp8_triton(q, pages, table, lens, 0.3, v, num_splits=splits, starts=starts)
    cpu = mla_decode_cpu(q, pages, table, lens, 0.3, v, starts)
    assert out.dtype == dtype and not out[2].any()  # an empty sequence gives zeros
    if dtype == torch.float32:
        # an output row is an average of value rows: fp32 sums in another order differ relative to the values'
        # magnitude, not the average's (the order varies with the CPU's vector width)
        largest = dequantise_rows(pages, v, v + rope)[..., :v].abs().max()
        torch.testing.assert_close(out, ref, atol=2e-5 * largest, rtol=2e-5)
        torch.testing.assert_close(cpu, ref, atol=2e-6 * largest, rtol=2e-6)
    else:  # p * scale rounded to bf16 before p @ V, as the bf16 kernel rounds p (tolerance of its own tests)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(cpu.float(), ref.float(), atol=1e-2, rtol=1e-2)


# The FP8 kernel's variants and tiles.  Under the interpreter the fp16 dots convert with ``.to`` (the compiled kernel's
# inline-asm conversion is the same instruction Triton uses; the GPU benchmark checks it against the twin).


def _variant_case(gen, v, rope, ps, dtype, q_scale=0.5, row_scales=None):
    """Four sequences: odd length over page boundaries, 3 tokens, empty, exactly two pages; shuffled pages, a spare
    page; starts (left padding) inside the first page, on a tile boundary, 0, past the first page."""
    latent = torch.randn(16, ps, v + rope, generator=gen) * 3.0
    if row_scales is not None:  # rows of very different sizes (the value-scale normalisation of p)
        latent = latent * row_scales.view(16, ps, 1)
    pages = quantise_rows(latent[..., :v], latent[..., v:] if rope else None)
    table = torch.tensor([[3, 7, 2, 12], [1, 0, 4, 6], [5, 9, 11, 13], [15, 8, 14, 10]], dtype=torch.int32)
    lens = torch.tensor([3 * ps + 5, 3, 0, 2 * ps], dtype=torch.int32)
    starts = torch.tensor([4, 0, 0, ps + 1], dtype=torch.int32)
    q = (torch.randn(4, 5, v + rope, generator=gen) * q_scale).to(dtype)
    return q, pages, table, lens, starts


def _assert_twin(out, ref, dtype):
    assert out.dtype == ref.dtype and not out[2].any()  # an empty sequence gives zeros
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:  # the output rounded to 16 bits, p rounded before p @ V (the bf16 kernel's tests' tolerance)
        scale = ref.float().abs().amax()
        torch.testing.assert_close(out.float() / scale, ref.float() / scale, atol=2e-2, rtol=2e-2)


VARIANTS = list(itertools.product([1, 2], [False, True], [False, True]))  # v_split, shared_cvt, f16_dots


@pytest.mark.parametrize("v_split,shared_cvt,f16_dots", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("v,rope,ps,block_n,splits", [
    (64, 16, 16, 16, 3),  # tiles inside a page, 3 splits
    (64, 16, 8, 16, 1),  # pages smaller than the tile: rows look their page up; one split (direct output)
    (48, 0, 16, 32, None),  # v_dim not a power of two (masked value columns), no rope, 32-token tiles over pages
])
def test_fp8_decode_variants_match_twin(interp, v_split, shared_cvt, f16_dots, dtype, v, rope, ps, block_n, splits):
    gen = torch.Generator().manual_seed(v + ps + block_n)
    q, pages, table, lens, starts = _variant_case(gen, v, rope, ps, dtype)
    cfg = MLADecodeFP8Config(16, block_n, 4, 2, v_split=v_split, shared_cvt=shared_cvt, f16_dots=f16_dots)
    for st in (None, starts):
        ref = mla_decode_fp8_ref(q, pages, table, lens, 0.3, v, st)
        out = mla_decode_fp8_triton(q, pages, table, lens, 0.3, v, num_splits=splits, config=cfg, starts=st)
        _assert_twin(out, ref, dtype)


@pytest.mark.parametrize("v_split,shared_cvt", [(1, False), (2, True)])
@pytest.mark.parametrize("q_scale,rows", [
    (3e5, None),  # q overflows fp16 (65504) unscaled
    (1e-6, None),  # q is subnormal in fp16 unscaled
    (0.5, 1e-5),  # tiny rows: p * s_c (~1e-7) would be subnormal in fp16 without the value-scale unit
    (0.5, (-3, 3)),  # row scales spanning 1e-3..1e3
])
def test_fp8_f16_dots_outside_fp16_range(interp, v_split, shared_cvt, q_scale, rows):
    """fp16 dots with a bf16 q or cache rows far outside fp16's range: q's per-head power-of-two scaling and p's
    value-scale unit (the largest row scale so far) keep them as exact as in range."""
    gen = torch.Generator().manual_seed(11)
    if isinstance(rows, tuple):
        rows = 10.0 ** torch.empty(16 * 16).uniform_(*rows, generator=gen)
    elif rows is not None:
        rows = torch.full((16 * 16,), rows)
    q, pages, table, lens, starts = _variant_case(gen, 64, 16, 16, torch.bfloat16, q_scale, rows)
    cfg = MLADecodeFP8Config(16, 16, 4, 2, v_split=v_split, shared_cvt=shared_cvt, f16_dots=True)
    scale = 0.3 / q_scale / (1.0 if rows is None else float(rows.max()))  # scores of order 1
    ref = mla_decode_fp8_ref(q, pages, table, lens, scale, 64, starts)
    out = mla_decode_fp8_triton(q, pages, table, lens, scale, 64, num_splits=2, config=cfg, starts=starts)
    assert torch.isfinite(out).all()
    _assert_twin(out, ref, torch.bfloat16)


def _bench_module():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "bench_mla_decode_kernel.py")
    spec = importlib.util.spec_from_file_location("bench_mla_decode_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("H", [5, 20])
def test_fp8_default_and_sweep_configs_match_twin(interp, H):
    """Every config the default table or the benchmark's FP8 sweep can pick (heads per tile clipped to H's), on a
    case with odd lengths, page boundaries, left padding and the split count each config's plan picks."""
    sweep = _bench_module().fp8_sweep_configs(128 if H > 16 else 16)
    assert 0 < len(sweep) <= 12 and all(isinstance(c, MLADecodeFP8Config) for c in sweep)
    assert sweep[0] == default_fp8_config(128 if H > 16 else 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(H)
    q, pages, table, lens, starts = _variant_case(gen, 64, 16, 64, torch.bfloat16)
    q = q.repeat(1, 4, 1)[:, :H]
    ref = mla_decode_fp8_ref(q, pages, table, lens, 0.3, 64, starts)
    for cfg in [default_fp8_config(H, torch.bfloat16), *sweep]:
        out = mla_decode_fp8_triton(q, pages, table, lens, 0.3, 64, config=cfg, starts=starts)
        _assert_twin(out, ref, torch.bfloat16)


def test_fp8_default_config_table():
    for H, (block_h, block_n, warps) in {1: (16, 32, 4), 16: (16, 32, 4), 32: (32, 32, 8), 128: (64, 32, 8)}.items():
        cfg = default_fp8_config(H, torch.bfloat16)
        assert isinstance(cfg, MLADecodeFP8Config) and isinstance(cfg, MLADecodeConfig)
        assert (cfg.block_h, cfg.block_n, cfg.num_warps) == (block_h, block_n, warps)
        assert cfg.f16_dots and cfg.shared_cvt and cfg.v_split == 2
        assert default_fp8_config(H, torch.float16) == cfg
    fp32 = default_fp8_config(16, torch.float32)  # the bf16 kernel's fp32 tiles, no variants
    assert vars(fp32) == dict(vars(default_config(16, torch.float32)), v_split=1, shared_cvt=False, f16_dots=False)


def test_fp8_decode_takes_a_plain_tile_config(interp):
    """A plain ``MLADecodeConfig`` sets the tiles and leaves every variant off."""
    gen = torch.Generator().manual_seed(3)
    q, pages, table, lens, starts = _variant_case(gen, 32, 16, 16, torch.float32)
    out = mla_decode_fp8_triton(q, pages, table, lens, 0.3, 32, config=MLADecodeConfig(16, 16, 4, 2), starts=starts)
    _assert_twin(out, mla_decode_fp8_ref(q, pages, table, lens, 0.3, 32, starts), torch.float32)


def test_fp8_decode_dispatch_and_refusals(monkeypatch, interp):
    gen = torch.Generator().manual_seed(5)
    pages = _pool(gen, 4, 16, 32, 16)
    q = torch.randn(2, 4, 48, generator=gen)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32)
    want = mla_decode_fp8_ref(q, pages, table, lens, 0.25, 32)
    torch.testing.assert_close(mla_decode_fp8(q, pages, table, lens, 0.25, 32), want, atol=2e-6, rtol=2e-6)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    torch.testing.assert_close(mla_decode_fp8(q, pages, table, lens, 0.25, 32), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mla_decode_fp8(q, dequantise_rows(pages, 32, 48), table, lens, 0.25, 32)
    with pytest.raises(ValueError, match="packed"):
        mla_decode_fp8(q[..., :40], pages, table, lens, 0.25, 32)


# ----------------------------------------------------------------------------------------------------------------
# the cache in a model


def _fused(**kw):
    model = tiny_deepseek("deepseek_v2", attn="vllm_mla", **kw)
    mla_fuser.fuse(model)
    return model


def _teacher_forced(model, cache, ids, mask, tokens):
    """Logits of the prompt's last position and of each forced decode step ``[B, steps + 1, vocab]``."""
    with torch.no_grad():
        out = [model(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True).logits[:, -1]]
        for i in range(tokens.shape[1]):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out.append(model(input_ids=tokens[:, i:i + 1], attention_mask=mask, **{KW: cache},
                             use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def test_default_cache_dtype_is_unchanged_and_bad_dtypes_are_refused():
    model = _fused()
    ids, mask = left_padded_prompts([5, 3], seed=2)
    cache = PagedLatentCache(model, max_cache_tokens=256)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{KW: cache}, use_cache=True)
    assert cache.latent_dtype is None and cache.paged[0].pool.pages.dtype == torch.float32
    assert cache.paged[0].pool.width == 16 + 4
    for bad in (torch.float8_e5m2, torch.int8):
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            PagedLatentCache(model, dtype=bad)


def test_fp8_cache_logits_and_tokens_close_to_fp32_cache():
    model = _fused()
    ids, mask = left_padded_prompts([9, 6, 12, 4], seed=4)
    steps = 24
    with torch.no_grad():
        ref_out = model.generate(ids, attention_mask=mask, **{KW: PagedLatentCache(model, max_cache_tokens=256)},
                                 max_new_tokens=steps, do_sample=False)
    forced = ref_out[:, ids.shape[1]:-1]  # the fp32 run's tokens, fed to both caches
    fp8 = PagedLatentCache(model, max_cache_tokens=256, dtype=FP8_DTYPE)
    ref = _teacher_forced(model, PagedLatentCache(model, max_cache_tokens=256), ids, mask, forced)
    got = _teacher_forced(model, fp8, ids, mask, forced)
    layer = fp8.paged[0]
    assert layer.pool.pages.dtype == FP8_DTYPE and layer.pool.width == packed_width(20)
    assert layer.keys.dtype == torch.float32 and layer.keys.shape[-1] == 16  # read back dequantised
    # the prompt's own prefill attends its unquantised latent: the first logits are equal
    torch.testing.assert_close(got[:, 0], ref[:, 0], atol=1e-5, rtol=1e-5)
    delta = (got - ref).norm(dim=-1) / ref.norm(dim=-1)  # [B, steps]
    assert delta.max() <= 2**-4, delta.max()
    change = (got - ref).abs().amax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    same = got.argmax(-1) == ref.argmax(-1)
    assert same[margin > 2 * change].all()  # wherever a flip is impossible, there is none
    agreement = same.float().mean().item()
    print(f"FP8 cache vs fp32 cache: max relative logit change {delta.max():.4f} (mean {delta.mean():.4f}), "
          f"teacher-forced next-token agreement {agreement:.3f} over {same.numel()} steps")
    assert agreement >= 0.75
    # free-running greedy tokens
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **{KW: PagedLatentCache(model, dtype=FP8_DTYPE)},
                             max_new_tokens=steps, do_sample=False)
    free = (out[:, ids.shape[1]:] == ref_out[:, ids.shape[1]:]).float().mean().item()
    print(f"free-running greedy token agreement {free:.3f}")


def test_fp8_static_cache_beam_search_equals_fp8_growing_cache():
    """Beam reorders move whole packed rows (values and scales): in place on a static cache, by copies on a growing
    one.  Both hold the same quantised rows, so the beams are the same."""
    model = _fused()
    ids, mask = left_padded_prompts([3, 5], seed=11)
    kw = dict(attention_mask=mask, max_new_tokens=14, num_beams=2, do_sample=False)
    static = PagedLatentCache(model, page_size=4, static=True, max_seq_len=24, max_cache_tokens=4 * 24,
                              dtype=FP8_DTYPE)
    with torch.no_grad():
        a = model.generate(ids, **{KW: static}, **kw)
        b = model.generate(ids, **{KW: PagedLatentCache(model, page_size=4, dtype=FP8_DTYPE)}, **kw)
    assert torch.equal(a, b)
    assert static.paged[0].pool.pages.dtype == FP8_DTYPE


def test_fp8_cache_crop_select_and_padding_moves_keep_rows():
    model = _fused()
    ids, mask = left_padded_prompts([6, 6], seed=6)
    cache = PagedLatentCache(model, page_size=4, static=True, max_seq_len=16, max_cache_tokens=32, dtype=FP8_DTYPE)
    with torch.no_grad():
        model(input_ids=ids, **{KW: cache}, use_cache=True)
    layer = cache.paged[0]
    before = layer.gather().clone()
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    cache.move_padding_left(right)
    cache.restore_padding()
    assert torch.equal(layer.gather(), before)
    cache.crop(-2)
    assert torch.equal(layer.gather(), before[:, :4])
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(layer.gather(), before[[1, 1], :4])


def test_fp8_static_cache_through_the_graphed_generate_path():
    """What generate() does on CUDA (decode steps through DecodeGraph, mask-free with left padding in the cache), run
    eagerly on CPU over an FP8 static cache: the same tokens as plain generate over an FP8 cache."""
    from mla_fuser.plans import model_state
    from mla_fuser.runtime.generate import _left_padding, generate_graphed

    model = _fused()
    ids, mask = left_padded_prompts([3, 8, 5], seed=9)
    cache = PagedLatentCache.static_for(model, 3, 8 + 13, page_size=4, dtype=FP8_DTYPE)
    cache.set_left_padding(_left_padding(mask))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = generate_graphed(model, model.generate, cache, (ids,), dict(kw, **{KW: cache}))
    assert model_state(model).graphed_steps == 11
    with torch.no_grad():
        plain = model.generate(ids, **{KW: PagedLatentCache(model, dtype=FP8_DTYPE)}, **kw)
    assert torch.equal(out, plain)
