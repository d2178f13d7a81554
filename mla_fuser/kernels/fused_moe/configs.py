"""Tile configs of the fused MoE kernels: defaults for H100/H200-class GPUs, or tuned ones from a JSON file.

Tuned tiles stay data, not code: ``benchmarks/bench_fused_moe.py --sweep`` writes them (its ``best_configs``
JSON) and ``MLA_FUSER_MOE_CONFIGS`` names the file to use (the variable is read at each call, a file parsed once).
The decode GEMVs' defaults come from the shipped table of :mod:`.gemv_tiles` (per layer size, dtype and tokens).
"""

from __future__ import annotations

import functools
import json

from ... import envs
from .gemv_tiles import decode_gemv_tiles


def default_config(path: str, num_tokens: int, topk: int, num_experts: int, hidden: int = 0) -> dict:
    """Starting points for H100/H200-class GPUs (bf16); ``benchmarks/bench_fused_moe.py --sweep``
    measures better ones, loadable through ``MLA_FUSER_MOE_CONFIGS``.

    small: memory bound, one tile of 16 rows (minimum tl.dot M) per expert; narrow N-tiles give enough
    programs to keep all SMs streaming when only 6 experts are live (1 token: 6 x 44 GEMM1 programs);
    4 stages keep bytes in flight, and the modest tile leaves room for several programs per SM.
    aligned: BLOCK_M follows the average number of pairs per expert so an expert's weights are read by
    as few tiles as possible while not padding too much.  ``hidden`` (the layer's hidden size; 0: unknown) picks
    the decode GEMVs' tuned tiles (:mod:`.gemv_tiles`): ``gemv2``, and ``gemv1`` where GEMM1 is a GEMV too.
    """
    if path == "small":
        # sm_90 build of these: GEMM1 140 registers / 60 KB smem, GEMM2 108 / 36 KB, no spills.
        g1 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        # GEMV down+combine (T <= GEMV_DOWN_MAX_TOKENS): 8 rows x 512 per expert tile, 6 tiles in flight per
        # step; H/8 = 256 programs for one token (two per SM).
        gv = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)
        gemv1, gemv2 = decode_gemv_tiles(num_tokens, hidden) or (None, gv)
        cfg = {"gemm1": g1, "gemm2": g2, "gemv2": gemv2}
        if gemv1:
            cfg["gemv1"] = gemv1
        return cfg
    avg = num_tokens * topk / max(1, num_experts)
    if avg <= 16:
        g = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif avg <= 32:
        g = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
    elif avg <= 96:
        g = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif avg > 256:
        # prefill-sized (compute-bound); the best of a sweep on an H200 at 8192 tokens (avg 768 pairs per
        # expert, benchmarks/results/fused_moe_sweep_prefill.json): 2.07 ms vs 2.16 with the tile below
        return {"gemm1": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4),
                "gemm2": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)}
    else:
        g = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    g1 = dict(g)
    if g["BLOCK_M"] == 128:  # GEMM1 carries two accumulators; keep its register footprint like GEMM2's
        g1["BLOCK_N"] = 64
        g1["num_warps"] = 4
    return {"gemm1": g1, "gemm2": dict(g)}


def default_fp8_config(path: str, num_tokens: int, topk: int, num_experts: int, hidden: int = 0) -> dict:
    """The block-FP8 experts' defaults: :func:`default_config`'s, except the aligned path's tiles at decode batch sizes
    (up to 16 pairs per expert): half as wide (32 columns) with 3 stages.  An e4m3 tile holds half the bytes of a bf16
    one, so narrower tiles keep more programs streaming.  On an H200 (``bench_fp8_gemm.py --experts-sweep
    --experts-sweep-path aligned``, one V2-Lite layer, GPU time; ``fp8_experts_sweep_aligned.json``) the best of 36
    tiles at 8 and 16 tokens: 117 vs 126 us and 164 vs 175 us with the bf16 tiles."""
    cfg = default_config(path, num_tokens, topk, num_experts, hidden)
    gemvs = decode_gemv_tiles(num_tokens, hidden, fp8=True) if path == "small" else None
    if gemvs:  # (their own decode GEMV tiles, beside the bf16 ones)
        if gemvs[0]:
            cfg["fp8_gemv1"] = gemvs[0]
        cfg["fp8_gemv2"] = gemvs[1]
    if path == "aligned" and num_tokens * topk / max(1, num_experts) <= 16:
        tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        cfg = {"gemm1": dict(tile), "gemm2": dict(tile)}
    return cfg


