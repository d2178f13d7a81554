"""MoE router at decode sizes: the modeling code's ops vs the selection kernel on torch's logits vs both kernels.

Three ways to route ``rows`` hidden states over a gate ``[experts, hidden]``, timed by CUDA-graph replay:

* ``native``: what DeepSeek-V2's router runs (``F.linear`` of fp32 copies, softmax, ``topk``, scale; V3's sigmoid,
  correction bias and top-2-sum groups for the V3 shape);
* ``torch_logits``: the fp32 copies and ``F.linear`` (cuBLAS), then ``moe_router.select_experts`` (one launch):
  the fused router with ``MLA_FUSER_ROUTER_LOGITS_KERNEL=0``;
* ``logits_kernel``: ``moe_router.router_logits_triton`` then ``select_experts``: two launches;
* ``row_block_kernel`` (``--block-m``): the same with the row-block logits kernel at each rows-per-program given.

Each graph routes over many copies of the gate in turn (together more than twice the L2), as a decode step meets
each layer's gate cold.  Reported per call, in microseconds; the kernel's routing is checked against the twin's
(sets per row, near-ties aside) and its logits against ``F.linear`` (within ``router_binding.LOGITS_RTOL``).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

# name: (experts, hidden, gate dtype, route params keyword arguments)
GATES = {
    "v2lite_64x2048": (64, 2048, torch.bfloat16, dict(top_k=6, post=(("scale", 1.0),))),
    "glm_air_128x4096": (128, 4096, torch.bfloat16, dict(top_k=8, scoring="sigmoid", weights_from="scores",
                                                          renorm=True, renorm_eps=1e-20, post=(("scale", 1.0),))),
    "v2_160x5120": (160, 5120, torch.bfloat16, dict(top_k=6, post=(("scale", 16.0),))),
    "v3_256x7168_fp32": (256, 7168, torch.float32, dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                                                         group_topn=2, weights_from="scores", renorm=True,
                                                         renorm_eps=1e-20, post=(("scale", 2.5),))),
}


def native_route(x, weight, correction, p):
    logits = F.linear(x.type(torch.float32), weight.type(torch.float32))
    if p.scoring == "softmax":
        weights, ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), k=p.top_k, dim=-1, sorted=False)
    else:
        scores = logits.sigmoid()
        choice = scores + correction
        groups = choice.view(-1, p.n_group or 1, logits.shape[-1] // (p.n_group or 1)).topk(2, dim=-1)[0].sum(-1)
        idx = torch.topk(groups, k=max(p.topk_group, 1), dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, idx, 1)
        keep = mask.unsqueeze(-1).expand(-1, groups.shape[-1], logits.shape[-1] // groups.shape[-1]).reshape(
            logits.shape)
        ids = torch.topk(choice.masked_fill(~keep.bool(), 0.0), k=p.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * p.post[0][1], ids


def graph_us(calls, copies: int, replays: int = 10) -> float:
    """Per call: one graph runs ``calls(i)`` for every copy ``i``; median over ``replays`` replays (NaN off CUDA,
    where each call runs once: a dry run)."""
    for i in range(copies):
        calls(i)
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            calls(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    from mla_fuser.fusers.moe import router_binding as rb
    from mla_fuser.kernels import moe_router as mr

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--gates", default=",".join(GATES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep-block-e", action="store_true", help="also the kernel at 1, 2, 4 and 8 experts per "
                    "program, where the gate fits the kernel")
    ap.add_argument("--block-m", default="", help="comma list of M or MxE: also the row-block logits kernel at M rows "
                    "(and E experts) per program, powers of two >= 16, each with the selection, its logits checked")
    ap.add_argument("--dry-run", action="store_true", help="without a GPU: every path once on CPU (with "
                    "TRITON_INTERPRET=1 and MLA_FUSER_BACKEND=triton for the kernels), two gate copies, no times")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("bench_router.py times CUDA graphs: it needs a GPU (or --dry-run)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1 << 16
    results = []
    for name in args.gates.split(","):
        experts, hidden, dtype, kw = GATES[name]
        p = mr.RouteParams(**kw)
        g = torch.Generator(device="cpu").manual_seed(0)
        size = experts * hidden * torch.empty((), dtype=dtype).element_size()
        copies = 2 if args.dry_run else max(8, min(512, math.ceil(2 * l2 / size)))
        gates = [(torch.randn(experts, hidden, generator=g) * hidden ** -0.5).to(device, dtype) for _ in range(copies)]
        correction = (torch.rand(experts, generator=g) * 0.1).to(device) if p.scoring == "sigmoid" else None
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
            fits = mr.logits_fit(x, gates[0], None)
            row = {"gate": name, "experts": experts, "hidden": hidden, "gate_dtype": str(dtype), "rows": rows,
                   "gate_copies": copies, "logits_fit": fits}
            row["native_us"] = graph_us(lambda i: native_route(x, gates[i], correction, p), copies)
            row["torch_logits_us"] = graph_us(
                lambda i: mr.select_experts(mr.router_logits_ref(x, gates[i], None), correction, p), copies)
            row["logits_kernel_us"] = graph_us(
                lambda i: mr.select_experts(mr.router_logits_triton(x, gates[i], None), correction, p), copies)
            if args.sweep_block_e and fits:
                row["logits_kernel_us_by_block_e"] = {
                    block_e: graph_us(lambda i, b=block_e: mr.select_experts(
                        mr.router_logits_triton(x, gates[i], None, block_e=b), correction, p), copies)
                    for block_e in (1, 2, 4, 8)}
            want = mr.router_logits_ref(x, gates[0], None)
            got = mr.router_logits_triton(x, gates[0], None)
            total = F.linear(x.float().abs(), gates[0].float().abs())
            for tile in filter(None, args.block_m.split(",")):
                block_m, _, block_e = tile.partition("x")
                kw_tile = dict(block_m=int(block_m), block_e=int(block_e) if block_e else None)
                row.setdefault("row_block_kernel_us", {})[tile] = graph_us(lambda i, k=kw_tile: mr.select_experts(
                    mr.router_logits_triton(x, gates[i], None, **k), correction, p), copies)
                blocked = mr.router_logits_triton(x, gates[0], None, **kw_tile)
                row.setdefault("row_block_within_rtol", {})[tile] = bool(
                    ((blocked - want).abs() <= rb.LOGITS_RTOL * total).all())
            row["logits_within_rtol"] = bool(((got - want).abs() <= rb.LOGITS_RTOL * total).all())
            twin = mr.select_experts_ref(want, correction, p)
            ours = mr.select_experts(got, correction, p)
            ties = rb._near_ties(want, correction, p, (got - want).abs().amax(dim=-1))
            row["routing_equal_twin"] = rb._same_sets(ours, twin, ties, slack=4 * float((got - want).abs().max()))
            row["near_tie_rows"] = int(ties.sum())
            results.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "timing": "CUDA-graph replay median, per call; each graph routes over gate copies totalling >= 2x L2",
           "l2_bytes": l2, "rows": results}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
