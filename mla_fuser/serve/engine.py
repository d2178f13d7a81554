"""Transformers' own OpenAI-compatible server of 5.25 on (``transformers.cli.serving``, rebuilt around engine
processes) over one model this package loads and fuses.

Why this shape: from 5.25 the server runs each model in a spawned process of its own (the engine), which loads the
model itself with a pickled copy of the server's ``ModelLoader``, by repository name; the API server (this process)
keeps only the model's config, generation config and tokenizer, which it reads with the same loader.  A loaded model
can no longer be handed to the server, but a loader can:

* :class:`FusedModelLoader`: a ``ModelLoader`` pinned to our model: in the engine process it loads and fuses it through
  this package (``presets.load_for_cli``: a preset with seeded weights, or a checkpoint through our drop-in loader) and
  prints the fusion report; for a preset, which has no repository, it builds the config, generation config and
  tokenizer in code, in both processes, and the engine checks that the model's generation config is the one the API
  server builds its requests from.
* :class:`PinnedModelManager`: Transformers' model manager whose pinned model is a :class:`ContextCappedEngine`
  named as given (a preset is not a Hub repository: no ``@main`` in the answers).
* :class:`ContextCappedEngine`: the model's ``EngineClient`` capping each request's new tokens at what the context
  still holds (``serve.common.new_tokens_that_fit``).
* :func:`checked`: endpoint handlers refusing a non-positive token limit and a prompt that fills the context with our
  HTTP 400 message, and logging a request cancelled before its end with its id.

What 5.25 does itself and this module therefore leaves to it (``serve.app`` adds its own up to 5.24): cancelling the
engine request of a client that goes away (its ``CancelOnDisconnect``, streaming or not), the plain ASGI request-id
middleware, per-stream SSE templates, and a log line per request.  Imported only on such a release, once the serving
dependencies are known to be installed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types

from fastapi.responses import StreamingResponse
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import EngineClient, ModelLoader, ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import (
    EngineDeadError,
    GenerationState,
    canonical_model_id,
    parse_model_id,
    prompt_length,
)

from ..compat import accepted_keywords
from .common import check_prompt_room, check_token_limits, new_tokens_that_fit, openai_errors, openai_shaped

logger = logging.getLogger("mla_fuser.serve")
# what a model's arguments may hold, as ``presets.load_for_cli`` reads them (kept plain: the loader is pickled)
MODEL_ARGS = ("model", "preset", "dtype", "device", "seed")
# generation-config fields the API server builds every request from (``BaseHandler._build_generation_kwargs``)
REQUEST_DEFAULTS = ("max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_k", "top_p")


class FusedModelLoader(ModelLoader):
    """Transformers' model loader pinned to one model of ours: ``name`` (a preset's name or ``--model``'s directory,
    as the server serves it) with the command line's model arguments (``MODEL_ARGS``).  The engine process gets a
    pickled copy, so it holds only plain values; ``switch_interval`` (seconds, or None) is that process's GIL switch
    interval: its continuous-batching thread steps while its request and result threads wait for the GIL."""

    def __init__(self, name: str, model_args: dict, switch_interval: float | None = None):
        super().__init__()  # (Transformers' own loading settings: unused, our loading reads ``model_args``)
        self.name, self.model_args, self.switch_interval = name, dict(model_args), switch_interval

    @property
    def preset(self) -> str | None:
        """The preset served, or None for a checkpoint directory."""
        return None if self.model_args.get("model") else self.model_args["preset"]

    def _check_model_id(self, model_id: str) -> None:
        """A ``ValueError`` (HTTP 400) for any model but ours: this loader loads one model only."""
        if parse_model_id(model_id)[0] != self.name:
            raise ValueError(f"this server serves {self.name!r} only (requested {model_id!r})")

    def load_processor(self, model_id: str):
        """The preset's tokenizer built in code, or the checkpoint's own (as ``serve.load_served_model``)."""
        self._check_model_id(model_id)
        if self.preset is not None:
            from ..presets import preset_tokenizer

            return preset_tokenizer(self.preset)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.name)

    def load_config(self, model_id: str):
        """``(config, generation config)``: a checkpoint's from its files (Transformers' own reading); a preset's
        built as its model gets them (``from_config``, then the tokenizer's pad/bos/eos ids)."""
        self._check_model_id(model_id)
        if self.preset is None:
            return super().load_config(self.name)
        from transformers import GenerationConfig

        from ..presets import preset_config, use_tokenizer_ids

        config = preset_config(self.preset)
        holder = types.SimpleNamespace(generation_config=GenerationConfig.from_model_config(config))
        use_tokenizer_ids(holder, self.load_processor(model_id))
        return config, holder.generation_config

    def load_model_and_processor(self, model_id: str, on_progress=None):
        """In the engine process: our model, loaded and fused (its fusion report printed), and its tokenizer."""
        import argparse

        from ..presets import load_for_cli, use_tokenizer_ids

        self._check_model_id(model_id)
        if self.switch_interval is not None:  # (this process serves this model and nothing else)
            sys.setswitchinterval(self.switch_interval)
        if on_progress is not None:
            on_progress({"status": "loading", "model": model_id, "stage": "processor"})
        processor = self.load_processor(model_id)
        if on_progress is not None:
            on_progress({"status": "loading", "model": model_id, "stage": "weights"})
        model, _ = load_for_cli(argparse.Namespace(**self.model_args), "vllm_mla")
        if self.preset is not None:
            use_tokenizer_ids(model, processor)
        self._check_generation_config(model, model_id)
        print(f"model: {self.name}")
        print(model.fusion_report, flush=True)
        return model, processor

    def _check_generation_config(self, model, model_id: str) -> None:
        """The API server builds every request from the generation config ``load_config`` gives (end of sequence,
        sampling defaults); a model that generates with other values would answer differently: fail loading."""
        expected = self.load_config(model_id)[1]
        differ = {name: (getattr(expected, name, None), getattr(model.generation_config, name, None))
                  for name in REQUEST_DEFAULTS + ("pad_token_id", "bos_token_id")
                  if getattr(expected, name, None) != getattr(model.generation_config, name, None)}
        if differ:
            raise RuntimeError(f"{self.name}: the loaded model's generation config differs from the server's "
                               f"(field: (server, model)): {differ}")


class ContextCappedEngine(EngineClient):
    """The served model's ``EngineClient``: each request's ``max_new_tokens`` is capped, in the handler's own
    generation settings (so its finish reason says ``length``), at what the context still holds after the prompt
    (the handlers have refused a prompt that fills it)."""

    def _cap(self, inputs: dict, generation_kwargs: dict) -> None:
        context = self.generation_state.context_length(self.model_config)
        generation_kwargs["max_new_tokens"] = new_tokens_that_fit(generation_kwargs.get("max_new_tokens"),
                                                                  prompt_length(inputs), context)

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict):
        self._cap(inputs, generation_kwargs)
        return await super().generate_non_streaming(inputs, generation_kwargs)

    def generate_streaming(self, inputs: dict, generation_kwargs: dict, response_parser=None):
        self._cap(inputs, generation_kwargs)
        return super().generate_streaming(inputs, generation_kwargs, response_parser=response_parser)


