"""``bench router`` builds replica indexes of the asked size and scores every request."""

from __future__ import annotations

from hybridcache.bench.router import run_router_bench


def test_router_bench_fills_the_indexes_and_times_each_request():
    record = run_router_bench(replicas=2, blocks=600, requests=12, prompt_tokens=256, block_size=16)
    assert record["blocks_per_replica"] >= 600 and record["checkpoints_per_replica"] > 0
    assert record["requests"] == 12 and 0 < record["p50_ms"] <= record["p99_ms"]
