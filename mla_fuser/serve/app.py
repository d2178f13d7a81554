"""Transformers' own OpenAI-compatible server (``transformers.cli.serving``) over one model this package loaded.

``transformers serve`` loads models itself (by architecture name, checking the attention name against its own list),
so it cannot serve a fused model.  Its pieces can: this module subclasses three of them and uses the rest as they are
(``build_server``, the endpoint handlers, the continuous-batching glue, SSE streaming, request ids):

* :class:`PreloadedModelManager`: the model manager pinned to our model; other model names get Transformers' own
  HTTP 400 ("Server is pinned to ...").
* :class:`CheckedGenerationState`: the generation managers it hands out check each prompt against the model's
  context before anything is queued (HTTP 400), and cancel the engine request of a client that went away.
* :func:`checked`: endpoint handlers that refuse a non-positive token limit with HTTP 400.
* ``serve.streaming``: text-only stream chunks from per-stream templates, and a plain ASGI request-id middleware in
  place of Transformers' ``BaseHTTPMiddleware`` one (less host time per streamed token, the same bytes).
* :class:`CancelOnDisconnect`: a non-streaming request whose client goes away is cancelled in the engine (Starlette
  only notices a disconnect while it streams a response; a JSON answer would generate to its end for nobody).

Bad JSON and unknown request fields get Transformers' (FastAPI's) own HTTP 422.  ``serve.common.openai_errors`` gives
every error response the OpenAI API's shape as well, so OpenAI clients show the message, not only the status code.
Imported only once the serving dependencies are known to be installed (``mla_fuser.serve.missing_packages``).
"""

from __future__ import annotations

import asyncio
import logging

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, TimedModel
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import X_REQUEST_ID, BaseGenerateManager, GenerationState

from ..compat import accepted_keywords, serving_engine, serving_optional_handlers
from .common import check_prompt_room, check_token_limits, new_tokens_that_fit, openai_errors
from .streaming import fast_text_chunks, replace_request_id_middleware

logger = logging.getLogger("mla_fuser.serve")

class PreloadedModelManager(ModelManager):
    """Transformers' model manager holding one model loaded (and fused) by us, under ``name``, never unloaded while
    the server runs.  Only the public surface the handlers use changes: ``load_model_and_processor`` returns our
    model, and names are kept as given (no ``@main`` revision: a preset is not a Hub repository)."""

    def __init__(self, model, processor, name: str):
        super().__init__(**accepted_keywords(ModelManager.__init__, {"model_timeout": -1}))
        self.force_model = name  # handlers answer requests naming another model with HTTP 400
        self.loaded_models[name] = TimedModel(model, timeout_seconds=-1, processor=processor)

    @staticmethod
    def process_model_name(model_id: str) -> str:
        return model_id

    def load_model_and_processor(self, model_id_and_revision: str, progress_callback=None, **kwargs):
        timed = self.loaded_models.get(model_id_and_revision)
        if timed is None or timed.model is None:
            raise ValueError(f"this server serves {self.force_model!r} only (requested {model_id_and_revision!r})")
        if progress_callback is not None:
            progress_callback({"status": "ready", "model": model_id_and_revision, "cached": True})
        return timed.model, timed.processor


def checked(handler_class: type) -> type:
    """``handler_class`` (a Transformers endpoint handler) whose requests pass :func:`check_token_limits` first."""

    class Checked(handler_class):
        async def handle_request(self, body, request_id):
            if isinstance(body, dict):
                check_token_limits(body)
            return await super().handle_request(body, request_id)

    Checked.__name__ = Checked.__qualname__ = f"Checked{handler_class.__name__}"
    return Checked


def fit_to_context(inputs, gen_config, context: int | None) -> None:
    """HTTP 400 for an empty prompt or one that leaves no room in the model's context; otherwise cap the request's
    new tokens at what the context holds (the response then says ``finish_reason: "length"``)."""
    ids = inputs["input_ids"]
    length = int(ids.shape[-1]) if hasattr(ids, "shape") else len(ids)
    check_prompt_room(length, context)
    gen_config.max_new_tokens = new_tokens_that_fit(gen_config.max_new_tokens, length, context)


class _CancelLogged:
    """A Transformers streamer whose ``cancel`` (called when the SSE client goes away, or at a shutdown's deadline)
    is logged with the request id; everything else is the streamer's own."""

    def __init__(self, streamer, request_id: str):
        self._streamer, self._request_id = streamer, request_id

    def cancel(self) -> None:
        logger.info("request %s cancelled before its end: its client went away, or the shutdown deadline passed",
                    self._request_id)
        self._streamer.cancel()

    def __getattr__(self, name):
        return getattr(self._streamer, name)


