"""The fleet's load: this router's own requests counted as they start and end, on top of what
the replicas' gauges said others sent, and priced in the tokens they still compute; a replica
restarted since its index was built (its seqs went back, or its instance id changed) is
forgotten and subscribed anew."""

from __future__ import annotations

import pytest

import threading

from hybridcache.errors import InvalidArgumentError
from hybridcache.router.discovery import Continuity
from hybridcache.router.fleet import Fleet
from hybridcache.router.request_key import RequestKey


def test_load_counts_the_routers_own_requests_at_once():
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    replica.others = 2.0
    relays = [fleet.started(replica, 100), fleet.started(replica, 100)]
    assert replica.load == 4.0 and fleet.status()[0].load == 4.0
    for relay in relays:
        fleet.ended(relay)
    assert replica.load == 2.0 and replica.in_flight == 0 and replica.prefill_tokens == 0


def test_a_request_counts_its_tokens_to_compute_until_its_answer_starts():
    fleet = Fleet(["http://127.0.0.1:9"], "restorable", load_tokens=50)
    replica = fleet.replicas[0]
    replica.others = 2.0
    first, second = fleet.started(replica, 300), fleet.started(replica, 20)
    assert replica.queued_tokens(50) == 300 + 20 + 2 * 50
    fleet.answering(first)
    fleet.answering(first)  # every chunk of a stream says so: counted once
    assert replica.queued_tokens(50) == 20 + 2 * 50 and replica.in_flight == 2
    fleet.ended(first)
    fleet.ended(second)
    assert replica.queued_tokens(50) == 2 * 50 and replica.in_flight == 0


def test_others_requests_cost_the_mean_predicted_compute_unless_given():
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    assert fleet._per_request_tokens() == 0.0  # nothing routed yet: nothing known
    fleet._predicted_compute, fleet._keyed_routes = 900, 3
    assert fleet._per_request_tokens() == 300.0
    assert Fleet(["http://127.0.0.1:9"], "restorable", load_tokens=64)._per_request_tokens() == 64
    for bad in (-1, float("nan"), "512"):
        with pytest.raises(InvalidArgumentError):
            Fleet(["http://127.0.0.1:9"], "restorable", load_tokens=bad)


def test_a_health_check_keeps_only_the_others_requests_from_the_gauge(monkeypatch):
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_load", lambda url, timeout: 3.0)  # the gauge counts our one request
    monkeypatch.setattr(fleet, "_subscribe", lambda r: (None, None, None))
    relay = fleet.started(replica, 10)
    fleet.check_health()
    assert replica.healthy and replica.others == 2.0 and replica.load == 3.0
    fleet.ended(relay)
    assert replica.load == 2.0


class _Feed:
    """A feed whose batches arrive one per poll, up to ``arriving``."""

    resets = 0
    undecodable = 0
    awaiting_replay = False

    def __init__(self, applied, arriving):
        self.last_seqs, self._arriving = applied, list(arriving)

    def poll(self, timeout_ms=0):
        if self._arriving:
            self.last_seqs = self._arriving.pop(0)
        return 1

    def catch_up(self):
        return None

    def request_catch_up(self):
        return None

    def apply_catch_up(self, fetched):
        return None


def test_settle_applies_the_replicas_events_up_to_its_next_seq(monkeypatch):
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_next_seqs", lambda url, timeout: (5, 3))
    replica.feed = _Feed((3, 1), [(4, 1), (4, 2)])
    assert fleet.settle(replica) and replica.feed.last_seqs == (4, 2)
    replica.feed = _Feed((3, 1), [])  # the events never come: bounded, and says so
    assert not fleet.settle(replica, timeout_s=0.01)
    monkeypatch.setattr(fleet_module, "read_next_seqs", lambda url, timeout: (0, None))  # nothing published yet
    replica.feed = _Feed((None, None), [])
    assert fleet.settle(replica)
    monkeypatch.setattr(fleet_module, "read_next_seqs", lambda url, timeout: None)  # a replica that does not say
    assert not fleet.settle(replica)


