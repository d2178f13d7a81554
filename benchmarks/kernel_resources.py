"""Registers and spills of the FP8 GEMM kernels for sm_90, tiles loaded from pointers or by TMA, without a GPU.

Triton compiles to PTX and assembles with its bundled ``ptxas`` on any machine; ``cuobjdump --dump-resource-usage``
(bundled too) reads each cubin's registers per thread and stack bytes (spills).  This compiles, at the tiles the
shipped tables use, the block-FP8 linear's tensor-core GEMM (``fp8_gemm_kernel``), its split-K GEMM
(``w8_gemm_kernel``: W8A8 and weight-only MMA) and the experts' W8A8 GEMM (``moe_w8_gemm_kernel``), each with its
operands as pointers and as tensor descriptors, and writes one row per variant:

    python benchmarks/kernel_resources.py --out benchmarks/results/kernel_resources_triton<version>.json

Run it with the Triton the GPU image has (``PYTHONPATH`` to a target install of that wheel) as well as the newest:
register allocation changes between releases.  Not a timing: what these numbers buy on a GPU is for
``bench_fp8_gemm.py`` (``*_tma`` variants, ``--sweep``, ``--experts``) to say.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
import warnings


def compile_sm90(jit_fn, types: dict, consts: dict, warps: int, stages: int):
    """``jit_fn`` (a ``JITFunction``) compiled for sm_90; arguments not in ``types`` / ``consts`` are i32, declared
    constexpr defaults apply (``tests/test_kernel_compile.py`` compiles through this too)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    declared = inspect.signature(jit_fn.fn).parameters
    names = list(declared)
    unknown = set(consts) - set(names)
    if unknown:
        raise ValueError(f"not parameters of {jit_fn.fn.__name__}: {sorted(unknown)}")
    consts = {**{n: p.default for n, p in declared.items() if p.default is not inspect.Parameter.empty}, **consts}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(fn=jit_fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))


def cuobjdump() -> str | None:
    """The ``cuobjdump`` this Triton bundles, or None."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return tool if os.path.exists(tool) else None


def resource_usage(compiled) -> dict:
    """Registers per thread and stack bytes (spills) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[:300]}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}


def usage(compiled) -> dict:
    ptx = compiled.asm["ptx"]
    return {**resource_usage(compiled), "bulk_tensor_copies": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))}


def variants():
    """``(kernel name, tile label, jit, types(tma), consts(tma), warps, stages)`` at the shipped tables' tiles."""
    from mla_fuser.kernels.fp8.linear import TC_CONFIGS, W8A8_CONFIGS, W8_CONFIGS
    from mla_fuser.kernels.fp8.triton_kernels import fp8_gemm_kernel, w8_gemm_kernel
    from mla_fuser.kernels.fused_moe.configs import default_w8a8_config

    for max_tokens, _, cfg in TC_CONFIGS:
        def types(tma, c=cfg):
            a = f"tensordesc<fp8e4nv[{c.block_m}, {c.block_k}]>" if tma else "*fp8e4nv"
            b = f"tensordesc<fp8e4nv[{c.block_n}, {c.block_k}]>" if tma else "*fp8e4nv"
            return {"xq_ptr": a, "xs_ptr": "*fp32", "w_ptr": b, "s_ptr": "*fp32", "bias_ptr": "*bf16",
                    "out_ptr": "*bf16"}

        yield ("fp8_gemm_kernel (tensor cores)", f"<= {max_tokens} tokens: {cfg}", fp8_gemm_kernel.get(), types,
               lambda tma, c=cfg: dict(HAS_BIAS=False, EVEN_K=True, SCALAR_B=True, UPCAST=False, BLOCK_M=c.block_m,
                                       BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, TMA=tma),
               cfg.warps, cfg.stages)
    for table, name in ((W8A8_CONFIGS, "w8_gemm_kernel (W8A8)"), (W8_CONFIGS, "w8_gemm_kernel (weight-only)")):
        for max_tokens, _, cfg in table:
            yield (name, f"<= {max_tokens} tokens: {cfg}", w8_gemm_kernel.get(),
                   lambda tma, c=cfg: {"x_ptr": "*bf16", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32",
                                       "final_ptr": "*bf16", "tickets_ptr": "*i32",
                                       "w_ptr": f"tensordesc<fp8e4nv[{c.block_n}, {c.block_k}]>" if tma
                                       else "*fp8e4nv"},
                   lambda tma, c=cfg: dict(HAS_BIAS=True, EVEN_K=True, DOT=c.dot, UPCAST=False, IEEE=False,
                                           BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, FIXUP=True,
                                           ACT_QUANT=c.act_quant, W_TMA=tma),
                   cfg.warps, cfg.stages)
    from mla_fuser.kernels.fused_moe.fp8_kernels import moe_w8_gemm_kernel

    # one V2-Lite layer (64 experts, top-6): decode, 512-token and 8192-token tiles (activations quantised before
    # the GEMM from 16 tokens: fp8_launch.FP8_PREQUANT_MIN_TOKENS)
    for tokens in (16, 512, 8192):
        tile = default_w8a8_config("aligned", tokens, 6, 64)["gemm1"]
        a_fp8 = tokens >= 16
        yield ("moe_w8_gemm_kernel (W8A8, gate/up)", f"{tokens} tokens: {tile}", moe_w8_gemm_kernel.get(),
               lambda tma, t=tile, f=a_fp8: {
                   "a_ptr": "*fp8e4nv" if f else "*bf16", "as_ptr": "*fp32", "s_ptr": "*fp32", "c_ptr": "*bf16",
                   "ids_ptr": "*i64", "rw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                   "num_post_ptr": "*i32",
                   "w_ptr": f"tensordesc<fp8e4nv[1, {t['BLOCK_N']}, {t['BLOCK_K']}]>" if tma else "*fp8e4nv"},
               lambda tma, t=tile, f=a_fp8: dict(
                   A_ROW_DIV=6, ALIGNED=True, GATED=True, MUL_ROUTING=False, ACT=0, IEEE=False, UPCAST=False,
                   SCAN_P=16, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], GROUP_M=t["GROUP_M"],
                   ACT_QUANT=True, A_FP8=f, W_TMA=tma),
               tile["num_warps"], tile["num_stages"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    import triton

    rows = []
    for kernel, tile, jit_fn, types, consts, warps, stages in variants():
        row = {"kernel": kernel, "tile": tile, "warps": warps, "stages": stages}
        for tma in (False, True):
            row["tma" if tma else "pointers"] = usage(compile_sm90(jit_fn, types(tma), consts(tma), warps, stages))
        rows.append(row)
        print(f"{kernel:38s} {tile[:60]:60s} pointers {row['pointers']['registers']:3d} regs "
              f"{row['pointers']['stack_bytes']:5d} B stack | TMA {row['tma']['registers']:3d} regs "
              f"{row['tma']['stack_bytes']:5d} B stack", flush=True)
    result = {"what": "registers per thread and stack bytes (spills) for sm_90, from cuobjdump; not a timing",
              "triton": triton.__version__, "target": "cuda sm_90 (compiled without a GPU)", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
