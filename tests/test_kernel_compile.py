"""Kernels compile for a Hopper GPU (sm_90) on a machine without one.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every interpreted test and still not
compile (a constexpr branch that returns early, for one, left names of its own to the code after it, and the compiler
refused the kernel for a variable's type).  Triton compiles to PTX and runs its bundled ``ptxas`` without a GPU, so
this compiles the FP8 decode kernels' variants and checks in the PTX how they widen e4m3 (``cvt.rn.f16x2.e4m3x2``,
then ``cvt.f32.f16`` for the FMA GEMVs or ``cvt.bf16.f16`` for bf16 dots) and which dots they run.
"""

import importlib.util
import os
import re

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    CROSS_COMPILES = GPUTarget is not None and ASTSource is not None
except ImportError:  # pragma: no cover - an older Triton
    CROSS_COMPILES = False

pytestmark = pytest.mark.skipif(not CROSS_COMPILES, reason="this Triton cannot compile for another target")

_SPEC = importlib.util.spec_from_file_location(
    "kernel_resources", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                     "kernel_resources.py"))
KERNEL_RESOURCES = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(KERNEL_RESOURCES)
HAS_TMA = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None  # (Triton 3.4 on)
needs_tma = pytest.mark.skipif(not HAS_TMA, reason="this Triton has no tensor descriptors (3.4 on)")


def _ptx(kernel, pointers: dict, constexprs: dict, num_warps=4, num_stages=2) -> str:
    """PTX of ``kernel`` (a ``LazyJit``) for sm_90: pointer arguments typed by ``pointers``, other non-constexpr
    arguments i32."""
    return _compiled(kernel, pointers, constexprs, num_warps, num_stages).asm["ptx"]


def _compiled(kernel, pointers: dict, constexprs: dict, num_warps=4, num_stages=2):
    """``kernel`` compiled for sm_90 (see :func:`_ptx`) by ``benchmarks/kernel_resources.py``'s ``compile_sm90``
    (constexprs left out take their declared defaults)."""
    fn = kernel.get()
    if not isinstance(fn, triton.runtime.jit.JITFunction):  # under TRITON_INTERPRET the wrapper is the interpreter's
        pytest.skip("the interpreter is on in this process")
    try:
        return KERNEL_RESOURCES.compile_sm90(fn, pointers, constexprs, num_warps, num_stages)
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton build
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {exc}")
        raise


def _resources(compiled) -> dict:
    """Registers and stack bytes (spills) per thread of a compiled kernel, by the ``cuobjdump`` Triton bundles."""
    if KERNEL_RESOURCES.cuobjdump() is None:
        pytest.skip("this Triton bundles no cuobjdump")
    return KERNEL_RESOURCES.resource_usage(compiled)


def _count(ptx: str, instruction: str) -> int:
    return len(re.findall(re.escape(instruction) + r"\b", ptx))


GEMV_POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "bias_ptr": "*bf16", "c_ptr": "*bf16", "out_ptr": "*bf16",
                 "ids_ptr": "*i64", "rw_ptr": "*fp32"}


@pytest.mark.parametrize("kind", ["up", "down"])
@pytest.mark.parametrize("variant", ["bf16", "bf16_bias", "fp8"])
def test_decode_gemvs_compile(kind, variant):
    from mla_fuser.kernels.fused_moe.triton_kernels import moe_down_gemv_kernel, moe_up_gemv_kernel

    fp8 = variant == "fp8"
    pointers = dict(GEMV_POINTERS, w_ptr="*fp8e4nv" if fp8 else "*bf16", s_ptr="*fp32" if fp8 else "*bf16")
    consts = dict(TOPK=6, HAS_BIAS=variant == "bf16_bias", SCALED=fp8, BLOCK_N=8, BLOCK_K=512)
    if kind == "up":
        kernel = moe_up_gemv_kernel
        consts.update(ACT=0, INTERLEAVED=variant == "bf16_bias")
    else:
        kernel = moe_down_gemv_kernel
    ptx = _ptx(kernel, pointers, consts)
    assert _count(ptx, "mma.sync") == 0  # (FMAs: no tensor-core padding of a token's row to 16)
    if fp8:
        assert _count(ptx, "cvt.rn.f16x2.e4m3x2") > 0 and _count(ptx, "cvt.f32.f16") > 0


