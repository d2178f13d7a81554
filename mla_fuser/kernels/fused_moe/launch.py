"""Launching the fused MoE kernels: which path runs (small batch or aligned), the alignment, the GEMMs, the K-sum.

The paths are described in the package docstring (:mod:`mla_fuser.kernels.fused_moe`).  The token thresholds
between them are read per call (``MLA_FUSER_MOE_SMALL_BATCH_TOKENS``, ``MLA_FUSER_MOE_GEMV_TOKENS``) and the
tiles come from :mod:`.configs`.  :func:`launch_gemm` and :func:`launch_down_gemv` are public for the
benchmark's tile sweeps (``warmup=True`` compiles without launching).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ... import envs
from ..dispatch import cdiv, next_pow2, triton_interpreting, use_triton
from .configs import default_config, get_moe_config
from .reference import activation_code, align_tokens_to_experts_ref, check_shapes, max_padded_pairs
from .triton_kernels import (moe_align_kernel, moe_combine_kernel, moe_down_gemv_kernel, moe_gemm_kernel,
                             moe_up_gemv_kernel)

# Up to this many tokens the decode (small-batch) path runs; env override MLA_FUSER_MOE_SMALL_BATCH_TOKENS (read per
# call).  H200, DeepSeek-V2-Lite layer, eager: small vs aligned = 0.071 vs 0.148 ms at 1 token, 0.112 vs 0.181 at 4,
# 0.230 vs 0.225 at 16, 0.301 vs 0.285 at 64 -- the launches the small path saves stop mattering around 16 tokens.
SMALL_BATCH_MAX_TOKENS = 16
# Every small-batch program scans all routing ids (twice); past this many (token, k) pairs "auto" prefers the
# aligned path even under a raised token threshold.
SMALL_BATCH_MAX_PAIRS = 1024
# Up to this many tokens the small path fuses the down projection with the K-sum: one program per
# (token, H-tile) streams the down rows of the token's K experts (a GEMV; no per-pair output, no combine
# launch).  It reads an expert's down weights once per token that picked it, so it only pays while
# tokens rarely share experts: decode of a few sequences.  Env override: MLA_FUSER_MOE_GEMV_TOKENS.
GEMV_DOWN_MAX_TOKENS = 4


def small_batch_max_tokens(default: int = SMALL_BATCH_MAX_TOKENS) -> int:
    """``MLA_FUSER_MOE_SMALL_BATCH_TOKENS``, else ``default`` (the block-FP8 op passes its own)."""
    return envs.moe_small_batch_tokens(default)


def gemv_down_max_tokens() -> int:
    return envs.moe_gemv_tokens(GEMV_DOWN_MAX_TOKENS)


def align_tokens_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the flat (token, k) pairs by expert, padding each group to a multiple of ``block_m``.

    Output format: see :func:`align_tokens_to_experts_ref`.  Triton (one launch, no sort, no host sync)
    when :func:`use_triton` says so, otherwise the torch reference.
    """
    if not use_triton(topk_ids):
        return align_tokens_to_experts_ref(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    if num_experts == 0 or num_pairs == 0:
        sorted_ids.fill_(num_pairs)
        expert_ids.fill_(-1)
        return sorted_ids, expert_ids, torch.zeros(1, dtype=torch.int32, device=flat.device)
    num_post = torch.empty(1, dtype=torch.int32, device=flat.device)  # (the kernel's program 0 writes it: no fill)
    chunk = min(1024, max(16, next_pow2(num_pairs)))
    moe_align_kernel[(num_experts,)](
        flat,
        sorted_ids,
        expert_ids,
        num_post,
        num_pairs,
        num_experts,
        max_padded,
        num_blocks,
        BLOCK_M=block_m,
        E_POW2=next_pow2(num_experts + 1),
        CHUNK=chunk,
        num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


def launch_gemm(
    *,
    a,
    w,
    bias,
    c,
    flat_ids,
    routing,
    align,
    num_pairs,
    n_out,
    k_dim,
    a_row_div,
    gated,
    interleaved,
    act,
    cfg,
    num_experts,
    warmup=False,
):
    """Launch one expert-grouped GEMM (GEMM1 if ``gated`` else GEMM2); ``align`` None = small path.
    ``warmup=True`` only compiles (the benchmark's sweep compiles its configs in parallel threads)."""
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dummy = c  # never read when the matching constexpr flag is off
    if align is None:
        grid = (num_experts, cdiv(n_out, block_n))
        sorted_ids = expert_ids = num_post = dummy
        num_m_blocks = 0
    else:
        sorted_ids, expert_ids, num_post = align
        num_m_blocks = expert_ids.numel()
        grid = (num_m_blocks * cdiv(n_out, block_n),)
    launch = functools.partial(moe_gemm_kernel.get().warmup, grid=grid) if warmup else moe_gemm_kernel[grid]
    a_s, w_s, c_s = a.stride(), w.stride(), c.stride()  # (one call each: this runs for every GEMM of an eager step)
    b_s = bias.stride() if bias is not None else (0, 0)
    launch(
        a,
        w,
        bias if bias is not None else dummy,
        c,
        flat_ids,
        routing if routing is not None else dummy,
        sorted_ids,
        expert_ids,
        num_post,
        num_pairs,
        n_out,
        k_dim,
        num_m_blocks,
        a_s[0],
        a_s[1],
        w_s[0],
        w_s[1],
        w_s[2],
        b_s[0],
        b_s[1],
        c_s[0],
        c_s[1],
        A_ROW_DIV=a_row_div,
        ALIGNED=align is not None,
        GATED=gated,
        INTERLEAVED=interleaved,
        HAS_BIAS=bias is not None,
        MUL_ROUTING=routing is not None,
        ACT=act,
        IEEE=w.dtype == torch.float32,
        UPCAST=w.dtype == torch.bfloat16 and not w.is_cuda and triton_interpreting(),
        SCAN_P=cfg["SCAN_P"] if "SCAN_P" in cfg else _scan_p(num_pairs),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg.get("GROUP_M", 1),
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )


@functools.lru_cache(maxsize=256)
def _combine_tiles(hidden_size: int) -> tuple[int, int]:
    block_h = min(1024, max(16, next_pow2(hidden_size)))
    return block_h, cdiv(hidden_size, block_h)


@functools.lru_cache(maxsize=1024)
def _scan_p(num_pairs: int) -> int:
    return min(512, max(16, next_pow2(num_pairs)))


def _gemv_block_k(cfg, k_dim):
    """A decode GEMV launch's K tile: the config's, at most the next power of two of K."""
    return min(cfg["BLOCK_K"], next_pow2(k_dim))


def launch_up_gemv(x, gate_up_w, gate_up_bias, inter_buf, flat_ids, topk, num_experts, act, interleaved, cfg,
                   warmup=False, gate_up_scale=None, gate_up_block=None, up_scale_base=0, up_row_shift=0):
    """Launch the decode path's GEMM1 + activation GEMV (``moe_up_gemv_kernel``) into ``inter_buf [pairs, I]``.
    ``gate_up_scale`` / ``gate_up_block``: a block-FP8 stack's fp32 scales and ``(bn, bk)``, with the up half's scale
    rows placed by ``up_scale_base`` / ``up_row_shift``; ``cfg["BLOCK_N"]`` must divide ``bn`` and the shift."""
    num_pairs, inter = inter_buf.shape
    block_k = _gemv_block_k(cfg, x.shape[1])
    grid = (num_pairs, cdiv(inter, cfg["BLOCK_N"]))
    launch = functools.partial(moe_up_gemv_kernel.get().warmup, grid=grid) if warmup else moe_up_gemv_kernel[grid]
    has_bias, scaled = gate_up_bias is not None, gate_up_scale is not None
    launch(
        x, gate_up_w, gate_up_bias if has_bias else inter_buf, inter_buf, flat_ids,
        inter, x.shape[1], num_experts,
        x.stride(0), x.stride(1), gate_up_w.stride(0), gate_up_w.stride(1), gate_up_w.stride(2),
        gate_up_bias.stride(0) if has_bias else 0, gate_up_bias.stride(1) if has_bias else 0,
        inter_buf.stride(0), inter_buf.stride(1),
        gate_up_scale if scaled else inter_buf, *(gate_up_scale.stride() if scaled else (0, 0, 0)),
        *(gate_up_block if scaled else (1, 1)), up_scale_base, up_row_shift,
        TOPK=topk, ACT=act, INTERLEAVED=interleaved, HAS_BIAS=has_bias, SCALED=scaled,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


def launch_down_gemv(inter_buf, down_w, down_bias, out, flat_ids, routing, topk, num_experts, cfg, warmup=False,
                     down_scale=None, down_block=None):
    """Launch the small path's GEMM2 + K-sum GEMV (``moe_down_gemv_kernel``) into ``out [T, H]``.  ``down_scale`` /
    ``down_block``: a block-FP8 down stack's fp32 scales and ``(bn, bk)``; ``cfg["BLOCK_N"]`` must divide ``bn``."""
    num_tokens, hidden_size = out.shape
    block_k = _gemv_block_k(cfg, inter_buf.shape[1])
    grid = (num_tokens, cdiv(hidden_size, cfg["BLOCK_N"]))
    launch = functools.partial(moe_down_gemv_kernel.get().warmup, grid=grid) if warmup else moe_down_gemv_kernel[grid]
    has_bias, scaled = down_bias is not None, down_scale is not None
    launch(
        inter_buf, down_w, down_bias if has_bias else out, out, flat_ids, routing,
        hidden_size, inter_buf.shape[1], num_experts,
        inter_buf.stride(0), inter_buf.stride(1), down_w.stride(0), down_w.stride(1), down_w.stride(2),
        down_bias.stride(0) if has_bias else 0, down_bias.stride(1) if has_bias else 0,
        out.stride(0), out.stride(1),
        down_scale if scaled else out, *(down_scale.stride() if scaled else (0, 0, 0)),
        *(down_block if scaled else (1, 1)),
        TOPK=topk, HAS_BIAS=has_bias, SCALED=scaled, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _tiles(path: str, num_tokens: int, topk: int, num_experts: int, tuned_file, fp8: bool = False,
           hidden: int = 0, act_quant: bool = False) -> dict:
    """``get_moe_config`` for one shape (``fp8``: of block-FP8 experts, ``act_quant``: their W8A8 GEMMs), asked
    once: keyed by the tuned file the variable names at the call (read per call; a file is parsed once), so a
    changed ``MLA_FUSER_MOE_CONFIGS`` is still honoured.  Read only."""
    return get_moe_config(path, num_tokens, topk, num_experts, fp8=fp8, hidden=hidden, act_quant=act_quant)


@functools.lru_cache(maxsize=256)
def _default_gemv(num_tokens: int, topk: int, num_experts: int, hidden: int) -> dict:
    return default_config("small", num_tokens, topk, num_experts, hidden)["gemv2"]


def _choose_path(path: str, num_tokens: int, num_pairs: int, max_tokens: int = SMALL_BATCH_MAX_TOKENS) -> str:
    """"auto": the small path (no alignment launch, GEMV down+combine up to ``GEMV_DOWN_MAX_TOKENS``) up to
    ``max_tokens`` tokens (default ``SMALL_BATCH_MAX_TOKENS``; the variable overrides it), the aligned grouped GEMM
    above.  The choice depends on shapes only, never on whether a CUDA graph is being captured: a captured step must
    use the kernels its eager warm-up compiled (at 16 tokens, where the two meet, an H200 measured 0.230 vs 0.225 ms
    eager)."""
    if path == "auto":
        small = num_tokens <= small_batch_max_tokens(max_tokens) and num_pairs <= SMALL_BATCH_MAX_PAIRS
        return "small" if small else "aligned"
    if path not in ("small", "aligned"):
        raise ValueError(f"path must be 'auto', 'small' or 'aligned', got {path!r}")
    return path


def fused_experts_triton(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    activation: str = "silu",
    path: str = "auto",
    config: Optional[dict] = None,
) -> torch.Tensor:
    """The Triton implementation (no dispatch); ``path`` in {"auto", "small", "aligned"}; ``config``
    ``{"gemm1": {...}, "gemm2": {...}, "gemv1": {...}, "gemv2": {...}}`` overrides the tile configs (benchmark
    sweeps).  Up to ``GEMV_DOWN_MAX_TOKENS`` tokens the small path's down projection + combine is a GEMV
    (``gemv2``), and its gate/up projection too where the config has a ``gemv1`` tile (else its GEMM runs).  For the
    aligned path both GEMMs must use the same ``BLOCK_M`` (they share one alignment)."""
    num_tokens, hidden_size, num_experts, inter, topk = check_shapes(
        hidden, gate_up_w, down_w, topk_ids, topk_weights, gate_up_bias, down_bias
    )
    act = activation_code(activation)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    num_pairs = num_tokens * topk
    if num_pairs == 0:
        return out.zero_()
    path = _choose_path(path, num_tokens, num_pairs)
    cfg = config if config is not None else _tiles(path, num_tokens, topk, num_experts, envs.moe_configs_path(),
                                                   False, hidden_size)
    wdtype = gate_up_w.dtype
    x = hidden if hidden.dtype == wdtype else hidden.to(wdtype)
    flat_ids = topk_ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    routing = topk_weights.reshape(-1)
    if not routing.is_contiguous():
        routing = routing.contiguous()

    align = None
    if path == "aligned":
        block_m = cfg["gemm1"]["BLOCK_M"]
        if cfg["gemm2"]["BLOCK_M"] != block_m:
            raise ValueError("the aligned path needs the same BLOCK_M for gemm1 and gemm2")
        align = align_tokens_to_experts(flat_ids, num_experts, block_m)

    inter_buf = torch.empty(num_pairs, inter, dtype=wdtype, device=hidden.device)
    decode_gemvs = path == "small" and num_tokens <= gemv_down_max_tokens()
    if decode_gemvs and cfg.get("gemv1"):
        launch_up_gemv(x, gate_up_w, gate_up_bias, inter_buf, flat_ids, topk, num_experts, act, interleaved,
                       cfg["gemv1"])
    else:
        launch_gemm(
            a=x, w=gate_up_w, bias=gate_up_bias, c=inter_buf, flat_ids=flat_ids, routing=None, align=align,
            num_pairs=num_pairs, n_out=inter, k_dim=hidden_size, a_row_div=topk, gated=True,
            interleaved=interleaved, act=act, cfg=cfg["gemm1"], num_experts=num_experts,
        )  # fmt: skip
    if decode_gemvs:
        gv = cfg.get("gemv2") or _default_gemv(num_tokens, topk, num_experts, hidden_size)
        launch_down_gemv(inter_buf, down_w, down_bias, out, flat_ids, routing, topk, num_experts, gv)
        return out
    pair_out = torch.empty(num_pairs, hidden_size, dtype=wdtype, device=hidden.device)
    launch_gemm(
        a=inter_buf, w=down_w, bias=down_bias, c=pair_out, flat_ids=flat_ids, routing=routing, align=align,
        num_pairs=num_pairs, n_out=hidden_size, k_dim=inter, a_row_div=1, gated=False,
        interleaved=False, act=act, cfg=cfg["gemm2"], num_experts=num_experts,
    )  # fmt: skip
    block_h, h_tiles = _combine_tiles(hidden_size)
    moe_combine_kernel[(num_tokens, h_tiles)](
        pair_out,
        flat_ids,
        out,
        hidden_size,
        num_experts,
        pair_out.stride(0),
        pair_out.stride(1),
        out.stride(0),
        out.stride(1),
        TOPK=topk,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out
