"""What the router reads in a replica's answer, and what reading one may raise.

Owns nothing. An answer is the replica's input to the router: its bytes may be anything, so
every reader here returns None for what it cannot read (JSON nested past the parser's stack
included) instead of raising.
"""

from __future__ import annotations

import http.client
import json

MAX_BODY = 64 * 1024 * 1024  # bytes the router buffers of one body: a client's request, a replica's answer
# What a replica's connection raises for an answer that fails or is cut: the socket's errors,
# http.client's (a short body: IncompleteRead) and a chunk size that is not hex (ValueError).
UPSTREAM_FAILURES = (OSError, ValueError, http.client.HTTPException)


def only_role(chunk: bytes) -> bool:
    """Whether ``chunk`` is a chat stream's opening role event alone (no token yet)."""
    return chunk.count(b"data:") == 1 and b'"role"' in chunk


def last_usage_event(stream_tail: bytes) -> bytes | None:
    """The last ``data:`` event of an SSE answer that carries a usage object."""
    for line in reversed(stream_tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and b'"usage"' in line and b'"prompt_tokens_details"' in line:
            return line[5:].strip()
    return None


def reported_cached_tokens(data: bytes | None) -> int | None:
    """The ``usage.prompt_tokens_details.cached_tokens`` an answer (or usage event) reports."""
    if not data:
        return None
    try:
        cached = json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
