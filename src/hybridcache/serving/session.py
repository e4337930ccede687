"""One generation request from submission to its last byte.

Owns: the request's update queue (fed by the engine loop thread through the event loop), its
``TextProgress``, its ticket in the engine loop and its timing. A session cancels its ticket
whenever it stops listening early: its client left (polled while waiting for a whole
response; a cancelled stream for streaming), or a stop string ended the text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request as HttpRequest

from hybridcache.engine import Request
from hybridcache.serving.api_errors import error_body
from hybridcache.serving.loop import Update
from hybridcache.serving.metrics import RequestRecord
from hybridcache.serving.responses import DONE, Reply, TextProgress, sse, usage
from hybridcache.serving.schemas import ChatCompletionRequest, CompletionRequest

DISCONNECT_POLL_S = 0.25


class Session:
    def __init__(self, runtime, http: HttpRequest, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                 received: float) -> None:
        self.runtime, self.http, self.body, self.prompt_ids = runtime, http, body, prompt_ids
        self.reply = Reply.new("chat" if isinstance(body, ChatCompletionRequest) else "completion", body.model)
        self.received = received
        self.first_token_at: float | None = None
        self.progress = TextProgress(runtime.tokenizer, body.stop_strings())
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        self._ticket: int | None = None
        self._ended = False

    async def submit(self, request: Request) -> bool:
        """Hand the request to the engine loop and wait until it is accepted (False: the client
        left first). A refusal (overload, never fits, bad tokens) raises."""
        loop = asyncio.get_running_loop()
        tokenizer = self.runtime.tokenizer
        stop_ids = frozenset() if self.body.ignore_eos or tokenizer is None else tokenizer.eos_ids
        self._ticket = self.runtime.loop.submit(
            request, stop_ids, lambda update: loop.call_soon_threadsafe(self._updates.put_nowait, update)
        )
        accepted = await self._next(watch_disconnect=True)
        if accepted is not None and accepted.error is not None:
            error = accepted.error
            if getattr(error, "param", None) is None:  # the engine refused the prompt itself
                error.param = "messages" if self.reply.kind == "chat" else "prompt"
            raise error
        return accepted is not None

    async def complete(self) -> dict:
        """Wait for the whole response (cancelling if the client leaves meanwhile)."""
        update = Update([])
        while not update.final:
            update = await self._next(watch_disconnect=True)
            if update is None:
                return {}
            update, _ = self._apply(update)
        if update.error is not None:
            raise update.error
        self._record(update)
        return self.reply.body(self.progress.sent, update, self.prompt_ids, self.body.return_token_ids)

    async def stream(self):
        """SSE chunks: the role first (chat), the text deltas (with ``return_token_ids``, every
        new token's chunk carries its ids, text or not), the finish chunk, the usage chunk (with
        ``stream_options.include_usage``) and ``[DONE]``."""
        reply, with_usage = self.reply, self.body.include_usage
        try:
            if reply.kind == "chat":
                yield reply.chunk(reply.choice(None, None, chunk=True, role=True), self._chunk_usage(Update([])))
            update, sent_ids = Update([]), 0
            while not update.final:
                update, delta = self._apply(await self._next(watch_disconnect=False))
                new_ids, sent_ids = update.tokens[sent_ids:], len(update.tokens)
                if delta or (new_ids and self.body.return_token_ids):
                    choice = reply.choice(delta, None, chunk=True)
                    if self.body.return_token_ids:
                        choice["token_ids"] = new_ids
                    yield reply.chunk(choice, self._chunk_usage(update))
            if update.error is not None:
                yield sse(error_body(update.error)[1])
            else:
                finish = reply.choice(None if reply.kind == "chat" else "", update.finish_reason, chunk=True)
                yield reply.chunk(finish, self._chunk_usage(update))
                if with_usage:
                    yield reply.usage_chunk(update, len(self.prompt_ids))
                self._record(update)
            yield DONE
        finally:
            self._cancel()

    def _chunk_usage(self, update: Update) -> dict | None | bool:
        """What a content chunk says about usage: nothing (False), ``null`` (with
        ``include_usage``) or the counts so far (with ``continuous_usage_stats``, as vLLM)."""
        options = self.body.stream_options
        if options is not None and options.continuous_usage_stats:
            return usage(len(self.prompt_ids), len(update.tokens), update.cached_tokens)
        return None if self.body.include_usage else False

    def _apply(self, update: Update) -> tuple[Update, str]:
        """The update with stop strings applied, and the text it adds."""
        if update.tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if update.final:
            self._ended = True  # the engine loop is done with the ticket
        delta = self.progress.advance(update.tokens, update.final)
        if self.progress.stopped and update.error is None:
            self._cancel()
            update = dataclasses.replace(update, finish_reason="stop")
        return update, delta

    async def _next(self, *, watch_disconnect: bool) -> Update | None:
        while True:
            try:
                return await asyncio.wait_for(self._updates.get(), DISCONNECT_POLL_S if watch_disconnect else None)
            except TimeoutError:
                if await self.http.is_disconnected():
                    self._cancel()
                    return None

    def _cancel(self) -> None:
        if self._ticket is not None and not self._ended:
            self.runtime.loop.cancel(self._ticket)
            self._ended = True

    def _record(self, update: Update) -> None:
        now = time.perf_counter()
        first = self.first_token_at or now
        record = RequestRecord(
            self.reply.response_id, self.reply.kind, len(self.prompt_ids), update.cached_tokens, len(update.tokens),
            update.miss_reason, first - self.received, 200,
        )
        self.runtime.metrics.record_request(record, now - self.received)
