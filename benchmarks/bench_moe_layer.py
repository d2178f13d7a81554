"""One DeepSeek-V2-Lite MoE *layer* (router + 64 routed experts top-6 + 2 shared experts, hidden 2048,
I=1408), bf16: native Transformers (its default experts implementation, and the others on request) vs the
same layer fused by ``MoEFuser`` (router replayed, experts on the ``fused_experts`` Triton kernel), in the
same run, eager and replayed from a CUDA graph.  This is the comparison issue 4's targets are stated in.

    python benchmarks/bench_moe_layer.py                     # JSON to benchmarks/results/moe_layer.json
    python benchmarks/bench_moe_layer.py --dry-run           # tiny shape on CPU, checks the script
"""

import argparse
import copy
import json
import os

import torch


def build(tiny: bool, device, dtype, impl: str):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    if tiny:
        cfg = DeepseekV2Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                               n_shared_experts=2, num_hidden_layers=2)
    else:
        cfg = DeepseekV2Config(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                               num_experts_per_tok=6, n_shared_experts=2, num_hidden_layers=2)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    with torch.device(device):
        layer = DeepseekV2Moe(cfg)
    with torch.no_grad():  # a bare module is not initialised by Transformers (only whole models are)
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    return layer.to(dtype).eval()


def fuse_layer(layer, example):
    from mla_fuser.fusers.moe import MoEFuser

    match, reason = MoEFuser.explain(layer, ((example,), {}))
    if match is None:
        raise SystemExit(f"MoE layer not fused: {reason}")
    row = MoEFuser.apply(layer, match, "layer")
    if row.status != "fused":
        raise SystemExit(f"MoE layer not fused: {row.reason}")
    return layer


def timings(fn, x, device, graphs: bool):
    if device.type != "cuda":
        import time

        fn(x)
        t = time.perf_counter()
        for _ in range(3):
            fn(x)
        return {"eager_ms": (time.perf_counter() - t) / 3 * 1e3}
    import triton.testing

    from bench_fused_moe import cuda_graph_timer

    def timer(f):
        return triton.testing.do_bench(f, warmup=25, rep=100)

    out = {"eager_ms": timer(lambda: fn(x))}
    if graphs:
        out["cudagraph_ms"] = cuda_graph_timer(lambda: fn(x), timer)
    return out


def bytes_read(layer, x) -> int:
    """Weight bytes one forward of ``layer`` on ``x`` must read: router, shared experts and each routed expert
    picked by at least one token (the floor any implementation pays; what bandwidth is reported against)."""
    with torch.no_grad():
        _, _, ids = layer.gate(x)
    experts = layer.experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.gate_up_proj.element_size()
    rest = sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if not name.startswith("experts."))
    return int(per_expert * torch.unique(ids).numel() + rest)


def copy_bandwidth(device) -> float | None:
    """Device-to-device copy GB/s (read + write) of a 1 GiB buffer, the ceiling bandwidth figures compare with."""
    if device.type != "cuda":
        return None
    import triton.testing

    from bench_fused_moe import copy_bandwidth as measure

    return measure(device, lambda f: triton.testing.do_bench(f, warmup=10, rep=50), 1 << 30)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,64,512,8192")
    p.add_argument("--native-impls", default="grouped_mm", help="comma list of Transformers experts impls")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe_layer.json"))
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    import mla_fuser  # noqa: F401  (registers the "mla_fuser" experts implementation)

    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens = [int(t) for t in args.tokens.split(",")] if not args.dry_run else [1, 4]
    if args.dry_run:
        args.out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "moe_layer_dry.json")
    impls = [i for i in args.native_impls.split(",") if i]
    natives = {impl: build(args.dry_run, device, dtype, impl) for impl in impls}
    reference = natives[impls[0]]
    for layer in natives.values():
        layer.load_state_dict(reference.state_dict())
    fused = copy.deepcopy(reference)
    hidden = reference.config.hidden_size
    fuse_layer(fused, torch.randn(1, 3, hidden, device=device, dtype=dtype))
    copy_gbps = copy_bandwidth(device)
    results = {"device_copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dtype": str(dtype), "targets_ms": {1: 0.10, 16: 0.35, 64: 0.45, 512: 0.7,
                                                                                8192: 2.3}, "rows": []}
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(1, t, hidden, device=device, dtype=dtype, generator=gen)
            row = {"tokens": t, "fused": timings(fused, x, device, graphs=True)}
            ref_out = reference(x).float()
            row["rel_err_vs_native"] = ((fused(x).float() - ref_out).abs().max() / ref_out.abs().max()).item()
            for impl, layer in natives.items():
                if impl == "batched_mm" and t > 512:  # gathers [T*K, 2I, H] weights: 528 GiB at 8192 tokens
                    row[f"native_{impl}"] = {"skipped": "gathers a weight copy per (token, expert): out of memory"}
                    continue
                try:
                    row[f"native_{impl}"] = timings(layer, x, device, graphs=impl != "eager")
                except torch.OutOfMemoryError as exc:
                    row[f"native_{impl}"] = {"error": f"out of memory: {str(exc)[:120]}"}
                    torch.cuda.empty_cache()
            weight_bytes = bytes_read(reference, x)
            row["weight_bytes_read"] = weight_bytes
            for kind in ("eager_ms", "cudagraph_ms"):
                if kind in row["fused"]:
                    row["fused"][kind.replace("_ms", "_weight_gbps")] = weight_bytes / row["fused"][kind] / 1e6
            base = row[f"native_{impls[0]}"]
            row["speedup_eager"] = base["eager_ms"] / row["fused"]["eager_ms"]
            if "cudagraph_ms" in base:
                row["speedup_cudagraph"] = base["cudagraph_ms"] / row["fused"]["cudagraph_ms"]
            results["rows"].append(row)
            print(row, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
