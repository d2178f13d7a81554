"""Block-FP8 experts (float8 ``gate_up_proj``/``down_proj`` stacks with per-expert block scales) on the fused MoE
path: the Triton kernel against its torch reference, recognition by the stacks' tensors (and the declines, with
reasons), tiny DeepSeek-V3/V2 models whose experts are FP8 against a reference holding the same weights dequantised
in fp32, and FP8 on demand quantising the expert stacks on a CPU.

FP8 modules are made by Transformers' own ``replace_with_fp8_linear`` (its FP8 experts module at ``*.experts``) and
filled with weights quantised here.  Kernel tests run the Triton kernel under ``TRITON_INTERPRET=1`` (or compiled
on a GPU); the model tests run the CPU path (the torch reference ``fused_experts_fp8_ref``).  The interpreter's
fp32 -> e4m3 rounding bug (``tests/test_fp8.py``) does not touch these kernels: they only load e4m3 and widen it
(weights are quantised by torch here); its fp32 -> bf16 conversions truncate, which the bf16 tolerance allows for.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mla_fuser
from mla_fuser.kernels import fused_moe as fm
from mla_fuser.kernels.dispatch import triton_available
from mla_fuser.kernels.fp8 import dequantize_block_fp8, quantize_block_fp8
from mla_fuser.kernels.fp8.experts import explain_fp8_experts, quantize_expert_stack
from mla_fuser.kernels.tma import HAS_HOST_TENSOR_DESCRIPTORS
from mla_fuser.kernels.fused_moe import configs, fp8_launch
from mla_fuser.kernels.fused_moe.fp8_reference import dequantize_expert

from conftest import close_to_reference as _close, tiny_deepseek

transformers = pytest.importorskip("transformers")
from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
needs_tma = pytest.mark.skipif(not HAS_HOST_TENSOR_DESCRIPTORS,
                               reason="this Triton builds no tensor descriptors on the host (3.4 on)")
TINY = {"gemm1": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, SCAN_P=16),
        "gemm2": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, SCAN_P=32)}


# ----------------------------------------------------------------------------------------------------------------
# kernel vs reference


def _stacks(num_experts, hidden, inter, block, halves, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * torch.linspace(0.05, 2, hidden)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    rows = 2 * -(-inter // block[0]) if halves else None
    q1, s1 = quantize_expert_stack(gate_up, block, rows)
    q2, s2 = quantize_expert_stack(down, block)
    layout = dict(gate_up_block=block, down_block=block, up_scale_base=s1.shape[1] // 2 if halves else 0,
                  up_row_shift=0 if halves else None)
    return (q1, s1, q2, s2), layout


@needs_triton
@pytest.mark.parametrize("path", ["small", "aligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,block,halves", [(32, (16, 16), True), (24, (16, 16), False), (24, (16, 16), True),
                                                (40, (32, 16), True)])
def test_fp8_kernel_matches_reference(monkeypatch, path, dtype, inter, block, halves):
    """Both grids, both gate/up scale layouts (24 rows: a block straddling gate and up, or each half apart), block
    sizes dividing the dims and not (48 = 1.5 blocks of 32), a sentinel id, more pairs than one tile."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    num_experts, hidden, tokens, topk = 5, 48, 18, 2
    stacks, layout = _stacks(num_experts, hidden, inter, block, halves)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    ids[:, 0] = 0  # expert 0 gets 18 > BLOCK_M pairs
    ids[1, 1] = num_experts  # an expert-parallel sentinel: contributes nothing
    w = torch.rand(tokens, topk, generator=gen)
    ref = fm.fused_experts_fp8_ref(x, *stacks, ids, w, **layout)
    dev = [t.to(DEVICE) for t in (x, *stacks, ids, w)]
    out = fm.fused_experts_fp8_triton(*dev, path=path, config=TINY, **layout).cpu()
    _close(out, ref, dtype)


GEMV_TILES = {"fp8_gemv1": dict(BLOCK_N=8, BLOCK_K=32), "fp8_gemv2": dict(BLOCK_N=8, BLOCK_K=16)}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("inter,block,halves", [(32, (16, 16), True), (24, (16, 16), False), (24, (8, 16), True),
                                                (40, (32, 16), True)])
