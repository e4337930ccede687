"""The OpenAI response bodies and stream chunks, and the text a request has produced so far.

Owns: per request, a ``TextProgress`` (the text already sent and whether a stop string ended
it). Everything else is pure formatting: ``usage`` (with ``prompt_tokens_details.cached_tokens``
= the depth actually restored), the ``hybridcache`` block (restored depth and miss reason), and
the completion / chat bodies and chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from hybridcache.serving.loop import Update
from hybridcache.serving.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


@dataclass
class TextProgress:
    """The text of one request's tokens, with stop strings applied. ``advance`` returns the
    text not sent yet; it holds back what may still change (an incomplete character, an end
    that may be the start of a stop string) until the next tokens or the end decide it."""

    tokenizer: TextTokenizer | None
    stops: tuple[str, ...]
    sent: str = ""
    stopped: bool = False

    def advance(self, tokens: list[int], final: bool) -> str:
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.text(tokens)
        cuts = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        if cuts:
            text, self.stopped, final = text[: min(cuts)], True, True
        if not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self._stop_prefix_length(text)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or a decoder that rewrote earlier text: send nothing more)
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _stop_prefix_length(self, text: str) -> int:
        """The longest end of ``text`` that a stop string begins with."""
        return max((_held_back(text, stop) for stop in self.stops), default=0)


def _held_back(text: str, stop: str) -> int:
    """The longest end of ``text``, shorter than ``stop``, that ``stop`` begins with. Only the
    places in the tail where ``stop``'s first character occurs are compared, so a step costs
    about the tail's length, not its square."""
    if len(stop) < 2:
        return 0
    tail = text[-(len(stop) - 1):]
    start = tail.find(stop[0])
    while start >= 0:
        if stop.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(stop[0], start + 1)
    return 0


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cache_block(update: Update) -> dict:
    """Our extension: the restored depth, why a cached prefix was not (fully) restored, and
    (with event streams) their ``next_seq`` once the answer ended, for a router to settle on."""
    block = {"cached_tokens": update.cached_tokens, "miss_reason": update.miss_reason}
    return block if update.next_seq is None else {**block, "next_seq": update.next_seq}


@dataclass(frozen=True)
class Reply:
    """Who is answering what: the response id, creation time, model id and endpoint kind."""

    kind: str  # "chat" or "completion"
    model: str
    response_id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: str, model: str) -> Reply:
        return cls(kind, model, new_id(kind), int(time.time()))

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str | None, finish_reason: str | None, *, chunk: bool, role: bool = False) -> dict:
        if self.kind != "chat":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if chunk:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}

    def body(self, text: str, update: Update, prompt_ids: list[int], with_ids: bool) -> dict:
        """The whole non-streamed response (``with_ids``: vLLM's ``return_token_ids``)."""
        choice = self.choice(text, update.finish_reason, chunk=False)
        out = {**self._envelope(False), "choices": [choice],
               "usage": usage(len(prompt_ids), len(update.tokens), update.cached_tokens),
               "hybridcache": cache_block(update)}
        if with_ids:
            choice["token_ids"] = update.tokens
            out["prompt_token_ids"] = prompt_ids
        return out

    def chunk(self, choice: dict | None, chunk_usage: dict | None | bool) -> str:
        """A content chunk; ``chunk_usage`` False leaves ``usage`` out, else it is its value."""
        data = {**self._envelope(True), "choices": [] if choice is None else [choice]}
        if chunk_usage is not False:
            data["usage"] = chunk_usage
        return sse(data)

    def usage_chunk(self, update: Update, prompt_tokens: int) -> str:
        data = {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, len(update.tokens), update.cached_tokens),
                "hybridcache": cache_block(update)}
        return sse(data)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


DONE = sse("[DONE]")