def test_settle_uses_the_next_seq_the_answer_carried_without_asking(monkeypatch):
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    asked = []
    monkeypatch.setattr(fleet_module, "read_next_seqs", lambda url, timeout: asked.append(url))
    replica.feed = _Feed((3, 1), [(4, 2)])
    assert fleet.settle(replica, expected=(5, 3)) and asked == []


class _ReplacedFeed(_Feed):
    """A feed the health thread replaces (the replica restarted) while a settle waits on it."""

    def __init__(self, replica, applied):
        super().__init__(applied, [])
        self._replica = replica

    def poll(self, timeout_ms=0):
        self._replica.feed = _Feed((None, None), [])  # the new run's feed: nothing applied yet
        return 0


def test_a_settle_whose_feed_was_replaced_leaves_nothing_announced_for_the_new_feed():
    # The seqs an answer carried are of the old run: kept as "announced", the new feed's next
    # route would ask its replay socket for seqs the new run may never reach.
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    replica.feed = _ReplacedFeed(replica, (3, 1))
    assert not fleet.settle(replica, timeout_s=0.01, expected=(50, 20))
    assert replica.announced == (None, None)


class _ClosableFeed(_Feed):
    closed = False

    def close(self):
        self.closed = True


def test_a_replica_whose_seqs_went_back_is_forgotten_then_subscribed_anew(monkeypatch):
    """Restarted between two health checks, before a live batch of its new run arrived: its
    next_seq is below what the router applied, so the old index goes and is rebuilt."""
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_load", lambda url, timeout: 0.0)
    subscribed = []
    monkeypatch.setattr(fleet, "_subscribe", lambda r: (subscribed.append(r), (None, None, None))[1])
    old = replica.feed = _ClosableFeed((40, 12), [])
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity(None, (41, 13)))  # the same run: kept
    fleet.check_health()
    assert replica.feed is old and not old.closed
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity(None, (3, 0)))  # seq from 0
    fleet.check_health()
    assert old.closed and replica.feed is None and replica.index is None and replica.healthy
    fleet.check_health()
    assert subscribed == [replica]  # the next check subscribes anew (catch-up from the replay sockets)


def test_a_replica_with_a_new_instance_id_is_forgotten_though_its_seqs_passed_the_old(monkeypatch):
    """Restarted between two health checks and already past the old seqs: only the instance id
    tells the runs apart; the same id with seqs ahead is the same run, kept."""
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_load", lambda url, timeout: 0.0)
    monkeypatch.setattr(fleet, "_subscribe", lambda r: (None, None, None))
    old = replica.feed = _ClosableFeed((40, 12), [])
    replica.instance_id = "run-a"
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity("run-a", (90, 30)))
    fleet.check_health()
    assert replica.feed is old and not old.closed
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity("run-b", (90, 30)))
    fleet.check_health()
    assert old.closed and replica.feed is None and replica.instance_id is None and replica.healthy


def test_a_restart_the_feed_rebuilt_from_itself_adopts_the_new_instance_id(monkeypatch):
    """The feed saw the new run's seqs go back and rebuilt from its replay: the index is of the
    new run, and the health check must not throw it away for naming the new run's id."""
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_load", lambda url, timeout: 0.0)
    monkeypatch.setattr(fleet, "_subscribe", lambda r: (None, None, None))
    feed = replica.feed = _ClosableFeed((4, 2), [])
    replica.instance_id, replica.feed_resets = "run-a", 0
    feed.resets = 2  # both streams restarted, rebuilt from run-b's replay
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity("run-b", (5, 3)))
    fleet.check_health()
    assert replica.feed is feed and not feed.closed and replica.index_losses == 0
    assert replica.instance_id == "run-b" and replica.feed_resets == 2
    monkeypatch.setattr(fleet_module, "read_continuity", lambda url, timeout: Continuity("run-c", (90, 30)))
    fleet.check_health()  # a restart the feed did not see: forgotten
    assert feed.closed and replica.feed is None and replica.index_losses == 1


class _SlowReplayFeed(_Feed):
    """A feed whose replay socket answers only once ``release`` is set."""

    def __init__(self):
        super().__init__((3, 1), [])
        self.entered, self.release, self.answered = threading.Event(), threading.Event(), threading.Event()

    def _wait(self):
        self.entered.set()
        self.release.wait(30)
        self.answered.set()

    def catch_up(self):
        self._wait()

    def request_catch_up(self):
        self._wait()
        return "fetched"

    def apply_catch_up(self, fetched):
        self.applied = fetched


