"""The replicas behind a router: their indexes, health and load, kept current by one thread.

Owns: one ``Replica`` record per URL (its index, its feed while it is healthy, the instance id
of the streams its index was built from and the feed's restart count then, the highest seqs it
announced that are not applied yet, its load, its health, the requests this router is relaying
to it), the adapter names the replicas announced, and the lock that orders the thread's
updates against routing. Every ``health_interval_s`` the thread reads each replica's
``/metrics``: a replica that does not answer is marked dead, its feed closed and its index
cleared, so it is never chosen for longer than one interval; one that answers again is
subscribed anew (``/kv_events``) and rebuilt from its replay sockets; one whose
``/kv_events`` names another instance id (unless its feed saw the restart and rebuilt itself:
the new id is adopted), or a next_seq at or below what was applied, restarted since: its index
is forgotten and rebuilt the same way. Between health checks the thread applies the streams'
batches as they arrive, and once per interval asks the replay sockets for anything a lost last
message hid; ``route`` applies whatever arrived since the thread's last poll before it scores,
so a turn that follows its predecessor at once sees the checkpoint that predecessor saved, and
asks the replay socket (once, bounded by its timeout) for any batch the replica announced (an
answer's next_seq, a health read) that did not arrive. Replay sockets are asked without the
lock, and an answer is applied only to the feed it was asked of.
"""

from __future__ import annotations

import logging
import threading
import time

from hybridcache.errors import EventStreamError, InvalidArgumentError
from hybridcache.router.discovery import read_continuity, read_load, read_next_seqs, read_streams
from hybridcache.router.feed import FetchedCatchUp, ReplicaFeed
from hybridcache.router.metrics import RouterMetrics
from hybridcache.router.policy import Decision, choose
from hybridcache.router.replica import Relay, Replica, ReplicaStatus, applied_up_to, highest, restarted, status_of
from hybridcache.router.replica_index import Depths, ReplicaIndex
from hybridcache.router.request_key import RequestKey

_log = logging.getLogger(__name__)
_POLL_MS = 10
_SETTLE_S = 0.2  # the most an answer's end waits for its replica's events
_SETTLE_POLL_S = 0.001
_LIVE_WAIT_S = 0.02  # how long a settle waits for announced batches live before asking the replay socket
PREFILL_WAIT_S = 30.0  # the most a request waits for prefills of its prefix ahead of it on its replica
_MAX_PREFILL_WAITS = 8  # waits for prefills ahead before a request is sent beside whatever still runs


def _fetch_catch_up(feed: ReplicaFeed) -> FetchedCatchUp | EventStreamError:
    """``feed``'s replay answers (without the lock), or the error its sockets failed with."""
    try:
        return feed.request_catch_up()
    except EventStreamError as error:
        return error