def test_linear_decode_gemv_compiles():
    from mla_fuser.kernels.fp8.triton_kernels import w8_gemv_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    ptx = _ptx(w8_gemv_kernel, pointers, dict(HAS_BIAS=True, EVEN_K=True, BLOCK_N=8, BLOCK_K=1024))
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") > 0 and _count(ptx, "mma.sync") == 0


@pytest.mark.parametrize("dot", [False, True])
def test_linear_weight_only_gemm_compiles(dot):
    from mla_fuser.kernels.fp8.triton_kernels import w8_gemm_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32",
                "final_ptr": "*bf16", "tickets_ptr": "*i32"}
    consts = dict(HAS_BIAS=False, EVEN_K=True, DOT=dot, UPCAST=False, IEEE=False, BLOCK_M=16 if dot else 4,
                  BLOCK_N=32, BLOCK_K=128, FIXUP=False, ACT_QUANT=False)
    ptx = _ptx(w8_gemm_kernel, pointers, consts, num_stages=3)
    assert (_count(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") > 0) == dot
    assert "atom" not in ptx


def test_linear_split_k_fixup_compiles():
    """The split-K fix-up: a CTA barrier, then one acquire-release GPU-scope atomic add per program (the ticket),
    the partials read back past L1 (``ld.global.cg``), the ticket reset with an exchange."""
    from mla_fuser.kernels.fp8.triton_kernels import w8_gemm_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32",
                "final_ptr": "*bf16", "tickets_ptr": "*i32"}
    consts = dict(HAS_BIAS=True, EVEN_K=True, DOT=True, UPCAST=False, IEEE=False, BLOCK_M=16, BLOCK_N=32,
                  BLOCK_K=128, FIXUP=True, ACT_QUANT=False)
    ptx = _ptx(w8_gemm_kernel, pointers, consts, num_stages=3)
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1, re.findall(r"atom\S*", ptx)
    assert re.search(r"atom\.global\S*\.exch", ptx), re.findall(r"atom\S*", ptx)
    assert re.search(r"ld\.global\.cg", ptx) and "bar.sync" in ptx


@pytest.mark.parametrize("block_m,block_n,warps", [(16, 64, 4), (64, 128, 8)])
def test_linear_w8a8_gemm_runs_on_fp8_tensor_cores(block_m, block_n, warps):
    """The weight-only GEMM's W8A8 variant: FP8 ``wgmma`` with the weight rows as its 64-row side, activations
    converted to e4m3, weights never widened."""
    from mla_fuser.kernels.fp8.triton_kernels import w8_gemm_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32",
                "final_ptr": "*bf16", "tickets_ptr": "*i32"}
    consts = dict(HAS_BIAS=True, EVEN_K=True, DOT=True, UPCAST=False, IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=128, FIXUP=True, ACT_QUANT=True)
    ptx = _ptx(w8_gemm_kernel, pointers, consts, num_warps=warps, num_stages=3)
    assert _count(ptx, f"wgmma.mma_async.sync.aligned.m64n{block_m}k32.f32.e4m3.e4m3") > 0
    assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") > 0
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") == 0 and _count(ptx, "cvt.bf16.f16") == 0


