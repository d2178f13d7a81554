"""``mla-fuser serve``: an OpenAI-compatible HTTP server for a fused model, on Transformers' own server.

Why not ``transformers serve``: it loads models itself and accepts only its own attention names, so it cannot serve a
fused model.  Here the model is loaded and fused by this package (a preset with its built-in tokenizer, or a local
checkpoint with its own) and served by Transformers' server pieces, with continuous batching on by default (the fused
model's ``init_continuous_batching``, over latent pages).  Up to Transformers 5.24 the server runs in this process
and gets the loaded model (``serve.app``); from 5.25 it runs each model in an engine process of its own that loads it
with a loader it is given, so it gets our loader, which loads and fuses the model there (``serve.engine``).

The ``--cb-*`` options are those of ``transformers serve``, with the same meaning, plus ``--cb-max-requests-per-batch``
(the engine's ``max_requests_per_batch``, which ``transformers serve`` does not offer); this package imports the server
dependencies (FastAPI, uvicorn, openai: Transformers' ``serving`` extra) only here, after checking they are installed.
Shutdown (SIGINT/SIGTERM): uvicorn stops accepting, in-flight requests finish within ``--timeout-graceful-shutdown``
seconds or are cancelled in the engine, the engine (from 5.25: its process) stops, the process exits 0.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys

from ..compat import FEATURE_MIN_VERSION, serving_in_engine_processes, serving_log_requests, transformers_version

# Transformers' `serving` extra, as far as its server needs (its `is_serve_available` names the first four)
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "openai", "starlette")
INSTALL_HINT = 'pip install "mla-fuser[serve]"'
MIN_VERSION = FEATURE_MIN_VERSION["serve"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# `--cb-*` option of `transformers serve` -> ContinuousBatchingConfig field (its --cb-block-size is the page size)
CB_OPTIONS = {"cb_block_size": "page_size", "cb_num_blocks": "num_blocks", "cb_max_batch_tokens": "max_batch_tokens",
              "cb_max_memory_percent": "max_memory_percent", "cb_use_cuda_graph": "use_cuda_graph",
              "cb_max_requests_per_batch": "max_requests_per_batch"}

logger = logging.getLogger("mla_fuser.serve")


def missing_packages() -> list[str]:
    """The server dependencies that are not installed (empty when ``serve`` can run)."""
    return [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]


def unsupported() -> str | None:
    """Why the installed Transformers cannot serve a fused model, or None."""
    import transformers

    if transformers_version() >= MIN_VERSION:
        return None
    need = ".".join(map(str, MIN_VERSION))
    return (f"serve needs transformers>={need} (continuous batching of fused MLA models), installed "
            f"{transformers.__version__}: pip install -U 'transformers[serving]>={need}'")


def has_tokenizer(model_dir: str) -> bool:
    """Whether a checkpoint directory holds tokenizer files (a server speaks text)."""
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def unsupported_options(args) -> str | None:
    """Why a ``--cb-*`` option the installed engine has no field for cannot be taken (None when all can)."""
    import transformers

    fields = getattr(transformers.ContinuousBatchingConfig, "__dataclass_fields__", {})
    for option, field in CB_OPTIONS.items():
        if getattr(args, option, None) is not None and field not in fields:
            flag = "--" + option.replace("_", "-")
            return (f"{flag} needs a Transformers whose ContinuousBatchingConfig has {field} (installed: "
                    f"{transformers.__version__})")
    return None


def cb_config(args):
    """The ``ContinuousBatchingConfig`` the ``--cb-*`` options ask for, or None for the engine's defaults."""
    kwargs = {field: getattr(args, option) for option, field in CB_OPTIONS.items()
              if getattr(args, option, None) is not None}
    if not kwargs:
        return None
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**kwargs)


def load_served_model(args):
    """``(model, tokenizer, name)``: the model through the package's loader (fused), and the tokenizer a preset
    builds in code (its generation config then uses that tokenizer's ids) or the checkpoint's own."""
    from ..presets import load_for_cli, preset_tokenizer, use_tokenizer_ids

    model, name = load_for_cli(args, "vllm_mla")
    if args.model:
        from transformers import AutoTokenizer

        return model, AutoTokenizer.from_pretrained(args.model), name
    tokenizer = preset_tokenizer(args.preset)
    use_tokenizer_ids(model, tokenizer)
    return model, tokenizer, name


