"""Block-FP8 (DeepSeek-format) linears: kernels against their torch references, recognition by structure (and the
declines, with reasons), fused tiny DeepSeek-V2/V3 models against a reference holding the same weights dequantised
in fp32, the checkpoint format kept through ``state_dict``/``save_pretrained``, and FP8 on demand on a CPU.

FP8 modules are made by Transformers' own ``replace_with_fp8_linear`` and filled with weights quantised here (block
sizes dividing the dims and not).  Kernels: both Triton kernels run under ``TRITON_INTERPRET=1`` (Triton 3.9's
interpreter loads, converts and multiplies float8); the model tests run the CPU path (the torch reference).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mla_fuser
from mla_fuser.fusers import FP8LinearFuser
from mla_fuser.kernels.fp8 import (block_fp8_linear_act_quant_ref, block_fp8_linear_ref, dequantize_block_fp8,
                                   explain_block_fp8, quantize_block_fp8)
from mla_fuser.kernels.dispatch import cdiv
from mla_fuser.kernels.fp8 import linear as fp8_linear
from mla_fuser.kernels.tma import HAS_HOST_TENSOR_DESCRIPTORS
from mla_fuser.kernels.fp8.quant import quantize_token_groups_ref
from mla_fuser.rewrite import STACKED_ATTR

from conftest import tiny_deepseek

transformers = pytest.importorskip("transformers")
from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import FP8Linear, replace_with_fp8_linear  # noqa: E402

SKIP = ["lm_head", "experts"]  # the output head stays as checkpoints keep it; expert stacks have no FP8 path yet


# ----------------------------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize("m,n,k,block", [(3, 40, 72, (16, 32)), (5, 64, 128, (32, 64)), (1, 100, 96, None),
                                         (17, 48, 64, (16, 16))])
@pytest.mark.parametrize("splits", [1, 2])
def test_weight_only_kernel_matches_reference(monkeypatch, m, n, k, block, splits):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(m * n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    bn, bk = block or (0, 0)
    out = fp8_linear.w8_linear_triton(x, weight, scale, bias, bn, bk, splits=splits, tiles=(16, 16, 16))
    ref = block_fp8_linear_ref(x, weight, scale, bn, bk, bias)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


W8 = fp8_linear.W8Config
W8_VARIANTS = {  # tiny tiles of each kernel variant: tensor-core MMA (rows padded to 16), GEMV for 1 and 4 rows
    "mma": W8(16, 16, 16, fill=0), "mma_k32": W8(16, 32, 32, fill=0),
    "gemv1": W8(1, 16, 16, fill=0, dot=False), "gemv4": W8(4, 8, 16, fill=0, dot=False),
}


@pytest.mark.parametrize("m,n,k,block", [(1, 40, 72, (16, 32)), (3, 100, 96, None), (17, 48, 80, (32, 32))])
@pytest.mark.parametrize("variant", list(W8_VARIANTS))
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_only_variants_match_reference(monkeypatch, m, n, k, block, variant, splits, with_bias):
    """Every kernel variant, with and without split-K (the reduction kernel adds the bias and casts), K a
    multiple of the tile or not (72 = 4.5 tiles of 16, 80 = 2.5 of 32), one token and several."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(m + n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen) if with_bias else None
    bn, bk = block or (0, 0)
    out = fp8_linear.w8_linear_triton(x, weight, scale, bias, bn, bk, splits=splits, config=W8_VARIANTS[variant])
    ref = block_fp8_linear_ref(x, weight, scale, bn, bk, bias)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["mma", "gemv1"])
