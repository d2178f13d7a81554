"""``block_fp8_linear``: ``y = x @ dequant(W)^T + b`` for a block-FP8 weight, on our own kernels (no Hub download).

Four Triton paths (:mod:`.triton_kernels`), chosen by :func:`choose_path` from the number of tokens and the weight's
shape:

* up to ``GEMV_MAX_TOKENS`` tokens (decode), the **GEMV**: weight-only, one launch for the whole of K, the block scales
  folded into the activations (``w8_gemv_kernel``; it needs a power-of-two tile of at least ``GEMV_MIN_BLOCK_N``
  rows dividing the quantisation block's ``bn``, else the next path runs);
* below ``FP8_TENSOR_CORE_MIN_TOKENS`` tokens, **W8A8**: the split-K GEMM with each activation tile quantised in
  registers per token and ``bk`` features and the e4m3 weight tile fed to FP8 tensor cores as loaded
  (``w8_gemm_kernel``'s ``ACT_QUANT``), on GPUs with FP8 tensor cores (compute capability >= 8.9), fp16/bf16
  activations, ``bk`` in ``W8A8_GROUPS``, at least ``W8A8_MIN_K_TILES`` K tiles and, at few tokens, weights large
  enough to gain (``W8A8_MIN_WEIGHT``; at one token it reads large weights faster than the GEMV);
* where W8A8 cannot run, **weight-only**: activations stay in their dtype, weights are widened in the kernel (the
  more accurate path: no activation rounding);
* from ``FP8_TENSOR_CORE_MIN_TOKENS`` tokens (from ``TENSOR_CORE_WIDE_MIN_TOKENS`` where its output tiles alone fill
  the SMs), on GPUs with FP8 tensor cores, the **FP8 tensor-core GEMM** on activations quantised per token and
  ``bk`` features by a launch of their own (dynamic scaling), where the GEMM is compute-bound.

``MLA_FUSER_FP8_ACT_QUANT=0`` (read per call) keeps the weight-only paths at every size.

Launch configs (tiles, warps, stages, split-K, MMA or GEMV) come from small tables keyed by token count,
``W8_CONFIGS``, ``W8A8_CONFIGS`` and ``TC_CONFIGS`` (picked by ``benchmarks/bench_fp8_gemm.py``), and the one-token
GEMV's
``GEMV_CONFIG`` (``--gemv-sweep``), resolved once per shape into a cached plan (``gemv_plan``, ``w8_plan``,
``tc_plan``): a decode GEMM's host work is a cache lookup, its allocations and one launch (a split K is summed by a
second launch with ``MLA_FUSER_SPLITK_FIXUP=0``, else by the last split of each output tile).

Torch references: ``block_fp8_linear_ref`` (weight-only, fp32 math: what a model whose FP8 weights were
dequantised to fp32 computes) and ``block_fp8_linear_act_quant_ref`` (the FP8 path's math, activations quantised
the same way).  CPU tensors run the weight-only reference; ``MLA_FUSER_BACKEND`` forces a backend
(``dispatch.use_triton``).  The op is the custom op ``mla_fuser::block_fp8_linear`` under torch.compile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ... import envs
from ..dispatch import cdiv, cuda_index, kernel_op, next_pow2, pow2_divisor, triton_interpreting, use_triton
from .format import FP8_DTYPE, FP8_MAX
from .quant import dequantize_block_fp8, dequantize_token_groups, quantize_token_groups_ref
from .triton_kernels import act_quant_kernel, fp8_gemm_kernel, splitk_reduce_kernel, w8_gemm_kernel, w8_gemv_kernel
from ..tma import tma_operand, tma_ready


# tokens from which the FP8 tensor-core path runs (benchmarks/bench_fp8_gemm.py measures both paths at every size)
FP8_TENSOR_CORE_MIN_TOKENS = 128
# up to this many tokens the GEMV runs.  It reads the weight once per token, so it pays at one token only: on an H200
# (``fp8_gemm_decode.json``, CUDA-graph timing) at 1 token it beat the split-K weight-only GEMM on every V2-Lite and
# V3 shape measured (q_proj 5.8 vs 8.4 us, V3 down 60 vs 63 us), at 4 tokens it lost on most (q_proj 9.4 vs 8.4,
# V3 down 132 vs 63: the weight re-read from HBM where it outgrows L2)
GEMV_MAX_TOKENS = 1
GEMV_MIN_BLOCK_N = 4
# W8A8 against the weight-only paths on an H200 (``bench_fp8_gemm.py``, CUDA-graph timing, V2-Lite and V3 shapes at
# 1-64 tokens; ``fp8_gemm_w8a8.json``, ``fp8_gemm_w8a8_small.json``, ``fp8_gemm_auto_w8a8.json``): at 2-16 tokens it
# beat the weight-only GEMM on V3's large weights (MLP down 40 vs 63 us, o_proj 36 vs 56, gate_up 72 vs 100: 75-87%
# of the copy bandwidth) but not on V2-Lite's small ones (q+kv_a 8.9 vs 8.3 us, shared down 8.6 vs 7.8 at 16
# tokens; the V2-Lite-shaped model's linears took 1.03 against 0.96 ms of its 16x4096 step), so below 2**24 weight
# elements they stay weight-only; from 17 tokens it won on every shape (32 tokens: q+kv_a 11.1 vs 12.2, V3 down 70
# vs 85).  With 4 K tiles (V3 kv_b_proj, K 512) it lost, 11.1 vs 9.7 us.  At one token it beat the GEMV from 2**25
# elements on (V3 q_b_proj 15 vs 19 us, V2-Lite's dense MLP gate_up 17.1 vs 17.8, V3 MLP down about even) and lost
# below (V3 q_a+kv_a, 15M: 12.0 vs 9.2; V2-Lite q+kv_a 8.7 vs 5.3).  From 64 tokens the tensor-core GEMM (no
# split-K) won where its 64x64 output tiles alone fill the SMs (V3 gate_up 96 vs 137 us, q_b_proj 17 vs 34;
# narrower: V3 down 111 vs 82).
W8A8_MIN_K_TILES = 8
# ``(max tokens, min N*K)``: up to that many tokens W8A8 takes weights of at least that many elements; above the last
# row, any
W8A8_MIN_WEIGHT = ((GEMV_MAX_TOKENS, 1 << 25), (16, 1 << 24))
TENSOR_CORE_WIDE_MIN_TOKENS = 64
GEMV, WEIGHT_ONLY, W8A8, TENSOR_CORE = "gemv", "weight_only", "w8a8", "fp8_tensor_core"
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
W8A8_DTYPES = (torch.bfloat16, torch.float16)
_PER_TENSOR = 1 << 30  # "block" size that puts every element in block 0 (a per-tensor scale)
_TINY_SCALE = 1e-12


def _block(block_n: int, block_k: int) -> tuple[int, int] | None:
    return None if block_n <= 0 else (block_n, block_k)


def block_fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only reference: the weight dequantised in fp32, an fp32 GEMM, the result in ``x``'s dtype."""
    w = dequantize_block_fp8(weight, scale, _block(block_n, block_k), torch.float32)
    out = F.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return out.to(x.dtype)