@pytest.mark.parametrize("tiles", ["tiny", "default"])
def test_decode_gemvs_match_reference(monkeypatch, dtype, tokens, inter, block, halves, tiles):
    """The decode path (two GEMV launches): both gate/up scale layouts (24 rows whole: the up half starts mid-block,
    so the row tile is capped to 8), K tiles spanning several scale columns or part of one, K and the rows not
    multiples of the tiles (48 = 1.5 tiles of 32; 40 = 5 row tiles of 8), a sentinel id."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    num_experts, hidden, topk = 5, 48, 3
    stacks, layout = _stacks(num_experts, hidden, inter, block, halves)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    ids[0, 1] = num_experts  # an expert-parallel sentinel: contributes nothing
    w = torch.rand(tokens, topk, generator=gen)
    calls = []
    real = fp8_launch.launch_w8_gemvs
    monkeypatch.setattr(fp8_launch, "launch_w8_gemvs",
                        lambda **k: calls.append((k["gemv1"]["BLOCK_N"], k["gemv2"]["BLOCK_N"])) or real(**k))
    ref = fm.fused_experts_fp8_ref(x, *stacks, ids, w, **layout)
    dev = [t.to(DEVICE) for t in (x, *stacks, ids, w)]
    out = fm.fused_experts_fp8_triton(*dev, config=GEMV_TILES if tiles == "tiny" else None, **layout).cpu()
    # each row tile is the one asked for, capped to lie in one scale row: it divides the block's rows and, for the
    # gate/up stack, the up half's row shift (24 rows whole: the up half starts mid-block, which caps it to 8)
    wanted = GEMV_TILES if tiles == "tiny" else configs.default_fp8_config("small", tokens, topk, num_experts)
    (up, down), = calls
    shift = inter if layout["up_row_shift"] is None else layout["up_row_shift"]
    assert block[0] % up == 0 and (shift % up == 0 if shift else True) and block[0] % down == 0
    assert up <= wanted["fp8_gemv1"]["BLOCK_N"] and down <= wanted["fp8_gemv2"]["BLOCK_N"]
    if (inter, block, halves) == (24, (16, 16), False):
        assert up == 8
    _close(out, ref, dtype)


W8A8_TILES = {"gemm1": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, SCAN_P=16),
              "gemm2": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, SCAN_P=32)}


@needs_triton
@pytest.mark.parametrize("path", ["small", "aligned"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden,inter,block,halves", [(80, 40, (32, 32), True), (64, 48, (16, 32), False),
                                                       (64, 32, (64, 64), True)])
@pytest.mark.parametrize("prequant", [False, True])
def test_w8a8_gemms_match_their_reference(monkeypatch, path, dtype, hidden, inter, block, halves, prequant):
    """The W8A8 GEMMs (activations quantised per token and ``bk`` features, in the kernel or, with ``prequant``, by
    launches of their own before each GEMM; e4m3 products) compute the reference's W8A8 math, and measurably not the
    weight-only math: the output is on average at least twice as close to the act-quant reference as to the
    weight-only one.  K not a multiple of ``bk`` (80 = 2.5 groups of 32: the last group partial), both gate/up scale
    layouts, a sentinel id, an expert with more pairs than one tile; activations spread over three decades so that
    per-group scales matter."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    num_experts, tokens, topk = 5, 18, 2
    stacks, layout = _stacks(num_experts, hidden, inter, block, halves)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-3, 0, hidden)).to(dtype)
    ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    ids[:, 0] = 0  # expert 0 gets 18 > BLOCK_M pairs
    ids[1, 1] = num_experts  # an expert-parallel sentinel: contributes nothing
    w = torch.rand(tokens, topk, generator=gen)
    ref = fm.fused_experts_fp8_ref(x, *stacks, ids, w, act_quant=True, **layout)
    weight_only = fm.fused_experts_fp8_ref(x, *stacks, ids, w, **layout)
    dev = [t.to(DEVICE) for t in (x, *stacks, ids, w)]
    out = fm.fused_experts_fp8_triton(*dev, path=path, config=W8A8_TILES, act_quant=True, prequant=prequant,
                                      **layout).cpu()
    _close(out, ref, dtype)
    to_ref = (out.float() - ref.float()).abs().mean().item()
    to_weight_only = (out.float() - weight_only.float()).abs().mean().item()
    assert to_ref * 2 <= to_weight_only, (to_ref, to_weight_only)


