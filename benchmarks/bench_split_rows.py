"""The split-row decode kernel (continuous batching's attention) on step shapes of a serving run: decode tokens of many
requests, prefill chunks, and a mix; one token per program (``group=1``) vs runs of one request's tokens grouped
(the default), by CUDA-graph replay, with the result checked against the torch twin.

    python benchmarks/bench_split_rows.py --out benchmarks/results/split_rows.json
    python benchmarks/bench_split_rows.py --dry-run          # tiny shapes, interpreted Triton on a CPU

Where a shape has prefill chunks (H=16 by default), they are also timed absorbed vs expanded (``prefill_arms``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def step(requests, heads, rank, rope, device, dtype, seed=0):
    """One step: ``requests`` = [(cached rows, new tokens)]; the contexts' rows in shuffled slots of a pool whose V
    halves sit a page after the K halves (as the engine's pages hold them)."""
    gen = torch.Generator().manual_seed(seed)
    half, page = (rank + rope) // 2, 256
    total = sum(c + n for c, n in requests)
    blocks = -(-total // page) + 1
    pool = torch.randn(blocks * 2 * page, half, generator=gen).to(device, dtype)
    k_rows, v_rows = pool[:-page], pool[page:]
    slots = torch.tensor([b * 2 * page + p for b in range(blocks) for p in range(page)])
    slots = slots[torch.randperm(len(slots), generator=gen)][:total].to(device, torch.int32)
    starts, ends, k0 = [], [], 0
    for cached, new in requests:
        for t in range(new):
            starts.append(k0)
            ends.append(k0 + cached + t + 1)
        k0 += cached + new
    q = (torch.randn(len(starts), heads, rank + rope, generator=gen) * 0.5).to(device, dtype)
    as_i32 = dict(device=device, dtype=torch.int32)
    return q, k_rows, v_rows, slots, torch.tensor(ends, **as_i32), torch.tensor(starts, **as_i32)


def timed(fn, device, replays=20):
    if device.type != "cuda":
        fn()
        return float("nan")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / replays * 1e3


def sweep(shapes, device, dtype, scale):
    """The grouped launch's tile knobs (64 rows of token x head) on the shapes with prefill chunks, H=16; each config
    checked against the default's output (same math, another summation order)."""
    from mla_fuser.kernels.mla_decode import MLADecodeConfig
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows_triton

    rows = []
    for name, requests in shapes.items():
        if all(new == 1 for _, new in requests):
            continue
        q, k_rows, v_rows, slots, ends, starts = step(requests, 16, 512, 64, device, dtype)
        base = mla_decode_split_rows_triton(q, k_rows, v_rows, slots, ends, starts, scale, 512).float()
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = MLADecodeConfig(block_h=64, block_n=block_n, num_warps=warps, num_stages=stages)

                    def run(cfg=cfg):
                        return mla_decode_split_rows_triton(q, k_rows, v_rows, slots, ends, starts, scale, 512,
                                                            grouped_config=cfg)
                    try:
                        err = ((run().float() - base).abs().max() / base.abs().max()).item()
                        row = {"shape": name, "block_n": block_n, "warps": warps, "stages": stages,
                               "us": timed(run, device), "rel_diff_vs_default": err}
                    except Exception as exc:  # (out of shared memory or registers: recorded, the sweep goes on)
                        row = {"shape": name, "block_n": block_n, "warps": warps, "stages": stages,
                               "error": repr(exc)[:200]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def prefill_arms(requests, heads, device, dtype, scale, rank=512, rope=64, nope=128, v_dim=128, seed=0):
    """The prefill chunks of a step (``requests`` with more than one new token) two ways, with the query and the
    output projections each needs (DeepSeek-V2-Lite widths), by CUDA-graph replay: **absorbed** (the query's nope part
    through W_UK, the split-row kernel over the latent rows in place, W_UV on its output: what continuous batching
    runs) and **expanded** (each chunk's context rows gathered and joined, expanded through kv_b_proj into per-head
    K / V, then SDPA, causal from the context's end); the two outputs checked against each other (the same
    attention, another order of sums).  Issue 12's "varlen latent prefill kernel or per-chunk expansion of only what
    each chunk attends, whichever measures faster"."""
    from torch.nn.attention.bias import causal_lower_right

    from mla_fuser.kernels.mla_decode_split import join_split_rows, mla_decode_split_rows

    chunks = [(cached, new) for cached, new in requests if new > 1]
    if not chunks:
        return None
    gen = torch.Generator().manual_seed(seed)
    _, k_rows, v_rows, slots, ends, starts = step(chunks, heads, rank, rope, device, dtype, seed)
    tokens = int(ends.shape[0])
    w = (torch.randn(heads, nope + v_dim, rank, generator=gen) * rank ** -0.5).to(device, dtype)  # kv_b_proj
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q = (torch.randn(tokens, heads, nope + rope, generator=gen) * 0.5).to(device, dtype)
    bounds, k0, t0 = [], 0, 0
    for cached, new in chunks:
        bounds.append((t0, t0 + new, k0, k0 + cached + new))
        t0, k0 = t0 + new, k0 + cached + new

    def absorbed():
        q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)
        out = mla_decode_split_rows(q_lat, k_rows, v_rows, slots, ends, starts, scale, rank, q_rope=q[..., nope:])
        return torch.einsum("thr,hvr->thv", out, w_uv)

    def expanded():
        out = q.new_empty(tokens, heads, v_dim)
        for q0, q1, c0, c1 in bounds:
            rows = slots[c0:c1]
            latent = join_split_rows(k_rows.index_select(0, rows), v_rows.index_select(0, rows), rank)
            kv = torch.einsum("tr,hkr->htk", latent[:, :rank], w)  # [H, T, nope + v]
            k = torch.cat([kv[..., :nope], latent[:, rank:].expand(heads, -1, -1)], dim=-1)
            v = torch.nn.functional.pad(kv[..., nope:], (0, nope + rope - v_dim))
            qc = q[q0:q1].transpose(0, 1).unsqueeze(0)
            mask = causal_lower_right(q1 - q0, c1 - c0)
            o = torch.nn.functional.scaled_dot_product_attention(qc, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                                                 scale=scale)
            out[q0:q1] = o[0, :, :, :v_dim].transpose(0, 1)
        return out

    a, e = absorbed().float(), expanded().float()
    return {"chunk_tokens": tokens, "context_rows": int(slots.shape[0]),
            "absorbed_us": timed(absorbed, device), "expanded_us": timed(expanded, device),
            "max_rel_diff": ((a - e).abs().max() / e.abs().max()).item()}


def main(argv=None):
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows, mla_decode_split_rows_ref

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,128")
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="grouped launch's tiles swept on the prefill shapes (H=16)")
    p.add_argument("--prefill-heads", default="16", help="head counts whose prefill chunks are also timed absorbed "
                   "vs expanded (comma-separated; empty: none)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.prefill_heads = {int(h) for h in args.prefill_heads.split(",") if h}
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    scale = 1 / 192 ** 0.5
    if cuda:
        shapes = {"decode_256x600": [(600, 1)] * 256,
                  "prefill_4x2048": [(0, 2048)] * 4,
                  "chunk_2048_after_6k": [(6144, 2048)],
                  "mixed_8x512_prefill_and_192_decodes": [(256, 512)] * 8 + [(800, 1)] * 192}
    else:
        shapes = {"decode_8x40": [(40, 1)] * 8, "prefill_2x24": [(0, 24)] * 2, "mixed": [(10, 9), (30, 1), (5, 1)]}
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        for name, requests in shapes.items():
            q, k_rows, v_rows, slots, ends, starts = step(requests, heads, 512, 64, device, dtype)
            # the twin materialises [tokens, heads, rows]: checked on the first tokens only where that is large
            check = max(1, min(q.shape[0], (1 << 23) // int(slots.shape[0])))  # (~1.2 KB per token and row)
            want = mla_decode_split_rows_ref(q[:check].float(), k_rows.float(), v_rows.float(), slots, ends[:check],
                                             starts[:check], scale, 512)
            row = {"heads": heads, "shape": name, "tokens": q.shape[0], "context_rows": int(slots.shape[0]),
                   "tokens_checked_against_twin": check}
            for label, group in (("one_token_per_program", 1), ("grouped", None)):
                def run(group=group):
                    return mla_decode_split_rows(q, k_rows, v_rows, slots, ends, starts, scale, 512, group=group)
                err = ((run()[:check].float() - want).abs().max() / want.abs().max()).item()
                row[label] = {"us": timed(run, device), "max_rel_err": err}
            arms = prefill_arms(requests, heads, device, dtype, scale) if heads in args.prefill_heads else None
            if arms is not None:
                row["prefill_chunks_absorbed_vs_expanded"] = arms
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.sweep:
        rows += sweep(shapes, device, dtype, scale)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