class Fleet:
    def __init__(self, urls: list[str], policy: str, *, health_interval_s: float = 1.0,
                 load_tokens: float | None = None, timeout_s: float = 2.0) -> None:
        """``load_tokens``: the tokens one request sent by others counts for (None: the mean
        tokens to compute of the requests this router routed so far)."""
        if load_tokens is not None and not (isinstance(load_tokens, (int, float)) and 0 <= load_tokens < float("inf")):
            raise InvalidArgumentError(f"load_tokens must be a finite number >= 0 or None, got {load_tokens!r}")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.policy = policy
        self._interval = health_interval_s
        self._load_tokens = load_tokens
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # notified when a relayed answer starts
        self._stop = threading.Event()
        self._number = 0
        self._predicted_compute = 0  # tokens to compute predicted for the requests routed with a key
        self._keyed_routes = 0
        self.adapters: frozenset[str] = frozenset()  # every adapter name a replica announced
        self._thread = threading.Thread(target=self._run, name="hybridcache-router-fleet", daemon=True)

    def start(self) -> None:
        self.check_health()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._answered:
            self._answered.notify_all()  # requests waiting for a prefill ahead go on at once
        if self._thread.is_alive():
            self._thread.join(self._interval + 5)
        with self._lock:
            for replica in self.replicas:
                self._drop(replica)

    # --- routing -------------------------------------------------------------------------------

    def route(self, key: RequestKey | None, prompt_tokens: int, exclude: tuple[Replica, ...] = ()) -> tuple[Replica, Decision] | None:
        """The replica for a request (None when no healthy one is left)."""
        if key is not None:
            self._catch_up_announced(exclude)
        with self._lock:
            candidates = [r for r in self.replicas if r.healthy and r not in exclude]
            if not candidates:
                return None
            if key is not None:
                for replica in candidates:
                    self._poll(replica)
            number, self._number = self._number, self._number + 1
            policy = self.policy if key is not None else "round-robin"
            depths = [r.index.depths(key) if key is not None and r.index is not None else Depths(0, 0) for r in candidates]
            per_request = self._per_request_tokens()
            decision = choose(policy, prompt_tokens, depths, [r.queued_tokens(per_request) for r in candidates], number)
            if key is not None:
                self._predicted_compute += prompt_tokens - decision.predicted_tokens
                self._keyed_routes += 1
            return candidates[decision.index], decision

    def route_after_prefills(self, key: RequestKey | None, prompt_tokens: int, metrics: RouterMetrics,
                             exclude: tuple[Replica, ...] = (), deadline: float | None = None):
        """``route``, but not beside a prefill of the same prefix: while a request this router
        sent to the chosen replica shares more of the prompt than the predicted restore and is
        still in its prefill, wait until it answers (its prefill's checkpoints are then
        published), apply the replica's events up to then and route again. Whether the replica
        would otherwise restore such a checkpoint for this request depends on whether it admits
        it after that prefill's save or beside it, which no router can see; after the wait the
        prediction is of what is announced, and the prefix is not computed twice. All waits of
        one request end by ``deadline`` (``time.monotonic``; default ``PREFILL_WAIT_S`` from
        now); ``metrics`` counts them."""
        if deadline is None:
            deadline = time.monotonic() + PREFILL_WAIT_S
        routed = self.route(key, prompt_tokens, exclude=exclude)
        for _ in range(_MAX_PREFILL_WAITS):
            if routed is None or key is None:
                return routed
            replica, decision = routed
            ahead = self.prefills_ahead(replica, key, decision.predicted_tokens)
            if not ahead:
                return routed
            metrics.count("prefill_waits")
            if not self.wait_answering(ahead, max(0.0, deadline - time.monotonic())):
                metrics.count("prefill_waits_timed_out")
                return routed
            self.settle(replica)  # the events up to the replica's next_seq now (from /kv_events)
            routed = self.route(key, prompt_tokens, exclude=exclude)
        return routed

    def _catch_up_announced(self, exclude: tuple[Replica, ...]) -> None:
        """Apply what reached the router since the thread's last poll (a turn's own checkpoint);
        when a replica announced a later seq than that (an answer's next_seq whose settle ran
        out of time, a health check's read), the batches in between were published before this
        decision but lost or late: ask its replay socket for them (bounded by its timeout,
        without the lock), so the route scores every change the replica said it made. Asked
        once per announcement: what the replay cannot give (a restart) the continuity check
        handles. A gap the feed waits at is the thread's to fill (a replay socket that never
        answers would otherwise cost every route its timeout)."""
        with self._lock:
            lagging = [(r, r.feed) for r in self.replicas if r.healthy and r not in exclude and self._lags_announced(r)]
        self._catch_up(lagging)

    def _lags_announced(self, replica: Replica) -> bool:
        """Whether ``replica``'s feed, polled now, lacks a seq it announced (the announcement
        then spent, counted as a catch-up). Under the lock."""
        announced = replica.announced
        replica.announced = (None, None)
        self._poll(replica)
        feed = replica.feed
        if feed is None:
            return False
        if applied_up_to(feed.last_seqs, announced):
            return False
        replica.catch_ups += 1
        return True

    def _catch_up(self, feeds: list[tuple[Replica, ReplicaFeed]]) -> None:
        """Ask each feed's replay sockets without the lock (one slow socket must not stall every
        route, settle and health check), then apply each answer under it to a feed still its
        replica's (one closed or replaced meanwhile describes another run, or none). A replay
        socket that fails costs its replica the index (rebuilt at the next health check)."""
        fetched = [(replica, feed, _fetch_catch_up(feed)) for replica, feed in feeds]
        if not fetched:
            return
        with self._lock:
            for replica, feed, answer in fetched:
                if replica.feed is not feed:
                    continue
                if isinstance(answer, EventStreamError):
                    _log.warning("dropped the index of %s: %s", replica.url, answer)
                    self._forget(replica)
                else:
                    self._guarded(replica, feed.apply_catch_up, answer)

    def _poll(self, replica: Replica) -> None:
        """Apply what arrived on ``replica``'s streams (under the lock; never a network wait)."""
        if replica.feed is not None:
            self._guarded(replica, replica.feed.poll, 0)

    def _guarded(self, replica: Replica, step, *args) -> None:
        """Run one step on ``replica``'s feed (under the lock): whatever its data makes it raise
        costs the replica its index, rebuilt at the next health check, and nothing else (the
        thread and the routes go on)."""
        try:
            step(*args)
        except Exception:
            _log.warning("dropped the index of %s: its event streams failed", replica.url, exc_info=True)
            self._forget(replica)

    def _per_request_tokens(self) -> float:
        """What a request sent by others is taken to compute: ``load_tokens``, else the mean
        predicted for this router's own requests so far."""
        if self._load_tokens is not None:
            return self._load_tokens
        return self._predicted_compute / self._keyed_routes if self._keyed_routes else 0.0

    def status(self) -> list[ReplicaStatus]:
        """Every replica's status, read together."""
        with self._lock:
            return [status_of(r) for r in self.replicas]

    def started(self, replica: Replica, tokens: int, key: RequestKey | None = None) -> Relay:
        """A request (``key``: its prompt, None when unknown) predicted to compute ``tokens`` is
        being relayed to ``replica`` (until ``ended``)."""
        relay = Relay(replica, tokens, key)
        with self._lock:
            replica.in_flight += 1
            replica.prefill_tokens += tokens
            replica.prefilling.append(relay)
        return relay

    def answering(self, relay: Relay) -> None:
        """The relayed request's answer started: its prefill is done."""
        with self._lock:
            if not relay.answering:
                relay.answering = True
                relay.replica.prefill_tokens -= relay.tokens
                relay.replica.prefilling.remove(relay)
                self._answered.notify_all()

    def prefills_ahead(self, replica: Replica, key: RequestKey, predicted: int) -> list[Relay]:
        """This router's requests to ``replica`` still in their prefill whose prompt shares more
        of ``key``'s than the ``predicted`` restore (at least a block, in its namespace): a
        checkpoint one of them saves there is one ``key`` could restore, or not, depending on
        whether the replica admits it after that save or beside it."""
        with self._lock:
            index = replica.index
            if index is None:
                return []
            reach = len(key.token_ids) - 1  # the engine computes at least the prompt's last token
            return [relay for relay in replica.prefilling
                    if relay.key is not None and min(reach, key.shared_prefix(relay.key)) > max(predicted, index.block_size - 1)]

    def wait_answering(self, relays: list[Relay], timeout_s: float = PREFILL_WAIT_S) -> bool:
        """Until every one of ``relays`` answers (or ends); False when ``timeout_s`` ran out, or
        the fleet closed, first."""
        with self._answered:
            self._answered.wait_for(lambda: self._stop.is_set() or all(relay.answering for relay in relays), timeout_s)
            return not self._stop.is_set() and all(relay.answering for relay in relays)

    def ended(self, relay: Relay) -> None:
        self.answering(relay)
        with self._lock:
            relay.replica.in_flight -= 1

    def settle(self, replica: Replica, timeout_s: float = _SETTLE_S,
               expected: tuple[int | None, int | None] | None = None) -> bool:
        """Apply every batch ``replica`` published up to ``expected`` (the ``next_seq`` its
        answer carried; without it, read from its ``/kv_events``); True once applied. Called as
        a relayed answer ends, before its last bytes reach the client: the client's next turn
        is then routed with the events of the step that finished this one (they travel on
        another socket, and could arrive after the turn did). Waits for them live for at most
        ``_LIVE_WAIT_S`` (or until its feed waits at a gap), then asks the replay socket once,
        without the lock (a lost last message reveals no gap, and the health loop's catch-up may
        be an interval away), then live again until
        ``timeout_s``; whatever is still missing the next ``route`` to this replica asks the
        replay for (``announced``). False when the replica does not say or they did not arrive."""
        if expected is None:
            expected = read_next_seqs(replica.url, timeout_s)
        if expected is None:
            return False
        with self._lock:
            feed = replica.feed  # the seqs expected are of this feed's run: a feed replaced since starts over
        began = time.monotonic()
        asked = False
        while True:
            with self._lock:
                if feed is not None:
                    self._poll(replica)
                if feed is None or replica.feed is not feed:
                    return False
                if applied_up_to(feed.last_seqs, expected):
                    return True
                waited = time.monotonic() - began
                ask = not asked and (feed.awaiting_replay or waited >= min(_LIVE_WAIT_S, timeout_s))
                if ask:
                    replica.catch_ups += 1
                elif waited >= timeout_s:
                    replica.announced = highest(replica.announced, expected)
                    return False
            if ask:
                asked = True
                self._catch_up([(replica, feed)])
            else:
                time.sleep(_SETTLE_POLL_S)

    def mark_dead(self, replica: Replica) -> None:
        """A connection to ``replica`` failed: stop routing to it until it answers again."""
        with self._lock:
            self._drop(replica)

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_check = time.monotonic() + self._interval
        while not self._stop.is_set():
            self._stop.wait(_POLL_MS / 1000)
            self._follow_streams()
            if time.monotonic() >= next_check:
                self.check_health()
                next_check = time.monotonic() + self._interval

    def _follow_streams(self) -> None:
        """Apply what arrived on every feed (bounded, under the lock), then fill the gaps that
        stopped them from their replay sockets (without it)."""
        with self._lock:
            for replica in self.replicas:
                self._poll(replica)
            waiting = [(r, r.feed) for r in self.replicas if r.feed is not None and r.feed.awaiting_replay]
        self._catch_up(waiting)

    def check_health(self) -> None:
        """Read every replica's load; subscribe to the ones that came up, drop the ones gone.
        A replica without event streams is still routed to (by load and round robin). Whatever
        one replica's answers make its check raise marks it dead until its next check; the
        others are checked all the same."""
        for replica in self.replicas:
            try:
                self._check(replica)
            except Exception:
                _log.warning("marked %s dead: its health check failed", replica.url, exc_info=True)
                self.mark_dead(replica)

    def _check(self, replica: Replica) -> None:
        load = read_load(replica.url, self._timeout)
        feed, index, instance_id = None, None, None
        if load is not None and replica.feed is None:
            feed, index, instance_id = self._subscribe(replica)
        with self._lock:
            if load is None:
                self._drop(replica)
                return
            replica.others, replica.healthy = max(0.0, load - replica.in_flight), True
            if feed is not None:
                replica.feed, replica.index, replica.instance_id = feed, index, instance_id
                replica.feed_resets = feed.resets
                return
            followed = replica.feed
        if followed is not None:
            self._catch_up([(replica, followed)])
            self._check_continuity(replica)

    def _check_continuity(self, replica: Replica) -> None:
        """Forget the index of a replica whose streams restarted since it was built (see
        ``restarted``); it is rebuilt at the next health check. A restart the feed saw itself
        (its seqs went back: it cleared and rebuilt from the new run's replay) left an index of
        the new run: its instance id is adopted, and only the seqs can tell of a later restart."""
        with self._lock:  # read before next_seq: of one run of the replica it is then below next_seq
            feed = replica.feed
            applied = None if feed is None else feed.last_seqs
            resets = None if feed is None else feed.resets
            subscribed_id = replica.instance_id if resets == replica.feed_resets else None
        now = None if applied is None else read_continuity(replica.url, self._timeout)
        with self._lock:
            if now is None or replica.feed is not feed:
                return
            if restarted(subscribed_id, applied, now):
                self._forget(replica)
                return
            if subscribed_id is None:
                replica.instance_id, replica.feed_resets = now.instance_id, resets
            replica.announced = highest(replica.announced, now.next_seqs)  # published before now: the next route waits for it

    def _forget(self, replica: Replica) -> None:
        """Close the feed and clear the index, but keep routing to the replica (it answers)."""
        healthy = replica.healthy
        self._drop(replica)
        replica.healthy = healthy

    def _subscribe(self, replica: Replica) -> tuple[ReplicaFeed | None, ReplicaIndex | None, str | None]:
        """A feed and index for ``replica``, rebuilt from its replay sockets, and the instance id
        of the streams they follow (all None when it describes no streams)."""
        try:
            streams = read_streams(replica.url, self._timeout)
            index = ReplicaIndex(streams.block_size)
            feed = ReplicaFeed(index, streams.kv, streams.state, replay_timeout_s=self._timeout)
        except EventStreamError:
            return None, None, None
        try:
            feed.catch_up()
        except EventStreamError:
            feed.close()
            return None, None, None
        self.adapters |= streams.adapters
        return feed, index, streams.instance_id

    def _drop(self, replica: Replica) -> None:
        replica.healthy = False
        if replica.feed is not None:
            replica.feed.close()
            replica.index_losses += 1
        replica.feed = None
        if replica.index is not None:
            replica.index.clear()
        replica.index = None
        replica.instance_id = None
        replica.feed_resets = 0
        replica.announced = (None, None)
