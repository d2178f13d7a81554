"""``mla-fuser generate | inspect | bench | serve``.

Every command works on the embedded default preset (no download) or on a local checkpoint (``--model DIR``; ``serve``
also takes it as its first argument).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

from . import envs
from .presets import DEFAULT_PRESET, DTYPES, FULL_SIZE_PRESETS, PRESETS, load_for_cli, preset_config

PROG = "mla-fuser"
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # what --device may also be with --model


class UsageError(Exception):
    """A command line that cannot work, found before anything is built; ``main`` prints it as one error line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``mla-fuser: error: ...`` and exit status 2: the message says what is
    wrong and what is allowed, ``--help`` has the rest (subcommand parsers inherit the class)."""

    def error(self, message):
        self.exit(2, f"{PROG}: error: {' '.join(str(message).split())}\n")


def _positive_int(text: str) -> int:
    """argparse type of counts (tokens, steps): zero or a negative count cannot run."""
    if not (text.strip().isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    """argparse type of how many requests take a part (zero: none)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _shapes(text: str) -> list[tuple[int, int]]:
    """argparse type of ``--shapes``: ``BATCHxCONTEXT`` pairs of positive integers, comma-separated."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not BATCHxCONTEXT: expected positive integers, "
                                             "comma-separated, e.g. 1x64,4x128")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _output_file(text: str) -> str:
    """argparse type of ``--out``/``--plot``: a file that can be written, checked before a benchmark that may run
    for minutes rather than after it."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory: expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder} does not exist: expected a file in an existing directory")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return text


def _check_device(args) -> None:
    """``--device`` must name a device this torch can use; otherwise it fails deep inside the model build.  With
    ``--model`` it is a device_map, so Accelerate's strategies (``auto`` ...) are allowed too."""
    name = args.device
    if name is None or (args.model and name in DEVICE_MAP_STRATEGIES):
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device: expected e.g. cpu, cuda or cuda:1") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this torch sees no CUDA device (torch.cuda.is_available() is False); "
                         "use --device cpu or leave --device out")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"--device {name}: there are {count} CUDA device(s): expected cuda:0 to cuda:{count - 1}")


def _model_config(args):
    """The config of the model the command would build, read without building it (a preset's from code, a
    checkpoint's from its config.json alone), so a wrong ``--model`` fails before any weights load."""
    if not args.model:
        return preset_config(args.preset)
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: no such directory: expected a local checkpoint directory")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model {args.model}: no config.json there: expected a Transformers checkpoint directory")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model}: its config.json cannot be read: {exc}") from None


def _check_prompt_ids(args, config) -> None:
    """Token ids outside the vocabulary fail inside the embedding lookup, after the model is built and fused."""
    vocab = config.get_text_config().vocab_size
    bad = [i for i in args.prompt_ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"--prompt-ids: {', '.join(map(str, bad))} outside the vocabulary of "
                         f"{args.model or args.preset}: expected ids from 0 to {vocab - 1}")


def _in_unit_interval(text: str, expected: str) -> float:
    """A number in (0, 1], else argparse's error saying what was ``expected``."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """argparse type of a memory share: a number in (0, 1]."""
    return _in_unit_interval(text, "a number in (0, 1]")


def _seconds(text: str) -> float:
    """argparse type of a time limit: zero or more seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}")
    return value


def _interval(text: str) -> float:
    """argparse type of a GIL switch interval: a number of seconds in (0, 1]."""
    return _in_unit_interval(text, "seconds in (0, 1]")


def _port(text: str) -> int:
    if not (text.strip().isdigit() and 0 < int(text) < 65536):
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return int(text)


def _check_serve_setup(args) -> None:
    """``serve``: its dependencies and Transformers release first (the one-line answer says what to install), then
    which model: ``MODEL_DIR`` is ``--model``'s positional spelling."""
    from . import serve

    missing = serve.missing_packages()
    if missing:
        raise UsageError(f"serve needs the server dependencies (missing: {', '.join(missing)}): {serve.INSTALL_HINT}")
    reason = serve.unsupported() or serve.unsupported_options(args)
    if reason:
        raise UsageError(reason)
    if args.model_dir:
        if args.model or args.preset != DEFAULT_PRESET:
            raise UsageError("serve takes one model: MODEL_DIR, --model DIR or --preset NAME")
        args.model = args.model_dir