class ContextCheckedManager(BaseGenerateManager):
    """One of Transformers' generation managers (sequential or continuous batching) behind :func:`fit_to_context`.
    A non-streaming request whose handler task is cancelled (uvicorn does so at the shutdown deadline) is cancelled
    in the engine too, as Transformers already does for a stream whose client goes away."""

    def __init__(self, inner: BaseGenerateManager, context: int | None):
        self.inner, self.context = inner, context

    def init_cb(self, model, gen_config) -> None:
        self.inner.init_cb(model, gen_config)

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, **kwargs):
        fit_to_context(inputs, gen_config, self.context)
        queue, streamer = self.inner.generate_streaming(model, processor, inputs, gen_config, request_id, **kwargs)
        return queue, _CancelLogged(streamer, request_id)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id, **kwargs):
        fit_to_context(inputs, gen_config, self.context)
        try:
            return await self.inner.generate_non_streaming(model, processor, inputs, gen_config, request_id, **kwargs)
        except asyncio.CancelledError:
            engine = serving_engine(self.inner)
            if engine is not None:
                logger.info("request %s cancelled before the end", request_id)
                engine.cancel_request(request_id)
            raise

    def stop(self) -> None:
        self.inner.stop()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CancelOnDisconnect:
    """ASGI middleware: while a request has not started its response (a non-streaming completion still
    generating), its client's ``http.disconnect`` cancels the handler task, and :class:`ContextCheckedManager`
    turns that cancellation into the engine's ``cancel_request`` (pages freed, other requests untouched).  A
    response already started (a stream) is left to Starlette, which listens for the disconnect itself.  Installed
    with FastAPI's public ``add_middleware``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages: asyncio.Queue = asyncio.Queue()
        started = False

        async def send_(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def read():  # every message the server gets, in order, for the app; ends at the disconnect
            while True:
                message = await receive()
                await messages.put(message)
                if message["type"] == "http.disconnect":
                    return

        handler = asyncio.ensure_future(self.app(scope, messages.get, send_))
        reader = asyncio.ensure_future(read())
        try:
            await asyncio.wait({handler, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not handler.done() and not started:
                logger.info("%s %s: the client went away before the response", scope.get("method"),
                            scope.get("path"))
                handler.cancel()
            try:
                await handler
            except asyncio.CancelledError:
                if not reader.done():  # (cancelled from outside, not by the disconnect)
                    raise
        finally:
            reader.cancel()


class CheckedGenerationState(GenerationState):
    """Transformers' generation state (one continuous-batching manager, or a sequential one per model) whose
    managers are wrapped in :class:`ContextCheckedManager` for a model of ``context`` positions (None: unchecked)."""

    def __init__(self, context: int | None, **kwargs):
        super().__init__(**kwargs)
        self.context = context

    def get_manager(self, model_id: str, use_cb: bool = False) -> BaseGenerateManager:
        return ContextCheckedManager(super().get_manager(model_id, use_cb=use_cb), self.context)


def build_app(model, processor, name: str, *, continuous_batching: bool = True, cb_config=None):
    """``(app, generation_state)``: Transformers' FastAPI app serving ``model`` (with ``processor``, a tokenizer)
    as ``name`` on ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/models``, ``/health``;
    ``generation_state.shutdown()`` stops its engine once the server has stopped."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    manager = PreloadedModelManager(model, processor, name)
    state = CheckedGenerationState(context, continuous_batching=continuous_batching, compile=False,
                                   cb_config=cb_config)
    common = {"model_manager": manager, "generation_state": state, "chat_template_kwargs": {}}
    handlers = {
        "completion_handler": fast_text_chunks(checked(CompletionHandler), "text")(manager, state),
        "response_handler": checked(ResponseHandler)(**common),
        "transcription_handler": TranscriptionHandler(manager, state),
    }
    for keyword, cls in serving_optional_handlers().items():
        handlers[keyword] = cls(**accepted_keywords(cls.__init__, common))
    chat = fast_text_chunks(checked(ChatCompletionHandler), "content")(**common)
    app = build_server(manager, chat, **accepted_keywords(build_server, {**handlers, "generation_state": state}))
    replace_request_id_middleware(app, X_REQUEST_ID)
    openai_errors(app)
    app.add_middleware(CancelOnDisconnect)
    return app, state
