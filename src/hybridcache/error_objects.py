"""The OpenAI-style error object every HTTP surface answers a refusal with (``serve`` and the
router alike): ``{"error": {"message", "type", "param", "code"}}``.

Owns nothing: one pure function, kept apart from both servers so the router (no FastAPI) and
``serve`` build the same shape.
"""

from __future__ import annotations


def error_object(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
