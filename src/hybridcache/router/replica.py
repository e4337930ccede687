"""One replica as the fleet sees it, and the rules on its streams' seqs.

Owns nothing itself: ``Replica`` and ``Relay`` records are mutated only under the ``Fleet``'s
lock (``router.fleet``), which owns them; the functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hybridcache.router.discovery import Continuity
from hybridcache.router.feed import ReplicaFeed
from hybridcache.router.replica_index import ReplicaIndex
from hybridcache.router.request_key import RequestKey


@dataclass(eq=False)
class Replica:
    url: str
    index: ReplicaIndex | None = None
    feed: ReplicaFeed | None = None
    healthy: bool = False
    others: float = 0.0  # requests others sent, as of the last /metrics read
    in_flight: int = 0  # requests this router is relaying to it now
    prefill_tokens: int = 0  # what this router's requests not yet answering still compute
    prefilling: list[Relay] = field(default_factory=list)  # this router's requests to it not yet answering
    instance_id: str | None = None  # the run of its streams the index was built from (None: not said)
    feed_resets: int = 0  # the feed's restarts as of ``instance_id`` (more: it rebuilt from a newer run itself)
    announced: tuple[int | None, int | None] = (None, None)  # the highest next_seq per stream it said (answers, /kv_events)
    catch_ups: int = 0  # replays asked because a seq it announced had not arrived live
    index_losses: int = 0  # times its index was dropped (no answer to /metrics, a failed connection, a restart)

    @property
    def load(self) -> float:
        """Running plus waiting requests: this router's own counted as they start and end (the
        replica's gauges lag by up to a health interval, and would count a conversation's
        finished turn against the replica holding its state), everyone else's as last read."""
        return self.others + self.in_flight

    def queued_tokens(self, per_request: float) -> float:
        """The tokens this replica computes before it can start a new request's prefill: the
        predicted tokens to compute of this router's requests whose answer has not started
        (past their first byte they decode, and continuous batching runs a new prefill beside
        them), plus ``per_request`` for each request others sent (their tokens are unknown)."""
        return self.prefill_tokens + self.others * per_request


@dataclass(eq=False)
class Relay:
    """One request this router relays: to which replica, and the tokens it was predicted to
    compute there until its answer starts."""

    replica: Replica
    tokens: int
    key: RequestKey | None = None
    answering: bool = False


class ReplicaStatus(NamedTuple):
    url: str
    healthy: bool
    load: float
    undecodable: int
    applied_seqs: tuple[int | None, int | None]  # the last seq applied from the KV and checkpoint streams
    catch_ups: int = 0  # replays asked because an announced seq had not arrived live
    index_losses: int = 0  # times its index was dropped


def status_of(replica: Replica) -> ReplicaStatus:
    feed = replica.feed
    if feed is None:
        return ReplicaStatus(replica.url, replica.healthy, replica.load, 0, (None, None), replica.catch_ups, replica.index_losses)
    return ReplicaStatus(replica.url, replica.healthy, replica.load, feed.undecodable, feed.last_seqs, replica.catch_ups,
                         replica.index_losses)


def restarted(subscribed_id: str | None, applied: tuple[int | None, int | None], now: Continuity) -> bool:
    """Whether the replica restarted since its index was built (the index then describes a
    cache it no longer has): its ``instance_id`` changed, or a stream's ``next_seq`` is at or
    below the seq already applied from it (its counter went back to 0; what tells a replica
    that names no instance). ``applied`` must be read before ``now`` (an answer's next_seq is
    older than batches applied since, and cannot be used). The seqs alone miss a restart whose
    new seqs passed the old ones before the subscriber reconnected: the live stream then shows
    only a gap, filled from the new run's replay on top of the old run's index."""
    if subscribed_id is not None and now.instance_id is not None and now.instance_id != subscribed_id:
        return True
    return any(seen is not None and wanted is not None and wanted <= seen for seen, wanted in zip(applied, now.next_seqs))


def applied_up_to(applied: tuple[int | None, int | None], expected: tuple[int | None, int | None]) -> bool:
    """Whether each stream's applied seq reached ``next_seq - 1`` (a stream with nothing sent is)."""
    return all(not wanted or (seen is not None and seen >= wanted - 1) for seen, wanted in zip(applied, expected))


def highest(known: tuple[int | None, int | None], said: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    """Per stream, the higher of two next_seqs (None: not said)."""
    return tuple(b if a is None else a if b is None else max(a, b) for a, b in zip(known, said))
