"""The routes a router reads from a replica: ``GET /kv_events`` and ``POST /tokenize``.

Owns nothing. ``GET /kv_events`` describes the engine's event streams as ``Engine.events``
does (block size, each stream's endpoint, replay endpoint and topic) plus the served model id
and its adapter names (an adapter's blocks are announced with ``lora_name`` set to its name),
so a router needs only the replica's URL, and ``next_seq``: each stream's seq once what is
queued is sent (a router that applied ``next_seq - 1`` has seen every change made so far);
404 when the server publishes no events.
``POST /tokenize`` takes vLLM's body (``model`` and ``prompt``, or ``model`` and
``messages``) and answers ``{"count", "max_model_len", "tokens"}``: exactly the ids
``/v1/completions`` or ``/v1/chat/completions`` would compute for that body.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from hybridcache.error_objects import error_object
from hybridcache.errors import InvalidArgumentError
from hybridcache.serving.api_errors import error_body, rejected
from hybridcache.serving.runtime import ServingRuntime
from hybridcache.serving.schemas import TokenizeRequest, parse_body

PromptIds = Callable[[ServingRuntime, object, str], list[int]]
ReadBody = Callable[[HttpRequest, int], Awaitable[bytes]]


def add_router_routes(app: FastAPI, prompt_ids: PromptIds, read_body: ReadBody) -> None:
    """``prompt_ids(runtime, body, kind)`` and ``read_body(http, limit)`` are the generation
    routes' own tokenization and bounded body read."""

    async def tokenize(http: HttpRequest) -> JSONResponse:
        runtime: ServingRuntime = http.app.state.runtime
        try:
            body = parse_body(await read_body(http, runtime.config.max_body_bytes), TokenizeRequest)
            runtime.resolve_model(body.model, None)
            if (body.prompt is None) == (body.messages is None):
                raise rejected(InvalidArgumentError, "give either a prompt or messages", "prompt")
            ids = prompt_ids(runtime, body, "chat" if body.messages is not None else "completion")
        except Exception as error:  # every refusal becomes an error body, never a traceback
            status, payload = error_body(error)
            return JSONResponse(payload, status_code=status)
        return JSONResponse({"count": len(ids), "max_model_len": runtime.config.max_context_tokens, "tokens": ids})

    app.get("/kv_events")(_kv_events)
    app.post("/tokenize")(tokenize)


async def _kv_events(http: HttpRequest) -> JSONResponse:
    runtime: ServingRuntime = http.app.state.runtime
    if runtime.events_description is None:
        message = "this server publishes no KV events (start it with --kv-events-config)"
        return JSONResponse(error_object(message, "not_found_error"),
                            status_code=404)
    adapters = list(runtime.adapters)
    # next_seq reads two monotonic counters the loop thread only ever increments
    return JSONResponse({**runtime.events_description, "model": runtime.config.served_name, "adapters": adapters,
                         "next_seq": runtime.engine.events.next_seqs()})