def test_weight_only_half_precision_split_k_is_deterministic(monkeypatch, dtype, variant):
    """Half-precision activations: the fp32 result rounded once (as the reference), split-K partials summed in
    split order (the same bits every run)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    weight, scale = quantize_block_fp8(torch.randn(48, 96, generator=gen), (16, 32))
    x, bias = torch.randn(2, 96, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    cfg = W8_VARIANTS[variant]
    out = fp8_linear.w8_linear_triton(x, weight, scale, bias, 16, 32, splits=3, config=cfg)
    again = fp8_linear.w8_linear_triton(x, weight, scale, bias, 16, 32, splits=3, config=cfg)
    ref = block_fp8_linear_ref(x, weight, scale, 16, 32, bias)
    assert out.dtype == dtype and torch.equal(out, again)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2), (out.float() - ref.float()).abs().max()


ON_GPU = torch.cuda.is_available()
needs_tma = pytest.mark.skipif(not HAS_HOST_TENSOR_DESCRIPTORS,
                               reason="this Triton builds no tensor descriptors on the host (3.4 on)")
DEVICE = "cuda" if ON_GPU else "cpu"


def _fixup_case(m, n, k, block, with_bias, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + m + n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return [t.to(DEVICE) if t is not None else None for t in (x, weight, scale, bias)]


@pytest.mark.parametrize("m,n,k,block,splits", [(3, 40, 72, (16, 32), 2), (17, 48, 80, (32, 32), 3),
                                                (2, 100, 96, None, 4), (16, 64, 256, (32, 32), 8)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["mma", "gemv4"])
def test_split_k_fixup_equals_the_reduction(monkeypatch, m, n, k, block, splits, with_bias, dtype, variant):
    """``MLA_FUSER_SPLITK_FIXUP`` on: each output tile's last split sums the partials in split order, so the result is
    the reduction kernel's (``MLA_FUSER_SPLITK_FIXUP=0``) bit for bit, with one launch; the tickets are back at 0
    after every call, so the next call (and a replay) starts clean.  Compiled on a GPU, interpreted elsewhere."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if dtype == torch.bfloat16 and not ON_GPU and variant == "mma":
        pytest.skip("the interpreter's bf16 dots are upcast; the fp32 case covers the same code")
    x, weight, scale, bias = _fixup_case(m, n, k, block, with_bias, dtype)
    bn, bk = block or (0, 0)
    cfg = W8_VARIANTS[variant]
    launches = []
    real = fp8_linear._launcher
    monkeypatch.setattr(fp8_linear, "_launcher", lambda kernel, *a: launches.append(kernel) or real(kernel, *a))
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", "0")
    reduced = fp8_linear.w8_linear_triton(x, weight, scale, bias, bn, bk, splits=splits, config=cfg)
    assert launches == [fp8_linear.w8_gemm_kernel, fp8_linear.splitk_reduce_kernel]
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", "1")
    for _ in range(3):  # (the tickets reset themselves)
        launches.clear()
        fixed = fp8_linear.w8_linear_triton(x, weight, scale, bias, bn, bk, splits=splits, config=cfg)
        assert len(launches) == 1 and launches[0] is fp8_linear.w8_gemm_kernel
        assert fixed.dtype == reduced.dtype and torch.equal(fixed, reduced)
        assert not fp8_linear.split_ticket_ring(x.device).any()
    ref = block_fp8_linear_ref(x, weight, scale, bn, bk, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # relative to the terms' magnitudes (|x| @ |W|^T): a sum of k terms in another order differs by that much, however
    # small the result (fp32 order differences vary with the CPU's vector width)
    dense = block_fp8_linear_ref(torch.eye(k, device=x.device), weight, scale, bn, bk).t()  # the dequantised weight
    magnitude = x.float().abs() @ dense.float().abs().t()
    assert ((fixed.float() - ref.float()).abs() <= tol * (magnitude + ref.float().abs())).all()


@pytest.mark.parametrize("m,n,k,block", [(3, 100, 96, (32, 32)), (17, 64, 80, (64, 32)), (5, 128, 256, (128, 64))])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fixup", ["0", "1"])
def test_weight_only_gemm_w8a8_variant_matches_its_reference(monkeypatch, m, n, k, block, splits, dtype, fixup):
    """``W8Config(act_quant=True)``: activations quantised in the kernel per token and ``bk`` features, e4m3 products
    on FP8 tensor cores, transposed; equal (to half-precision rounding) to ``block_fp8_linear_act_quant_ref`` and
    measurably not the weight-only math, with K split or not (summed by the fix-up or the reduction), K not a
    multiple of ``bk`` (80 = 2.5 groups of 32), rows past one tile (17), a bias.  Compiled on a GPU, interpreted
    elsewhere."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", fixup)
    gen = torch.Generator().manual_seed(m + n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 0, k)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    cfg = W8(16, 64, block[1], warps=4, stages=2, fill=0, act_quant=True)
    dev = [t.to(DEVICE) for t in (x, weight, scale, bias)]
    out = fp8_linear.w8_linear_triton(*dev, *block, splits=splits, config=cfg).cpu()
    ref = block_fp8_linear_act_quant_ref(x, weight, scale, *block, bias)
    weight_only = block_fp8_linear_ref(x, weight, scale, *block, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    scale_ref = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2 * scale_ref
    to_ref = (out.float() - ref.float()).abs().mean().item()
    assert to_ref * 2 <= (out.float() - weight_only.float()).abs().mean().item()


@needs_tma
@pytest.mark.parametrize("variant", ["mma_k32", "gemv4", "w8a8"])
@pytest.mark.parametrize("m,n,k,block,splits", [(3, 40, 96, (16, 32), 1), (17, 100, 96, (32, 32), 2),
                                                (5, 64, 80, (32, 32), 3)])
@pytest.mark.parametrize("fixup", ["0", "1"])
def test_weight_only_gemm_weight_tiles_by_tma_equal_its_pointer_loads(monkeypatch, variant, m, n, k, block, splits,
                                                                      fixup):
    """``W8Config.tma``: the weight tiles by TMA are the pointer loads' tiles (rows past N and a K past the tensor
    read as zeros), for the MMA, the GEMV and the W8A8 variants, K split or not, summed by the fix-up or the
    reduction: the outputs are equal, bit for bit."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", fixup)
    gen = torch.Generator().manual_seed(m * n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    dtype = torch.bfloat16 if variant == "w8a8" else torch.float32
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 0, k)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    cfg = W8(16, 64, block[1], warps=4, stages=2, fill=0, act_quant=True) if variant == "w8a8" else \
        W8_VARIANTS[variant]
    dev = [t.to(DEVICE) for t in (x, weight, scale, bias)]
    asked = []
    real = fp8_linear.tma_ready
    monkeypatch.setattr(fp8_linear, "tma_ready", lambda *a: asked.append(real(*a)) or asked[-1])
    by_pointers = fp8_linear.w8_linear_triton(*dev, *block, splits=splits, config=cfg).cpu()
    assert asked == []
    by_tma = fp8_linear.w8_linear_triton(*dev, *block, splits=splits, config=cfg._replace(tma=True)).cpu()
    assert asked == [True]
    assert torch.equal(by_tma, by_pointers)


def test_weight_only_gemm_w8a8_variant_refuses_what_it_cannot_run():
    cfg = W8(16, 64, 128, fill=0, act_quant=True)
    for block_n, block_k, dtype in ((128, 128, torch.float32), (0, 0, torch.bfloat16), (16, 16, torch.bfloat16)):
        with pytest.raises(ValueError, match="W8A8"):
            fp8_linear.w8_plan(4, 64, 256, block_n, block_k, dtype, False, False, None,
                               cfg._replace(block_k=block_k or 128))


