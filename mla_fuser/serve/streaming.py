"""Less host work per streamed token in Transformers' server, with the same bytes on the wire.

Why: the server runs in the engine's process, and every streamed token costs it Python time under the same GIL as the
continuous-batching loop.  Profiled on a CPU (200 streams of a tiny model, cProfile on the server thread), about
two thirds of that time went to two things:

* building each chunk: an OpenAI ``Completion`` (or ``ChatCompletionChunk``) pydantic object per token, dumped to
  JSON.  :func:`fast_text_chunks` gives a handler a per-stream template instead: Transformers' own builder makes the
  chunk once per stream and second with a marker as its text, and each token's chunk is that template with the
  marker replaced by the token's text, encoded by pydantic's own JSON encoder (the escaping the builder uses).  Only
  text-only chunks take it; anything else (role, finish reason, usage, tool calls) is built as before.  A template
  whose marker is not found exactly once turns the shortcut off for that handler.
* the request-id middleware, a Starlette ``BaseHTTPMiddleware``, which passes every streamed chunk through an extra
  memory stream and task switch.  :func:`replace_request_id_middleware` puts a plain ASGI middleware with the same
  behaviour in its place (the ``x-request-id`` header or a new UUID, on ``request.state.request_id`` and on the
  response).
"""

from __future__ import annotations

import logging
import time
import uuid

from pydantic_core import to_json
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware

logger = logging.getLogger("mla_fuser.serve")

# the text a template is built with (private-use characters: no tokenizer or JSON escaping touches them)
MARK = "\ue000mla-fuser-text\ue001"
_MARK_JSON = to_json(MARK).decode()
# templates kept per handler (one per live stream; cleared past this)
MAX_TEMPLATES = 4096


def fast_text_chunks(handler_class: type, text_field: str) -> type:
    """``handler_class`` (a Transformers streaming endpoint handler whose ``_build_chunk_sse`` takes the chunk's text
    as the keyword ``text_field``) building its text-only chunks from per-stream templates."""

    class FastTextChunks(handler_class):
        def _build_chunk_sse(self, *args, **kwargs):
            text = kwargs.get(text_field)
            state = self.__dict__.setdefault("_mla_fuser_templates", {})
            if (type(text) is not str or state.get("off") or len(args) > 2
                    or not set(kwargs) <= {text_field, "model"}):
                return super()._build_chunk_sse(*args, **kwargs)
            key, now = (args, kwargs.get("model")), int(time.time())
            held = state.get(key)
            if held is None or held[0] != now:  # (a new stream, or a new second: "created" moves on)
                sse = super()._build_chunk_sse(*args, **{**kwargs, text_field: MARK})
                if sse.count(_MARK_JSON) != 1:
                    logger.warning("%s: chunk template without a unique text marker; chunks built one by one",
                                   handler_class.__name__)
                    state["off"] = True
                    return super()._build_chunk_sse(*args, **kwargs)
                if len(state) > MAX_TEMPLATES:
                    state.clear()
                held = state[key] = (now, *sse.split(_MARK_JSON))
            return held[1] + to_json(text).decode() + held[2]

    FastTextChunks.__name__ = FastTextChunks.__qualname__ = handler_class.__name__
    return FastTextChunks


class RequestIds:
    """ASGI middleware doing what Transformers' ``request_id_middleware`` does: the request's ``header`` value or a
    new UUID4 as ``request.state.request_id``, and the same value as that header of the response."""

    def __init__(self, app, header: str):
        self.app = app
        self.header = header
        self._raw = header.lower().encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == self._raw), b"")
        request_id = given.decode("latin-1") or str(uuid.uuid4())
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[self.header] = request_id
            await send(message)

        await self.app(scope, receive, send_)


def replace_request_id_middleware(app, header: str) -> bool:
    """Put :class:`RequestIds` where ``app`` (built by Transformers' ``build_server``) has its ``request_id_middleware``
    (a ``BaseHTTPMiddleware``), at the same place in the stack; False, the app unchanged, when it has none."""
    for i, entry in enumerate(app.user_middleware):
        dispatch = getattr(entry, "kwargs", {}).get("dispatch")
        if getattr(dispatch, "__name__", None) == "request_id_middleware":
            app.user_middleware[i] = Middleware(RequestIds, header=header)
            return True
    logger.debug("no request_id_middleware in the app's middleware: left as it is")
    return False
