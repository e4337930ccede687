"""A request is not sent beside a prefill of its own prefix that the router sent the chosen
replica before it: it waits for that answer to start, the replica's events are applied, and it
is routed again, now predicted from what that prefill saved."""

from __future__ import annotations

import threading

from hybridcache.router.fleet import Fleet
from hybridcache.router.metrics import RouterMetrics
from hybridcache.router.policy import Decision
from hybridcache.router.replica_index import ReplicaIndex
from hybridcache.router.request_key import RequestKey

SYSTEM = list(range(1, 65))  # four blocks of 16


class _ScriptedFleet(Fleet):
    """A fleet over one replica whose routes predict what ``depth`` says now and whose settles
    are counted instead of read from a replica."""

    def __init__(self) -> None:
        super().__init__(["http://127.0.0.1:9"], "restorable")
        self.replica = self.replicas[0]
        self.replica.healthy, self.replica.index = True, ReplicaIndex(16)
        self.depth, self.settles, self.routes = 0, 0, 0

    def route(self, key, prompt_tokens, exclude=()):
        self.routes += 1
        return self.replica, Decision(0, "restorable", self.depth)

    def settle(self, replica, timeout_s=0.2, expected=None):
        self.settles += 1
        return True


def test_a_request_waits_for_a_prefill_of_its_prefix_then_is_routed_again():
    fleet, metrics = _ScriptedFleet(), RouterMetrics()
    ahead = fleet.started(fleet.replica, 70, RequestKey(SYSTEM + [200, 201]))
    follower = RequestKey(SYSTEM + [210, 211])
    routed = []
    thread = threading.Thread(target=lambda: routed.append(fleet.route_after_prefills(follower, 66, metrics)))
    thread.start()
    while metrics.value("prefill_waits") == 0 and thread.is_alive():
        thread.join(0.001)
    assert metrics.value("prefill_waits") == 1 and not routed  # still waiting: the prefill ahead has not answered
    fleet.depth = 64  # what the prefill ahead saved, announced before its answer started
    fleet.answering(ahead)
    thread.join(30)
    (replica, decision), = routed
    assert replica is fleet.replica and decision.predicted_tokens == 64
    assert fleet.settles == 1 and fleet.routes == 2 and metrics.value("prefill_waits") == 1


def test_no_wait_without_a_prefill_deeper_than_the_prediction():
    fleet, metrics = _ScriptedFleet(), RouterMetrics()
    fleet.started(fleet.replica, 70, RequestKey([300] * 70))  # another prefix
    fleet.depth = 64
    fleet.started(fleet.replica, 70, RequestKey(SYSTEM + [200]))  # shares only what is predicted already
    assert fleet.route_after_prefills(RequestKey(SYSTEM + [210]), 65, metrics)[1].predicted_tokens == 64
    assert fleet.route_after_prefills(None, 65, metrics) is not None  # a prompt the router does not know
    assert metrics.value("prefill_waits") == 0 and fleet.settles == 0