class _Signals:
    """SIGINT/SIGTERM before the server runs: exit 0 at once (nothing is in flight).  While it runs uvicorn handles
    them (graceful shutdown); afterwards it raises the signal it caught again, which then lands here and is done."""

    def __init__(self):
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if not self.serving:
            raise SystemExit(0)


def _log_to_stderr() -> None:
    """Our request log lines (cancellations) on stderr beside uvicorn's; the command is the application here."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("INFO:     mla-fuser: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


# The server process's GIL switch interval: Transformers' engine steps in one Python thread and the server answers in
# another, and CPython makes a thread that wants the GIL wait up to this long for the holder to let go (its default
# is 5 ms).  On an H200 host (``benchmarks/results/serving_switch_ab.json``: 256 requests in flight, in process) 0.5 ms
# served 8137 and 9263 output tokens/s against 7372 and 7606 with the default, TPOT p50 23-28 ms against 28-29 ms.
SWITCH_INTERVAL_S = 0.0005


class switch_interval:
    """``sys.setswitchinterval(seconds)`` while the block runs, the previous value restored after (the server sets it
    for its own process only: this package never changes it on import or for a library call)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        self.previous = sys.getswitchinterval()
        sys.setswitchinterval(self.seconds)
        return self

    def __exit__(self, *exc):
        sys.setswitchinterval(self.previous)


def _in_process_app(args):
    """Transformers 5.19-5.24: the model loaded and fused here, handed to the server (``serve.app``)."""
    from .app import build_app

    model, tokenizer, name = load_served_model(args)
    print(f"model: {name}")
    print(model.fusion_report, flush=True)
    app, state = build_app(model, tokenizer, name, continuous_batching=args.continuous_batching,
                           cb_config=cb_config(args))
    return app, name, state.shutdown, None


def _engine_process_app(args, interval: float):
    """Transformers 5.25 on: the model loaded and fused in the server's engine process by our loader
    (``serve.engine``; it prints the fusion report there); returns once it is loaded."""
    from .engine import MODEL_ARGS, build_app

    serving_log_requests(logging.INFO)  # (a line per request, as every release before logged one)
    name = args.model or args.preset
    app, manager = build_app(name, {field: getattr(args, field, None) for field in MODEL_ARGS},
                             continuous_batching=args.continuous_batching, cb_config=cb_config(args),
                             switch_interval=interval)
    return app, name, manager.shutdown, lambda: manager.is_dead


def run(args) -> int:
    """Load, fuse, print the fusion report, serve until SIGINT/SIGTERM; 0 after a clean shutdown, 1 when the
    engine process died (the server then stops, as ``transformers serve`` does)."""
    signals = _Signals()
    _log_to_stderr()
    import uvicorn

    interval = getattr(args, "switch_interval", None) or SWITCH_INTERVAL_S
    if serving_in_engine_processes():
        app, name, stop, engine_dead = _engine_process_app(args, interval)
    else:
        app, name, stop, engine_dead = _in_process_app(args)
    watch = {}
    if engine_dead is not None:  # (uvicorn calls it on its loop every few seconds)
        async def stop_if_the_engine_died() -> None:
            if engine_dead():
                server.should_exit = True

        watch = {"callback_notify": stop_if_the_engine_died, "timeout_notify": 5}
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown, **watch)
    server = uvicorn.Server(config)
    mode = "continuous batching" if args.continuous_batching else "one request at a time (generate)"
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 ({mode}; GIL switch interval {interval * 1e3:g} ms); "
          "SIGINT/SIGTERM stops", flush=True)
    signals.serving = True
    try:
        with switch_interval(interval):
            server.run()
    finally:
        stop()
    if engine_dead is not None and engine_dead():
        print("mla-fuser: error: the model's engine process died (see the error above): the server stopped",
              file=sys.stderr, flush=True)
        return 1
    return 0