@needs_tma
@pytest.mark.parametrize("tma", [False, True])
def test_linear_tensor_core_gemm_by_tma_keeps_its_accumulators_in_registers(tma):
    """The prefill GEMM at the table's largest tile: fed by TMA (``cp.async.bulk.tensor``, two boxes per pipeline
    stage) it holds its two 128x128 fp32 accumulators (the running sum and the K tile's product) in registers without
    spilling; from pointers, the per-element addresses push it to the register limit and into spills (stack)."""
    from mla_fuser.kernels.fp8.linear import TC_CONFIGS
    from mla_fuser.kernels.fp8.triton_kernels import fp8_gemm_kernel

    cfg = TC_CONFIGS[-1][2]
    a = f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>" if tma else "*fp8e4nv"
    b = f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>" if tma else "*fp8e4nv"
    pointers = {"xq_ptr": a, "xs_ptr": "*fp32", "w_ptr": b, "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    consts = dict(HAS_BIAS=False, EVEN_K=True, SCALAR_B=True, UPCAST=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, TMA=tma)
    compiled = _compiled(fp8_gemm_kernel, pointers, consts, num_warps=cfg.warps, num_stages=cfg.stages)
    ptx = compiled.asm["ptx"]
    assert _count(ptx, f"wgmma.mma_async.sync.aligned.m64n{cfg.block_n}k32.f32.e4m3.e4m3") > 0
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.", ptx)) == (2 * cfg.stages if tma else 0)
    if tma:  # (from pointers, Triton 3.9 gives it 255 registers and a 904-byte stack of spills)
        used = _resources(compiled)
        assert used["stack_bytes"] == 0 and used["registers"] < 255, used


@needs_tma
@pytest.mark.parametrize("block_m,block_n,act_quant", [(16, 64, True), (16, 32, False)])
def test_linear_split_k_gemm_by_tma_takes_fewer_registers(block_m, block_n, act_quant):
    """The split-K GEMM's decode tiles (W8A8 at up to 16 tokens, weight-only MMA) with the weight tiles by TMA: bulk
    tensor copies, no stack, and fewer registers than the pointer loads (W8A8: 80 against 253 in Triton 3.9, 196 in
    3.6; weight-only: 78 against 189, 59 against 96), so more CTAs fit an SM to keep weight reads in flight."""
    from mla_fuser.kernels.fp8.triton_kernels import w8_gemm_kernel

    used = {}
    for tma in (False, True):
        pointers = {"x_ptr": "*bf16", "w_ptr": f"tensordesc<fp8e4nv[{block_n}, 128]>" if tma else "*fp8e4nv",
                    "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32", "final_ptr": "*bf16",
                    "tickets_ptr": "*i32"}
        consts = dict(HAS_BIAS=True, EVEN_K=True, DOT=True, UPCAST=False, IEEE=False, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=128, FIXUP=True, ACT_QUANT=act_quant, W_TMA=tma)
        compiled = _compiled(w8_gemm_kernel, pointers, consts, num_warps=4, num_stages=3)
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.", compiled.asm["ptx"])) == (3 if tma else 0)
        used[tma] = _resources(compiled)
    assert used[True]["stack_bytes"] == 0 and used[True]["registers"] < used[False]["registers"], used


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_expert_gemm_compiles(aligned, gated):
    from mla_fuser.kernels.fused_moe.fp8_kernels import moe_w8_gemm_kernel

    pointers = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "c_ptr": "*bf16", "ids_ptr": "*i64",
                "rw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_post_ptr": "*i32"}
    consts = dict(A_ROW_DIV=6 if gated else 1, ALIGNED=aligned, GATED=gated, MUL_ROUTING=not gated, ACT=0,
                  IEEE=False, UPCAST=False, SCAN_P=16, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1,
                  ACT_QUANT=False, A_FP8=False)
    ptx = _ptx(moe_w8_gemm_kernel, pointers, consts, num_stages=3)
    assert _count(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") > 0
    assert _count(ptx, "cvt.bf16.f16") > 0  # (bf16 dots widen e4m3 through fp16)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("block_m,block_n,warps", [(16, 64, 4), (32, 128, 8)])
def test_fp8_expert_w8a8_gemm_runs_on_fp8_tensor_cores(aligned, block_m, block_n, warps):
    """The W8A8 variant: Hopper's FP8 ``wgmma`` with the weight rows as its 64-row side (``m64n<tokens>k32``), the
    activations converted to e4m3 (``cvt.rn.satfinite.e4m3x2.f32``, two per instruction) and the weights never
    widened."""
    from mla_fuser.kernels.fused_moe.fp8_kernels import moe_w8_gemm_kernel

    pointers = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "c_ptr": "*bf16", "ids_ptr": "*i64",
                "rw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_post_ptr": "*i32"}
    consts = dict(A_ROW_DIV=6, ALIGNED=aligned, GATED=True, MUL_ROUTING=False, ACT=0, IEEE=False, UPCAST=False,
                  SCAN_P=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, ACT_QUANT=True, A_FP8=False)
    ptx = _ptx(moe_w8_gemm_kernel, pointers, consts, num_warps=warps, num_stages=3)
    assert _count(ptx, f"wgmma.mma_async.sync.aligned.m64n{block_m}k32.f32.e4m3.e4m3") > 0
    assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") > 0
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") == 0 and _count(ptx, "cvt.bf16.f16") == 0


