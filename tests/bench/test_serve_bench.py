"""``hybridcache bench serve`` at smoke size: real server processes, clients over HTTP, every
request answered, later turns restored from the cache (with caching on) and none without."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from hybridcache.bench.serve import ServeBench, run_serve_bench  # noqa: E402


def test_the_serve_bench_runs_clients_against_a_real_server_with_and_without_caching():
    bench = ServeBench(clients=2, turns=2, system_tokens=96, opening_tokens=32, user_tokens=16, reply_tokens=3, model="tiny")
    on, off = run_serve_bench(bench)
    assert (on["caching"], off["caching"]) == (True, False)
    assert on["requests"] == off["requests"] == 4 and on["errors"] == off["errors"] == 0
    assert on["token_hit_rate"] > 0.5 and off["token_hit_rate"] == 0.0
    assert on["ttft_p50_vs_off"] > 0 and on["config"]["clients"] == 2
    assert on["server_audit"] == off["server_audit"] == "hybridcache serve: cache accounting holds after shutdown (check_invariants)"
