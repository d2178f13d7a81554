"""The serving shortcuts of ``mla_fuser.serve.streaming`` give the bytes Transformers' own code gives: stream chunks
built from per-stream templates equal the handlers' own builders for any text, other chunks are the builders' own,
and the plain ASGI request-id middleware behaves as Transformers' ``BaseHTTPMiddleware`` one."""

import asyncio

import pytest

from mla_fuser import compat
from mla_fuser.serve import MIN_VERSION, missing_packages

pytestmark = pytest.mark.skipif(bool(missing_packages()) or compat.transformers_version() < MIN_VERSION,
                                reason="serving dependencies missing, or a release serve refuses")

TEXTS = ["", "a", " word", 'say "hi"', "back\\slash", "new\nline\ttab", "\x00\x01\x1f\x7f", "é ü ß", "日本語",
         "emoji 🙂", "\u2028\u2029", "</script>", "\ud7ff\ue000"]


def _handlers():
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    from mla_fuser.serve.streaming import fast_text_chunks

    # the builders use nothing of the handlers' state: bare instances are enough
    plain = (CompletionHandler.__new__(CompletionHandler), ChatCompletionHandler.__new__(ChatCompletionHandler))
    fast = (fast_text_chunks(CompletionHandler, "text"), fast_text_chunks(ChatCompletionHandler, "content"))
    return plain, tuple(cls.__new__(cls) for cls in fast)


def test_text_chunks_are_the_builders_own_bytes(monkeypatch):
    import mla_fuser.serve.streaming as streaming

    monkeypatch.setattr(streaming.time, "time", lambda: 1_700_000_000.5)
    (completion, chat), (fast_completion, fast_chat) = _handlers()
    for _ in range(2):  # the second round comes from the templates
        for text in TEXTS:
            assert fast_completion._build_chunk_sse("req-1", "m", text=text) == \
                completion._build_chunk_sse("req-1", "m", text=text)
            assert fast_chat._build_chunk_sse("req-2", model="m", content=text) == \
                chat._build_chunk_sse("req-2", model="m", content=text)
    assert len(fast_completion._mla_fuser_templates) == 1 and len(fast_chat._mla_fuser_templates) == 1


def test_other_chunks_are_built_as_before(monkeypatch):
    from openai.types import CompletionUsage

    import mla_fuser.serve.streaming as streaming

    monkeypatch.setattr(streaming.time, "time", lambda: 1_700_000_000.0)
    (completion, chat), (fast_completion, fast_chat) = _handlers()
    usage = CompletionUsage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    assert fast_completion._build_chunk_sse("r", "m", finish_reason="length", usage=usage) == \
        completion._build_chunk_sse("r", "m", finish_reason="length", usage=usage)
    assert fast_chat._build_chunk_sse("r", role="assistant", model="m") == \
        chat._build_chunk_sse("r", role="assistant", model="m")
    assert fast_chat._build_chunk_sse("r", model="m", reasoning_content="hm") == \
        chat._build_chunk_sse("r", model="m", reasoning_content="hm")
    assert not fast_completion.__dict__.get("_mla_fuser_templates") and not fast_chat.__dict__.get(
        "_mla_fuser_templates")


def test_a_new_second_renews_the_template(monkeypatch):
    import json

    import mla_fuser.serve.streaming as streaming

    clock = [1_700_000_000.0]
    monkeypatch.setattr(streaming.time, "time", lambda: clock[0])
    _, (fast_completion, _) = _handlers()
    first = json.loads(fast_completion._build_chunk_sse("r", "m", text="x")[len("data: "):])
    clock[0] += 1
    second = json.loads(fast_completion._build_chunk_sse("r", "m", text="y")[len("data: "):])
    assert (first["created"], second["created"]) == (1_700_000_000, 1_700_000_001)
    assert second["choices"][0]["text"] == "y"


def test_a_template_without_a_unique_marker_turns_the_shortcut_off(monkeypatch, caplog):
    import mla_fuser.serve.streaming as streaming

    class Echo:  # a builder that writes its text twice
        def _build_chunk_sse(self, request_id, model_id, text=""):
            return f"data: {text}|{text}\n\n"

    handler = streaming.fast_text_chunks(Echo, "text")()
    assert handler._build_chunk_sse("r", "m", text="a") == "data: a|a\n\n"
    assert handler._build_chunk_sse("r", "m", text="b") == "data: b|b\n\n"
    assert handler._mla_fuser_templates == {"off": True}
    assert "without a unique text marker" in caplog.text


def _asgi_call(app, headers):
    """(response start message, body) of one GET through ``app``."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b"",
             "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 1),
             "client": ("127.0.0.1", 2), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("given", [b"my-id-7", None])
def test_request_ids_as_transformers_middleware_gives_them(given):
    """The same app (an endpoint answering with ``request.state.request_id``) with Transformers' way (a
    ``BaseHTTPMiddleware``) and with ours: same header, same state; a missing header gets a new UUID."""
    import uuid

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    from mla_fuser.serve.streaming import replace_request_id_middleware

    def app_with_transformers_way():
        app = FastAPI()

        @app.middleware("http")
        async def request_id_middleware(request: Request, call_next):
            request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
            request.state.request_id = request_id
            response = await call_next(request)
            response.headers["x-request-id"] = request_id
            return response

        @app.get("/")
        async def root(request: Request):
            return PlainTextResponse(request.state.request_id)

        return app

    theirs, ours = app_with_transformers_way(), app_with_transformers_way()
    assert replace_request_id_middleware(ours, "x-request-id")
    assert not replace_request_id_middleware(ours, "x-request-id")  # (nothing left to replace)
    headers = [(b"x-request-id", given)] if given else []
    (start_a, body_a), (start_b, body_b) = _asgi_call(theirs, headers), _asgi_call(ours, headers)
    id_a, id_b = dict(start_a["headers"])[b"x-request-id"], dict(start_b["headers"])[b"x-request-id"]
    assert body_a == id_a and body_b == id_b
    if given:
        assert id_a == id_b == given
    else:
        assert uuid.UUID(id_b.decode()).version == 4 and id_a != id_b
