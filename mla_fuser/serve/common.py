"""What ``mla-fuser serve`` adds to Transformers' server on every release it drives (``serve.app`` for the in-process
server of 5.19-5.24, ``serve.engine`` for the engine processes of 5.25 on): the request checks and the OpenAI-shaped
errors.  Kept apart so that neither of those modules imports the other's Transformers pieces (each release has only
one set of them).

* :func:`check_token_limits`: a non-positive token limit is refused with HTTP 400 (Transformers would queue a request
  that cannot generate, or fail it later with a 500).
* :func:`check_prompt_room` and :func:`new_tokens_that_fit`: a prompt that fills the model's context is refused with
  HTTP 400 naming the context; otherwise the request's new tokens are capped at what the context still holds (past
  it a model's answers are wrong, not merely slow).
* :func:`openai_errors`: every error response in the OpenAI API's shape, so OpenAI clients show the message.
"""

from __future__ import annotations

import json

from fastapi import HTTPException
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# the request fields that set how many tokens to generate (completions; chat completions; responses)
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def check_token_limits(body: dict) -> None:
    """HTTP 400 for a token limit that is not a positive integer."""
    for key in TOKEN_LIMITS:
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise HTTPException(status_code=400, detail=f"{key} must be a positive integer, got {value!r}")


def check_prompt_room(length: int, context: int | None) -> None:
    """HTTP 400 for an empty prompt, or one of ``length`` tokens that leaves no room in a context of ``context``
    positions (None: the model states none, nothing to check)."""
    if length == 0:
        raise HTTPException(status_code=400, detail="the prompt is empty after tokenization: send at least one token")
    if context is not None and length >= context:
        raise HTTPException(status_code=400, detail=(
            f"the prompt is {length} tokens, the model's context is {context} tokens: at most {context - 1} prompt "
            "tokens leave room for one new token"))


def new_tokens_that_fit(requested: int | None, length: int, context: int | None) -> int | None:
    """The new tokens a request of ``length`` prompt tokens may generate: ``requested`` capped at what the context
    still holds (the response then says ``finish_reason: "length"``); unchanged without a context."""
    if context is None:
        return requested
    room = context - length
    return min(requested or room, room)


def _error_response(status: int, message: str, detail, headers=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status},
                         "detail": jsonable_encoder(detail)}, status_code=status, headers=headers)


def _validation_message(errors) -> str:
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()))
        why = (error.get("ctx") or {}).get("error")
        parts.append(f"{where}: {error.get('msg')}" + (f" ({why})" if why else ""))
    return "invalid request body: " + "; ".join(parts)


def openai_errors(app) -> None:
    """Error responses of ``app`` in the OpenAI API's shape, ``{"error": {"message", "type", "param", "code"}}``, with
    FastAPI's ``detail`` kept beside it: the ``openai`` client puts ``error.message`` in its exception text (with
    ``detail`` alone it says only "Error code: 400").  Installed through FastAPI's public exception handlers."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        message = exc.detail if isinstance(exc.detail, str) else str(jsonable_encoder(exc.detail))
        return _error_response(exc.status_code, message, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request, exc):
        return _error_response(422, _validation_message(exc.errors()), exc.errors())


def openai_shaped(app, exception_classes) -> None:
    """The JSON error responses of ``app``'s own handlers for ``exception_classes`` (Transformers registers some: a
    ``ValueError`` is the request's fault, a dead engine a 503) in the OpenAI shape as well: same status, the
    handler's message as ``error.message``.  Wraps the registered handler through FastAPI's public
    ``exception_handler``; a class the app has no handler for is left alone."""
    for cls in exception_classes:
        handler = app.exception_handlers.get(cls)
        if handler is None:
            continue

        async def reshaped(request, exc, _handler=handler):
            response = await _handler(request, exc)
            if not isinstance(response, JSONResponse) or response.status_code < 400:
                return response
            body = json.loads(response.body)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return response
            message = body.get("detail", body.get("error")) if isinstance(body, dict) else body
            return _error_response(response.status_code, message if isinstance(message, str) else str(message),
                                   message)

        app.exception_handler(cls)(reshaped)
