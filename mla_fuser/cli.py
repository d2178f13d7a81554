"""``mla-fuser generate | inspect | bench``.

Every command works on the embedded default preset (no download) or on a local checkpoint (``--model DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .presets import DEFAULT_PRESET, PRESETS, build_preset


def _dtype(name: str):
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16}[name]


def _load(args, attn_implementation: str, fuse: bool = True):
    """(model, name): a local checkpoint through the drop-in loader, or a preset with seeded weights."""
    if args.model:
        from transformers import AutoModelForCausalLM as HFAuto

        from .fusion import fuse as fuse_model

        model = HFAuto.from_pretrained(args.model, attn_implementation=attn_implementation, dtype=_dtype(args.dtype),
                                       device_map=args.device)
        model.eval()
        if fuse and attn_implementation == "vllm_mla":
            fuse_model(model)
        return model, args.model
    model = build_preset(args.preset, seed=args.seed, attn_implementation=attn_implementation,
                         dtype=_dtype(args.dtype), device=args.device, fuse=fuse)
    return model, args.preset


def _prompt(args, model) -> torch.Tensor:
    device = model.get_input_embeddings().weight.device
    if args.prompt_ids:
        return torch.tensor([args.prompt_ids], device=device)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, vocab, (1, args.prompt_len), generator=gen).to(device)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local checkpoint directory (no download happens)")
    src.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
                     help=f"embedded model with seeded random weights (default {DEFAULT_PRESET})")
    p.add_argument("--dtype", default="float32", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"])
    p.add_argument("--device", default=None, help="e.g. cuda; default: CPU (or the checkpoint's device_map)")
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args) -> int:
    model, name = _load(args, "vllm_mla")
    print(f"model: {name}")
    print(model.fusion_report)
    ids = _prompt(args, model)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             min_new_tokens=args.max_new_tokens)
    elapsed = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    print(f"prompt ids: {ids[0].tolist()}")
    print(f"generated ids: {new}")
    print(f"{len(new)} tokens in {elapsed:.3f} s: {len(new) / elapsed:.1f} tokens/s (fused)")
    if args.check:
        native, _ = _load(args, "sdpa", fuse=False)
        start = time.perf_counter()
        with torch.no_grad():
            ref = native.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                  min_new_tokens=args.max_new_tokens)
        n_elapsed = time.perf_counter() - start
        same = torch.equal(ref, out)
        print(f"native sdpa: {len(new)} tokens in {n_elapsed:.3f} s: {len(new) / n_elapsed:.1f} tokens/s")
        print(f"check: fused output {'EQUALS' if same else 'DIFFERS FROM'} the native output")
        return 0 if same else 1
    return 0


def cmd_inspect(args) -> int:
    model, name = _load(args, "vllm_mla")
    print(f"model: {name}")
    print(model.fusion_report)
    if args.show_source:
        from .rewrite import SOURCE_ATTR

        shown = set()
        for qualname, module in model.named_modules():
            diff = getattr(module, SOURCE_ATTR, None)
            if diff and diff not in shown:
                shown.add(diff)
                print(f"\n# rewritten forward of {type(module).__name__} (first instance: {qualname})")
                print(diff)
    return 0


def cmd_bench(args) -> int:
    from .bench import run_model_bench

    result = run_model_bench(args)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-fuser", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy generation with the fused model")
    _add_model_args(gen)
    gen.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids")
    gen.add_argument("--prompt-len", type=int, default=16, help="random prompt length when no ids are given")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--check", action="store_true", help="also run the native sdpa model and compare tokens")
    gen.set_defaults(func=cmd_generate)

    ins = sub.add_parser("inspect", help="print the fusion report (and the rewritten source)")
    _add_model_args(ins)
    ins.add_argument("--show-source", action="store_true", help="print each rewritten forward as a diff")
    ins.set_defaults(func=cmd_inspect)

    bench = sub.add_parser("bench", help="native vs fused decode ms/step, prefill time, peak memory")
    _add_model_args(bench)
    bench.add_argument("--shapes", default="1x64,4x128", help="comma list of BATCHxCONTEXT (default: CPU-sized)")
    bench.add_argument("--steps", type=int, default=8, help="decode steps timed per shape")
    bench.add_argument("--out", help="write the JSON here")
    bench.add_argument("--plot", help="write a PNG of ms/step against context length (needs matplotlib)")
    bench.add_argument("--skip-native", action="store_true")
    bench.add_argument("--generate", action="store_true",
                       help="time Transformers' generate() itself (ms/step from two calls; fused models on CUDA "
                            "replay decode steps from a CUDA graph)")
    bench.add_argument("--cuda-graph", action="store_true",
                       help="capture the fused decode step as a CUDA graph (mla_fuser.DecodeGraph, static paged cache)")
    bench.add_argument("--compile-mode", default=None, choices=[None, "default", "reduce-overhead", "max-autotune"],
                       help="run decode steps under torch.compile over static caches (reduce-overhead = CUDA graphs)")
    bench.add_argument("--compile-backend", default="inductor", help="torch.compile backend (e.g. eager to check "
                       "tracing only)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
