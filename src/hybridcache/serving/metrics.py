"""What the server observed: Prometheus metrics under vLLM's names and ours, the live page's
history, and the log line for queries that keep missing.

Owns: the prometheus registry (request histograms, token and error counters), the latest
``EngineSnapshot`` (replaced whole by the engine loop thread, read by ``/metrics`` and the page,
so both show the same numbers), the hit-rate history, the recent requests, and when each miss
reason was last logged. Engine-side numbers are read from the snapshot at scrape time by a
custom collector, so counters are exactly the engine's own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridcache.engine import Engine, EngineConfig
from hybridcache.tiers.tier_calls import TIER_NAMES

log = logging.getLogger("hybridcache.serving")

HISTORY_EVERY_S = 1.0
HISTORY_POINTS = 300
RECENT_REQUESTS = 20
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
MISS_ADVICE = {
    "no_checkpoint": "KV blocks were cached but no recurrent-state checkpoint covered them "
                     "(raise checkpoint_budget / num_state_slots, or use --policy auto)",
    "nothing_to_match": "the prompt is shorter than one KV block plus one token",
    "no_cached_prefix": "nothing cached shares a prefix with the prompt (different prefixes, salt or adapter)",
    "recompute_overlap": "cached blocks were recomputed to rebuild a state",
    "multimodal_boundary": "the cached prefix ended inside a multimodal span",
    "routed_experts": "cached blocks lacked the routed-expert rows the request asked for",
}
TIER_MISS_ADVICE = {
    "tier_unavailable": "a tier store failed or could not be reached, or its circuit breaker skips it (check the store)",
    "tier_timeout": "a tier store did not answer in time (check the store and its network)",
    "evicted": "a checkpoint this server published is gone from every tier (raise --host-bytes / --disk-bytes or the store's memory)",
    "tier_rejected": "what a tier returned failed verification or could not be adopted (another model or a damaged store)",
    "slower_than_recompute": "the measured restore cost exceeded recomputing the prefix",
    "tier_error": "the tier side raised unexpectedly (see the engine's tier counters)",
}


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters and occupancy at one moment (all token counts cumulative)."""

    taken_at: float = -float("inf")  # time.monotonic(): only ever compared with another snapshot's
    query_tokens: int = 0
    hit_tokens: int = 0
    hits: int = 0
    matches: int = 0
    misses: dict = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    state_usage: float = 0.0
    checkpoints_held: int = 0
    evicted_blocks: int = 0
    evicted_checkpoints: int = 0
    written_checkpoints: int = 0
    tier_checkpoints_written: dict = field(default_factory=dict)  # tier -> checkpoints newly stored there
    tier_restored_tokens: dict = field(default_factory=dict)  # tier -> tokens it served
    tier_misses: dict = field(default_factory=dict)  # reason -> requests the tiers served less than expected

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        stats, config = engine.stats(), engine.config
        tiers = stats.get("tiers", {})
        stored = tiers.get("store", {}).get("counters", {})
        return cls(
            taken_at=time.monotonic(),
            query_tokens=stats["query_tokens"], hit_tokens=stats["hit_tokens"], hits=stats["hits"],
            matches=stats["matches"], misses=dict(stats["misses"]),
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
            kv_usage=1.0 - stats["free_blocks"] / config.num_kv_blocks,
            state_usage=1.0 - stats["free_state_slots"] / config.num_state_slots,
            checkpoints_held=engine.states.num_checkpoint,
            evicted_blocks=stats["evicted_blocks"], evicted_checkpoints=stats["evicted_checkpoints"],
            written_checkpoints=stats["written_checkpoints"],
            tier_checkpoints_written={tier: stored.get(f"{tier}_checkpoints_stored", 0) for tier in TIER_NAMES},
            tier_restored_tokens={tier: tiers.get("restored_tokens", {}).get(tier, 0) for tier in TIER_NAMES},
            tier_misses={reason: tiers.get("misses", {}).get(reason, 0) for reason in TIER_MISS_ADVICE},
        )


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, as the live page lists it."""

    request_id: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    miss_reason: str | None
    ttft_s: float
    status: int


class ServingMetrics:
    def __init__(self, served_name: str, engine_config: EngineConfig, miss_log_interval_s: float) -> None:
        self.served_name, self.engine_config = served_name, engine_config
        self.registry = CollectorRegistry()
        names = ("model_name", "engine")
        self.labels = (served_name, "0")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", names,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", names,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", names, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", names, registry=self.registry)
        self.errors = Counter("hybridcache:request_errors", "Requests answered with an error, by status.",
                              (*names, "status"), registry=self.registry)
        self.request_misses = Counter("hybridcache:request_misses", "Requests served, by the miss reason their response gave.",
                                      (*names, "reason"), registry=self.registry)
        for family in (self.ttft, self.e2e, self.prompt_tokens, self.generation_tokens):
            family.labels(*self.labels)  # present at 0 from the first scrape, as dashboards expect
        self.registry.register(_SnapshotCollector(self))
        self.snapshot = EngineSnapshot()
        self.history: deque[EngineSnapshot] = deque(maxlen=HISTORY_POINTS)
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self._miss_log = _MissLog(miss_log_interval_s)

    # --- the engine loop thread -----------------------------------------------------------------

    def observe_engine(self, engine: Engine) -> None:
        """After every step, before its answers are sent, so a scrape that follows a response
        counts what that response said (a snapshot costs about 6 µs against a step's
        milliseconds; skipping steps let a scrape lag a finished request)."""
        now = time.monotonic()  # a wall clock stepped back would freeze the history for as long
        self.snapshot = snapshot = EngineSnapshot.of(engine)
        if not self.history or now - self.history[-1].taken_at >= HISTORY_EVERY_S:
            self.history.append(snapshot)
        self._miss_log.observe({**snapshot.misses, **snapshot.tier_misses}, now)

    # --- the HTTP side ---------------------------------------------------------------------------

    def record_request(self, record: RequestRecord, e2e_s: float) -> None:
        labels = self.labels
        if record.status == 200:
            self.prompt_tokens.labels(*labels).inc(record.prompt_tokens)
            self.generation_tokens.labels(*labels).inc(record.completion_tokens)
            self.ttft.labels(*labels).observe(record.ttft_s)
            self.e2e.labels(*labels).observe(e2e_s)
            if record.miss_reason is not None:
                self.request_misses.labels(*labels, record.miss_reason).inc()
        else:
            self.errors.labels(*labels, str(record.status)).inc()
        self.recent.append(record)

    def record_error(self, status: int) -> None:
        self.errors.labels(*self.labels, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Engine-side metrics, read from the latest snapshot at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        metrics, snap = self._metrics, self._metrics.snapshot
        names, labels = ["model_name", "engine"], list(metrics.labels)

        def family(kind, name, documentation, value, extra=None):
            metric = kind(name, documentation, labels=names + list(extra or {}))
            metric.add_metric(labels + list((extra or {}).values()), value)
            return metric

        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", snap.query_tokens)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in restored tokens.", snap.hit_tokens)
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", snap.running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be admitted.", snap.waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV block pool usage (1 = full).", snap.kv_usage)
        yield family(GaugeMetricFamily, "vllm:cache_config_info", "The cache configuration.", 1, _cache_labels(metrics))
        yield family(CounterMetricFamily, "hybridcache:checkpoint_hits", "Admissions that restored a cached prefix.", snap.hits)
        misses = CounterMetricFamily("hybridcache:prefix_cache_misses", "Admissions that restored nothing, by reason.",
                                     labels=names + ["reason"])
        for reason in sorted(set(MISS_ADVICE) | set(snap.misses)):
            misses.add_metric(labels + [reason], snap.misses.get(reason, 0))
        yield misses
        yield family(GaugeMetricFamily, "hybridcache:state_slot_usage_perc", "Recurrent-state slot usage (1 = full).", snap.state_usage)
        yield family(GaugeMetricFamily, "hybridcache:checkpoints", "State checkpoints held in slots.", snap.checkpoints_held)
        yield family(CounterMetricFamily, "hybridcache:checkpoints_written", "State checkpoints published in slots.",
                     snap.written_checkpoints)
        yield family(CounterMetricFamily, "hybridcache:checkpoints_evicted", "State checkpoints evicted.", snap.evicted_checkpoints)
        yield _by_label(CounterMetricFamily("hybridcache:tier_checkpoints_written",
                                            "Checkpoints newly stored in a tier, by tier.", labels=names + ["tier"]),
                        labels, snap.tier_checkpoints_written)
        yield _by_label(CounterMetricFamily("hybridcache:tier_misses", "Requests a tier served less than expected, by reason.",
                                            labels=names + ["reason"]), labels, snap.tier_misses)
        yield family(CounterMetricFamily, "hybridcache:kv_blocks_evicted", "Cached KV blocks evicted.", snap.evicted_blocks)
        restored = CounterMetricFamily("hybridcache:restored_tokens", "Restored prompt tokens, by the tier they came from.",
                                       labels=names + ["tier"])
        restored.add_metric(labels + ["device"], max(0, snap.hit_tokens - sum(snap.tier_restored_tokens.values())))
        yield _by_label(restored, labels, snap.tier_restored_tokens)


def _by_label(metric, labels: list[str], values: dict):
    """``metric`` with one sample per key of ``values`` (its last label)."""
    for key, value in values.items():
        metric.add_metric(labels + [key], value)
    return metric


def _cache_labels(metrics: ServingMetrics) -> dict[str, str]:
    config = metrics.engine_config
    return {
        "block_size": str(config.block_size), "num_gpu_blocks": str(config.num_kv_blocks),
        "enable_prefix_caching": str(config.prefix_caching), "num_state_slots": str(config.num_state_slots),
        "checkpoint_budget": str(config.checkpoint_budget), "policy": config.checkpoint_policy,
    }


class _MissLog:
    """Logs a miss reason the first time it is seen, then at most once per ``interval_s`` while
    queries keep missing for it, with the count since the last line."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (when, count at that time)

    def observe(self, misses: dict, now: float) -> None:
        for reason, count in misses.items():
            when, logged = self._logged.get(reason, (None, 0))
            if count <= logged or (when is not None and now - when < self._interval_s):
                continue
            advice = MISS_ADVICE.get(reason) or TIER_MISS_ADVICE.get(reason, "")
            log.warning("prefix cache: %d more queries restored nothing (%s): %s", count - logged, reason, advice)
            self._logged[reason] = (now, count)
