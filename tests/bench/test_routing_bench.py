"""``hybridcache bench routing`` at smoke size: real replicas behind a real router, every
request answered, later turns restored, the router's predictions compared."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("zmq", reason="the events extra is not installed")

from hybridcache.bench.routing import RoutingBench, run_routing_bench  # noqa: E402


def test_the_routing_bench_drives_conversations_through_the_router():
    bench = RoutingBench(replicas=2, clients=2, conversations=2, turns=2, system_tokens=64, checkpoint_policy="marconi")
    (record,) = run_routing_bench(bench, ("restorable",))
    assert record["policy"] == "restorable" and record["requests"] == 4 and record["errors"] == 0
    assert record["token_hit_rate"] > 0 and record["reported_cached_tokens"] > 0
    assert 0 < record["predictions_exact"] <= 1 and record["restorable_over_this"] == 1.0
    assert record["config"]["replicas"] == 2 and record["config"]["checkpoint_policy"] == "marconi"
    assert 0 <= record["headroom"] < 1  # the deepest restore offered at each decision, less the one taken
    assert record["settles_unapplied"] >= 0 and record["catch_ups"] >= 0 and record["index_losses"] >= 0