@needs_tma
@needs_triton
@pytest.mark.parametrize("hidden,inter,block,halves", [(80, 40, (32, 32), True), (64, 48, (16, 32), False),
                                                       (128, 64, (64, 64), True)])
@pytest.mark.parametrize("prequant", [False, True])
def test_w8a8_weight_tiles_by_tma_equal_the_pointer_loads(monkeypatch, hidden, inter, block, halves, prequant):
    """Weight tiles by TMA (the tile config's ``W_TMA``) are the tiles the pointer loads read: rows past the stack and
    a K that is no multiple of the tile read as zeros, gate rows past ``N`` as up rows whose products the store drops;
    the output is the same, bit for bit.  A stack whose rows are not on 16 bytes (the 40-wide down stack) keeps its
    pointer loads."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    num_experts, tokens, topk = 5, 18, 2
    stacks, layout = _stacks(num_experts, hidden, inter, block, halves)
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-3, 0, hidden)).to(torch.bfloat16)
    ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    ids[:, 0] = 0
    w = torch.rand(tokens, topk, generator=gen)
    dev = [t.to(DEVICE) for t in (x, *stacks, ids, w)]
    asked = []
    real = fp8_launch.tma_ready
    monkeypatch.setattr(fp8_launch, "tma_ready", lambda a, wt: asked.append(real(a, wt)) or asked[-1])
    tma_tiles = {k: dict(v, W_TMA=True) for k, v in W8A8_TILES.items()}
    runs = {cfg_tma: fm.fused_experts_fp8_triton(*dev, path="aligned", config=tma_tiles if cfg_tma else W8A8_TILES,
                                                 act_quant=True, prequant=prequant, **layout).cpu()
            for cfg_tma in (False, True)}
    assert asked == [True, inter % 16 == 0]  # (asked only where the config wants TMA: gate/up, then down)
    assert torch.equal(runs[True], runs[False])


@needs_triton
def test_w8a8_prequantised_activations_are_the_in_kernel_ones(monkeypatch):
    """Quantising the activations before each GEMM gives the e4m3 values and scales the GEMM would compute in its
    registers, so both give the same bits (interpreted; compiled, to the last bf16 bit at most); auto prequantises
    from FP8_PREQUANT_MIN_TOKENS tokens; prequant without W8A8 is an error."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    num_experts, hidden, inter, block = 4, 64, 32, (32, 32)
    stacks, layout = _stacks(num_experts, hidden, inter, block, True)
    gen = torch.Generator().manual_seed(9)
    tokens, topk = 12, 2
    x = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(-2, 1, hidden)).to(torch.bfloat16)
    ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    w = torch.rand(tokens, topk, generator=gen)
    dev = [t.to(DEVICE) for t in (x, *stacks, ids, w)]
    calls = []
    real = fp8_launch.quantize_token_groups
    monkeypatch.setattr(fp8_launch, "quantize_token_groups", lambda *a: calls.append(a[0].shape) or real(*a))
    runs = {p: fm.fused_experts_fp8_triton(*dev, path="aligned", config=W8A8_TILES, act_quant=True, prequant=p,
                                           **layout).cpu() for p in (False, True)}
    assert calls == [(tokens, hidden), (tokens * topk, inter)]  # the hidden rows, then the pairs' intermediates
    if ON_GPU:
        assert torch.allclose(runs[True].float(), runs[False].float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(runs[True], runs[False])
    calls.clear()
    monkeypatch.setattr(fp8_launch, "FP8_PREQUANT_MIN_TOKENS", tokens)
    fm.fused_experts_fp8_triton(*dev, path="aligned", config=W8A8_TILES, act_quant=True, **layout)
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(fp8_launch, "FP8_PREQUANT_MIN_TOKENS", tokens + 1)
    fm.fused_experts_fp8_triton(*dev, path="aligned", config=W8A8_TILES, act_quant=True, **layout)
    assert calls == []
    with pytest.raises(ValueError, match="needs act_quant"):
        fm.fused_experts_fp8_triton(*dev, path="aligned", config=W8A8_TILES, act_quant=False, prequant=True,
                                    **layout)


def test_w8a8_is_chosen_by_tokens_dtype_blocks_and_switch(monkeypatch):
    """Auto: W8A8 from FP8_ACT_QUANT_MIN_TOKENS tokens (up to FP8_ACT_QUANT_MAX_TOKENS where one is set) on fp16/bf16
    activations with 32/64/128-wide K blocks and FP8 tensor cores (the interpreter stands in), never with
    ``MLA_FUSER_FP8_ACT_QUANT=0``; forcing it where it cannot run is an error, not a silent fallback."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    many = fp8_launch.FP8_ACT_QUANT_MIN_TOKENS
    bf16 = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert fp8_launch.choose_act_quant(bf16, many, (128, 128), (128, 128))
    assert not fp8_launch.choose_act_quant(bf16, many - 1, (128, 128), (128, 128))
    assert fp8_launch.choose_act_quant(bf16, 8192, (128, 128), (128, 128))  # prefill sizes too
    monkeypatch.setattr(fp8_launch, "FP8_ACT_QUANT_MAX_TOKENS", 64)
    assert fp8_launch.choose_act_quant(bf16, 64, (128, 128), (128, 128))
    assert not fp8_launch.choose_act_quant(bf16, 65, (128, 128), (128, 128))
    monkeypatch.setattr(fp8_launch, "FP8_ACT_QUANT_MAX_TOKENS", None)
    assert not fp8_launch.choose_act_quant(bf16.float(), many, (128, 128), (128, 128))
    assert not fp8_launch.choose_act_quant(bf16, many, (128, 128), (128, 16))
    monkeypatch.setenv("MLA_FUSER_FP8_ACT_QUANT", "0")
    assert not fp8_launch.choose_act_quant(bf16, many, (128, 128), (128, 128))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("MLA_FUSER_FP8_ACT_QUANT")
    if not ON_GPU:  # (no FP8 tensor cores on a CPU)
        assert not fp8_launch.choose_act_quant(bf16, many, (128, 128), (128, 128))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stacks, layout = _stacks(2, 32, 32, (16, 16), False)
    x = torch.randn(many, 32)
    ids, w = torch.zeros(many, 1, dtype=torch.long), torch.ones(many, 1)
    with pytest.raises(ValueError, match="W8A8"):
        fm.fused_experts_fp8_triton(x.to(DEVICE), *[t.to(DEVICE) for t in (*stacks, ids, w)], act_quant=True,
                                    **layout)


@needs_triton
def test_decode_gemvs_step_aside_when_no_row_tile_fits(monkeypatch):
    """A layout no row tile of GEMV_MIN_BLOCK_N fits (the up half starting 2 rows into a block) and calls above
    GEMV_DOWN_MAX_TOKENS tokens run the small path's GEMMs, still right."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = fp8_launch.launch_w8_gemvs
    monkeypatch.setattr(fp8_launch, "launch_w8_gemvs", lambda **k: calls.append(1) or real(**k))
    assert fp8_launch.gemv_block_n(8, (16, 16), 26) == 0
    assert fp8_launch.gemv_block_n(8, (16, 16), 24) == 8
    assert fp8_launch.gemv_block_n(32, (16, 16), 48) == 16
    assert fp8_launch.gemv_block_n(8, (4, 16)) == 4
    assert fp8_launch.gemv_block_n(8, (2, 16)) == 0
    for inter, tokens in ((26, 1), (32, fm.launch.GEMV_DOWN_MAX_TOKENS + 1)):
        stacks, layout = _stacks(4, 32, inter, (16, 16), False)
        gen = torch.Generator().manual_seed(inter)
        x, ids, w = torch.randn(tokens, 32, generator=gen), torch.randint(0, 4, (tokens, 2), generator=gen), \
            torch.rand(tokens, 2, generator=gen)
        ref = fm.fused_experts_fp8_ref(x, *stacks, ids, w, **layout)
        out = fm.fused_experts_fp8_triton(*[t.to(DEVICE) for t in (x, *stacks, ids, w)], path="small", config=TINY,
                                          **layout).cpu()
        _close(out, ref, torch.float32)
    assert calls == []


def test_fp8_auto_path_by_tokens(monkeypatch):
    """FP8 "auto": the small path (its decode GEMVs) up to FP8_SMALL_BATCH_MAX_TOKENS tokens, the aligned path above
    (the bf16 op keeps the small path to 16); the token variable moves both; an explicit path is kept."""
    limit = fp8_launch.FP8_SMALL_BATCH_MAX_TOKENS
    assert fp8_launch.choose_fp8_path("auto", limit, limit * 6) == "small"
    assert fp8_launch.choose_fp8_path("auto", limit + 1, (limit + 1) * 6) == "aligned"
    assert fm.launch._choose_path("auto", limit + 1, (limit + 1) * 6) == "small"
    assert fp8_launch.choose_fp8_path("small", 16, 96) == "small"
    monkeypatch.setenv("MLA_FUSER_MOE_SMALL_BATCH_TOKENS", "16")
    assert fp8_launch.choose_fp8_path("auto", 16, 96) == "small"
    with pytest.raises(ValueError, match="path must be"):
        fp8_launch.choose_fp8_path("fast", 1, 6)


def test_w8a8_tiles_by_pairs_per_expert():
    """The W8A8 GEMMs' default tiles: 16 x 64 up to 32 pairs per expert (and on the small path), 64 x 128 on 8 warps
    up to 128, 64 x 64 on 4 warps above (each the sweep's best there); gemm1 and gemm2 share BLOCK_M (the aligned
    path's one alignment)."""
    def tile(tokens, path="aligned"):
        cfg = configs.get_moe_config(path, tokens, 6, 64, fp8=True, act_quant=True)
        assert cfg["gemm1"] == cfg["gemm2"]
        return tuple(cfg["gemm1"][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))

    assert tile(16) == tile(341) == tile(8192, "small") == (16, 64, 4, 3)  # 341 tokens: 31.97 pairs per expert
    assert tile(342) == tile(1365) == (64, 128, 8, 3)  # 1365: 127.97
    assert tile(1366) == tile(65536) == (64, 64, 4, 3)


def test_fp8_tiles_default_to_their_own_at_decode_sizes(monkeypatch):
    """Block-FP8 experts take ``default_fp8_config``: narrower aligned tiles up to 16 pairs per expert, the bf16
    defaults otherwise; a tuned table (``MLA_FUSER_MOE_CONFIGS``) still wins for both."""
    from mla_fuser.kernels.fused_moe import configs

    fp8 = configs.get_moe_config("aligned", 16, 6, 64, fp8=True)
    assert fp8["gemm1"]["BLOCK_N"] == 32 and fp8["gemm1"]["BLOCK_M"] == fp8["gemm2"]["BLOCK_M"]
    assert fp8 != configs.get_moe_config("aligned", 16, 6, 64)
    for args in (("aligned", 8192, 6, 64), ("small", 4, 6, 64)):  # (plus their own decode GEMV tiles)
        own = configs.get_moe_config(*args, fp8=True)
        assert {k: v for k, v in own.items() if not k.startswith("fp8_")} == configs.default_config(*args)
    assert set(configs.get_moe_config("small", 4, 6, 64, fp8=True)) >= {"fp8_gemv1", "fp8_gemv2"}
    seen = []
    real = fp8_launch._tiles
    monkeypatch.setattr(fp8_launch, "_tiles", lambda *a: seen.append(a[5]) or real(*a))
    stacks, layout = _stacks(4, 32, 16, (16, 16), True)
    x, ids, w = torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = fm.fused_experts_fp8_triton(*[t.to(DEVICE) for t in (x, *stacks, ids, w)], **layout).cpu()
    assert seen == [True]  # (the FP8 defaults, asked once per shape)
    _close(out, fm.fused_experts_fp8_ref(x, *stacks, ids, w, **layout), torch.float32)


def test_reference_equals_dequantised_bf16_style_reference():
    """The FP8 reference is the fp32 reference on the dequantised stacks (halves and whole layouts)."""
    for inter, halves in ((24, True), (24, False)):
        (q1, s1, q2, s2), layout = _stacks(3, 32, inter, (16, 16), halves)
        kw = dict(gated=True, up_scale_base=layout["up_scale_base"],
                  up_row_shift=inter if layout["up_row_shift"] is None else layout["up_row_shift"])
        gate_up = torch.stack([dequantize_expert(q1[e], s1[e], (16, 16), **kw) for e in range(3)])
        down = torch.stack([dequantize_expert(q2[e], s2[e], (16, 16)) for e in range(3)])
        if not halves:  # one grid over [2I, H]: the linear's dequantisation
            assert torch.equal(gate_up[1], dequantize_block_fp8(q1[1], s1[1], (16, 16)))
        x, ids, w = torch.randn(7, 32), torch.randint(0, 3, (7, 2)), torch.rand(7, 2)
        got = fm.fused_experts_fp8_ref(x, q1, s1, q2, s2, ids, w, **layout)
        want = fm.fused_experts_ref(x, gate_up, down, ids, w)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)


