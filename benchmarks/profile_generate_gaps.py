"""Where a graphed ``generate()`` step spends its time beside the replay: host phases of Transformers' loop and ours.

A graphed decode step of ``generate()`` is slower than a bare loop of replays (``profile_decode_step.py``'s
``ms_per_replay``) by the host work the GPU waits for: Transformers' loop syncs once per step (its stopping check),
so everything the host does from that sync until the next replay is launched leaves the GPU idle.  This times, per
step and on the host, with ``time.perf_counter`` marks around the functions that bound each phase (instrumentation
of this script only, undone at the end):

* ``sync_wait``: inside ``_has_unfinished_sequences`` (Transformers 5.24 syncs earlier, in its stop check);
* ``hf_before_forward``: from the sync to our forward (``prepare_inputs_for_generation`` and the loop's own work);
* ``ours_before_replay``: from our forward's entry to ``CUDAGraph.replay`` (checks, positions, input copies);
* ``replay_launch``: the replay call itself (the graph launch, host side);
* ``ours_after_replay``: from the replay's return to our forward's return (lengths advanced, the output built);
* ``hf_after_forward``: from our forward's return to the next sync (logits, processors, argmax, stopping
  criteria: launched while the GPU runs the step; Transformers' ``StopCheck`` waits for the GPU in here).

``parts``: median microseconds of a few calls inside those phases (Transformers' ``prepare_inputs_for_generation``
where it runs: the prefill, and every step unless ``GraphedForward`` prepares the replayed steps' inputs itself;
``_update_model_kwargs_for_generation``, our ``_positions``, ``_check_step``, ``_current_addresses``).

The GPU idles for about ``hf_before_forward + ours_before_replay + replay_launch`` per step plus the step's tail of
small kernels.  ``generate_ms_per_step`` (two calls that differ by ``--new-tokens`` - 8 steps), ``bare_replay_ms`` and
``generate_fixed_ms_per_call`` (what a call costs besides its steps: the prefill, replaying the step the previous call
kept) and ``generate_fixed_ms_per_call_cold`` (the same with nothing kept: prefill, eager first step, capture) are
measured in the same process.

    python benchmarks/profile_generate_gaps.py --shapes 1x512,16x4096 [--fp8-weights] --out gaps.json
    python benchmarks/profile_generate_gaps.py --dry-run     # CPU, tiny preset (the step runs eagerly there)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import time

import torch

PHASES = ("sync_wait", "hf_before_forward", "ours_before_replay", "replay_launch", "ours_after_replay",
          "hf_after_forward")


class Marks:
    """Timestamps of phase boundaries, appended by the wrappers installed in :meth:`install`."""

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self.undo: list = []
        self.durations: dict[str, list[float]] = {}

    def timed(self, owner, attr: str):
        """Time every call of ``owner.attr`` (a part of a phase), in microseconds."""
        original = getattr(owner, attr)
        found = self.durations.setdefault(attr, [])

        @functools.wraps(original)  # (signature checks see the original's)
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                found.append((time.perf_counter() - began) * 1e6)

        setattr(owner, attr, wrapper)
        self.undo.append((owner, attr, original))

    def mark(self, name: str):
        self.events.append((name, time.perf_counter()))

    def wrap(self, owner, attr: str, before: str, after: str):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.mark(before)
            try:
                return original(*args, **kwargs)
            finally:
                self.mark(after)

        setattr(owner, attr, wrapper)
        self.undo.append((owner, attr, original))

    def install(self, device: str):
        from transformers.generation.utils import GenerationMixin

        from mla_fuser.runtime.decode_graph import DecodeGraph
        from mla_fuser.runtime.generate import GraphedForward

        for owner, attr in ((GenerationMixin, "prepare_inputs_for_generation"),
                            (GenerationMixin, "_update_model_kwargs_for_generation"),
                            (GraphedForward, "_positions"), (DecodeGraph, "_check_step"),
                            (DecodeGraph, "_current_addresses")):
            self.timed(owner, attr)
        self.wrap(GenerationMixin, "_has_unfinished_sequences", "sync_begin", "sync_end")
        self.wrap(GraphedForward, "__call__", "forward_begin", "forward_end")
        if device == "cuda":
            self.wrap(torch.cuda.CUDAGraph, "replay", "replay_begin", "replay_end")
        else:  # (a dry run: the step runs eagerly, which stands in for the replay)
            self.wrap(DecodeGraph, "_eager", "replay_begin", "replay_end")

    def remove(self):
        for owner, attr, original in reversed(self.undo):
            setattr(owner, attr, original)

    def phases(self) -> dict:
        """Median microseconds per phase over the steps whose six boundaries all appear in order."""
        order = ["sync_begin", "sync_end", "forward_begin", "replay_begin", "replay_end", "forward_end"]
        found = {name: [] for name in PHASES}
        events, inside = [], False
        for name, t in self.events:  # (an eager step calls the model's forward inside the "replay": not a phase)
            if inside and name.startswith("forward_"):
                continue
            inside = name == "replay_begin" or (inside and name != "replay_end")
            events.append((name, t))
        self.events = events
        names = [n for n, _ in self.events]
        for i in range(len(names) - 6):
            if names[i:i + 7] != order + ["sync_begin"]:
                continue
            t = [self.events[i + j][1] for j in range(7)]
            for name, (a, b) in zip(PHASES, ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6))):
                found[name].append((t[b] - t[a]) * 1e6)
        steps = len(found["sync_wait"])
        parts = {name: statistics.median(v) if v else None for name, v in self.durations.items()}
        syncs = [t for n, t in self.events if n == "sync_begin"]
        periods = [(b - a) * 1e3 for a, b in zip(syncs[2:], syncs[3:])]  # (steady steps: after the capture)
        return {"steps": steps, "median_step_ms": statistics.median(periods) if periods else None,
                **{name: statistics.median(v) if v else None for name, v in found.items()}, "parts": parts}


def bare_replay_ms(model, batch, length, device, steps=30) -> float:
    from mla_fuser.cache import PagedLatentCache
    from mla_fuser.compat import cache_keyword
    from mla_fuser.runtime import DecodeGraph

    ids = torch.randint(3, 1000, (batch, length), device=device)
    cache = PagedLatentCache.static_for(model, batch, length + steps + 8)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache}).logits[:, -1]
        step = DecodeGraph(model, cache)
        token, position = logits.argmax(-1, keepdim=True), length
        for _ in range(3):
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps - 3):
            token = step(token, torch.full_like(token, position)).argmax(-1, keepdim=True)
            position += 1
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3 / (steps - 3)


def generate_ms(model, batch, length, device, new_tokens, marks: Marks | None = None) -> dict:
    """``generate_ms_per_step`` (two calls of 8 and ``new_tokens`` tokens: their fixed costs cancel) and a call's
    fixed cost (prefill, plus the eager first step and the capture where it captures): with the step kept by the
    previous call of the same shape (``runtime.kept_steps``; both rounded to one cache size here), and cold, after
    ``release_decode_graphs``."""
    from mla_fuser import release_decode_graphs

    ids = torch.randint(3, 1000, (batch, length), device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def call(tokens, marked=False):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        if marked:
            marks.events.clear()
            marks.install(device)
        try:
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        finally:
            if marked:
                marks.remove()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) * 1e3

    with torch.no_grad():
        call(new_tokens)  # (warm: compiles, keeps its step)
        short, long = call(8), call(new_tokens, marked=marks is not None)
        release_decode_graphs(model)
        cold = call(8)
    step = (long - short) / (new_tokens - 8)
    return {"generate_ms_per_step": step, "generate_fixed_ms_per_call": short - 7 * step,
            "generate_fixed_ms_per_call_cold": cold - 7 * step}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x512,16x4096")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--fp8-weights", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, one small shape")
    p.add_argument("--ab-attr", default=None, help="MODULE:NAME, a boolean constant of ours (e.g. mla_fuser.runtime."
                                                    "decode_graph:ONE_LAUNCH_INPUT_COPY, mla_fuser.runtime.generate:"
                                                    "PREPARE_STEP_INPUTS): every shape measured with it False, then "
                                                    "True, in this process")
    args = p.parse_args(argv)
    from mla_fuser.presets import load_for_cli

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    preset, dtype = ("deepseek-v2-lite-tiny", "fp32") if device == "cpu" else ("deepseek-v2-lite", "bf16")
    if device == "cpu":
        args.shapes, args.new_tokens = "2x16", 24
    model_args = argparse.Namespace(model=None, preset=preset, dtype=dtype, device=device, seed=0)
    model = load_for_cli(model_args, "vllm_mla", fp8_weights=args.fp8_weights)[0]
    if device == "cpu":  # (a dry run takes the graphed plan's code path, its steps run eagerly)
        from mla_fuser.runtime import generate as runtime_generate

        runtime_generate.graphs_possible = lambda model: True
    rows = []
    settings = [None] if args.ab_attr is None else [False, True]
    for shape, setting in ((shape, setting) for shape in args.shapes.split(",") for setting in settings):
        batch, length = (int(v) for v in shape.split("x"))
        if setting is not None:
            module, name = args.ab_attr.split(":")
            setattr(importlib.import_module(module), name, setting)
        marks = Marks()
        row = {"batch": batch, "context": length, "new_tokens": args.new_tokens,
               **({} if setting is None else {"ab": {args.ab_attr: setting}}),
               "generate_ms_per_step": None, "generate_fixed_ms_per_call": None,
               "generate_fixed_ms_per_call_cold": None,
               "bare_replay_ms": bare_replay_ms(model, batch, length, device) if device == "cuda" else None,
               "host_us": None}
        row.update(generate_ms(model, batch, length, device, args.new_tokens, marks))
        row["host_us"] = marks.phases()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "preset": preset,
                  "fp8_weights": args.fp8_weights, "phases": list(PHASES), "rows": rows}
        if args.out:  # (after every shape: a run cut short keeps what it measured)
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
