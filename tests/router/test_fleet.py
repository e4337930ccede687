"""The fleet's load: this router's own requests counted as they start and end, on top of what
the replicas' gauges said others sent."""

from __future__ import annotations

from hybridcache.router.fleet import Fleet


def test_load_counts_the_routers_own_requests_at_once():
    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    replica.others = 2.0
    fleet.started(replica)
    fleet.started(replica)
    assert replica.load == 4.0 and fleet.status()[0].load == 4.0
    fleet.ended(replica)
    fleet.ended(replica)
    assert replica.load == 2.0 and replica.in_flight == 0


def test_a_health_check_keeps_only_the_others_requests_from_the_gauge(monkeypatch):
    import hybridcache.router.fleet as fleet_module

    fleet = Fleet(["http://127.0.0.1:9"], "restorable")
    replica = fleet.replicas[0]
    monkeypatch.setattr(fleet_module, "read_load", lambda url, timeout: 3.0)  # the gauge counts our one request
    monkeypatch.setattr(fleet, "_subscribe", lambda r: (None, None))
    fleet.started(replica)
    fleet.check_health()
    assert replica.healthy and replica.others == 2.0 and replica.load == 3.0
    fleet.ended(replica)
    assert replica.load == 2.0