def test_a_slow_replay_socket_stalls_no_route_status_or_load_update():
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    feed = replica.feed = _SlowReplayFeed()
    replica.healthy = True
    settling = threading.Thread(target=fleet.settle, args=(replica, 60.0, (5, 3)))
    settling.start()
    try:
        assert feed.entered.wait(30)  # the settle is asking the replay socket
        routed = fleet.route(RequestKey([1, 2, 3]), 3)
        relay = fleet.started(replica, 3)
        fleet.ended(relay)
        statuses = fleet.status()
        assert not feed.answered.is_set()  # all of it ran while the replay was still out
        assert routed is not None and routed[0] is replica and statuses[0].healthy
    finally:
        feed.release.set()
        replica.feed = None  # the settle then ends (its feed gone)
        settling.join(30)


def _fleet_with_index(block_size: int = 16) -> tuple[Fleet, object]:
    from hybridcache.router.replica_index import ReplicaIndex

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    replica.index = ReplicaIndex(block_size)
    return fleet, replica


def test_a_prefill_ahead_is_one_sharing_more_than_the_predicted_restore_and_a_block():
    fleet, replica = _fleet_with_index()
    system = list(range(1, 65))  # 4 blocks
    ahead = fleet.started(replica, 70, RequestKey(system + [200, 201, 202]))
    fleet.started(replica, 70, RequestKey([300] * 70))  # another prefix: never waited for
    fleet.started(replica, 70, None)  # a prompt the router does not know
    follower = RequestKey(system + [210, 211])
    assert fleet.prefills_ahead(replica, follower, predicted=0) == [ahead]
    assert fleet.prefills_ahead(replica, follower, predicted=64) == []  # nothing deeper to wait for
    assert fleet.prefills_ahead(replica, RequestKey(system[:10] + [9] * 20), predicted=0) == []  # under a block
    assert fleet.prefills_ahead(replica, RequestKey(system + [210], "adapter"), predicted=0) == []  # another namespace
    fleet.answering(ahead)
    assert fleet.prefills_ahead(replica, follower, predicted=0) == []


def test_waiting_for_prefills_ends_when_each_answers_or_times_out():
    fleet, replica = _fleet_with_index()
    first, second = fleet.started(replica, 10, RequestKey([1] * 40)), fleet.started(replica, 10, RequestKey([1] * 50))
    assert not fleet.wait_answering([first], timeout_s=0.01)
    done = threading.Event()

    def wait():
        fleet.wait_answering([first, second], timeout_s=30)
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    fleet.answering(first)
    assert not done.wait(0.05)  # the second is still in its prefill
    fleet.ended(second)  # an answer that failed ends too
    waiter.join(30)
    assert done.is_set() and replica.prefilling == []


def test_shared_prefix_compares_tokens_in_one_namespace():
    key = RequestKey([1, 2, 3, 4])
    assert key.shared_prefix(RequestKey([1, 2, 3, 9])) == 3
    assert key.shared_prefix(RequestKey([1, 2])) == 2
    assert key.shared_prefix(RequestKey([1, 2, 3, 4], cache_salt="s")) == 0


@pytest.mark.parametrize("token_ids, lora_name, cache_salt", [
    ([-1, 2], None, None), ([2**31, 2], None, None), ([2**32] * 4, None, None), ([2**70] * 4, None, None),
    ([1, True], None, None), ([1, 2.0], None, None), ([1, 2], "\udc00", None), ([1, 2], None, "\ud800"), ([1, 2], None, 5),
], ids=["negative", "2**31", "2**32", "2**70", "bool", "float", "lone surrogate adapter", "lone surrogate salt", "salt not str"])
def test_a_key_no_replica_could_hash_is_refused_at_construction(token_ids, lora_name, cache_salt):
    from hybridcache.errors import InvalidArgumentError, InvalidTypeError

    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        RequestKey(token_ids, lora_name, cache_salt)
