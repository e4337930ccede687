"""The replicas behind a router: their indexes, health and load, kept current by one thread.

Owns: one ``Replica`` record per URL (its index, its feed while it is healthy, its load, its
health, the requests this router is relaying to it), the adapter names the replicas announced, and the lock that orders the thread's
updates against routing. Every ``health_interval_s`` the thread reads each replica's ``/metrics``: a replica that does not
answer is marked dead, its feed closed and its index cleared, so it is never chosen for longer
than one interval; one that answers again is subscribed anew (``/kv_events``) and rebuilt from
its replay sockets. Between health checks the thread applies the streams' batches as they
arrive, and once per interval asks the replay sockets for anything a lost last message hid;
``route`` applies whatever arrived since the thread's last poll before it scores, so a turn
that follows its predecessor at once sees the checkpoint that predecessor saved.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from hybridcache.errors import EventStreamError
from hybridcache.router.discovery import read_load, read_streams
from hybridcache.router.feed import ReplicaFeed
from hybridcache.router.policy import DEFAULT_LOAD_TOKENS, Decision, choose
from hybridcache.router.replica_index import Depths, ReplicaIndex
from hybridcache.router.request_key import RequestKey

_POLL_MS = 10


@dataclass(eq=False)
class Replica:
    url: str
    index: ReplicaIndex | None = None
    feed: ReplicaFeed | None = None
    healthy: bool = False
    others: float = 0.0  # requests others sent, as of the last /metrics read
    in_flight: int = 0  # requests this router is relaying to it now

    @property
    def load(self) -> float:
        """Running plus waiting requests: this router's own counted as they start and end (the
        replica's gauges lag by up to a health interval, and would count a conversation's
        finished turn against the replica holding its state), everyone else's as last read."""
        return self.others + self.in_flight


class ReplicaStatus(NamedTuple):
    url: str
    healthy: bool
    load: float
    undecodable: int
    applied_seqs: tuple[int | None, int | None]  # the last seq applied from the KV and checkpoint streams


def _status(replica: Replica) -> ReplicaStatus:
    feed = replica.feed
    if feed is None:
        return ReplicaStatus(replica.url, replica.healthy, replica.load, 0, (None, None))
    return ReplicaStatus(replica.url, replica.healthy, replica.load, feed.undecodable, feed.last_seqs)


class Fleet:
    def __init__(self, urls: list[str], policy: str, *, health_interval_s: float = 1.0,
                 load_tokens: float = DEFAULT_LOAD_TOKENS, timeout_s: float = 2.0) -> None:
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.policy = policy
        self._interval = health_interval_s
        self._load_tokens = load_tokens
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._number = 0
        self.adapters: frozenset[str] = frozenset()  # every adapter name a replica announced
        self._thread = threading.Thread(target=self._run, name="hybridcache-router-fleet", daemon=True)

    def start(self) -> None:
        self.check_health()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._interval + 5)
        with self._lock:
            for replica in self.replicas:
                self._drop(replica)

    # --- routing -------------------------------------------------------------------------------

    def route(self, key: RequestKey | None, prompt_tokens: int, exclude: tuple[Replica, ...] = ()) -> tuple[Replica, Decision] | None:
        """The replica for a request (None when no healthy one is left)."""
        with self._lock:
            candidates = [r for r in self.replicas if r.healthy and r not in exclude]
            if not candidates:
                return None
            for replica in candidates:  # what arrived since the thread's last poll: a turn's own checkpoint
                if replica.feed is not None and key is not None:
                    replica.feed.poll(0)
            number, self._number = self._number, self._number + 1
            policy = self.policy if key is not None else "round-robin"
            depths = [r.index.depths(key) if key is not None and r.index is not None else Depths(0, 0) for r in candidates]
            decision = choose(policy, prompt_tokens, depths, [r.load for r in candidates], number, self._load_tokens)
            return candidates[decision.index], decision

    def status(self) -> list[ReplicaStatus]:
        """Every replica's status, read together."""
        with self._lock:
            return [_status(r) for r in self.replicas]

    def started(self, replica: Replica) -> None:
        """A request is being relayed to ``replica`` (until ``ended``)."""
        with self._lock:
            replica.in_flight += 1

    def ended(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    def mark_dead(self, replica: Replica) -> None:
        """A connection to ``replica`` failed: stop routing to it until it answers again."""
        with self._lock:
            self._drop(replica)

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_check = time.monotonic() + self._interval
        while not self._stop.is_set():
            with self._lock:
                feeds = [r.feed for r in self.replicas if r.feed is not None]
                for feed in feeds:
                    feed.poll(0)
            if not feeds:
                self._stop.wait(_POLL_MS / 1000)
            else:
                time.sleep(_POLL_MS / 1000)
            if time.monotonic() >= next_check:
                self.check_health()
                next_check = time.monotonic() + self._interval

    def check_health(self) -> None:
        """Read every replica's load; subscribe to the ones that came up, drop the ones gone.
        A replica without event streams is still routed to (by load and round robin)."""
        for replica in self.replicas:
            load = read_load(replica.url, self._timeout)
            feed, index = self._subscribe(replica) if load is not None and replica.feed is None else (None, None)
            with self._lock:
                if load is None:
                    self._drop(replica)
                    continue
                replica.others, replica.healthy = max(0.0, load - replica.in_flight), True
                if feed is not None:
                    replica.feed, replica.index = feed, index
                elif replica.feed is not None:
                    replica.feed.catch_up()

    def _subscribe(self, replica: Replica) -> tuple[ReplicaFeed | None, ReplicaIndex | None]:
        try:
            streams = read_streams(replica.url, self._timeout)
            self.adapters |= streams.adapters
            index = ReplicaIndex(streams.block_size)
            feed = ReplicaFeed(index, streams.kv, streams.state, replay_timeout_s=self._timeout)
        except EventStreamError:
            return None, None
        feed.catch_up()
        return feed, index

    def _drop(self, replica: Replica) -> None:
        replica.healthy = False
        if replica.feed is not None:
            replica.feed.close()
        replica.feed = None
        if replica.index is not None:
            replica.index.clear()
        replica.index = None