def block_fp8_linear_act_quant_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                                   block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor-core path's math: activations quantised per token and ``block_k`` features, then fp32."""
    rows = x.reshape(-1, x.shape[-1])
    q, s = quantize_token_groups_ref(rows, block_k)
    xd = dequantize_token_groups(q, s, block_k)
    w = dequantize_block_fp8(weight, scale, _block(block_n, block_k), torch.float32)
    out = F.linear(xd, w, None if bias is None else bias.to(torch.float32))
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _has_fp8_mma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def has_fp8_tensor_cores(x: torch.Tensor) -> bool:
    """``x``'s GPU multiplies e4m3 on its tensor cores (compute capability >= 8.9); the interpreter stands in."""
    return _has_fp8_mma(cuda_index(x)) if x.is_cuda else triton_interpreting()


def gemv_block_n(block_n: int, wanted: int) -> int:
    """The GEMV's row tile: ``wanted`` capped to the largest power of two dividing the quantisation block's ``bn``
    (any, for a per-tensor scale: ``block_n`` 0), so that a tile's rows share one scale row; 0 when that is below
    ``GEMV_MIN_BLOCK_N`` (the GEMV is not taken)."""
    tile = wanted if block_n <= 0 else pow2_divisor(block_n, wanted)
    return tile if tile >= GEMV_MIN_BLOCK_N else 0