class PinnedModelManager(ModelManager):
    """Transformers' model manager serving our model alone (``force_model``; other names get its HTTP 400 "Server is
    pinned to ..."), as a :class:`ContextCappedEngine` that goes by the name as given.  Its process starts, and the
    model loads, when the manager is built."""

    def preload_engine(self, force_model: str, engine_connection: tuple | None) -> None:
        engine = ContextCappedEngine(force_model, self.loader, self.generation_state, connection=engine_connection)
        self.engines[canonical_model_id(force_model)] = engine  # (where ``get_engine`` and ``list_models`` look)
        if engine_connection is None:
            engine.start()


def _log_cancelled(request_id: str) -> None:
    logger.info("request %s cancelled before its end: its client went away, or the shutdown deadline passed",
                request_id)


async def _logged_stream(body, request_id: str):
    """``body`` (a streamed answer) as it is; a stream stopped before its end (its client went away: Transformers'
    ``CancelOnDisconnect`` cancels it, and the engine request with it) is logged with the request id."""
    try:
        async for chunk in body:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        _log_cancelled(request_id)
        raise
    finally:
        await body.aclose()


def checked(handler_class: type) -> type:
    """``handler_class`` (a Transformers endpoint handler) refusing a non-positive token limit and a prompt that
    fills the model's context (HTTP 400, ``serve.common``), and logging a request cancelled before its end."""

    class Checked(handler_class):
        async def handle_request(self, body, request_id):
            if isinstance(body, dict):
                check_token_limits(body)
            try:
                response = await super().handle_request(body, request_id)
            except asyncio.CancelledError:  # (a JSON answer's client went away, or the shutdown deadline)
                _log_cancelled(request_id)
                raise
            if isinstance(response, StreamingResponse):
                response.body_iterator = _logged_stream(response.body_iterator, request_id)
            return response

        def _check_prompt_length(self, engine, inputs: dict) -> None:
            check_prompt_room(prompt_length(inputs), self.generation_state.context_length(engine.model_config))

    Checked.__name__ = Checked.__qualname__ = f"Checked{handler_class.__name__}"
    return Checked


def build_app(name: str, model_args: dict, *, continuous_batching: bool = True, cb_config=None,
              switch_interval: float | None = None):
    """``(app, model_manager)``: Transformers' FastAPI app serving our model as ``name`` on ``/v1/completions``,
    ``/v1/chat/completions``, ``/v1/responses``, ``/v1/models``, ``/health``.  Building it starts the engine process
    and waits for the model to load (a failure raises here); the app's shutdown, or ``model_manager.shutdown()``,
    stops it."""
    state = GenerationState(continuous_batching=continuous_batching, compile=False, cb_config=cb_config)
    loader = FusedModelLoader(name, model_args, switch_interval)
    manager = PinnedModelManager(loader, state, model_timeout=-1, force_model=name)
    common = {"model_manager": manager, "generation_state": state, "chat_template_kwargs": {}}
    app = build_server(
        manager,
        checked(ChatCompletionHandler)(**common),
        completion_handler=checked(CompletionHandler)(manager, state),
        response_handler=checked(ResponseHandler)(**common),
        transcription_handler=TranscriptionHandler(manager),
        systemone_handler=SystemOneHandler(**accepted_keywords(SystemOneHandler.__init__, common)),
    )
    openai_errors(app)
    openai_shaped(app, (ValueError, EngineDeadError))
    return app, manager
