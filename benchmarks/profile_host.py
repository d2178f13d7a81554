"""Host (Python) time of a fused DeepSeek-V2-Lite-shaped model: cProfile over prefills into a paged cache, or
(``--generate``) over the decode steps of a graphed ``generate()``.

A 512-token prefill on an H200 is host-bound (its kernels take ~13 ms); this lists where the host time goes,
by own time and by cumulative time within mla_fuser, so that overhead can be cut where it is.  With ``--generate``
the prefill is left out of the profile, and the same steps are timed beside a bare loop of graph replays (replay,
argmax, sync per step): the difference is what ``generate`` and our wrapper around the replay add per step.

    python benchmarks/profile_host.py --out profile_host.txt          # --dry-run: tiny preset on CPU
    python benchmarks/profile_host.py --generate --shape 1x512 --out profile_host_generate.txt
"""

import argparse
import cProfile
import io
import pstats
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1x512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="profile_host.txt")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--generate", action="store_true", help="profile the decode steps of a graphed generate()")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.presets import build_preset

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    preset, dtype = ("deepseek-v2-lite-tiny", torch.float32) if args.dry_run else ("deepseek-v2-lite", torch.bfloat16)
    batch, length = (int(v) for v in args.shape.split("x"))
    model = build_preset(preset, seed=0, dtype=dtype, device=device)
    ids = torch.randint(3, 1000, (batch, length), device=device)
    key = cache_keyword(model)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def prefill():
        cache = PagedLatentCache(model, max_cache_tokens=batch * (length + 64))
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})

    if args.generate:
        return profile_generate(args, model, ids, sync, preset, device)
    prefill()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        prefill()
    sync()
    wall = (time.perf_counter() - t0) / args.repeats * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.repeats):
        prefill()
    sync()
    profiler.disable()
    text = io.StringIO()
    text.write(f"{preset} {args.shape} prefill wall {wall:.2f} ms/call ({device})\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumtime").print_stats("mla_fuser", 40)
    with open(args.out, "w") as fh:
        fh.write(text.getvalue())
    print(text.getvalue()[:6000])


def profile_generate(args, model, ids, sync, preset, device):
    """ms/step of graphed greedy generate vs a bare replay loop, and cProfile of generate's decode steps only."""
    import transformers.generation.utils as generation_utils

    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.runtime import DecodeGraph

    n = args.new_tokens
    mask = torch.ones_like(ids)

    def generate(tokens):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        sync()
        return time.perf_counter() - t0

    generate(8)
    per_step = (generate(8 + n) - generate(8)) / n * 1e3
    # the bare loop: the same graph over a static cache, one argmax and one sync per step (what generate must do)
    batch, length = ids.shape
    cache = PagedLatentCache.static_for(model, batch, length + n + 4)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache}).logits[:, -1]
        step = DecodeGraph(model, cache)
        token = logits.argmax(-1, keepdim=True)
        for i in range(2):  # eager first step and capture
            token = step(token, torch.full_like(token, length + i)).argmax(-1, keepdim=True)
        sync()
        t0 = time.perf_counter()
        for i in range(2, n + 2):
            token = step(token, torch.full_like(token, length + i)).argmax(-1, keepdim=True)
            token.cpu()  # generate's stopping check syncs every step too
        bare = (time.perf_counter() - t0) / n * 1e3
    profiler = cProfile.Profile()
    original = generation_utils.GenerationMixin._prefill

    def unprofiled_prefill(self, *a, **k):
        profiler.disable()
        try:
            return original(self, *a, **k)
        finally:
            profiler.enable()

    generation_utils.GenerationMixin._prefill = unprofiled_prefill
    try:
        profiler.enable()
        generate(8 + n)
        profiler.disable()
    finally:
        generation_utils.GenerationMixin._prefill = original
    text = io.StringIO()
    text.write(f"{preset} {args.shape} graphed generate {per_step:.3f} ms/step, bare replay loop {bare:.3f} ms/step "
               f"({device}); profile: the decode steps of one generate call of {8 + n} tokens\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumtime").print_stats(30)
    with open(args.out, "w") as fh:
        fh.write(text.getvalue())
    print(text.getvalue()[:8000])


if __name__ == "__main__":
    main()
