"""The HTTP app: OpenAI-compatible routes over the engine loop.

Owns: nothing; the runtime it is given (``app.state.runtime``) is closed when its lifespan ends. Each route
validates its input (``schemas``), hands a typed ``Request`` to the engine loop and formats the
answer (``responses``); every refusal is a ``hybridcache.errors`` exception turned into an
OpenAI-style error body (``api_errors``). ``create_app`` takes a runtime already open, so that a
server that cannot start (a tier unreachable, a model that does not load) says why before
uvicorn runs; later features read their settings from ``runtime.config`` and add routes to the
returned app.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from hybridcache.engine import Request
from hybridcache.error_objects import error_object
from hybridcache.errors import (
    BodyTooLargeError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidTokenError,
    RequestTooLargeError,
)
from hybridcache.serving.api_errors import RETRY_AFTER_S, error_body, rejected
from hybridcache.serving.page import render_page
from hybridcache.serving.router_routes import add_router_routes
from hybridcache.serving.runtime import ServingRuntime
from hybridcache.serving.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from hybridcache.serving.session import Session

DRAIN_S = 10.0  # graceful shutdown: how long requests in the server may still run


def create_app(runtime: ServingRuntime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.runtime = runtime
        yield
        await asyncio.to_thread(app.state.runtime.close, DRAIN_S)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, title="hybridcache")
    app.add_exception_handler(HTTPException, _http_error)
    app.post("/v1/completions")(_completions)
    app.post("/v1/chat/completions")(_chat_completions)
    app.get("/v1/models")(_models)
    app.get("/health")(_health)
    app.get("/metrics")(_metrics)
    app.get("/")(_page)
    add_router_routes(app, _prompt_ids, _read_body)
    return app


# --- generation -------------------------------------------------------------------------------


async def _completions(http: HttpRequest) -> Response:
    return await _answer(http, "completion")


async def _chat_completions(http: HttpRequest) -> Response:
    return await _answer(http, "chat")


async def _answer(http: HttpRequest, kind: str) -> Response:
    runtime: ServingRuntime = http.app.state.runtime
    try:
        return await _generate(http, runtime, kind)
    except Exception as error:  # every refusal and failure becomes an error body, never a traceback
        return error_response(runtime, error)


async def _generate(http: HttpRequest, runtime: ServingRuntime, kind: str) -> Response:
    received = time.perf_counter()
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    body = parse_body(await _read_body(http, runtime.config.max_body_bytes), schema)
    adapter = runtime.resolve_model(body.model, body.adapter)
    prompt_ids = _prompt_ids(runtime, body, kind)
    request = _engine_request(runtime, body, prompt_ids, adapter)
    session = Session(runtime, http, body, prompt_ids, received)
    if not await session.submit(request):
        return Response(status_code=499)  # the client left before its request was accepted
    if body.stream:
        return StreamingResponse(session.stream(), media_type="text/event-stream")
    answer = await session.complete()
    next_seq = (answer.get("hybridcache") or {}).get("next_seq")
    headers = None if next_seq is None else {"x-hybridcache-next-seq": json.dumps(next_seq, separators=(",", ":"))}
    return JSONResponse(answer, headers=headers)


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise rejected(BodyTooLargeError, f"the body has {declared} bytes; the server takes at most {limit}", None)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise rejected(BodyTooLargeError, f"the body is larger than the {limit} bytes the server takes", None)
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_ids(runtime: ServingRuntime, body: CompletionRequest | ChatCompletionRequest, kind: str) -> list[int]:
    tokenizer = runtime.tokenizer
    if kind == "chat":
        if tokenizer is None or not tokenizer.has_chat_template:
            raise rejected(InvalidArgumentError, "this model has no chat template; use /v1/completions", "messages")
        return tokenizer.prompt_ids([{"role": m.role, "content": m.text()} for m in body.messages])
    if isinstance(body.prompt, list):
        outside = next((token for token in body.prompt if not 0 <= token < runtime.vocab_size), None)
        if outside is not None:  # checked here too, so /tokenize answers what generation would
            raise rejected(InvalidTokenError, f"token id {outside} outside the vocabulary [0, {runtime.vocab_size})",
                           "prompt")
        return list(body.prompt)
    if tokenizer is None:
        raise rejected(InvalidArgumentError, "this model has no tokenizer; send the prompt as token ids", "prompt")
    return tokenizer.encode(body.prompt)


def _engine_request(runtime: ServingRuntime, body, prompt_ids: list[int], adapter: str | None) -> Request:
    """The engine request, with ``max_tokens`` checked against what one request can hold."""
    limit, length = runtime.config.max_context_tokens, len(prompt_ids)
    requested = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
    field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if length >= limit:
        raise rejected(RequestTooLargeError, f"the prompt has {length} tokens; a request holds at most {limit}", field)
    if requested is not None and length + requested > limit:
        raise rejected(RequestTooLargeError,
                       f"max_tokens {requested} plus the prompt's {length} tokens exceed the {limit} a request holds",
                       "max_tokens")
    max_new = min(runtime.config.default_max_tokens, limit - length) if requested is None else requested
    try:
        return Request(prompt_ids, max_new_tokens=max_new, adapter=adapter, cache_salt=body.cache_salt,
                       temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    except HybridCacheError as error:
        error.param = field
        raise


def error_response(runtime: ServingRuntime, error: BaseException) -> JSONResponse:
    status, body = error_body(error)
    runtime.metrics.record_error(status)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


# --- the other routes -------------------------------------------------------------------------


async def _http_error(http: HttpRequest, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = error_object(str(error.detail), kind)
    return JSONResponse(body, status_code=error.status_code)


async def _models(http: HttpRequest) -> JSONResponse:
    runtime: ServingRuntime = http.app.state.runtime
    served, created = runtime.config.served_name, int(time.time())
    base = {"object": "model", "created": created, "owned_by": "hybridcache", "max_model_len": runtime.config.max_context_tokens}
    models = [{"id": served, "root": served, "parent": None, **base}]
    models += [{"id": name, "root": name, "parent": served, **base} for name in runtime.adapters]
    return JSONResponse({"object": "list", "data": models})


async def _health(http: HttpRequest) -> JSONResponse:
    runtime: ServingRuntime = http.app.state.runtime
    if runtime.loop.failure is not None:
        return _failed(runtime)
    return JSONResponse({"status": "ok", "model": runtime.config.served_name})


async def _metrics(http: HttpRequest) -> Response:
    runtime: ServingRuntime = http.app.state.runtime
    if runtime.loop.failure is not None:  # a router reads /metrics as its health check
        return _failed(runtime)
    return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _failed(runtime: ServingRuntime) -> JSONResponse:
    """503 for a server whose engine loop stopped: it serves nothing until restarted (the cause
    is in the server's log, not in an answer)."""
    return JSONResponse({"status": "failed", "model": runtime.config.served_name}, status_code=503)


async def _page(http: HttpRequest) -> HTMLResponse:
    return HTMLResponse(render_page(http.app.state.runtime.metrics))