# the W8A8 GEMMs' tile regimes by pairs per expert (``default_w8a8_config``): the decode tile up to the first bound,
# the 64 x 128 prefill tile up to the second, the 64 x 64 one above
W8A8_DECODE_MAX_PAIRS, W8A8_WIDE_TILE_MAX_PAIRS = 32, 128


def default_w8a8_config(path: str, num_tokens: int, topk: int, num_experts: int) -> dict:
    """The block-FP8 experts' W8A8 GEMMs (``fp8_kernels``' ``ACT_QUANT``; the launch sets ``BLOCK_K`` to the
    quantisation block's ``bk``): 16 pairs by 64 weight columns (the transposed product's MMA rows: ``wgmma`` takes
    64 per warp group), 4 warps, 3 stages at decode sizes (up to 32 pairs per expert on average): the best geometric
    mean of 30 tiles at 16 and 64 tokens on an H200 (``bench_fp8_gemm.py --experts-sweep --experts-sweep-path aligned
    --experts-sweep-act-quant``, one V2-Lite layer: 133 / 161 us, 1.01x / 1.02x of each size's own best;
    ``fp8_experts_sweep_aligned_w8a8.json``); up to 128 pairs per expert, 64 by 128 on 8 warps and 3 stages, the best
    of 20 tiles at 512 and 8192 tokens with the activations quantised in the GEMM (0.304 / 3.32 ms against 0.389 /
    4.24 for the same tile on 4 warps; 128-row tiles 3.81 ms at 8192, 256-column ones out of shared memory;
    ``fp8_experts_sweep_aligned_w8a8_prefill.json``); above, 64 by 64 on 4 warps and 3 stages, the best of 20 at 8192
    tokens (768 pairs per expert) with the activations quantised before the GEMM
    (``fp8_launch.FP8_PREQUANT_MIN_TOKENS``; 2.26 against 2.50 ms for the 64 by 128 tile,
    ``fp8_experts_sweep_aligned_w8a8_prequant.json``; not timed there at 512 tokens, which keeps the tile it was timed
    with).  Both prefill tiles take their weight tiles by TMA (``W_TMA``): one V2-Lite layer on an H100, both ways in
    one run (``fp8_experts_tma_h100.json``), 269 against 311 us at 512 tokens and 2138 against 2324 at 8192; at 16
    tokens it tied (171.8 / 172.0 us), so the decode tile keeps pointer loads."""
    pairs_per_expert = num_tokens * topk / max(1, num_experts)
    if path == "small" or pairs_per_expert <= W8A8_DECODE_MAX_PAIRS:
        tile = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    elif pairs_per_expert <= W8A8_WIDE_TILE_MAX_PAIRS:
        tile = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, W_TMA=True)
    else:
        tile = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, W_TMA=True)
    return {"gemm1": dict(tile), "gemm2": dict(tile)}


@functools.lru_cache(maxsize=4)
def _load_tuned(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def get_moe_config(path: str, num_tokens: int, topk: int, num_experts: int, fp8: bool = False,
                   hidden: int = 0, act_quant: bool = False) -> dict:
    """Config for one call: tuned (JSON at ``$MLA_FUSER_MOE_CONFIGS``, the ``best_configs`` format written
    by the benchmark: ``{path: {"<max_tokens>": {"gemm1": {...}, "gemm2": {...}}}}``, the smallest bucket
    >= num_tokens wins, and the aligned path's gemm1/gemm2 must share ``BLOCK_M``; it applies to block-FP8 experts
    too; its entries may carry the decode GEMVs' ``gemv1``/``gemv2`` and ``fp8_gemv1``/``fp8_gemv2`` tiles) or the
    defaults (``fp8``: :func:`default_fp8_config`, with ``act_quant`` :func:`default_w8a8_config`; ``hidden`` picks
    the decode GEMVs' tuned row)."""
    tuned_file = envs.moe_configs_path()
    if tuned_file:
        table = _load_tuned(tuned_file).get(path, {})
        buckets = sorted(int(b) for b in table)
        for b in buckets:
            if b >= num_tokens:
                return table[str(b)]
        if buckets:
            return table[str(buckets[-1])]
    if fp8 and act_quant:
        return default_w8a8_config(path, num_tokens, topk, num_experts)
    return (default_fp8_config if fp8 else default_config)(path, num_tokens, topk, num_experts, hidden)