@needs_tma
@pytest.mark.parametrize("block_m,block_n,warps,a_fp8", [(16, 64, 4, False), (64, 128, 8, True)])
def test_fp8_expert_w8a8_gemm_by_tma_spills_little(block_m, block_n, warps, a_fp8):
    """The experts' W8A8 GEMM at its decode and its 512-token tiles, weight tiles by TMA (``W_TMA``: bulk tensor
    copies of the gate and the up tile per pipeline stage) against the pointer loads: the gate and up accumulators
    with their K tile's products fill the registers, and the pointer loads' addresses and prefetched tiles spill
    past them (Triton 3.9: 1048 and 1784 stack bytes; by TMA 0 and 80)."""
    from mla_fuser.kernels.fused_moe.fp8_kernels import moe_w8_gemm_kernel

    used = {}
    for tma in (False, True):
        pointers = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "as_ptr": "*fp32", "s_ptr": "*fp32", "c_ptr": "*bf16",
                    "w_ptr": f"tensordesc<fp8e4nv[1, {block_n}, 128]>" if tma else "*fp8e4nv", "ids_ptr": "*i64",
                    "rw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_post_ptr": "*i32"}
        consts = dict(A_ROW_DIV=6, ALIGNED=True, GATED=True, MUL_ROUTING=False, ACT=0, IEEE=False, UPCAST=False,
                      SCAN_P=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, ACT_QUANT=True,
                      A_FP8=a_fp8, W_TMA=tma)
        compiled = _compiled(moe_w8_gemm_kernel, pointers, consts, num_warps=warps, num_stages=3)
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.", compiled.asm["ptx"])) == (6 if tma else 0)
        used[tma] = _resources(compiled)
    assert used[True]["stack_bytes"] <= used[False]["stack_bytes"] // 8, used


@pytest.mark.parametrize("gated", [False, True])
def test_fp8_expert_w8a8_gemm_on_prequantised_activations_converts_nothing(gated):
    """``A_FP8``: the activations arrive as e4m3 with their scales, so the prefill tile's GEMM runs FP8 ``wgmma``
    (weight rows as its 64-row side, 64 pairs on the other) with no conversion to or from e4m3 at all."""
    from mla_fuser.kernels.fused_moe.fp8_kernels import moe_w8_gemm_kernel

    pointers = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "c_ptr": "*bf16",
                "ids_ptr": "*i64", "rw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                "num_post_ptr": "*i32"}
    consts = dict(A_ROW_DIV=6 if gated else 1, ALIGNED=True, GATED=gated, MUL_ROUTING=not gated, ACT=0, IEEE=False,
                  UPCAST=False, SCAN_P=16, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, ACT_QUANT=True,
                  A_FP8=True)
    ptx = _ptx(moe_w8_gemm_kernel, pointers, consts, num_warps=8, num_stages=3)
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3") > 0
    assert _count(ptx, "cvt.rn.satfinite.e4m3x2.f32") == 0
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") == 0 and _count(ptx, "cvt.bf16.f16") == 0


@pytest.mark.parametrize("block_m", [16, 64])
def test_router_row_block_logits_kernel_compiles_to_tf32_tensor_cores(block_m):
    """The row-block router logits: bf16 tiles widened to fp32 and multiplied on TF32 tensor cores (exact for
    16-bit values), never FMA loops of a full-precision dot."""
    from mla_fuser.kernels.moe_router import _logits_rows_kernel, _row_block_tiles

    block_e, block_h, warps = _row_block_tiles(64, 2048, block_m, None)
    pointers = {"X": "*bf16", "W": "*bf16", "BIAS": "*fp32", "OUT": "*fp32"}
    consts = dict(BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_H=block_h, HAS_BIAS=True)
    ptx = _ptx(_logits_rows_kernel, pointers, consts, num_warps=warps)
    assert _count(ptx, ".tf32") > 0 and (_count(ptx, "mma.sync") > 0 or "wgmma" in ptx)


