"""``fused_experts_fp8``: the fused MoE experts forward on block-FP8 expert stacks (a custom op), and its launches.

The bf16 op's paths (:mod:`.launch`) with :func:`~.fp8_kernels.moe_w8_gemm_kernel` for both GEMMs, chosen by token
count (:func:`choose_fp8_path`: the small-batch grid per expert up to ``FP8_SMALL_BATCH_MAX_TOKENS`` tokens, the
aligned grouped GEMM above), the same alignment and K-sum kernels, the bf16 op's tiles but for narrower aligned ones
at decode sizes (``configs.default_fp8_config``), ``BLOCK_K`` capped by the quantisation block's ``bk`` (one scale
column per K tile).  Up to ``GEMV_DOWN_MAX_TOKENS`` tokens the small path is two GEMV launches instead
(the bf16 op's ``moe_up_gemv_kernel`` and ``moe_down_gemv_kernel`` with ``SCALED``: the block scales folded into
the activations, no MMA padding of one token's row to 16, no combine launch) when row tiles of at least
``GEMV_MIN_BLOCK_N`` fit the scale blocks (:func:`gemv_block_n`).  From ``FP8_ACT_QUANT_MIN_TOKENS`` to
``FP8_ACT_QUANT_MAX_TOKENS`` (None: no bound) tokens both GEMMs run W8A8 (:func:`choose_act_quant`: activations
quantised per token and ``bk`` features, in the kernel's registers or, from ``FP8_PREQUANT_MIN_TOKENS``, by the FP8
linear's quantisation launch before each GEMM; FP8 tensor cores; ``configs.default_w8a8_config`` tiles, decode and
prefill).

CPU tensors (and autograd, and block sizes without a power-of-two divisor >= 16) run the torch reference
:func:`~.fp8_reference.fused_experts_fp8_ref`; ``MLA_FUSER_BACKEND`` forces a backend (``dispatch.use_triton``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import envs
from ..dispatch import cdiv, kernel_op, next_pow2, pow2_divisor, triton_interpreting, use_triton
from ..fp8.linear import gemv_block_n as linear_gemv_block_n
from ..fp8.linear import (W8A8_DTYPES, W8A8_GROUPS, has_fp8_tensor_cores, quantize_token_groups, tma_operand,
                          tma_ready)
from .fp8_kernels import moe_w8_gemm_kernel
from .fp8_reference import check_fp8_shapes, fused_experts_fp8_ref
from .launch import (_choose_path, _tiles, align_tokens_to_experts, gemv_down_max_tokens, launch_down_gemv,
                     launch_up_gemv)
from .reference import activation_code
from .triton_kernels import moe_combine_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the decode GEMVs' tile where neither the config (keys "fp8_gemv1" / "fp8_gemv2") nor the tuned table
# (``gemv_tiles``, per layer size and token count: ``configs.default_fp8_config``) gives one: rows by K columns per step
FP8_GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)
# "auto" runs the small path up to this many tokens (the bf16 op: ``launch.SMALL_BATCH_MAX_TOKENS``, 16), the aligned
# path above; ``MLA_FUSER_MOE_SMALL_BATCH_TOKENS`` overrides both.  On an H200 (``bench_fp8_gemm.py --experts-sweep``,
# CUDA-graph timing, one V2-Lite layer) the aligned path beat every small-path tile at 8 and 16 tokens: 125 vs 138 us
# and 173 vs 190 us; below 5 tokens the decode GEMVs run
FP8_SMALL_BATCH_MAX_TOKENS = 4


# From FP8_ACT_QUANT_MIN_TOKENS tokens on, the expert GEMMs run W8A8 (``moe_w8_gemm_kernel``'s ``ACT_QUANT``:
# activations quantised per token and ``bk`` features inside the kernel, e4m3 weights straight into FP8 tensor cores)
# where :func:`act_quant_supported`; below, the decode GEMVs.  On an H200 (``bench_fp8_gemm.py --experts``, one
# V2-Lite layer, CUDA-graph timing) W8A8 against the GEMVs or weight-only GEMMs: 40.6 vs 24.9 us at 1 token, 44.6 vs
# 39.0 at 2, 50.3 vs 58.2 at 3, 68.4 vs 69.2 at 4 (``fp8_experts_w8a8_decode.json``); 105 vs 117 at 8, 147 vs 162 at
# 16, 167 vs 191 at 32, 177 vs 200 at 64 with the first tile (``fp8_experts_w8a8.json``), 133 at 16 and 161 at 64 with
# the tuned one; at prefill sizes with the tuned tile (``configs.default_w8a8_config``) 0.304 vs 0.390 ms at 512
# tokens and 3.32 vs 7.09 ms at 8192 (``fp8_experts_sweep_aligned_w8a8_prefill.json``; bf16 experts 0.305 / 1.94).
# FP8_ACT_QUANT_MAX_TOKENS: None, no bound.  ``MLA_FUSER_FP8_ACT_QUANT=0``: never.
FP8_ACT_QUANT_MIN_TOKENS, FP8_ACT_QUANT_MAX_TOKENS = 3, None
# From this many tokens the W8A8 GEMMs read activations quantised by a launch of their own before each GEMM
# (``moe_w8_gemm_kernel``'s ``A_FP8``) instead of quantising them in registers, where every weight-column tile
# quantises the same activation tile again.  H200, one V2-Lite layer, CUDA-graph timing, same tiles
# (``fp8_experts_w8a8_prequant.json``): 127 vs 133 us at 16 tokens, 159 vs 161 at 64, 212 vs 252 at 256, 262 vs 301
# at 512, 0.72 vs 0.95 ms at 2048, 2.51 vs 3.34 at 8192 (bf16: 220, 271, 296, 315 us, 0.65, 1.99 ms).  Below 16
# tokens not timed: the two extra launches stay out of the smallest decode steps.
FP8_PREQUANT_MIN_TOKENS = 16


def act_quant_supported(hidden: torch.Tensor, gate_up_block, down_block) -> bool:
    """The W8A8 GEMMs can run: fp16/bf16 activations (fp32 ones keep the exact weight-only GEMMs), both stacks'
    ``bk`` one of the FP8 linear's ``W8A8_GROUPS`` (one K tile is one activation group; FP8 MMAs take K >= 32), FP8
    tensor cores (or the interpreter)."""
    return (hidden.dtype in W8A8_DTYPES and gate_up_block[1] in W8A8_GROUPS and down_block[1] in W8A8_GROUPS
            and has_fp8_tensor_cores(hidden))


def choose_act_quant(hidden: torch.Tensor, num_tokens: int, gate_up_block, down_block) -> bool:
    """W8A8 for this call: from ``FP8_ACT_QUANT_MIN_TOKENS`` tokens (up to ``FP8_ACT_QUANT_MAX_TOKENS`` unless None),
    where supported, unless switched off."""
    return (FP8_ACT_QUANT_MIN_TOKENS <= num_tokens
            and (FP8_ACT_QUANT_MAX_TOKENS is None or num_tokens <= FP8_ACT_QUANT_MAX_TOKENS)
            and envs.fp8_act_quant() and act_quant_supported(hidden, gate_up_block, down_block))


def triton_supported(hidden: torch.Tensor, gate_up_block, down_block) -> bool:
    """The kernel takes fp16/bf16/fp32 activations and K blocks with a power-of-two divisor >= 16 (``tl.dot``)."""
    return hidden.dtype in KERNEL_DTYPES and all(pow2_divisor(b[1], 128) >= 16 for b in (gate_up_block, down_block))


def gemv_block_n(wanted: int, block, up_row_shift: int = 0) -> int:
    """A decode GEMV's row tile over a stack of scale blocks ``block``: the FP8 linear's GEMV row tile
    (:func:`~mla_fuser.kernels.fp8.linear.gemv_block_n`: it divides the block's rows, at least ``GEMV_MIN_BLOCK_N``,
    else 0 and the GEMVs are not taken), for the gate/up stack also dividing the up half's row shift (a tile then lies
    in one scale row)."""
    return linear_gemv_block_n(block[0], pow2_divisor(up_row_shift, wanted) if up_row_shift else wanted)


def launch_w8_gemvs(*, x, gate_up_w, gate_up_scale, down_w, down_scale, flat_ids, routing, out, topk, act,
                    gate_up_block, down_block, up_scale_base, up_row_shift, gemv1, gemv2, num_experts):
    """The decode path: GEMM1 + activation as one GEMV launch into ``[pairs, I]``, GEMM2 + routing weights + combine
    as another into ``out``; ``gemv1`` / ``gemv2`` their tiles, row tiles already fitted (:func:`gemv_block_n`)."""
    inter = down_w.shape[2]
    inter_buf = torch.empty(flat_ids.numel(), inter, dtype=x.dtype, device=x.device)
    launch_up_gemv(x, gate_up_w, None, inter_buf, flat_ids, topk, num_experts, act, False, gemv1,
                   gate_up_scale=gate_up_scale, gate_up_block=gate_up_block, up_scale_base=up_scale_base,
                   up_row_shift=up_row_shift)
    launch_down_gemv(inter_buf, down_w, None, out, flat_ids, routing, topk, num_experts, gemv2,
                     down_scale=down_scale, down_block=down_block)
    return out


def choose_fp8_path(path: str, num_tokens: int, num_pairs: int) -> str:
    """``path`` as the bf16 op's ``_choose_path``, except that "auto" leaves the small path at
    ``FP8_SMALL_BATCH_MAX_TOKENS`` tokens.  Shapes only, never whether a graph is being captured."""
    return _choose_path(path, num_tokens, num_pairs, FP8_SMALL_BATCH_MAX_TOKENS)


def launch_w8_gemm(*, a, w, scale, c, flat_ids, routing, align, num_pairs, n_out, k_dim, a_row_div, gated, act,
                   block, cfg, num_experts, up_scale_base=0, up_row_shift=0, act_quant=False, a_scale=None):
    """One block-FP8 expert-grouped GEMM (GEMM1 if ``gated`` else GEMM2); ``align`` None = small path.  (bf16
    activations' dots on fp16 operands, which widen e4m3 without the detour through fp16 to bf16, were slower on an
    H200 at 1-16 tokens, 184 against 166 us for a V2-Lite layer at 16, ``fp8_experts_variants.json``: the per-row
    scaling pass they need cost more than the widening saved.)  ``act_quant``: the W8A8 variant, whose K tile is
    the quantisation block's ``bk`` (one activation group per tile, :func:`act_quant_supported`); with ``a_scale``
    (``[rows of a, groups]`` fp32) ``a`` is e4m3 already, quantised per row and ``bk`` features (``A_FP8``)."""
    if a_scale is not None and not act_quant:
        raise ValueError("pre-quantised (e4m3) activations need the W8A8 GEMM (act_quant)")
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    block_k = block[1] if act_quant else min(cfg["BLOCK_K"], pow2_divisor(block[1], 128))
    if align is None:
        grid = (num_experts, cdiv(n_out, block_n))
        sorted_ids = expert_ids = num_post = c  # never read on the small path
        num_m_blocks = 0
    else:
        sorted_ids, expert_ids, num_post = align
        num_m_blocks = expert_ids.numel()
        grid = (num_m_blocks * cdiv(n_out, block_n),)
    fp8_a = a_scale is not None
    # (the W8A8 GEMM can take its weight tiles by TMA where the tile's config asks for it: key "W_TMA")
    w_tma = act_quant and bool(cfg.get("W_TMA", False)) and tma_ready(a, w)
    moe_w8_gemm_kernel[grid](
        a, a_scale if fp8_a else scale, tma_operand(w, [1, block_n, block_k], w_tma), scale, c, flat_ids,
        routing if routing is not None else c, sorted_ids, expert_ids, num_post,
        num_pairs, n_out, k_dim, num_m_blocks,
        a.stride(0), a.stride(1), a_scale.stride(0) if fp8_a else 0, a_scale.stride(1) if fp8_a else 0,
        w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2), c.stride(0), c.stride(1),
        block[0], block[1], up_scale_base, up_row_shift,
        A_ROW_DIV=a_row_div, ALIGNED=align is not None, GATED=gated, MUL_ROUTING=routing is not None, ACT=act,
        IEEE=a.dtype == torch.float32, UPCAST=not a.is_cuda and triton_interpreting(), A_FP8=fp8_a,
        SCAN_P=cfg.get("SCAN_P", min(512, max(16, next_pow2(num_pairs)))),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.get("GROUP_M", 1), ACT_QUANT=act_quant,
        W_TMA=w_tma, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip


def fused_experts_fp8_triton(hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights, *,
                             gate_up_block, down_block, up_scale_base=0, up_row_shift=None, activation="silu",
                             path="auto", config: Optional[dict] = None, decode_gemv: bool = True,
                             act_quant: Optional[bool] = None, prequant: Optional[bool] = None) -> torch.Tensor:
    """The Triton implementation (no dispatch); arguments as :func:`fused_experts_fp8`, ``config`` as the bf16
    op's (``{"gemm1": {...}, "gemm2": {...}}``, plus ``"fp8_gemv1"`` / ``"fp8_gemv2"`` for the decode GEMVs);
    ``decode_gemv`` False keeps the small path's GEMMs at decode sizes too (tests, benchmarks); ``act_quant`` forces
    the GEMMs' W8A8 variant on or off (None: :func:`choose_act_quant`; on needs :func:`act_quant_supported`);
    ``prequant`` forces W8A8's activations to be quantised by launches of their own before each GEMM, or in the
    GEMM's registers (None: from ``FP8_PREQUANT_MIN_TOKENS`` tokens; the same e4m3 values and scales either way)."""
    num_tokens, hidden_size, num_experts, inter, topk = check_fp8_shapes(
        hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights
    )
    if act_quant is None:
        act_quant = choose_act_quant(hidden, num_tokens, gate_up_block, down_block)
    elif act_quant and not act_quant_supported(hidden, gate_up_block, down_block):
        raise ValueError(f"the W8A8 expert GEMMs need fp16/bf16 activations (got {hidden.dtype}), K blocks in "
                         f"{W8A8_GROUPS} (got {gate_up_block[1]}, {down_block[1]}) and FP8 tensor cores")
    if prequant is None:
        prequant = act_quant and num_tokens >= FP8_PREQUANT_MIN_TOKENS
    elif prequant and not act_quant:
        raise ValueError("prequant quantises the W8A8 GEMMs' activations: it needs act_quant")
    act = activation_code(activation)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    num_pairs = num_tokens * topk
    if num_pairs == 0:
        return out.zero_()
    path = choose_fp8_path(path, num_tokens, num_pairs)
    cfg = config if config is not None else _tiles(path, num_tokens, topk, num_experts, envs.moe_configs_path(), True,
                                                   hidden_size, act_quant)
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    flat_ids = topk_ids.reshape(-1).contiguous()
    routing = topk_weights.reshape(-1).contiguous()
    shift = inter if up_row_shift is None else up_row_shift
    if decode_gemv and not act_quant and path == "small" and num_tokens <= gemv_down_max_tokens():
        gemv1, gemv2 = cfg.get("fp8_gemv1", FP8_GEMV_CONFIG), cfg.get("fp8_gemv2", FP8_GEMV_CONFIG)
        up_n = gemv_block_n(gemv1["BLOCK_N"], gate_up_block, shift)
        down_n = gemv_block_n(gemv2["BLOCK_N"], down_block)
        if up_n and down_n:
            return launch_w8_gemvs(
                x=x, gate_up_w=gate_up_w, gate_up_scale=gate_up_scale, down_w=down_w, down_scale=down_scale,
                flat_ids=flat_ids, routing=routing, out=out, topk=topk, act=act, gate_up_block=gate_up_block,
                down_block=down_block, up_scale_base=up_scale_base, up_row_shift=shift,
                gemv1=dict(gemv1, BLOCK_N=up_n), gemv2=dict(gemv2, BLOCK_N=down_n), num_experts=num_experts,
            )  # fmt: skip
    align = None
    if path == "aligned":
        block_m = cfg["gemm1"]["BLOCK_M"]
        if cfg["gemm2"]["BLOCK_M"] != block_m:
            raise ValueError("the aligned path needs the same BLOCK_M for gemm1 and gemm2")
        align = align_tokens_to_experts(flat_ids, num_experts, block_m)
    common = dict(flat_ids=flat_ids, align=align, num_pairs=num_pairs, act=act, num_experts=num_experts,
                  act_quant=act_quant)
    inter_buf = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    a1, s1 = quantize_token_groups(x, gate_up_block[1]) if prequant else (x, None)
    launch_w8_gemm(a=a1, a_scale=s1, w=gate_up_w, scale=gate_up_scale, c=inter_buf, routing=None, n_out=inter,
                   k_dim=hidden_size, a_row_div=topk, gated=True, block=gate_up_block, cfg=cfg["gemm1"],
                   up_scale_base=up_scale_base, up_row_shift=shift, **common)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    a2, s2 = quantize_token_groups(inter_buf, down_block[1]) if prequant else (inter_buf, None)
    launch_w8_gemm(a=a2, a_scale=s2, w=down_w, scale=down_scale, c=pair_out, routing=routing, n_out=hidden_size,
                   k_dim=inter, a_row_div=1, gated=False, block=down_block, cfg=cfg["gemm2"], **common)
    block_h = min(1024, max(16, next_pow2(hidden_size)))
    moe_combine_kernel[(num_tokens, cdiv(hidden_size, block_h))](
        pair_out, flat_ids, out, hidden_size, num_experts, pair_out.stride(0), pair_out.stride(1),
        out.stride(0), out.stride(1), TOPK=topk, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out


def _fp8_impl(hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights, gate_up_block,
              down_block, up_scale_base, up_row_shift, activation, path, torch_only=False):
    flat = hidden.dim() == 2
    hidden2d = hidden if flat else hidden.reshape(-1, hidden.shape[-1])
    ids2d = topk_ids if topk_ids.dim() == 2 else topk_ids.reshape(-1, topk_ids.shape[-1])
    w2d = topk_weights if topk_weights.dim() == 2 else topk_weights.reshape(-1, topk_weights.shape[-1])
    gub, db = tuple(gate_up_block), tuple(down_block)
    shift = None if up_row_shift < 0 else up_row_shift
    kwargs = dict(gate_up_block=gub, down_block=db, up_scale_base=up_scale_base, up_row_shift=shift,
                  activation=activation)
    if not torch_only and use_triton(hidden, gate_up_w) and triton_supported(hidden, gub, db):
        out = fused_experts_fp8_triton(hidden2d, gate_up_w, gate_up_scale, down_w, down_scale, ids2d, w2d,
                                       path=path, **kwargs)
    else:
        out = fused_experts_fp8_ref(hidden2d, gate_up_w, gate_up_scale, down_w, down_scale, ids2d, w2d, **kwargs)
    return out if flat else out.reshape(hidden.shape)


@kernel_op("fused_experts_fp8")
def _fused_experts_fp8_op(
    hidden: torch.Tensor, gate_up_w: torch.Tensor, gate_up_scale: torch.Tensor, down_w: torch.Tensor,
    down_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up_block: list[int],
    down_block: list[int], up_scale_base: int, up_row_shift: int, activation: str, path: str,
) -> torch.Tensor:
    return _fp8_impl(hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights, gate_up_block,
                     down_block, up_scale_base, up_row_shift, activation, path)


@_fused_experts_fp8_op.register_fake
def _fused_experts_fp8_fake(hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights,
                            gate_up_block, down_block, up_scale_base, up_row_shift, activation, path):  # fmt: skip
    return hidden.new_empty(hidden.shape)


def fused_experts_fp8(
    hidden: torch.Tensor,
    gate_up_w: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_w: torch.Tensor,
    down_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_block: tuple[int, int],
    down_block: tuple[int, int],
    up_scale_base: int = 0,
    up_row_shift: int | None = None,
    activation: str = "silu",
    path: str = "auto",
) -> torch.Tensor:
    """MoE experts forward on block-FP8 stacks: ``hidden [T, H]`` (or ``[..., H]``), ``gate_up_w`` e4m3
    ``[E, 2I, H]`` (concatenated ``[gate; up]``) with fp32 ``gate_up_scale [E, rows, ceil(H/bk)]``, ``down_w``
    e4m3 ``[E, H, I]`` with ``down_scale [E, ceil(H/bn), ceil(I/bk)]``; ids/weights as ``fused_experts``.
    ``up_scale_base`` / ``up_row_shift`` place the up half's scale rows (``kernels.fp8.experts.FP8ExpertsLayout``;
    ``up_row_shift`` None: ``I``, one grid over the whole stack).  Returns ``[T, H]`` in hidden's dtype.  While
    autograd records, the torch reference runs (the kernel has no backward).  Custom op
    ``torch.ops.mla_fuser.fused_experts_fp8`` under torch.compile / tracing."""
    args = (hidden, gate_up_w, gate_up_scale, down_w, down_scale, topk_ids, topk_weights,
            [int(b) for b in gate_up_block], [int(b) for b in down_block], int(up_scale_base),
            -1 if up_row_shift is None else int(up_row_shift), activation, path)
    if torch.is_grad_enabled() and hidden.requires_grad:
        return _fp8_impl(*args, torch_only=True)
    return _fused_experts_fp8_op(*args)
