"""The engine soak at smoke size: nothing leaks, invariants hold, sampled outputs are exact."""

from hybridcache.bench.soak_engine import run_soak_engine


def test_soak_engine_smoke_is_clean_and_exact():
    record = run_soak_engine(60, seed=3, check_every=5, exact_sample_every=15)
    assert record["requests"] == 60
    assert record["leaked_pool_entries"] == 0
    assert record["invariant_checks"] > 0
    exact, sampled = map(int, record["exact_samples"].split("/"))
    assert sampled == 4 and exact == sampled
    assert record["evicted_blocks"] > 0  # the pools are small enough to force eviction