def _check_serve_target(args) -> None:
    """``serve``: a checkpoint needs its tokenizer (the server speaks text), and the address must be free: both
    found here, not after minutes of loading."""
    import socket

    from . import serve

    if args.model and not serve.has_tokenizer(args.model):
        raise UsageError(f"{args.model}: no tokenizer files ({', '.join(serve.TOKENIZER_FILES)}): the server needs the "
                         "checkpoint's tokenizer")
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((args.host, args.port), family=family):
            pass
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None


def _check_usage(args) -> None:
    """Everything about the command line that needs more than one argument, or the model's config, checked before
    a model is built (single values are checked by the argparse ``type=`` functions)."""
    if args.command == "serve":
        _check_serve_setup(args)
    _check_device(args)
    if not args.model and args.preset in FULL_SIZE_PRESETS and args.device is None:
        raise UsageError(f"--preset {args.preset} is {FULL_SIZE_PRESETS[args.preset]}: say where to build it, "
                         f"--device cuda --dtype bf16 on a GPU (or --device cpu to build it on the CPU anyway)")
    config = _model_config(args)
    if getattr(args, "prompt_ids", None):
        _check_prompt_ids(args, config)
    if getattr(args, "plot", None) and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'mla-fuser[plot]'")
    if getattr(args, "fp8_cache", False) and not args.generate:
        raise UsageError("--fp8-cache times generate() over a float8 PagedLatentCache: add --generate")
    if getattr(args, "serve", False):
        decode_only = [flag for flag, on in (("--generate", args.generate), ("--cuda-graph", args.cuda_graph),
                                             ("--compile-mode", args.compile_mode), ("--fp8-weights", args.fp8_weights),
                                             ("--fp8-cache", args.fp8_cache)) if on]
        if decode_only:
            raise UsageError(f"--serve runs continuous batching over the default model: {', '.join(decode_only)} "
                             f"apply to the decode benchmark only")
        for name in ("prompt_range", "output_range"):
            low, high = getattr(args, name)
            if low > high:
                raise UsageError(f"--{name.replace('_', '-')} {low} {high}: MIN is above MAX")
        from .compat import FEATURE_MIN_VERSION, transformers_version

        needed = FEATURE_MIN_VERSION["continuous batching"]
        if transformers_version() < needed:
            import transformers

            raise UsageError(f"--serve runs Transformers' continuous batching, which fused MLA models need "
                             f"transformers>={'.'.join(map(str, needed))} for (installed: {transformers.__version__})")
    if args.command == "serve":
        _check_serve_target(args)


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
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default=None, help="e.g. cuda; default: CPU (or the checkpoint's device_map)")
    p.add_argument("--seed", type=int, default=0)


# timed calls per model (the median is reported): one call of the default preset on a CPU lasts ~0.1 s, and calls
# differ by up to ±5% on a shared machine
TIMED_CALLS = 3


def _timed_generates(models: dict, ids, args) -> tuple[dict, dict]:
    """``(outputs, seconds)`` by model name: each model's greedy call, timed ``TIMED_CALLS`` times, the models
    alternating (drifts of a shared machine hit all of them), after one untimed call of each just like the timed
    ones; with ``--no-warmup``, each model's first call, once.

    Why warm up: a first call pays one-time costs that are not the model's speed: the process's first run of each op
    (they fall on whichever model runs first, ~4% of the default preset's CPU call), and on a GPU Triton's compiles
    and the CUDA-graph capture of the decode step.  The warm-up is the same call because a shorter one would not take
    the same path: on a GPU ``generate`` replays its steps from a graph only from 8 new tokens, and keeps the captured
    step for the next call of the same shape, which the timed calls then replay."""
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    outputs, seconds = {}, {name: [] for name in models}
    with torch.no_grad():
        if not args.no_warmup:
            for model in models.values():
                model.generate(ids, **kwargs)
        for _ in range(1 if args.no_warmup else TIMED_CALLS):
            for name, model in models.items():
                start = time.perf_counter()
                outputs[name] = model.generate(ids, **kwargs)
                seconds[name].append(time.perf_counter() - start)
    return outputs, {name: statistics.median(times) for name, times in seconds.items()}