def test_split_k_fixup_only_where_k_is_split_and_the_tiles_fit():
    plan = fp8_linear.w8_plan(16, 3072, 2048, 128, 128, torch.bfloat16, True, False, None, W8(16, 32, 128, fill=0),
                              None, 4, True)
    assert plan.fixup and plan.meta["HAS_BIAS"] and plan.splits == 4
    one = fp8_linear.w8_plan(16, 3072, 2048, 128, 128, torch.bfloat16, True, False, None, W8(16, 32, 128, fill=0),
                             None, 1, True)
    assert not one.fixup and one.meta["HAS_BIAS"]
    off = fp8_linear.w8_plan(16, 3072, 2048, 128, 128, torch.bfloat16, True, False, None, W8(16, 32, 128, fill=0),
                             None, 4, False)
    assert not off.fixup and not off.meta["HAS_BIAS"]  # (the reduction adds it)
    many = fp8_linear.w8_plan(16, 16 * (fp8_linear.SPLIT_TICKETS + 1), 256, 128, 128, torch.bfloat16, False, False,
                              None, W8(16, 16, 128, fill=0), None, 2, True)
    assert not many.fixup  # (more output tiles than one stream's tickets)


def test_split_k_fixup_tickets_come_from_a_zeroed_ring_never_made_while_capturing(monkeypatch):
    """Each fix-up GEMM takes the next slice of the device's ring (two GEMMs issued one after the other never share
    counters); the ring is zeroed when made, and if the first fix-up GEMM on a device comes while a CUDA graph is
    captured (its zeroing would only be recorded in that graph), the reduction runs instead."""
    device = torch.device("cpu")
    monkeypatch.setattr(fp8_linear, "_TICKETS", {})
    monkeypatch.setattr(fp8_linear, "_NEXT_SLICE", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", "1")
    x, weight, scale, bias = [t.cpu() if t is not None else None for t in _fixup_case(3, 40, 72, (16, 32), True,
                                                                                       torch.float32)]
    launches = []
    real = fp8_linear._launcher
    monkeypatch.setattr(fp8_linear, "_launcher", lambda kernel, *a: launches.append(kernel) or real(kernel, *a))
    with monkeypatch.context() as capture:
        capture.setattr(fp8_linear, "_capturing", lambda device: True)
        assert not fp8_linear.split_tickets_ready(device)
        during = fp8_linear.w8_linear_triton(x, weight, scale, bias, 16, 32, splits=2, config=W8_VARIANTS["mma"])
        assert launches == [fp8_linear.w8_gemm_kernel, fp8_linear.splitk_reduce_kernel]
        assert fp8_linear.split_ticket_ring(device) is None
    launches.clear()
    after = fp8_linear.w8_linear_triton(x, weight, scale, bias, 16, 32, splits=2, config=W8_VARIANTS["mma"])
    assert launches == [fp8_linear.w8_gemm_kernel] and torch.equal(during, after)
    ring = fp8_linear.split_ticket_ring(device)
    assert ring.shape == (fp8_linear.SPLIT_TICKET_SLICES, fp8_linear.SPLIT_TICKETS) and not ring.any()
    first, second = fp8_linear.split_tickets(device), fp8_linear.split_tickets(device)  # (slices 1 and 2)
    assert first.data_ptr() == ring[1].data_ptr() and second.data_ptr() == ring[2].data_ptr()
    for _ in range(fp8_linear.SPLIT_TICKET_SLICES - 3):
        fp8_linear.split_tickets(device)
    assert fp8_linear.split_tickets(device).data_ptr() == ring[0].data_ptr()  # (the ring wraps)
    with monkeypatch.context() as capture:  # made before the capture: the capture uses it
        capture.setattr(fp8_linear, "_capturing", lambda device: True)
        assert fp8_linear.split_tickets_ready(device)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_split_k_fixup_in_graphs_captured_one_after_another(monkeypatch):
    """Two graphs captured one after the other (each its own ring slices), replayed in either order with eager fix-up
    GEMMs between them: always the reduction's bits."""
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", "1")
    cfg = W8(16, 32, 128, fill=0)
    cases = [_fixup_case(16, 3072, 2048, (128, 128), True, torch.bfloat16, seed=s) for s in (2, 3)]
    with monkeypatch.context() as off:
        off.setenv("MLA_FUSER_SPLITK_FIXUP", "0")
        wants = [fp8_linear.w8_linear_triton(*c, 128, 128, splits=8, config=cfg) for c in cases]
    for c in cases:  # (warm-up: compiles, makes the ring outside any capture)
        fp8_linear.w8_linear_triton(*c, 128, 128, splits=8, config=cfg)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for c in cases:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fp8_linear.w8_linear_triton(*c, 128, 128, splits=8, config=cfg))
        graphs.append(graph)
    for order in ((1, 0), (0, 1), (1, 1, 0)):
        for i in order:
            outs[i].zero_()
            graphs[i].replay()
            eager = fp8_linear.w8_linear_triton(*cases[1 - i], 128, 128, splits=8, config=cfg)
            torch.cuda.synchronize()
            assert torch.equal(outs[i], wants[i]) and torch.equal(eager, wants[1 - i])
    assert not fp8_linear.split_ticket_ring(outs[0].device).any()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and streams")
