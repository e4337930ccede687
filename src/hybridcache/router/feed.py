"""One replica's two event streams, applied to its index as they arrive.

Owns: the subscribers of the replica's KV stream and checkpoint stream
(``events.StreamSubscriber``) and the count of batches that failed to decode. A reset on a
stream (the replica restarted, or a gap its replay buffer no longer covers) clears what that
stream built, and a restart seen on one stream restarts the other too (a replica's two
counters restart together; the other's new batches may all have been sent before its
subscriber reconnected); a batch that does not decode is skipped and counted. ``poll`` never
waits on a replay socket and reads a bounded number of messages (it runs under the fleet's
lock): a gap, or a restart to rebuild from replay, leaves the feed ``awaiting_replay`` until a
catch-up fetched without that lock (``request_catch_up``) is applied. Every failure of the
sockets is an ``EventStreamError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from hybridcache.events.schema import decode_kv_batch, decode_state_batch
from hybridcache.events.subscriber import RESET, CatchUp, StreamSubscriber
from hybridcache.router.replica_index import ReplicaIndex

MAX_BATCHES_PER_POLL = 256  # per stream: how long one poll may hold the fleet's lock draining a busy stream


@dataclass(frozen=True)
class StreamInfo:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class FetchedCatchUp(NamedTuple):
    kv: CatchUp | None
    state: CatchUp | None


class ReplicaFeed:
    def __init__(self, index: ReplicaIndex, kv: StreamInfo, state: StreamInfo | None = None, *, replay_timeout_s: float = 2.0) -> None:
        self.index = index
        self._kv = StreamSubscriber(kv.endpoint, kv.replay_endpoint, kv.topic, replay_timeout_s=replay_timeout_s)
        self._state = None
        if state is not None:
            try:
                self._state = StreamSubscriber(state.endpoint, state.replay_endpoint, state.topic, replay_timeout_s=replay_timeout_s)
            except Exception:
                self._kv.close()
                raise
        self.undecodable = 0

    def catch_up(self) -> None:
        """Read what the replay sockets hold (a router joining, or restarted), waiting on them;
        a restart this shows on one stream asks the other's replay from 0 again."""
        self.apply_catch_up(self.request_catch_up())
        if self.awaiting_replay:
            self.apply_catch_up(self.request_catch_up())

    @property
    def awaiting_replay(self) -> bool:
        """Whether a stream waits for a replay answer (a gap, a restart) before it delivers more."""
        return self._kv.awaiting_replay or (self._state is not None and self._state.awaiting_replay)

    def request_catch_up(self) -> FetchedCatchUp:
        """Fetch what the replay sockets hold past what was applied, applying nothing: callable
        on any thread while another polls (the wait, bounded by the replay timeout, need not
        hold the caller's lock); ``apply_catch_up`` applies it."""
        return FetchedCatchUp(self._kv.request_catch_up(), None if self._state is None else self._state.request_catch_up())

    def apply_catch_up(self, fetched: FetchedCatchUp) -> None:
        before = self._restarts()
        self._apply_kv(self._kv.deliver_catch_up(fetched.kv))
        if self._state is not None:
            self._apply_state(self._state.deliver_catch_up(fetched.state))
        self._follow_restart(before)

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the batches that arrived, up to ``MAX_BATCHES_PER_POLL`` messages a stream and
        each stream's next gap (waiting at most ``timeout_ms`` on the KV stream, never on a
        replay socket); returns how many were delivered."""
        before = self._restarts()
        delivered = self._kv.receive_ready(timeout_ms, MAX_BATCHES_PER_POLL)
        self._apply_kv(delivered)
        count = len(delivered)
        if self._state is not None:
            state = self._state.receive_ready(0, MAX_BATCHES_PER_POLL)
            self._apply_state(state)
            count += len(state)
        self._follow_restart(before)
        return count

    def _restarts(self) -> tuple[int, int]:
        return self._kv.resets, 0 if self._state is None else self._state.resets

    def _follow_restart(self, before: tuple[int, int]) -> None:
        """One stream showed its replica restarted: the other restarted with it (both count
        from 0 again), even if none of its new batches reached us live. Clear it; its replay
        from 0 is then awaited (``awaiting_replay``)."""
        kv_restarted, state_restarted = (now > then for now, then in zip(self._restarts(), before))
        if self._state is None or kv_restarted == state_restarted:
            return
        if kv_restarted:
            self._apply_state(self._state.note_restart())
        else:
            self._apply_kv(self._kv.note_restart())

    def _apply_kv(self, delivered: list) -> None:
        for item in delivered:
            if item is RESET:
                self.index.blocks.clear()
                continue
            try:
                self.index.apply_kv(decode_kv_batch(item.payload).events)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.undecodable += 1

    def _apply_state(self, delivered: list) -> None:
        for item in delivered:
            if item is RESET:
                self.index.checkpoints.clear()
                continue
            try:
                self.index.apply_state(decode_state_batch(item.payload).events)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.undecodable += 1

    @property
    def last_seqs(self) -> tuple[int | None, int | None]:
        """The last seq applied from the KV stream and from the checkpoint stream."""
        return self._kv.last_delivered, None if self._state is None else self._state.last_delivered

    @property
    def resets(self) -> int:
        return self._kv.resets + (self._state.resets if self._state is not None else 0)

    def close(self) -> None:
        self._kv.close()
        if self._state is not None:
            self._state.close()