def cmd_generate(args) -> int:
    model, name = load_for_cli(args, "vllm_mla")
    print(f"model: {name}")
    print(model.fusion_report)
    ids = _prompt(args, model)
    models = {"fused": model}
    if args.check:
        models["native sdpa"] = load_for_cli(args, "sdpa")[0]
    outputs, seconds = _timed_generates(models, ids, args)
    new = outputs["fused"][0, ids.shape[1]:].tolist()
    timed = "first call" if args.no_warmup else f"median of {TIMED_CALLS} calls after a warm-up call"
    print(f"prompt ids: {ids[0].tolist()}")
    print(f"generated ids: {new}")
    elapsed = seconds["fused"]
    print(f"{len(new)} tokens in {elapsed:.3f} s: {len(new) / elapsed:.1f} tokens/s (fused, {timed})")
    if args.check:
        n_elapsed = seconds["native sdpa"]
        same = torch.equal(outputs["native sdpa"], outputs["fused"])
        print(f"native sdpa: {len(new)} tokens in {n_elapsed:.3f} s: {len(new) / n_elapsed:.1f} tokens/s ({timed})")
        print(f"check: fused output {'EQUALS' if same else 'DIFFERS FROM'} the native output")
        return 0 if same else 1
    return 0


def cmd_inspect(args) -> int:
    model, name = load_for_cli(args, "vllm_mla")
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
    if args.serve:
        result = _serve_bench(args)
    else:
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


def _serve_bench(args) -> dict:
    """``bench --serve``: :func:`bench_serve.serve_benchmark` on the command line's model, its PNG with ``--plot``."""
    from . import bench_serve

    name = args.model or args.preset
    result = bench_serve.serve_benchmark(
        lambda: load_for_cli(args, "vllm_mla")[0], lambda: load_for_cli(args, "sdpa")[0], name,
        requests=args.requests, prompt_range=tuple(args.prompt_range), output_range=tuple(args.output_range),
        static_requests=args.static_requests, static_batch=args.static_batch, native_requests=args.native_requests,
        native_batch=args.native_batch, max_memory_percent=args.max_memory_percent,
        max_batch_tokens=args.max_batch_tokens, warmup=args.warmup, seed=args.seed)
    if args.plot:
        bench_serve.plot(result, args.plot, f"{name}, {args.requests} requests")
    return result


