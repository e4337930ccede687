from hybridcache.router.fleet import ReplicaStatus
from hybridcache.router.metrics import RouterMetrics


def test_every_counter_is_exported_with_the_total_suffix():
    # Prometheus' convention (and prometheus_client's exposition): a counter's samples end in _total.
    text = RouterMetrics().render([ReplicaStatus("http://r", True, 0.0, 0, (None, None), 2, 1)])
    counters = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE") and line.endswith(" counter")]
    assert counters and all(name.endswith("_total") for name in counters)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['hybridcache_router_replica_catch_ups_total{replica="http://r"}'] == "2"
    assert samples['hybridcache_router_replica_index_losses_total{replica="http://r"}'] == "1"
