"""Whole-model A/B of ``mla_decode_tma``'s kernel: Transformers' ``generate()`` on the fused DeepSeek-V2-Lite-shaped
preset (27 layers, bf16, random weights), the TMA kernel off and on in turns, in one process.

Why a script of its own: the kernel's gain per call (``bench_mla_decode_kernel.py --tma-ab``) is a few us a layer,
and what a user sees is the graphed step; the kernel is chosen when a step is captured, so each turn frees the
kept step (``release_decode_graphs``) and captures again.

    python benchmarks/bench_decode_tma_generate.py --out benchmarks/results/decode_tma_generate_h100.json
"""
from __future__ import annotations

import argparse
import json

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x32768,1x4096,16x1024", help="comma list of BATCHxCONTEXT")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs per shape")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from mla_fuser.bench import _generate_run
    from mla_fuser.kernels import mla_decode as md, mla_decode_tma
    from mla_fuser.presets import load_for_cli
    from mla_fuser.runtime.kept_steps import release_decode_graphs

    model, name = load_for_cli(argparse.Namespace(model=None, preset="deepseek-v2-lite", dtype="bf16",
                                                  device="cuda", seed=0), "vllm_mla")
    vocab = model.get_input_embeddings().weight.shape[0]
    result = {"model": name, "device": torch.cuda.get_device_name(), "steps": args.steps, "runs": []}
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        ids = torch.randint(3, vocab, (B, L), generator=torch.Generator().manual_seed(0)).cuda()
        tokens = {}
        for rnd in range(args.rounds):
            for on in (False, True):
                mla_decode_tma.ENABLED = on
                release_decode_graphs(model)
                torch.cuda.empty_cache()
                _, step, out, _, median = _generate_run(model, ids, args.steps)
                ran = bool(md.LAST_LAUNCH.get("config") is not None and md.LAST_LAUNCH["config"].tma)
                tokens[on] = out.cpu()
                row = {"batch": B, "context": L, "tma": on, "tma_ran": ran, "round": rnd, "ms_per_step": step * 1e3,
                       "median_step_ms": median * 1e3 if median else None}
                print(json.dumps(row), flush=True)
                result["runs"].append(row)
        same = (tokens[False] == tokens[True]).float().mean().item()
        result["runs"].append({"batch": B, "context": L, "greedy_tokens_equal_fraction": same})
        print(json.dumps(result["runs"][-1]), flush=True)
    mla_decode_tma.ENABLED = None  # (the setting again)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