def test_split_k_fixup_in_cuda_graphs_and_on_two_streams(monkeypatch):
    """Replays of a captured fix-up GEMM keep giving the reduction's bits (the tickets reset inside the graph), and
    two fix-up GEMMs running at once on two streams each get their own slice of tickets."""
    monkeypatch.setenv("MLA_FUSER_SPLITK_FIXUP", "1")
    x, weight, scale, bias = _fixup_case(16, 3072, 2048, (128, 128), True, torch.bfloat16)
    x2, weight2, scale2, _ = _fixup_case(16, 2048, 2048, (128, 128), False, torch.bfloat16, seed=1)
    cfg = W8(16, 32, 128, fill=0)
    with monkeypatch.context() as off:
        off.setenv("MLA_FUSER_SPLITK_FIXUP", "0")
        want = fp8_linear.w8_linear_triton(x, weight, scale, bias, 128, 128, splits=8, config=cfg)
        want2 = fp8_linear.w8_linear_triton(x2, weight2, scale2, None, 128, 128, splits=8, config=cfg)
    side = torch.cuda.Stream()
    for _ in range(2):  # warm-up (compiles, the ring made outside the capture)
        fp8_linear.w8_linear_triton(x, weight, scale, bias, 128, 128, splits=8, config=cfg)
        with torch.cuda.stream(side):
            fp8_linear.w8_linear_triton(x2, weight2, scale2, None, 128, 128, splits=8, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        out = fp8_linear.w8_linear_triton(x, weight, scale, bias, 128, 128, splits=8, config=cfg)
        with torch.cuda.stream(side):
            out2 = fp8_linear.w8_linear_triton(x2, weight2, scale2, None, 128, 128, splits=8, config=cfg)
        main.wait_stream(side)
    for _ in range(20):
        out.zero_()
        out2.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(out2, want2)


GEMV = fp8_linear.GEMVConfig


@pytest.mark.parametrize("m,n,k,block,config", [
    (1, 40, 72, (16, 32), GEMV(8, 32)),     # K = 2.25 tiles of 32 (masked), a tile spans one scale column
    (4, 64, 128, (32, 64), GEMV(16, 128)),  # one tile spans two scale columns, 4 tokens
    (3, 100, 96, None, GEMV(8, 64)),        # per-tensor scale, N not a multiple of the row tile
    (2, 48, 64, (12, 16), GEMV(8, 32)),     # bn 12: the row tile is capped to 4 (12's power-of-two divisor)
    (1, 40, 80, (16, 32), GEMV()),          # default tiles (512 capped to K's power of two, 128)
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_gemv_matches_reference(monkeypatch, m, n, k, block, config, with_bias):
    """The decode GEMV (scales folded into the activations, K tiles spanning several scale columns or part of one),
    rows a tile does not fill, bias or not."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(m + n + k)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen) if with_bias else None
    bn, bk = block or (0, 0)
    out = fp8_linear.w8_gemv_triton(x, weight, scale, bias, bn, bk, config=config)
    ref = block_fp8_linear_ref(x, weight, scale, bn, bk, bias)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gemv_half_precision(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(5)
    weight, scale = quantize_block_fp8(torch.randn(48, 256, generator=gen), (16, 32))
    x, bias = torch.randn(3, 256, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    out = fp8_linear.w8_gemv_triton(x, weight, scale, bias, 16, 32, config=GEMV(8, 128))
    ref = block_fp8_linear_ref(x, weight, scale, 16, 32, bias)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2), (out.float() - ref.float()).abs().max()


def test_decode_sizes_take_the_gemv(monkeypatch):
    """Up to GEMV_MAX_TOKENS tokens the dispatch runs the GEMV (one launch), above them the split-K weight-only GEMM;
    a quantisation block whose rows no tile of GEMV_MIN_BLOCK_N divides keeps the GEMM at every size."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    calls = []
    for name in ("w8_gemv_triton", "w8_linear_triton"):
        real = getattr(fp8_linear, name)
        monkeypatch.setattr(fp8_linear, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    limit = fp8_linear.GEMV_MAX_TOKENS
    for block, tokens, want in (((16, 16), limit, "w8_gemv_triton"), ((16, 16), limit + 1, "w8_linear_triton"),
                                ((6, 16), 1, "w8_linear_triton")):
        weight, scale = quantize_block_fp8(torch.randn(24, 48), block)
        x = torch.randn(tokens, 48)
        calls.clear()
        out = mla_fuser.kernels.fp8.block_fp8_linear(x, weight, scale, block)
        assert calls == [want], (block, tokens, calls)
        assert torch.allclose(out, block_fp8_linear_ref(x, weight, scale, *block), atol=1e-5)
    assert fp8_linear.gemv_block_n(128, 8) == 8 and fp8_linear.gemv_block_n(0, 8) == 8
    assert fp8_linear.gemv_block_n(12, 8) == 4 and fp8_linear.gemv_block_n(6, 8) == 0
    with pytest.raises(ValueError, match="no GEMV row tile"):
        fp8_linear.gemv_plan(1, 24, 48, 6, False)


def test_launch_plans_from_the_tables(monkeypatch, request):
    """Default tiles come from the tables by token count (``block_k`` capped to the quantisation block's
    power-of-two divisor), split-K fills the SMs without a split shorter than two K tiles or past K, and a plan
    is computed once per shape."""
    monkeypatch.setattr(fp8_linear, "_sm_count", lambda index: 132)
    fp8_linear.w8_plan.cache_clear()
    request.addfinalizer(fp8_linear.w8_plan.cache_clear)  # (no plan sized by the fake SM count outlives the test)
    for table in (fp8_linear.W8_CONFIGS, fp8_linear.TC_CONFIGS):
        assert table[-1][:2] == (None, None)
    assert fp8_linear.table_config(((4, None, "a"), (None, 100, "b"), (None, None, "c")), 8, 10) == "b"
    assert fp8_linear.table_config(((4, None, "a"), (None, 100, "b"), (None, None, "c")), 8, 1000) == "c"
    args = (torch.bfloat16, False, False, 0)
    plan = fp8_linear.w8_plan(1, 3072, 2048, 128, 128, *args)
    cfg = fp8_linear.table_config(fp8_linear.W8_CONFIGS, 1, 3072 * 2048)
    tiles, k_tiles = cdiv(3072, cfg.block_n), cdiv(2048, plan.config.block_k)
    want = max(1, min(cdiv(cfg.fill * 132, tiles), k_tiles // fp8_linear.MIN_K_TILES_PER_SPLIT,
                      fp8_linear.MAX_SPLITS)) if cfg.fill else 1
    assert plan.splits == want and plan.grid == (1, tiles, want)
    assert fp8_linear.w8_plan(1, 3072, 2048, 128, 128, *args) is plan  # cached
    assert fp8_linear.w8_plan(1, 3072, 2048, 128, 48, *args).config.block_k == 16  # 48 = 3 * 16
    assert fp8_linear.w8_plan(1, 3072, 2048, 128, 48, *args[:3], None).splits == 1  # off CUDA: no split
    # more splits than K tiles: one tile each, none past K
    plan = fp8_linear.w8_plan(1, 40, 72, 16, 32, *args, None, (16, 16, 16), 8)
    assert plan.splits == 5 and plan.k_per_split == 16 and not plan.meta["EVEN_K"]
    assert fp8_linear.w8_plan(1, 40, 72, 16, 32, torch.bfloat16, True, False, 0, None, None, 1).meta["HAS_BIAS"]
    assert not fp8_linear.w8_plan(1, 40, 72, 16, 32, torch.bfloat16, True, False, 0, None, None, 2).meta["HAS_BIAS"]
    with pytest.raises(ValueError, match="must divide"):
        fp8_linear.w8_plan(1, 40, 96, 16, 48, *args, None, (16, 16, 32))
    weight, scale = quantize_block_fp8(torch.randn(40, 72), (16, 32))
    assert fp8_linear.w8_linear_triton(torch.randn(0, 72), weight, scale, None, 16, 32).shape == (0, 40)
    tc = fp8_linear.tc_plan(8192, 7168, 18432, 128, 128, False, False)
    assert tc.config == fp8_linear.table_config(fp8_linear.TC_CONFIGS, 8192, 7168 * 18432)
    assert tc.meta["SCALAR_B"] == (128 % tc.config.block_n == 0)


@pytest.mark.parametrize("m,n,k,block,tiles", [(3, 40, 96, (16, 32), (16, 16, 16)), (2, 40, 80, (16, 32), (16, 16, 32)),
                                               (20, 64, 128, (32, 64), None), (1, 40, 80, (16, 32), (16, 32, 32)),
                                               (5, 72, 80, (32, 16), (16, 64, 16))])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_tensor_core_kernel_matches_its_reference(monkeypatch, m, n, k, block, tiles, with_bias):
    """Weight scales per tile (``BLOCK_N`` divides ``bn``) or per column (wider tiles), K a multiple of the tile
    or not (80), one token, the table's tiles (``tiles=None``), with and without bias."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(k + m)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen) if with_bias else None
    q, s = fp8_linear.quantize_token_groups(x, block[1])
    q_ref, s_ref = quantize_token_groups_ref(x, block[1])
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
    out = fp8_linear.fp8_linear_triton(x, weight, scale, bias, *block, tiles=tiles)
    ref = block_fp8_linear_act_quant_ref(x, weight, scale, *block, bias)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-5), (out - ref).abs().max()
    # activation quantisation is what separates it from the weight-only reference: close, not equal
    weight_only = block_fp8_linear_ref(x, weight, scale, *block, bias)
    assert not torch.allclose(out, weight_only, atol=1e-4)
    assert (out - weight_only).norm() < 0.1 * weight_only.norm()


@needs_tma
@pytest.mark.parametrize("m,n,k,block,tiles", [(3, 40, 96, (16, 32), (16, 16, 16)),
                                               (20, 40, 80, (16, 32), (16, 16, 32)),
                                               (37, 72, 128, (32, 64), (32, 64, 64)),
                                               (5, 72, 80, (32, 16), (16, 64, 16))])
def test_fp8_tensor_core_kernel_by_tma_equals_its_pointer_loads(monkeypatch, m, n, k, block, tiles):
    """Tiles fed by tensor descriptors (``TCConfig.tma``): rows past M, columns past N and a K that is no multiple of
    the tile read as zeros, so the product is the pointer-load kernel's, bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(k * m)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block)
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen)
    q, _ = fp8_linear.quantize_token_groups(x, block[1])
    assert fp8_linear.tma_ready(x, q, weight)
    launches = []
    monkeypatch.setattr(fp8_linear, "_launcher", lambda *a, real=fp8_linear._launcher: (
        lambda *args, **kw: launches.append(kw["TMA"]) or real(*a)(*args, **kw)))
    cfg = fp8_linear.TCConfig(*tiles, group_m=2, warps=4, stages=2)
    by_pointers = fp8_linear.fp8_linear_triton(x, weight, scale, bias, *block, config=cfg)
    by_tma = fp8_linear.fp8_linear_triton(x, weight, scale, bias, *block, config=cfg._replace(tma=True))
    assert launches == [False, True]
    assert torch.equal(by_tma, by_pointers)
    ref = block_fp8_linear_act_quant_ref(x, weight, scale, *block, bias)
    assert torch.allclose(by_tma, ref, atol=1e-4, rtol=1e-5), (by_tma - ref).abs().max()


@needs_tma
def test_tma_only_where_a_descriptor_can_describe_the_operands(monkeypatch):
    """Rows of 72 bytes (not a multiple of 16), a column-major view or a base off 16 bytes take the pointer loads;
    off CUDA, only the interpreter stands in for a GPU with TMA."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 128)
    rows_72 = torch.zeros(8, 72, dtype=torch.float8_e4m3fn)
    square = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    assert fp8_linear.tma_ready(x, square, torch.zeros(8, 128, dtype=torch.float8_e4m3fn))
    assert not fp8_linear.tma_ready(x, rows_72)
    assert not fp8_linear.tma_ready(x, square.t())
    assert not fp8_linear.tma_ready(x, torch.zeros(4 * 128 + 8, dtype=torch.float8_e4m3fn)[8:].view(4, 128))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fp8_linear.tma_ready(x, square)


def test_activation_quantisation_over_several_programs_per_token(monkeypatch):
    """70 groups of 16 (the last partial) are 2 programs per token of 64 groups each; the scales come back as
    ``[M, groups]`` (stored group-major)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(3, 16 * 70 - 5, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 40, 16 * 70 - 5)
    q, s = fp8_linear.quantize_token_groups(x, 16)
    q_ref, s_ref = quantize_token_groups_ref(x, 16)
    assert s.shape == (3, 70) and s.stride() == (1, 3)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


def test_dispatch_takes_the_tensor_core_path_with_default_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    weight, scale = quantize_block_fp8(torch.randn(24, 128, generator=gen), (16, 64))
    x, bias = torch.randn(fp8_linear.FP8_TENSOR_CORE_MIN_TOKENS + 3, 128, generator=gen), torch.randn(24, generator=gen)
    assert fp8_linear.choose_path(x.shape[0], x, 24, 128, 16, 64) == fp8_linear.TENSOR_CORE
    out = mla_fuser.kernels.fp8.block_fp8_linear(x, weight, scale, (16, 64), bias)
    ref = block_fp8_linear_act_quant_ref(x, weight, scale, 16, 64, bias)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-5), (out - ref).abs().max()
    # MLA_FUSER_FP8_ACT_QUANT=0: weight-only at every size, the weight-only reference's result
    monkeypatch.setenv("MLA_FUSER_FP8_ACT_QUANT", "0")
    assert fp8_linear.choose_path(x.shape[0], x, 24, 128, 16, 64) == fp8_linear.WEIGHT_ONLY
    out = mla_fuser.kernels.fp8.block_fp8_linear(x, weight, scale, (16, 64), bias)
    assert torch.allclose(out, block_fp8_linear_ref(x, weight, scale, 16, 64, bias), atol=1e-4, rtol=1e-5)


def test_path_choice_by_tokens_weight_shape_dtype_and_switch(monkeypatch):
    """W8A8 below the tensor cores' sizes for fp16/bf16 activations, 32/64/128-wide K blocks, at least
    W8A8_MIN_K_TILES K tiles and, up to 16 tokens, large weights (W8A8_MIN_WEIGHT; at one token else the GEMV);
    from TENSOR_CORE_WIDE_MIN_TOKENS the tensor cores where their output tiles fill the SMs; weight-only where W8A8
    cannot run, and everywhere with MLA_FUSER_FP8_ACT_QUANT=0."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (stands in for FP8 tensor cores)
    L = fp8_linear
    bf16, fp32 = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 8)
    big = (36864, 7168)  # V3 MLP gate_up: 2**25 elements and more
    middle = (2112, 7168)  # V3 q_a + kv_a: 2**23 to 2**24
    small = (3648, 2048)  # V2-Lite q_proj + kv_a_proj
    assert L.W8A8_MIN_WEIGHT == ((1, 1 << 25), (16, 1 << 24))
    assert L.choose_path(1, bf16, *small, 128, 128) == L.GEMV
    assert L.choose_path(1, bf16, *middle, 128, 128) == L.GEMV
    assert L.choose_path(1, bf16, *big, 128, 128) == L.W8A8
    assert L.choose_path(1, fp32, *big, 128, 128) == L.GEMV
    for tokens in (2, 16):
        assert L.choose_path(tokens, bf16, *big, 128, 128) == L.W8A8
        assert L.choose_path(tokens, bf16, 4096, 4096, 128, 128) == L.W8A8  # 2**24
        assert L.choose_path(tokens, bf16, *small, 128, 128) == L.WEIGHT_ONLY
        assert L.choose_path(tokens, bf16, *middle, 128, 128) == L.WEIGHT_ONLY
    for tokens in (17, L.TENSOR_CORE_WIDE_MIN_TOKENS - 1):
        assert L.choose_path(tokens, bf16, *small, 128, 128) == L.W8A8
        assert L.choose_path(tokens, bf16.half(), *small, 64, 64) == L.W8A8
        assert L.choose_path(tokens, fp32, *small, 128, 128) == L.WEIGHT_ONLY
        assert L.choose_path(tokens, bf16, *small, 128, 96) == L.WEIGHT_ONLY  # bk not a W8A8 group
        assert L.choose_path(tokens, bf16, *small, 0, 0) == L.WEIGHT_ONLY  # per-tensor scale
        assert L.choose_path(tokens, bf16, 32768, 512, 128, 128) == L.WEIGHT_ONLY  # 4 K tiles
    # (on a CPU the SM count is 0: every tile grid fills it)
    assert L.choose_path(L.TENSOR_CORE_WIDE_MIN_TOKENS, bf16, *small, 128, 128) == L.TENSOR_CORE
    assert L._path(64, 36864, 7168, 128, 128, True, True, 132) == L.TENSOR_CORE  # 576 tiles of 64 x 64
    assert L._path(64, 7168, 18432, 128, 128, True, True, 132) == L.W8A8  # 112 tiles
    assert L._path(64, 7168, 18432, 128, 128, True, False, 132) == L.WEIGHT_ONLY  # (fp32 activations)
    assert L._path(L.FP8_TENSOR_CORE_MIN_TOKENS, 7168, 18432, 128, 128, True, False, 132) == L.TENSOR_CORE
    monkeypatch.setenv("MLA_FUSER_FP8_ACT_QUANT", "0")
    assert L.choose_path(1, bf16, *big, 128, 128) == L.GEMV
    assert L.choose_path(16, bf16, *big, 128, 128) == L.WEIGHT_ONLY
    assert L.choose_path(32, bf16, *small, 128, 128) == L.WEIGHT_ONLY
    assert L.choose_path(L.FP8_TENSOR_CORE_MIN_TOKENS, bf16, *small, 128, 128) == L.WEIGHT_ONLY


def test_dispatch_runs_the_w8a8_gemm_below_the_tensor_core_sizes(monkeypatch):
    """bf16 activations at a decode batch size: the split-K GEMM's W8A8 variant with the W8A8 table's tiles, its
    result the activation-quantised reference's (to bf16 rounding), not the weight-only one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    gen = torch.Generator().manual_seed(6)
    block = (32, 32)
    k = block[1] * fp8_linear.W8A8_MIN_K_TILES
    weight, scale = quantize_block_fp8(torch.randn(96, k, generator=gen), block)
    x = (torch.randn(17, k, generator=gen) * torch.linspace(0.1, 8, k)).to(torch.bfloat16)  # (no weight bound)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    calls = []
    real = fp8_linear.w8_linear_triton
    monkeypatch.setattr(fp8_linear, "w8_linear_triton", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    out = mla_fuser.kernels.fp8.block_fp8_linear(x, weight, scale, block, bias)
    assert calls == [{"act_quant": True}]
    assert fp8_linear.w8_plan(17, 96, k, *block, torch.bfloat16, True, True, None, act_quant=True).config == \
        fp8_linear.W8A8_CONFIGS[1][2]._replace(block_k=32)
    ref = block_fp8_linear_act_quant_ref(x.float(), weight, scale, *block, bias.float())
    weight_only = block_fp8_linear_ref(x.float(), weight, scale, *block, bias.float())
    to_ref, to_weight_only = (out.float() - ref).abs().mean(), (out.float() - weight_only).abs().mean()
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=1e-2), (out.float() - ref).abs().max()
    assert to_ref * 2 <= to_weight_only, (to_ref, to_weight_only)


def test_dispatch_runs_triton_when_forced(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    weight, scale = quantize_block_fp8(torch.randn(24, 48), (16, 16))
    x = torch.randn(2, 3, 48)
    calls = []
    real = fp8_linear.w8_linear_triton
    monkeypatch.setattr(fp8_linear, "w8_linear_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = mla_fuser.kernels.fp8.block_fp8_linear(x, weight, scale, (16, 16))
    assert calls and out.shape == (2, 3, 24)
    assert torch.allclose(out, block_fp8_linear_ref(x, weight, scale, 16, 16), atol=1e-5)


def test_block_quantisation_error_is_bounded():
    w = torch.randn(40, 72) * torch.linspace(0.01, 3, 72)
    for block in ((16, 32), (128, 128), None):
        q, s = quantize_block_fp8(w, block)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        back = dequantize_block_fp8(q, s, block)
        # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each value (above the subnormal range)
        assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()


# ----------------------------------------------------------------------------------------------------------------
# recognition by structure, and declines


def _fp8_module(n=40, k=72, block=(16, 32)):
    module = FP8Linear(k, n, block_size=block)
    q, s = quantize_block_fp8(torch.randn(n, k), block)
    module.weight, module.weight_scale_inv = nn.Parameter(q, requires_grad=False), nn.Parameter(s, requires_grad=False)
    return module


class _LooksLikeFP8Linear(nn.Module):
    """No Transformers class, no ``block_size``: recognised by its tensors (128x128 blocks tried first)."""

    def __init__(self, n, k):
        super().__init__()
        self.in_features, self.out_features = k, n
        q, s = quantize_block_fp8(torch.randn(n, k), (128, 128))
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale_inv", s)


def test_recognised_by_structure_not_by_class():
    layout, reason = explain_block_fp8(_fp8_module())
    assert reason == "" and layout.block == (16, 32) and layout.scale_shape == (3, 3)
    other = _LooksLikeFP8Linear(300, 200)
    layout, _ = explain_block_fp8(other)
    assert layout.block == (128, 128)
    x = torch.randn(4, 200)
    row = FP8LinearFuser.apply(other, layout, "x")
    assert row.status == "fused"
    ref = x @ dequantize_block_fp8(other.weight, other.weight_scale_inv, (128, 128)).T
    assert torch.allclose(other(x), ref, atol=1e-5)
    assert not FP8LinearFuser.is_candidate(nn.Linear(4, 4))


def test_declines_with_reasons():
    missing = _fp8_module()
    del missing.weight_scale_inv
    assert "scales are missing" in explain_block_fp8(missing)[1]
    wrong = _fp8_module()
    wrong.weight_scale_inv = nn.Parameter(torch.ones(2, 3), requires_grad=False)
    assert "does not fit" in explain_block_fp8(wrong)[1]
    ue8m0 = _fp8_module()
    ue8m0.weight_scale_inv = nn.Parameter(torch.ones(3, 3).to(torch.float8_e8m0fnu), requires_grad=False)
    assert "UE8M0" in explain_block_fp8(ue8m0)[1]
    fp4 = _fp8_module()
    fp4.weight = nn.Parameter(torch.zeros(40, 36, dtype=torch.int8), requires_grad=False)
    assert FP8LinearFuser.is_candidate(fp4) and "FP4" in explain_block_fp8(fp4)[1]
    embedding = nn.Embedding(10, 8)
    embedding.weight = nn.Parameter(torch.randn(10, 8).to(torch.float8_e4m3fn), requires_grad=False)
    assert FP8LinearFuser.is_candidate(embedding) and "not a linear" in explain_block_fp8(embedding)[1]
    for module in (missing, wrong, ue8m0, fp4, embedding):
        assert "forward" not in module.__dict__


def test_declined_module_is_reported_in_fuse():
    model = _fp8_model("deepseek_v3", (16, 16), q_lora_rank=32)[1]
    bad = model.model.layers[0].mlp.down_proj
    bad.weight_scale_inv = nn.Parameter(torch.ones(1, 1), requires_grad=False)  # wrong grid for [64, 96]
    report = mla_fuser.fuse(model)
    row = next(r for r in report.rows if r.qualname == "model.layers.0.mlp.down_proj")
    assert row.fuser == "fp8" and row.status == "fallback" and "does not fit" in row.reason
    assert "forward" not in bad.__dict__


# ----------------------------------------------------------------------------------------------------------------
# tiny models


def _fp8_model(arch, block, **overrides):
    """``(reference, fp8_model)``: the FP8 model made by Transformers' replacement function and loaded with weights
    quantised here; the reference (eager, fp32) holds the same weights dequantised."""
    ref = tiny_deepseek(arch, attn="eager", **overrides)
    model = copy.deepcopy(ref)
    replace_with_fp8_linear(model, modules_to_not_convert=SKIP,
                            quantization_config=FineGrainedFP8Config(weight_block_size=list(block)), pre_quantized=True)
    state, ref_state = {}, ref.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            q, s = quantize_block_fp8(ref_state[f"{name}.weight"], block)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, s
            ref.get_submodule(name).weight.data = dequantize_block_fp8(q, s, block)
    state.update({k: v for k, v in ref_state.items() if k not in state})
    model.load_state_dict(state, assign=True, strict=True)
    return ref, model.eval()


CASES = [  # (arch, block, overrides, stacked): q_lora 32 is two 16-row blocks; 24 is not; V2 without q-LoRA
    ("deepseek_v3", (16, 16), dict(q_lora_rank=32), True),
    ("deepseek_v3", (16, 16), dict(q_lora_rank=24), False),
    ("deepseek_v2", (32, 32), dict(q_lora_rank=None), None),
]


@pytest.mark.parametrize("arch,block,overrides,stacked", CASES)
def test_fused_fp8_model_equals_dequantised_reference(arch, block, overrides, stacked):
    ref, model = _fp8_model(arch, block, **overrides)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    report = mla_fuser.fuse(model)
    fp8_rows = [r for r in report.rows if r.fuser == "fp8"]
    fp8_modules = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert sorted(r.qualname for r in fp8_rows) == sorted(fp8_modules) and len(fp8_modules) >= 10
    assert all(r.status == "fused" for r in fp8_rows)
    mla_rows = report.fused("mla")
    assert len(mla_rows) == 2 and all("block-FP8 kv_b_proj" in r.reason for r in mla_rows)
    # the dense MLP and the shared experts: block-FP8 gate and up stacked (their rows are whole blocks here)
    mlp_rows = report.fused("mlp")
    assert len(mlp_rows) == 2 and all("gate and up stacked into one GEMM" in r.reason for r in mlp_rows)
    attn = model.model.layers[0].self_attn
    if stacked is True:
        down = attn.__dict__[STACKED_ATTR]
        assert down.fp8_scale is not None and "stacked with KV down-projection" in mla_rows[0].reason
        assert attn.q_a_proj.weight.data_ptr() == down.weight.data_ptr()
        assert attn.kv_a_proj_with_mqa.weight_scale_inv.data_ptr() == down.fp8_scale[2:].data_ptr()
    elif stacked is False:
        assert attn.__dict__[STACKED_ATTR].weight is None
        assert "not stacked (the first down-projection's 24 output rows" in mla_rows[0].reason

    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    expected = ref.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected)
    # the checkpoint's keys, dtypes and scales, untouched by fusion, stacking and decoding
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, (dtype, value) in before.items():
        assert after[key].dtype == dtype and torch.equal(after[key].view(torch.uint8) if dtype.itemsize == 1
                                                         and dtype.is_floating_point else after[key],
                                                         value.view(torch.uint8) if dtype.itemsize == 1
                                                         and dtype.is_floating_point else value), key


def test_save_pretrained_round_trip_keeps_fp8(tmp_path):
    from safetensors.torch import load_file

    dense = dict(q_lora_rank=32, first_k_dense_replace=2)  # (expert stacks are saved per expert: keys differ)
    ref, model = _fp8_model("deepseek_v3", (16, 16), **dense)
    mla_fuser.fuse(model)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = load_file(str(next(tmp_path.glob("*.safetensors"))))
    q_a = "model.layers.0.self_attn.q_a_proj"
    assert saved[f"{q_a}.weight"].dtype == torch.float8_e4m3fn
    assert saved[f"{q_a}.weight_scale_inv"].dtype == torch.float32 and saved[f"{q_a}.weight_scale_inv"].shape == (2, 4)
    assert saved.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key].float(), value.float()), key
    # reload into a fresh FP8 model (Transformers' replacement, the saved tensors) and fuse: the same logits
    fresh = tiny_deepseek("deepseek_v3", attn="eager", seed=5, **dense)
    replace_with_fp8_linear(fresh, modules_to_not_convert=SKIP,
                            quantization_config=FineGrainedFP8Config(weight_block_size=[16, 16]), pre_quantized=True)
    fresh.load_state_dict(saved, assign=True, strict=True)
    mla_fuser.fuse(fresh)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids).logits, logits)


