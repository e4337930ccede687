"""The engine snapshot that ``/metrics`` and the live page read is taken at every observation, so
a scrape after a response counts it; the page's history is sampled on the monotonic clock, so a
wall clock stepped back (NTP, a resumed VM) does not freeze it for as long as the step."""

from __future__ import annotations

import time

import numpy as np

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.serving import metrics as serving_metrics
from hybridcache.serving.metrics import HISTORY_EVERY_S, ServingMetrics


class SteppedClock:
    """Wall time that jumps back an hour once ``step_back`` is called; monotonic time that only
    advances, by more than the history interval at each read."""

    def __init__(self) -> None:
        self.wall, self.steady = time.time(), 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        self.steady += 2 * HISTORY_EVERY_S
        return self.steady

    def step_back(self) -> None:
        self.wall -= 3600.0


def _engine() -> Engine:
    return Engine(EngineConfig(block_size=8, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4,
                               max_running=4, max_batch_tokens=64, prefill_chunk=32))


def test_every_observation_takes_a_snapshot():
    """Two observations in a row (as the loop makes them, one step apart) both count: the
    second sees the request the first did not."""
    engine = _engine()
    metrics = ServingMetrics("tiny", engine.config, miss_log_interval_s=60.0)
    metrics.observe_engine(engine)
    engine.add_request(Request(np.arange(1, 20, dtype=np.int32), max_new_tokens=4))
    metrics.observe_engine(engine)
    assert metrics.snapshot.waiting + metrics.snapshot.running == 1


def test_a_wall_clock_stepped_back_does_not_freeze_the_history(monkeypatch):
    clock = SteppedClock()
    monkeypatch.setattr(serving_metrics, "time", clock)
    engine = _engine()
    metrics = ServingMetrics("tiny", engine.config, miss_log_interval_s=60.0)
    engine.add_request(Request(np.arange(1, 20, dtype=np.int32), max_new_tokens=4))
    metrics.observe_engine(engine)
    assert metrics.snapshot.waiting + metrics.snapshot.running == 1
    clock.step_back()
    while engine.scheduler.has_work:
        engine.step()
    metrics.observe_engine(engine)
    assert metrics.snapshot.waiting == metrics.snapshot.running == 0
    assert len(metrics.history) == 2  # sampled on the monotonic clock, which moved on
