"""Host (Python) time of a fused DeepSeek-V2-Lite-shaped model: cProfile over prefills into a paged cache.

A 512-token prefill on an H200 is host-bound (its kernels take ~13 ms); this lists where the host time goes,
by own time and by cumulative time within mla_fuser, so that overhead can be cut where it is.

    python benchmarks/profile_host.py --out profile_host.txt          # --dry-run: tiny preset on CPU
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


if __name__ == "__main__":
    main()
