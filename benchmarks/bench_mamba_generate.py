"""End-to-end ``generate`` of a Mamba-2-architecture model: fused (mla-fuser's Triton conv/SSD kernels
through the Mamba fuser) vs native Transformers (its torch fallback when mamba_ssm is not installed).

Shape: the Mamba-2 2.7B mixer (hidden 2560, 80 heads x 64, state 128, 1 group, conv 4, chunk 256), with
``--layers`` layers (64 in the real model; fewer keep the native run short), bf16 random weights built on
the GPU.  Reports prefill time, decode ms/step and tokens/s for both, greedy-token agreement, and writes
JSON (default ``benchmarks/results/mamba2_generate.json``).  ``--dry-run`` runs a tiny shape on CPU.

    python benchmarks/bench_mamba_generate.py --layers 8 --prompt 2048 --new-tokens 64
"""

import argparse
import json
import os
import time

import torch


def build(layers: int, tiny: bool, device, dtype):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    if tiny:
        cfg = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2,
                           num_hidden_layers=2, vocab_size=128, chunk_size=16)
    else:
        cfg = Mamba2Config(hidden_size=2560, num_heads=80, head_dim=64, state_size=128, n_groups=1, expand=2,
                           conv_kernel=4, chunk_size=256, num_hidden_layers=layers, vocab_size=50288)
    torch.manual_seed(0)
    with torch.device(device):
        model = Mamba2ForCausalLM(cfg).to(dtype).eval()
    return model


def timed_generate(model, ids, new_tokens, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        # warm-up: every kernel variant the timed calls use (prefill with and without a cache, decode steps)
        model.generate(ids, max_new_tokens=2, do_sample=False)
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync()
        total = time.perf_counter() - t0
    decode_ms = max(total - prefill, 1e-9) / new_tokens * 1e3
    return out[:, ids.shape[1]:], {"prefill_s": prefill, "generate_s": total, "decode_ms_per_step_est": decode_ms,
                                   "tok_per_s": ids.shape[0] * new_tokens / total}


def graph_decode(model, ids, new_tokens, device):
    """Prefill ``ids`` eagerly, then ``new_tokens`` greedy decode steps replayed from one CUDA graph
    (``mla_fuser.DecodeGraph``; eager steps with the same code on CPU).  Returns ms per step; the two
    warm-up steps (eager, capture) are not timed."""
    from transformers import DynamicCache

    from mla_fuser import DecodeGraph
    from mla_fuser.compat import cache_keyword

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache}).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        step = DecodeGraph(model, cache)
        position = ids.shape[1]
        for _ in range(2):
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        sync()
    return (time.perf_counter() - t0) / new_tokens * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "mamba2_generate.json"))
    p.add_argument("--dry-run", action="store_true", help="tiny shape on CPU, output to a temp file")
    args = p.parse_args()
    import mla_fuser

    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.dry_run:
        args.prompt, args.new_tokens = 16, 4
        args.out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "mamba2_generate_dry.json")
    native = build(args.layers, args.dry_run, device, dtype)
    fused = build(args.layers, args.dry_run, device, dtype)
    fused.load_state_dict(native.state_dict())
    report = mla_fuser.fuse(fused)
    vocab = native.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    n_tokens, n_stats = timed_generate(native, ids, args.new_tokens, device)
    f_tokens, f_stats = timed_generate(fused, ids, args.new_tokens, device)
    with torch.no_grad():  # how far apart the paths are before any token is chosen, and from fp32
        a = native(input_ids=ids, use_cache=False).logits.float()
        b = fused(input_ids=ids, use_cache=False).logits.float()
        oracle = build(args.layers, args.dry_run, device, torch.float32)
        oracle.load_state_dict(native.state_dict())
        c = oracle(input_ids=ids, use_cache=False).logits.float()
        del oracle
    rel = lambda x, y: ((x - y).abs().max() / y.abs().max()).item()  # noqa: E731
    prefill_rel_err = rel(b, a)
    errors_vs_fp32 = {"native": rel(a, c), "fused": rel(b, c)}
    agree = (n_tokens == f_tokens).all(0)
    first_divergence = int((~agree).nonzero()[0]) if not bool(agree.all()) else None
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "layers": args.layers, "prompt": args.prompt,
        "new_tokens": args.new_tokens, "batch": args.batch,
        "fused_mixers": len(report.fused("mamba")), "native": n_stats, "fused": f_stats,
        "speedup_tok_per_s": f_stats["tok_per_s"] / n_stats["tok_per_s"],
        "greedy_token_agreement": float((n_tokens == f_tokens).float().mean()),
        "greedy_first_divergence": first_divergence, "prefill_logits_rel_err": prefill_rel_err,
        "prefill_logits_rel_err_vs_native_fp32": errors_vs_fp32,
    }
    # decode replayed from a CUDA graph: per layer, at two context lengths (a fixed-size state: no dependence)
    for name, model in (("fused", fused), ("native", native)):
        graphed = {}
        for prompt in sorted({args.prompt, max(8, args.prompt // 8)}):
            try:
                ms = graph_decode(model, ids[:, :prompt], args.new_tokens, device)
                graphed[str(prompt)] = {"ms_per_step": ms, "ms_per_layer": ms / model.config.num_hidden_layers}
            except Exception as exc:  # noqa: BLE001 - reported: the native torch path may not be capturable
                graphed[str(prompt)] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        result[f"{name}_graph_decode"] = graphed
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
