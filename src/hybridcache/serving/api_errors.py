"""OpenAI-style error bodies: which status and type each refusal gets.

Owns nothing mutable. Every refusal is a ``hybridcache.errors`` exception; ``error_status``
maps its class to the HTTP status, ``error_body`` builds ``{"error": {"message", "type",
"param", "code"}}``. Anything unexpected is a 500 whose message names no internals.
"""

from __future__ import annotations

from hybridcache.error_objects import error_object
from hybridcache.errors import (
    BodyTooLargeError,
    HybridCacheError,
    InvalidArgumentError,
    InvalidTypeError,
    MalformedRequestError,
    RequestTooLargeError,
    ServerOverloadedError,
    UnknownModelError,
)

RETRY_AFTER_S = 1

# Most specific first: the first class an error is an instance of decides.
_STATUS = (
    (UnknownModelError, 404, "not_found_error", "model_not_found"),
    (BodyTooLargeError, 413, "invalid_request_error", "body_too_large"),
    (MalformedRequestError, 400, "invalid_request_error", "malformed_body"),
    (InvalidTypeError, 422, "invalid_request_error", "invalid_type"),
    (RequestTooLargeError, 400, "invalid_request_error", "request_too_large"),
    (ServerOverloadedError, 503, "server_overloaded", "server_overloaded"),
    (InvalidArgumentError, 400, "invalid_request_error", "invalid_value"),
)
INTERNAL = (500, "internal_error", "internal_error")


def rejected(cls: type[HybridCacheError], message: str, param: str | None) -> HybridCacheError:
    """A refusal naming the request field at fault (OpenAI's ``param``)."""
    error = cls(message)
    error.param = param
    return error


def error_status(error: BaseException) -> tuple[int, str, str]:
    """``(status, type, code)`` for a refusal or failure."""
    for cls, status, kind, code in _STATUS:
        if isinstance(error, cls):
            return status, kind, code
    return INTERNAL


def error_body(error: BaseException) -> tuple[int, dict]:
    """The status and the OpenAI-style body for ``error``."""
    status, kind, code = error_status(error)
    message = str(error) if isinstance(error, HybridCacheError) and status != 500 else "the server failed this request"
    return status, error_object(message, kind, code, getattr(error, "param", None))


def too_many_connections(limit: int) -> tuple[int, dict]:
    """The status and body for a connection past ``limit`` (``serve --max-connections``)."""
    message = f"the server holds at most {limit:,} connections at once; try again"
    return 503, error_object(message, "server_overloaded", "too_many_connections")