@needs_triton
def test_dispatch_runs_triton_when_forced(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    stacks, layout = _stacks(4, 32, 16, (16, 16), True)
    stacks = tuple(t.to(DEVICE) for t in stacks)
    x, ids, w = (t.to(DEVICE) for t in (torch.randn(2, 3, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)))
    calls = []
    real = fp8_launch.fused_experts_fp8_triton
    monkeypatch.setattr(fp8_launch, "fused_experts_fp8_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = fm.fused_experts_fp8(x, *stacks, ids, w, **layout)
    assert calls and out.shape == (2, 3, 32)
    _close(out.reshape(6, 32), fm.fused_experts_fp8_ref(x.reshape(6, 32), *stacks, ids, w, **layout), torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# tiny models


def _fill_experts_fp8(model, ref, name, block, halves_rows=None):
    """Quantise ``ref``'s stacks at ``name`` into ``model``'s FP8 experts (as a checkpoint would hold them) and put
    the dequantised stacks back into ``ref``; ``halves_rows`` replaces the scale grid Transformers allocated by one
    with the gate and up halves apart."""
    experts, ref_experts = model.get_submodule(name), ref.get_submodule(name)
    rows = halves_rows or experts.gate_up_proj_scale_inv.shape[1]
    q1, s1 = quantize_expert_stack(ref_experts.gate_up_proj.detach(), block, rows)
    q2, s2 = quantize_expert_stack(ref_experts.down_proj.detach(), block)
    layout, reason = explain_fp8_experts(_Stacks(q1, s1, q2, s2, block))
    assert layout is not None, reason
    kw = dict(gated=True, up_scale_base=layout.up_scale_base, up_row_shift=layout.up_row_shift)
    ref_experts.gate_up_proj.data = torch.stack([dequantize_expert(q1[e], s1[e], block, **kw)
                                                 for e in range(q1.shape[0])])
    ref_experts.down_proj.data = torch.stack([dequantize_expert(q2[e], s2[e], block) for e in range(q2.shape[0])])
    return {f"{name}.gate_up_proj": q1, f"{name}.gate_up_proj_scale_inv": s1, f"{name}.down_proj": q2,
            f"{name}.down_proj_scale_inv": s2}


def _fp8_model(arch, block, halves=False, **overrides):
    """``(reference, fp8_model)``: every linear but the head and every expert stack FP8 (Transformers' replacement,
    weights quantised here); the reference (eager, fp32) holds the same weights dequantised."""
    ref = tiny_deepseek(arch, attn="eager", **overrides)
    model = copy.deepcopy(ref)
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"],
                            quantization_config=FineGrainedFP8Config(weight_block_size=list(block)), pre_quantized=True)
    state, ref_state = {}, ref.state_dict()
    experts = [n for n, m in model.named_modules() if hasattr(m, "gate_up_proj_scale_inv")]
    assert experts
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale_inv"):
            q, s = quantize_block_fp8(ref_state[f"{name}.weight"], block)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, s
            ref.get_submodule(name).weight.data = dequantize_block_fp8(q, s, block)
    halves_rows = 2 * -(-ref.config.moe_intermediate_size // block[0]) if halves else None
    for name in experts:
        filled = _fill_experts_fp8(model, ref, name, block, halves_rows)
        if halves_rows:  # a grid Transformers did not allocate: assign the parameters, as a conversion would
            for key, value in filled.items():
                setattr(model.get_submodule(name), key.rsplit(".", 1)[1], nn.Parameter(value, requires_grad=False))
            filled = {k: v for k, v in filled.items() if not k.endswith("_scale_inv")}
        state.update(filled)
    state.update({k: v for k, v in ref_state.items() if k not in state and k in model.state_dict()})
    model.load_state_dict(state, assign=True, strict=not halves)
    return ref, model.eval()


class _Stacks(nn.Module):
    """FP8 expert stacks on a module of no Transformers class: recognised by the tensors alone."""

    def __init__(self, q1, s1, q2, s2, block=None):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(q1, False), nn.Parameter(q2, False)
        self.gate_up_proj_scale_inv, self.down_proj_scale_inv = nn.Parameter(s1, False), nn.Parameter(s2, False)
        if block is not None:
            self.block_size = list(block)


CASES = [  # (arch, block, halves, overrides)
    ("deepseek_v3", (16, 16), False, {}),  # I = 32: two whole row blocks per half
    ("deepseek_v3", (16, 16), False, dict(moe_intermediate_size=24)),  # gate_up quantised whole: a block straddles
    ("deepseek_v2", (32, 16), False, {}),
    ("deepseek_v2", (16, 16), True, dict(moe_intermediate_size=24)),  # gate and up apart, 1.5 blocks each
]


@pytest.mark.parametrize("arch,block,halves,overrides", CASES)
def test_fp8_experts_model_equals_dequantised_reference(monkeypatch, arch, block, halves, overrides):
    ref, model = _fp8_model(arch, block, halves, **overrides)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    report = mla_fuser.fuse(model)
    assert not any("capture" in n for n in report.notes), report.notes  # the capture forward ran our experts
    rows = {r.qualname: r for r in report.rows}
    experts = [n for n, m in model.named_modules() if hasattr(m, "gate_up_proj_scale_inv")]
    for name in experts:
        row = rows[name]
        assert row.fuser == "fp8" and row.status == "fused", row.reason
        assert "FP8 e4m3 experts" in row.reason and ("gate and up apart" in row.reason) == (
            halves or overrides.get("moe_intermediate_size", 32) % block[0] == 0)
        block_row = rows[name.rsplit(".", 1)[0]]
        assert block_row.fuser == "moe" and block_row.status == "fused", block_row.reason
    calls = []
    real = fp8_launch.fused_experts_fp8_ref
    monkeypatch.setattr(fp8_launch, "fused_experts_fp8_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert calls  # the FP8 experts ran fused_experts_fp8 (Transformers' own would need a Hub kernel)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False))
    after = model.state_dict()  # the checkpoint's keys, float8 dtypes and scales, untouched
    assert after.keys() == before.keys()
    for key, (dtype, value) in before.items():
        assert after[key].dtype == dtype, key
        same = (torch.equal(after[key].view(torch.uint8), value.view(torch.uint8)) if dtype.itemsize == 1
                else torch.equal(after[key], value))
        assert same, key


# ----------------------------------------------------------------------------------------------------------------
# declines


def _experts_of(model):
    return next((n, m) for n, m in model.named_modules() if hasattr(m, "gate_up_proj_scale_inv"))


@pytest.mark.parametrize("damage,reason", [
    ("no_scales", "the scales are missing"),
    ("grid", "do not fit"),
    ("ue8m0", "UE8M0"),
    ("clamped_gate", "gating function"),
])
def test_declined_fp8_experts_are_reported(damage, reason):
    _, model = _fp8_model("deepseek_v3", (16, 16))
    name, experts = _experts_of(model)
    if damage == "no_scales":
        del experts.gate_up_proj_scale_inv
    elif damage == "grid":
        experts.gate_up_proj_scale_inv = nn.Parameter(torch.ones(4, 3, 4), requires_grad=False)
    elif damage == "ue8m0":
        experts.down_proj_scale_inv = nn.Parameter(torch.ones(4, 4, 2).to(torch.float8_e8m0fnu), requires_grad=False)
    else:  # a SwiGLU clamp (the FP8 experts' own _apply_gate honours it): no longer act(gate) * up
        experts.limit = 0.5
    report = mla_fuser.fuse(model)
    rows = {r.qualname: r for r in report.rows}
    assert rows[name].fuser == "fp8" and rows[name].status == "fallback" and reason in rows[name].reason
    block = rows[name.rsplit(".", 1)[0]]
    assert block.fuser == "moe" and block.status == "fallback" and reason in block.reason
    assert "_ExpertsConfigView" not in type(experts.__dict__.get("config")).__name__


def test_recognised_by_tensors_not_by_class():
    (q1, s1, q2, s2), _ = _stacks(3, 32, 24, (16, 16), True)
    layout, reason = explain_fp8_experts(_Stacks(q1, s1, q2, s2))  # no block_size: 128x128 does not fit, inferred
    assert reason == "" and layout.halves and layout.gate_up_block == (16, 16) and layout.up_scale_base == 2
    assert "scales are missing" in explain_fp8_experts(_no_scale(q1, s1, q2, s2))[1]
    assert "do not fit" in explain_fp8_experts(_Stacks(q1, s1[:, :2], q2, s2, (16, 16)))[1]
    assert "float8_e5m2" in explain_fp8_experts(_Stacks(q1.to(torch.float8_e5m2), s1, q2, s2))[1]


def _no_scale(q1, s1, q2, s2):
    module = _Stacks(q1, s1, q2, s2)
    del module.gate_up_proj_scale_inv
    return module


# ----------------------------------------------------------------------------------------------------------------
# FP8 on demand


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_fp8_on_demand_quantises_expert_stacks(tmp_path):
    plain = tiny_deepseek("deepseek_v3", attn="eager", q_lora_rank=32)
    plain.save_pretrained(tmp_path)
    config = FineGrainedFP8Config(weight_block_size=[16, 16])
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32)
    name, experts = _experts_of(model)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj.dtype == torch.float8_e4m3fn
    report = model.fusion_report
    assert any("1 expert stacks quantised" in n for n in report.notes), report.notes
    row = next(r for r in report.rows if r.qualname == name)
    assert row.fuser == "fp8" and row.status == "fused" and not report.fallbacks("fp8")
    # equal to the same model with every quantised weight dequantised in fp32
    for mod_name, module in model.named_modules():
        if hasattr(module, "weight_scale_inv"):
            plain.get_submodule(mod_name).weight.data = dequantize_block_fp8(module.weight, module.weight_scale_inv,
                                                                             (16, 16))
    ref_experts = plain.get_submodule(name)
    kw = dict(gated=True, up_scale_base=2, up_row_shift=0)
    ref_experts.gate_up_proj.data = torch.stack([dequantize_expert(experts.gate_up_proj[e],
                                                                   experts.gate_up_proj_scale_inv[e], (16, 16), **kw)
                                                 for e in range(4)])
    ref_experts.down_proj.data = torch.stack([dequantize_expert(experts.down_proj[e], experts.down_proj_scale_inv[e],
                                                                (16, 16)) for e in range(4)])
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain.eval()(ids).logits, atol=1e-5, rtol=1e-4)


def test_fp8_experts_refuse_bad_inputs_like_the_bf16_ones():
    """The entry points share one check of stacks and routing with the bf16 experts (``check_stacks_and_routing``):
    float routing ids are refused, not cast; then the FP8-only checks (stack dtype, scale grids)."""
    (q1, s1, q2, s2), layout = _stacks(4, 32, 16, (16, 16), halves=False)
    hidden = torch.randn(3, 32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.rand(3, 2)
    with pytest.raises(TypeError, match="integer"):
        fm.fused_experts_fp8_ref(hidden, q1, s1, q2, s2, ids.float(), weights, **layout)
    with pytest.raises(ValueError, match="topk_weights"):
        fm.fused_experts_fp8_ref(hidden, q1, s1, q2, s2, ids, weights[:, :1], **layout)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fm.fused_experts_fp8_ref(hidden, q1.float(), s1, q2, s2, ids, weights, **layout)
    with pytest.raises(ValueError, match="gate_up_scale"):
        fm.fused_experts_fp8_ref(hidden, q1, s1[:2], q2, s2, ids, weights, **layout)
