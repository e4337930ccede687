"""A request's key as the router finds it: its prompt tokens (given, or the replica's
``POST /tokenize``) and namespace.

Owns nothing.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.router.answers import MAX_BODY, UPSTREAM_FAILURES
from hybridcache.router.fleet import Fleet
from hybridcache.router.request_key import RequestKey


def key_for(fleet: Fleet, path: str, body: dict) -> RequestKey | None:
    """The request's prompt tokens and namespace, or None when they cannot be had: also
    when they cannot be hashed (ids outside ``[0, 2**31)``, a name that is not UTF-8); such
    a request is routed by load, and the replica answers it (its own 400)."""
    prompt = body.get("prompt") if path == "/v1/completions" else None
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    lora = _adapter(fleet, body)
    try:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return RequestKey(prompt, lora, salt)
        tokens = _tokenize(fleet, path, body)
        return None if tokens is None else RequestKey(tokens, lora, salt)
    except (InvalidArgumentError, InvalidTypeError):
        return None


def _adapter(fleet: Fleet, body: dict) -> str | None:
    """The adapter a request names, as the replicas resolve it: ``adapter`` with the base
    model, or an adapter's own id in ``model``; None (the base model) otherwise."""
    named = body.get("adapter")
    if isinstance(named, str):
        return named
    model = body.get("model")
    return model if isinstance(model, str) and model in fleet.adapters else None


def _tokenize(fleet: Fleet, path: str, body: dict) -> list[int] | None:
    field = "prompt" if path == "/v1/completions" else "messages"
    if field not in body:
        return None
    routed = fleet.route(None, 0)
    if routed is None:
        return None
    request = {"model": body.get("model"), field: body[field]}
    try:
        status, data = _ask(routed[0].url, "/tokenize", json.dumps(request).encode(), 10.0)
        tokens = json.loads(data)["tokens"] if status == 200 else None
    except (*UPSTREAM_FAILURES, KeyError, TypeError, RecursionError):
        return None
    return tokens if isinstance(tokens, list) else None


def _ask(url: str, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
    """One whole POST and its answer (up to ``MAX_BODY`` bytes) with a replica: (status, body)."""
    connection = connect(url, timeout_s)
    try:
        connection.request("POST", path, body=body)
        response = connection.getresponse()
        data = response.read(MAX_BODY + 1)
        if len(data) > MAX_BODY:
            raise ValueError(f"{path} answered more than {MAX_BODY:,} bytes")
        return response.status, data
    finally:
        connection.close()


def connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