def cmd_serve(args) -> int:
    from .serve import run

    return run(args)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s options: the model, the address, and ``transformers serve``'s continuous-batching options under
    their names there."""
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="local checkpoint directory (same as --model)")
    _add_model_args(p)
    p.add_argument("--host", default="localhost", help="address to listen on (default localhost)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=True,
                   help="serve requests through Transformers' continuous batching (default on; off: one generate() "
                        "call at a time)")
    p.add_argument("--cb-block-size", type=_positive_int, help="KV cache block size in tokens for continuous batching")
    p.add_argument("--cb-num-blocks", type=_positive_int, help="number of KV cache blocks for continuous batching")
    p.add_argument("--cb-max-batch-tokens", type=_positive_int, help="maximum tokens per batch for continuous batching")
    p.add_argument("--cb-max-memory-percent", type=_fraction, help="max GPU memory fraction for the KV cache (0-1]")
    p.add_argument("--cb-use-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for continuous batching (default: the engine decides)")
    p.add_argument("--cb-max-requests-per-batch", type=_positive_int,
                   help="requests one engine step may hold (the engine's max_requests_per_batch; ours, not a "
                        "transformers serve option; default: no cap)")
    p.add_argument("--switch-interval", type=_interval, default=None, metavar="SECONDS",
                   help="the server process's GIL switch interval while it serves (default 0.0005; Python's own is "
                        "0.005): the engine's thread waits less for the GIL the server's thread holds")
    p.add_argument("--timeout-graceful-shutdown", type=_seconds, default=30.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are cancelled")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy generation with the fused model")
    _add_model_args(gen)
    gen.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids")
    gen.add_argument("--prompt-len", type=_positive_int, default=16,
                     help="random prompt length when no ids are given")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32)
    gen.add_argument("--check", action="store_true", help="also run the native sdpa model and compare tokens")
    gen.add_argument("--no-warmup", action="store_true",
                     help="time each model's first call, once (default: the median of 3 calls, the models "
                          "alternating, after an untimed call of each just like them)")
    gen.set_defaults(func=cmd_generate)

    ins = sub.add_parser("inspect", help="print the fusion report (and the rewritten source)")
    _add_model_args(ins)
    ins.add_argument("--show-source", action="store_true", help="print each rewritten forward as a diff")
    ins.set_defaults(func=cmd_inspect)

    bench = sub.add_parser("bench", help="native vs fused decode ms/step, prefill time, peak memory")
    _add_model_args(bench)
    bench.add_argument("--shapes", type=_shapes, default="1x64,4x128",
                       help="comma list of BATCHxCONTEXT (default: CPU-sized)")
    bench.add_argument("--steps", type=_positive_int, default=8, help="decode steps timed per shape")
    bench.add_argument("--out", type=_output_file, help="write the JSON here")
    bench.add_argument("--plot", type=_output_file,
                       help="write a PNG (needs matplotlib): ms/step against context length; with --serve, "
                            "throughput bars and the TPOT CDF")
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
    bench.add_argument("--fp8-weights", action="store_true",
                       help="quantise the fused model's linears and experts to block FP8 (128x128) on load; the "
                            "unquantised fused model runs beside it")
    bench.add_argument("--fp8-cache", action="store_true",
                       help="with --generate: the fused model decodes over a float8 PagedLatentCache")
    serving = bench.add_argument_group("--serve",
                                       "a ragged workload through continuous batching (mla_fuser.bench_serve)")
    serving.add_argument("--serve", action="store_true",
                         help="serve a seeded synthetic workload (all requests at once, fixed lengths) through "
                              "Transformers' continuous batching, beside fused and native static batches: output "
                              "tokens/s, TTFT, TPOT (the decode options above do not apply)")
    serving.add_argument("--requests", type=_positive_int, default=1000)
    serving.add_argument("--prompt-range", type=_positive_int, nargs=2, default=[32, 1024], metavar=("MIN", "MAX"))
    serving.add_argument("--output-range", type=_positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    serving.add_argument("--static-requests", type=_count, default=None,
                         help="requests of the workload run as fused static batches (default all; 0: none)")
    serving.add_argument("--static-batch", type=_positive_int, default=64)
    serving.add_argument("--native-requests", type=_count, default=64,
                         help="requests run as native static batches (default 64; 0: none)")
    serving.add_argument("--native-batch", type=_positive_int, default=32)
    serving.add_argument("--max-batch-tokens", type=_positive_int, default=None,
                         help="tokens per engine step (default: the engine's)")
    serving.add_argument("--max-memory-percent", type=_fraction, default=0.8)
    serving.add_argument("--warmup", type=_count, default=32, help="requests served untimed first (default 32)")
    bench.set_defaults(func=cmd_bench)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the fused model (Transformers' own server; "
                                       "needs mla-fuser[serve])")
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv=None) -> int:
    """Run a command; a usage error, or a bad environment variable met anywhere in the command, exits with status 2
    and one ``mla-fuser: error:`` line instead of a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        envs.check_all()
        _check_usage(args)
        return args.func(args)
    except (UsageError, envs.SettingError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