# ----------------------------------------------------------------------------------------------------------------
# FP8 on demand


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_fp8_on_demand_for_a_bf16_checkpoint_on_cpu(tmp_path):
    plain = tiny_deepseek("deepseek_v3", attn="eager", q_lora_rank=32)
    plain.save_pretrained(tmp_path)
    # (expert stacks are quantised too unless skipped: tests/test_fp8_experts.py covers them)
    config = FineGrainedFP8Config(weight_block_size=[16, 16], modules_to_not_convert=["lm_head", "experts"])
    # what Transformers does on this machine: refuses (its quantizer needs a GPU or XPU)
    with pytest.raises(RuntimeError, match="GPU"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32)
    q_a = model.model.layers[0].self_attn.q_a_proj
    assert isinstance(q_a, FP8Linear) and q_a.weight.dtype == torch.float8_e4m3fn
    assert not isinstance(model.lm_head, FP8Linear)
    report = model.fusion_report
    assert any("FP8 on demand" in n for n in report.notes)
    assert report.fused("fp8") and not report.fallbacks("fp8") and len(report.fused("mla")) == 2
    # equal to the same model with the quantised weights dequantised in fp32
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            plain.get_submodule(name).weight.data = dequantize_block_fp8(module.weight, module.weight_scale_inv,
                                                                         (16, 16))
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain.eval()(ids).logits, atol=1e-5, rtol=1e-4)
    assert model.config.quantization_config.quant_method == "fp8"