@pytest.mark.parametrize("bias,block_e", [(False, 1), (True, 8)])
def test_router_logits_kernel_compiles(bias, block_e):
    """The router logits: bf16 hidden states and gate widened in registers (no tensor cores, no fp32 copies), one
    store of fp32 logits per program."""
    from mla_fuser.kernels.moe_router import _logits_kernel, _logits_tiles

    block_e, block_h, warps = _logits_tiles(64, 2048, block_e)
    pointers = {"X": "*bf16", "W": "*bf16", "BIAS": "*fp32", "OUT": "*fp32"}
    ptx = _ptx(_logits_kernel, pointers, dict(BLOCK_E=block_e, BLOCK_H=block_h, HAS_BIAS=bias), num_warps=warps)
    assert _count(ptx, "mma.sync") == 0 and "wgmma" not in ptx
    assert _count(ptx, "cvt.f32.bf16") > 0 or _count(ptx, "shl.b32") > 0  # (bf16 -> fp32 is a shift in PTX)


@pytest.mark.parametrize("starts", [False, True])
def test_decode_kernel_compiles_to_mma_at_its_h16_defaults(starts):
    """The bf16 decode kernel at its H=16 defaults (64-token tiles of 512 + 64 columns, one 16-head tile) compiles for
    sm_90 onto tensor cores through mma.sync, the path ``default_config`` documents (wgmma measured slower there)."""
    from mla_fuser.kernels.mla_decode import _mla_decode_stage1

    pointers = {p: "*bf16" for p in ("Q", "QR", "KV", "OUT")}
    pointers.update({"BT": "*i32", "SEQ_LENS": "*i32", "STARTS": "*i32", "O_PART": "*fp32", "LSE": "*fp32",
                     "qk_scale": "fp32"})
    consts = dict(PAGE_SIZE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_V=512, BLOCK_R=64, HAS_ROPE=True, EVEN_V=True,
                  EVEN_R=True, PER_ROW_PAGES=False, DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False,
                  SWAP_AB=False, HAS_STARTS=starts)
    ptx = _ptx(_mla_decode_stage1, pointers, consts)
    assert _count(ptx, "mma.sync") > 0 and "wgmma" not in ptx


@needs_tma
@pytest.mark.parametrize("starts", [False, True])
def test_tma_decode_kernel_reads_tiles_in_bulk_onto_wgmma_at_its_h16_config(starts):
    """``mla_decode_tma``'s stage 1 at ``TMA_CONFIG`` (16 heads, 64-token tiles, two 256-column value chunks and the
    rope part) compiles for sm_90 to bulk tensor copies of 3-D boxes (three a tile, every tile in one loop) feeding
    wgmma, and spills less than ``mla_decode``'s own kernel at the same tile."""
    from mla_fuser.kernels.mla_decode import TMA_CONFIG, _mla_decode_stage1
    from mla_fuser.kernels.mla_decode_tma import _mla_decode_tma_stage1

    cfg = TMA_CONFIG
    pointers = {"Q": "*bf16", "QR": "*bf16", "OUT": "*bf16", "BT": "*i32", "SEQ_LENS": "*i32", "STARTS": "*i32",
                "O_PART": "*fp32", "LSE": "*fp32", "qk_scale": "fp32",
                "KV": "*bf16", "KV_C": f"tensordesc<bf16[1, {cfg.block_n}, 256]>",
                "KV_R": f"tensordesc<bf16[1, {cfg.block_n}, 64]>"}
    consts = dict(PAGE_SIZE=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, CHUNK=256, V_CHUNKS=2, ROPE=64, BLOCK_R=64,
                  DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, HAS_STARTS=starts)
    compiled = _compiled(_mla_decode_tma_stage1, pointers, consts, cfg.num_warps, cfg.num_stages)
    ptx = compiled.asm["ptx"]
    assert _count(ptx, "wgmma.mma_async") > 0
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.", ptx)) >= 3
    plain = {p: "*bf16" for p in ("Q", "QR", "KV", "OUT")}
    plain.update({k: v for k, v in pointers.items() if not k.startswith("KV_") and k not in plain})
    old = _compiled(_mla_decode_stage1, plain, dict(
        PAGE_SIZE=64, BLOCK_H=16, BLOCK_N=64, BLOCK_V=512, BLOCK_R=64, HAS_ROPE=True, EVEN_V=True, EVEN_R=True,
        PER_ROW_PAGES=False, DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, SWAP_AB=False,
        HAS_STARTS=starts), 4, 2)
    assert _resources(compiled)["stack_bytes"] < _resources(old)["stack_bytes"]
