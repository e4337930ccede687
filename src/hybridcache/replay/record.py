"""What one replay run measured: ``RunRecord``, built in one place (``RunRecord.measured``), and
its JSON row (``RunRecord.row``), the record ``hybridcache replay --json`` writes.

Owns ``RunCounters``, the totals one run adds up request by request (``fleet.Fleet`` owns the
instance and counts each request once, where it serves it); everything else here is a frozen
value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from hybridcache.policies import Policy
from hybridcache.replay.run_config import RunConfig


@dataclass
class RunCounters:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    flops_saved: float = 0.0
    flops_needed: float = 0.0
    checkpoints_written: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class Evictions:
    kv_blocks: int
    checkpoints_by_trie: int
    checkpoints_for_state_slots: int
    checkpoints_over_anchor_cap: int


@dataclass(frozen=True)
class ReplicaRecord:
    """What one replica of a multi-replica run served."""

    requests: int
    hit_tokens: int
    alpha: float | None


@dataclass(frozen=True)
class FleetMeasures:
    """What the fleet reports at the end of a run (``fleet.Fleet.measures``): the run's counters,
    the adapters' statistics summed over replicas, the first replica's alpha, each replica's share (None for
    one replica), the tokens tiers restored and the tier report (None without tiers)."""

    counters: RunCounters
    stats: dict
    alpha: float | None
    per_replica: tuple[ReplicaRecord, ...] | None
    remote_hit_tokens: int
    tiers: dict | None


@dataclass(frozen=True)
class TraceFacts:
    """What a sweep knows of its trace, the same for every run: its name, its infinite-cache
    bound, the continuations synthesis inferred and the prompt tokens no earlier prompt shares."""

    trace: str
    bound_token_hit_rate: float
    bound_request_hit_rate: float
    continuations: int
    unique_tokens: int


@dataclass(frozen=True)
class RunRecord:
    """One run's measurements, in the order of the JSON row (``row``)."""

    policy: str
    admission: str
    eviction: str
    model: str
    cache_bytes: int | None
    kv_bytes: int
    state_bytes: int
    block_size: int
    kv_blocks: int
    checkpoint_slots: int
    requests: int
    dropped_requests: int
    prompt_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    prefill_tokens_saved: int
    flops_saved: float
    flops_saved_fraction: float
    checkpoints_written: int
    checkpoint_bytes_written: int
    evictions: Evictions
    misses: dict
    shortened: dict
    trie_hit_rate: float
    wall_s: float
    alpha: float | None
    per_replica: tuple[ReplicaRecord, ...] | None  # None: one replica (the row leaves it out)
    replicas: int
    routing: str
    shared_tier: str
    remote_hit_tokens: int
    tiers: dict | None  # tiers.tier_report (None: no tiers; the row leaves it out)
    device_tflops: float

    @classmethod
    def measured(cls, config: RunConfig, policy: Policy, fleet: FleetMeasures, wall_s: float) -> RunRecord:
        """The record of a finished run: its ``config``, the ``policy`` it served with (fitted to
        the pools, with the oracle's foresight) and what its fleet counted and reports."""
        budget, geometry, stats, counters = config.budget, config.geometry, fleet.stats, fleet.counters
        requests, prompt_tokens = counters.requests, counters.prompt_tokens
        return cls(
            policy=policy.name, admission=policy.admission.name, eviction=policy.eviction.name,
            model=config.profile.name, cache_bytes=budget.cache_bytes, kv_bytes=budget.kv_bytes,
            state_bytes=budget.state_bytes, block_size=config.block_size, kv_blocks=geometry.kv_blocks,
            checkpoint_slots=geometry.checkpoint_slots, requests=requests, dropped_requests=counters.dropped,
            prompt_tokens=prompt_tokens,
            token_hit_rate=counters.hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            request_hit_rate=counters.hit_requests / requests if requests else 0.0,
            prefill_tokens_saved=counters.hit_tokens, flops_saved=counters.flops_saved,
            flops_saved_fraction=counters.flops_saved / counters.flops_needed if counters.flops_needed else 0.0,
            checkpoints_written=counters.checkpoints_written,
            checkpoint_bytes_written=counters.checkpoints_written * config.profile.state_bytes,
            evictions=Evictions(stats["evicted_blocks"], stats["evicted_checkpoints"],
                                stats["evicted_checkpoints_for_state_slots"], stats["released_checkpoints_over_anchor_cap"]),
            misses=stats["misses"], shortened=stats["shortened"], trie_hit_rate=stats["hit_rate"], wall_s=wall_s,
            alpha=fleet.alpha, per_replica=fleet.per_replica, replicas=config.replicas, routing=config.routing,
            shared_tier=config.shared_tier, remote_hit_tokens=fleet.remote_hit_tokens, tiers=fleet.tiers,
            device_tflops=config.device_tflops,
        )

    @property
    def ttft_saved_s(self) -> float:
        """The prefill time the hits saved at ``device_tflops`` sustained."""
        return self.flops_saved / (self.device_tflops * 1e12)

    @property
    def ttft_saved_ms_per_request(self) -> float:
        return 1e3 * self.ttft_saved_s / max(1, self.requests)

    def row(self, trace: TraceFacts) -> dict:
        """The JSON record: the trace's name, the measurements, the trace's facts, the TTFT
        saved, the fraction of the bound reached (and, with tiers, the bytes stored per unique
        prompt token in the tier that keeps them: the shared one, else the host)."""
        measured = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "device_tflops"}
        measured["evictions"] = asdict(self.evictions)
        if self.per_replica is None:
            del measured["per_replica"]
        else:
            measured["per_replica"] = [asdict(replica) for replica in self.per_replica]
        if self.tiers is None:
            del measured["tiers"]
        else:
            stored = self.tiers["stored_bytes_nominal"]
            kept = stored["shared"] if self.shared_tier != "none" else stored["host"]
            unique = trace.unique_tokens
            measured["tiers"] = {**self.tiers, "stored_bytes_per_unique_token": kept / unique if unique else 0.0}
        bound = trace.bound_token_hit_rate
        return {
            "trace": trace.trace,
            **measured,
            "bound_token_hit_rate": trace.bound_token_hit_rate,
            "bound_request_hit_rate": trace.bound_request_hit_rate,
            "continuations": trace.continuations,
            "device_tflops": self.device_tflops,
            "ttft_saved_s": self.ttft_saved_s,
            "ttft_saved_ms_per_request": self.ttft_saved_ms_per_request,
            "bound_fraction": self.token_hit_rate / bound if bound else 0.0,
        }