def choose_path(tokens: int, x: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> str:
    """The path of one call of ``tokens`` rows of ``x`` on an ``[n, k]`` weight (see the module's docstring); the
    FP8 paths need FP8 tensor cores and ``MLA_FUSER_FP8_ACT_QUANT`` (read per call) not off."""
    fp8_mma = envs.fp8_act_quant() and has_fp8_tensor_cores(x)
    sms = _sm_count(cuda_index(x)) if x.is_cuda else 0
    return _path(tokens, n, k, block_n, block_k, fp8_mma, fp8_mma and x.dtype in W8A8_DTYPES, sms)


@functools.lru_cache(maxsize=4096)
def _path(tokens: int, n: int, k: int, block_n: int, block_k: int, fp8_mma: bool, w8a8_dtype: bool, sms: int) -> str:
    min_weight = next((elems for max_tokens, elems in W8A8_MIN_WEIGHT if tokens <= max_tokens), 0)
    w8a8 = (w8a8_dtype and block_n > 0 and block_k in W8A8_GROUPS and cdiv(k, block_k) >= W8A8_MIN_K_TILES
            and n * k >= min_weight)
    if tokens <= GEMV_MAX_TOKENS and gemv_block_n(block_n, GEMV_CONFIG.block_n) and not w8a8:
        return GEMV
    if fp8_mma and block_n > 0 and block_k % 64 == 0:
        if tokens >= FP8_TENSOR_CORE_MIN_TOKENS:
            return TENSOR_CORE
        if tokens >= TENSOR_CORE_WIDE_MIN_TOKENS:
            tile = table_config(TC_CONFIGS, tokens, n * k)
            if cdiv(tokens, tile.block_m) * cdiv(n, tile.block_n) >= max(1, sms):
                return TENSOR_CORE
    return W8A8 if w8a8 else WEIGHT_ONLY


def triton_supported(x: torch.Tensor, block_n: int, block_k: int) -> bool:
    """The kernels take fp16/bf16/fp32 activations and K blocks with a power-of-two divisor >= 16."""
    return x.dtype in KERNEL_DTYPES and (block_n <= 0 or pow2_divisor(block_k, 128) >= 16)


# ----------------------------------------------------------------------------------------------------------------
# launch configs: small tables keyed by token count (and weight size), looked up once per shape


class W8Config(NamedTuple):
    """A weight-only launch: ``block_m x block_n x block_k`` tiles (``block_k`` is capped to the largest power of
    two dividing the quantisation block's ``bk``), Triton's ``warps``/``stages``; split-K aims at ``fill``
    programs per SM when the output tiles alone give fewer (0: never split); ``dot``: tensor-core MMA on the
    widened weights, else an fp32 multiply-and-sum (a GEMV, for ``block_m`` 1-4); ``act_quant``: W8A8 instead
    (``w8_gemm_kernel``'s ``ACT_QUANT``: activations quantised in the kernel, FP8 tensor cores; ``block_k`` must be the
    quantisation block's ``bk``, one of ``W8A8_GROUPS``, and ``block_n`` at least 64; ``W8A8_CONFIGS``); ``tma``:
    the weight tiles come by the Tensor Memory Accelerator where :func:`tma_ready` says they can.  (fp16
    dots on power-of-two-scaled bf16 rows, which avoid widening e4m3 through fp16 to bf16, were slower on an H200 at
    1-16 tokens on every shape measured, e.g. V3's MLP down 77 against 63 us: ``fp8_gemm_variants.json``.)"""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 4
    fill: int = 2
    dot: bool = True
    act_quant: bool = False
    tma: bool = False


class TCConfig(NamedTuple):
    """An FP8 tensor-core launch: tiles (``block_k`` divides the quantisation block's ``bk``), ``group_m`` row
    tiles walked per column tile (L2 reuse of the weight tile), Triton's ``warps``/``stages``; ``tma``: the tiles
    come by the Tensor Memory Accelerator where :func:`tma_ready` says they can (else by loads from pointers)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    tma: bool = False


# ``(max tokens, max N*K, config)``, None = no bound; the first row that fits a call applies.  Picked by
# ``benchmarks/bench_fp8_gemm.py --sweep`` on an H200 (triton 3.6, CUDA-graph timing; ``fp8_gemm_sweep.json``): at
# each token count the config with the best geometric-mean time over four shapes (V2-Lite q_proj and kv_a_proj,
# V3 gate_up and down).  Against each shape's own best: weight-only 1.04x (worst 1.16x, V3 down) at 1 and 16 tokens,
# 1.10x (worst 1.25x, V2-Lite kv_a) at 64; tensor cores 1.00x at 64, 1.05x at 512, 1.00x at 8192.  At 64 tokens the
# tensor cores won only on V3 gate_up (97 vs 172 us), so the weight-only path keeps everything below 128 tokens.
W8_CONFIGS: tuple[tuple[int | None, int | None, W8Config], ...] = (
    (16, None, W8Config(16, 32, 128, warps=4, stages=3, fill=4)),
    (None, None, W8Config(64, 128, 128, warps=4, stages=3, fill=4)),
)
# W8A8: the weight-only rows' tiles, 64 columns wide at least (``wgmma``'s M side: the product is computed transposed,
# weight rows by tokens) and K tiles of the quantisation block's ``bk`` (as timed: ``fp8_gemm_w8a8*.json``)
W8A8_CONFIGS: tuple[tuple[int | None, int | None, W8Config], ...] = (
    (16, None, W8Config(16, 64, 128, warps=4, stages=3, fill=4, act_quant=True)),
    (None, None, W8Config(64, 128, 128, warps=4, stages=3, fill=4, act_quant=True)),
)
# Tensor cores: tiles by TMA (``tma``), timed both ways in one run on an H100 (``fp8_gemm_tma_h100.json``): faster on
# every shape at 512 and 8192 tokens (V3 gate_up 358 / 5596 us against 419 / 6069, V3 down 192 / 3142 against 235 /
# 3406, V2-Lite q_proj 14.0 / 159 against 16.9 / 167) and with the first row's tile at 16 tokens (q_proj 10.8 against
# 18.3 us, V3 down 74 against 179).  The split-K tables keep pointer loads: at 16 tokens W8A8 tied
# and weight-only went either way (q_proj 8.6 against 8.2 us, V3 down 69.3 against 62.0, V3 gate_up 115.6 / 123.6).
TC_CONFIGS: tuple[tuple[int | None, int | None, TCConfig], ...] = (
    (64, None, TCConfig(64, 64, 128, group_m=8, warps=4, stages=4, tma=True)),
    (512, None, TCConfig(64, 128, 128, group_m=8, warps=4, stages=4, tma=True)),
    (None, None, TCConfig(128, 128, 128, group_m=8, warps=8, stages=3, tma=True)),
)


class GEMVConfig(NamedTuple):
    """The decode GEMV's launch: ``block_n`` weight rows (capped by :func:`gemv_block_n`) by ``block_k`` columns per
    step (capped to K's power of two), Triton's ``warps``/``stages``.  The defaults won ``bench_fp8_gemm.py
    --gemv-sweep`` on an H200 at one token (``fp8_gemv_sweep.json``): geometric mean 1.03x of each shape's own best
    tile over seven V2-Lite and V3 shapes, worst 1.07x."""

    block_n: int = 8
    block_k: int = 1024
    warps: int = 4
    stages: int = 2


GEMV_CONFIG = GEMVConfig()
# quantisation blocks' ``bk`` the weight-only GEMM's W8A8 variant (``W8Config.act_quant``) takes: one K tile per
# activation group, and FP8 MMAs take K >= 32
W8A8_GROUPS = (32, 64, 128)
# split-K: at most this many splits, each at least this many K tiles (a split shorter than the pipeline's depth
# is mostly prologue)
MAX_SPLITS, MIN_K_TILES_PER_SPLIT = 16, 2
_REDUCE_BLOCK = 1024


def table_config(table, tokens: int, weight_elems: int):
    """The first row of ``table`` whose bounds hold ``tokens`` and ``N*K``."""
    for max_tokens, max_elems, config in table:
        if (max_tokens is None or tokens <= max_tokens) and (max_elems is None or weight_elems <= max_elems):
            return config
    raise ValueError("a config table needs a last row without bounds")


def _launcher(kernel, grid, warmup: bool):
    """``kernel[grid]``, or with ``warmup`` a compile without launching (the benchmark's sweep compiles its
    configs in threads)."""
    return functools.partial(kernel.get().warmup, grid=grid) if warmup else kernel[grid]


def _resolved(table, m: int, weight_elems: int, qbk: int, config, tiles):
    """The launch config of one call: ``config`` as given, else the table's row for ``m`` tokens with ``block_k``
    capped to the quantisation block's power-of-two divisor; ``tiles`` (block m, n, k) override the tiles.  The K
    tile must divide the quantisation block ``qbk`` (one scale column per K tile)."""
    cfg = config or table_config(table, m, weight_elems)
    if tiles is not None:
        cfg = cfg._replace(block_m=tiles[0], block_n=tiles[1], block_k=tiles[2])
    elif config is None:
        cfg = cfg._replace(block_k=min(cfg.block_k, pow2_divisor(qbk, 128)))
    if qbk % cfg.block_k:
        raise ValueError(f"BLOCK_K {cfg.block_k} must divide the quantisation block {qbk}")
    return cfg


class W8Plan(NamedTuple):
    config: W8Config
    splits: int
    k_per_split: int
    grid: tuple[int, int, int]
    reduce_grid: tuple[int]
    meta: dict  # the kernel's constexprs and launch options

    @property
    def fixup(self) -> bool:
        """The last split of each output tile reduces (no second launch)."""
        return self.meta["FIXUP"]


# The split-K fix-up's counters: one int32 ring per device of SPLIT_TICKET_SLICES slices of SPLIT_TICKETS counters
# (one per output tile: a split GEMM has at most fill x SMs tiles), zeroed when made and left at 0 by every launch.
SPLIT_TICKETS, SPLIT_TICKET_SLICES = 1024, 1024
_TICKETS: dict = {}
_NEXT_SLICE: dict = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_tickets_ready(device: torch.device) -> bool:
    """A fix-up GEMM can get counters on ``device`` now: its ring exists, or can be made (not while a CUDA graph is
    captured: the zeroing would only be recorded in that graph, and another graph or an eager call could read the
    memory first; the reduction runs instead)."""
    return device in _TICKETS or not _capturing(device)


def split_tickets(device: torch.device) -> torch.Tensor:
    """The counters one fix-up GEMM (``w8_gemm_kernel``'s ``FIXUP``) on ``device`` uses: the next slice of the
    device's ring, so GEMMs issued one after the other never share counters, even on two streams at once (a shared
    expert on a side stream), unless ``SPLIT_TICKET_SLICES`` calls lie between them.  The ring is zeroed when made;
    callers ask :func:`split_tickets_ready` first."""
    ring = _TICKETS.get(device)
    if ring is None:
        ring = _TICKETS[device] = torch.zeros(SPLIT_TICKET_SLICES, SPLIT_TICKETS, dtype=torch.int32, device=device)
    index = _NEXT_SLICE.get(device, 0)
    _NEXT_SLICE[device] = (index + 1) % SPLIT_TICKET_SLICES
    return ring[index]


def split_ticket_ring(device: torch.device) -> torch.Tensor | None:
    """The device's whole ring of fix-up counters (None before the first fix-up GEMM): all 0 between launches."""
    return _TICKETS.get(device)


@functools.lru_cache(maxsize=1024)
def w8_plan(m: int, n: int, k: int, block_n: int, block_k: int, dtype: torch.dtype, has_bias: bool,
            interpreting: bool, device_index: int | None, config: W8Config | None = None,
            tiles: tuple[int, int, int] | None = None, splits: int | None = None, fixup: bool = False,
            act_quant: bool = False) -> W8Plan:
    """Everything a weight-only launch needs but its tensors, computed once per shape (a decode step's host work
    is one cache lookup); ``act_quant``: the W8A8 variant's table (``W8A8_CONFIGS``).  ``config``/``tiles``/``splits``
    override the table (tests, the benchmark's sweep);
    ``device_index`` (None off CUDA) gives the SM count the split is sized by; ``fixup``: a split K is reduced by
    each tile's last split (``w8_gemm_kernel``'s ``FIXUP``) instead of ``splitk_reduce_kernel``, where the tiles fit
    one slice of ``split_tickets``."""
    qbk = block_k if block_n > 0 else _PER_TENSOR
    cfg = _resolved(W8A8_CONFIGS if act_quant else W8_CONFIGS, m, n * k, qbk, config, tiles)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    k_tiles = cdiv(k, bk)
    grid_mn = cdiv(m, bm) * cdiv(n, bn)
    if splits is None:
        splits = 1
        if cfg.fill > 0 and device_index is not None:
            wanted = cdiv(cfg.fill * _sm_count(device_index), grid_mn)
            splits = max(1, min(wanted, k_tiles // MIN_K_TILES_PER_SPLIT, MAX_SPLITS))
    k_per_split = cdiv(k_tiles, max(1, splits)) * bk
    splits = cdiv(k, k_per_split)  # (no split starts past K)
    fixup = fixup and splits > 1 and grid_mn <= SPLIT_TICKETS
    if cfg.act_quant and not (block_n > 0 and bk == qbk and qbk in W8A8_GROUPS and dtype in W8A8_DTYPES):
        raise ValueError(f"W8A8 needs fp16/bf16 activations and a block-quantised weight whose bk ({block_k}) is "
                         f"one of {W8A8_GROUPS} and the K tile ({bk})")
    meta = dict(HAS_BIAS=has_bias and (splits == 1 or fixup), EVEN_K=k % bk == 0, DOT=cfg.dot, UPCAST=interpreting,
                IEEE=dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FIXUP=fixup,
                ACT_QUANT=cfg.act_quant, num_warps=cfg.warps, num_stages=cfg.stages)
    return W8Plan(cfg, splits, k_per_split, (cdiv(m, bm), cdiv(n, bn), splits), (cdiv(m * n, _REDUCE_BLOCK),), meta)


def w8_linear_triton(x2: torch.Tensor, weight, scale, bias, block_n: int, block_k: int, splits: int | None = None,
                     tiles: tuple[int, int, int] | None = None, config: W8Config | None = None,
                     warmup: bool = False, act_quant: bool = False) -> torch.Tensor:
    """Weight-only Triton GEMM on ``x2 [M, K]`` (with ``act_quant``, its W8A8 variant's table): one kernel, plus the
    split-K reduction (which adds the bias and casts) when K is split, unless ``MLA_FUSER_SPLITK_FIXUP`` (on by
    default) has the kernel's last split per output tile do it (``w8_gemm_kernel``'s ``FIXUP``; the same bits, one
    launch: H200, V2-Lite-shaped model at B=16 L=4096, step replay 6.17 against 6.20 ms and 760 against 869 launches,
    ``profile_decode_step_fp8_splitk_fixup.json``).  ``splits``/``tiles``/``config`` override the table (tests,
    benchmarks); ``warmup`` compiles without launching."""
    m, k = x2.shape
    n = weight.shape[0]
    if not (m and n and k):
        return block_fp8_linear_ref(x2, weight, scale, block_n, block_k, bias)
    fixup = envs.splitk_fixup() and split_tickets_ready(x2.device)
    plan = w8_plan(m, n, k, block_n, block_k, x2.dtype, bias is not None, triton_interpreting(),
                   x2.device.index if x2.is_cuda else None, config, tiles, splits, fixup, act_quant)
    qbn, qbk = (block_n, block_k) if block_n > 0 else (_PER_TENSOR, _PER_TENSOR)
    scale2 = scale.reshape(1, 1) if scale.ndim == 0 else scale
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    split = plan.splits > 1
    dest = torch.empty((plan.splits, m, n), dtype=torch.float32, device=x2.device) if split else out
    tickets = split_tickets(x2.device) if plan.fixup else dest  # (an unused pointer without the fix-up)
    cfg = plan.config
    w_tma = cfg.tma and tma_ready(x2, weight)
    _launcher(w8_gemm_kernel, plan.grid, warmup)(
        x2, tma_operand(weight, [cfg.block_n, cfg.block_k], w_tma), scale2,
        bias if plan.meta["HAS_BIAS"] else scale2, dest, out, tickets,
        m, n, k, plan.k_per_split,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), scale2.stride(0), scale2.stride(1),
        m * n if split else 0, n,
        qbn, qbk,
        W_TMA=w_tma, **plan.meta,
    )
    if split and not plan.fixup:
        _launcher(splitk_reduce_kernel, plan.reduce_grid, warmup)(
            dest, bias if bias is not None else dest, out, m * n, n, plan.splits,
            HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
        )
    return out


class GEMVPlan(NamedTuple):
    grid: tuple[int, int]
    meta: dict


@functools.lru_cache(maxsize=1024)
def gemv_plan(m: int, n: int, k: int, block_n: int, has_bias: bool, config: GEMVConfig = GEMV_CONFIG) -> GEMVPlan:
    """The decode GEMV's launch for one shape (cached like :func:`w8_plan`)."""
    bn = gemv_block_n(block_n, config.block_n)
    if not bn:
        raise ValueError(f"no GEMV row tile of at least {GEMV_MIN_BLOCK_N} divides the quantisation block {block_n}")
    bk = min(config.block_k, next_pow2(k))
    meta = dict(HAS_BIAS=has_bias, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.warps,
                num_stages=config.stages)
    return GEMVPlan((m, cdiv(n, bn)), meta)


def w8_gemv_triton(x2: torch.Tensor, weight, scale, bias, block_n: int, block_k: int,
                   config: GEMVConfig = GEMV_CONFIG, warmup: bool = False) -> torch.Tensor:
    """The decode GEMV on ``x2 [M, K]`` (``w8_gemv_kernel``): one launch; ``config`` overrides the tiles (benchmark
    sweeps); ``warmup`` compiles without launching."""
    m, k = x2.shape
    n = weight.shape[0]
    if not (m and n and k):
        return block_fp8_linear_ref(x2, weight, scale, block_n, block_k, bias)
    plan = gemv_plan(m, n, k, block_n, bias is not None, config)
    qbn, qbk = (block_n, block_k) if block_n > 0 else (_PER_TENSOR, _PER_TENSOR)
    scale2 = scale.reshape(1, 1) if scale.ndim == 0 else scale
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    _launcher(w8_gemv_kernel, plan.grid, warmup)(
        x2, weight, scale2, bias if bias is not None else scale2, out,
        n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), scale2.stride(0), scale2.stride(1),
        out.stride(0),
        qbn, qbk,
        **plan.meta,
    )
    return out


def quantize_token_groups(x2: torch.Tensor, group: int):
    """Triton per-token-group activation quantisation (``quantize_token_groups_ref``'s twin).  The scales come
    back as ``[M, groups]`` but are stored group-major (a transposed view): the GEMM reads a tile's rows' scales
    as one contiguous load."""
    m, k = x2.shape
    groups = cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    s = torch.empty((groups, m), dtype=torch.float32, device=x2.device).t()
    if m:
        pow2 = next_pow2(group)
        block_g = min(next_pow2(groups), max(1, 1024 // pow2))
        act_quant_kernel[(m, cdiv(groups, block_g))](
            x2, q, s, k, groups, x2.stride(0), x2.stride(1), q.stride(0), s.stride(0), s.stride(1),
            FP8_MAX=FP8_MAX, TINY=_TINY_SCALE, GROUP=group, GROUP_POW2=pow2, BLOCK_G=block_g,
            ROUND_FIRST=triton_interpreting(),
        )
    return q, s


class TCPlan(NamedTuple):
    config: TCConfig
    grid: tuple[int]
    meta: dict


@functools.lru_cache(maxsize=1024)
def tc_plan(m: int, n: int, k: int, block_n: int, block_k: int, has_bias: bool, interpreting: bool,
            config: TCConfig | None = None, tiles: tuple[int, int, int] | None = None) -> TCPlan:
    """The FP8 tensor-core launch for one shape (cached like :func:`w8_plan`)."""
    cfg = _resolved(TC_CONFIGS, m, n * k, block_k, config, tiles)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    meta = dict(HAS_BIAS=has_bias, EVEN_K=k % bk == 0, SCALAR_B=block_n % bn == 0, UPCAST=interpreting,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, num_warps=cfg.warps,
                num_stages=cfg.stages)
    return TCPlan(cfg, (cdiv(m, bm) * cdiv(n, bn),), meta)


def fp8_linear_triton(x2: torch.Tensor, weight, scale, bias, block_n: int, block_k: int,
                      tiles: tuple[int, int, int] | None = None, config: TCConfig | None = None,
                      warmup: bool = False) -> torch.Tensor:
    """FP8 tensor-core Triton GEMM on ``x2 [M, K]`` (activations quantised per token and ``block_k`` features).
    ``tiles``/``config`` override the table; ``warmup`` compiles the GEMM without launching anything."""
    m, k = x2.shape
    n = weight.shape[0]
    if not (m and n and k):
        return block_fp8_linear_act_quant_ref(x2, weight, scale, block_n, block_k, bias)
    plan = tc_plan(m, n, k, block_n, block_k, bias is not None, triton_interpreting(), config, tiles)
    if warmup:  # (the operands' values do not matter to a compile)
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
        s = torch.empty((cdiv(k, block_k), m), dtype=torch.float32, device=x2.device).t()
    else:
        q, s = quantize_token_groups(x2, block_k)
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    cfg = plan.config
    tma = cfg.tma and tma_ready(x2, q, weight)
    _launcher(fp8_gemm_kernel, plan.grid, warmup)(
        tma_operand(q, [cfg.block_m, cfg.block_k], tma), s, tma_operand(weight, [cfg.block_n, cfg.block_k], tma),
        scale, bias if bias is not None else scale, out,
        m, n, k,
        q.stride(0), s.stride(0), s.stride(1), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0),
        block_n, block_k,
        TMA=tma, **plan.meta,
    )
    return out


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block_n: int, block_k: int) -> torch.Tensor:
    shape = (*x.shape[:-1], weight.shape[0])
    if x.is_meta or weight.is_meta:
        return x.new_empty(shape)
    if not (use_triton(x, weight) and triton_supported(x, block_n, block_k)):
        return block_fp8_linear_ref(x, weight, scale, block_n, block_k, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    path = choose_path(x2.shape[0], x, weight.shape[0], weight.shape[1], block_n, block_k)
    if path == GEMV:
        out = w8_gemv_triton(x2, weight, scale, bias, block_n, block_k)
    elif path == TENSOR_CORE:
        out = fp8_linear_triton(x2, weight, scale, bias, block_n, block_k)
    else:
        out = w8_linear_triton(x2, weight, scale, bias, block_n, block_k, act_quant=path == W8A8)
    return out.view(shape)


@kernel_op("block_fp8_linear", eager=_linear_impl)
def _linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               block_n: int, block_k: int) -> torch.Tensor:
    return _linear_impl(x, weight, scale, bias, block_n, block_k).contiguous()


@_linear_op.register_fake
def _linear_fake(x, weight, scale, bias, block_n, block_k):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K], scale)^T (+ bias)`` in ``x``'s dtype; ``block`` = ``(bn, bk)``, or
    None for a per-tensor scale.  While autograd records (``x`` needs a gradient) the torch reference runs: the
    kernels have no backward."""
    block_n, block_k = block if block is not None else (0, 0)
    if torch.is_grad_enabled() and x.requires_grad:
        return block_fp8_linear_ref(x, weight, scale, block_n, block_k, bias)
    return _linear_op(x, weight, scale, bias, int(block_n), int(block_k))
