"""The replicas of one replay run, and which of them serves each request.

Owns, per replica, its device cache (``adapter.CacheAdapter``: pools and trie), its alpha
tuning (``tuning``), what a router would know of it (``routing.AnnouncedReplica``, routed
runs only) and the count of what it served; the run's counters (``record.RunCounters``, each
request counted once, where it is served); the fleet's tiers (``tier_run``, through the tier
client the engine uses) when the run has any. A request's trace record is read once, here,
and only values go down; it goes to the replica the routing chooses; with tiers, its keys are
made once (``TierRun.turn_keys``), the deepest verified prefix the tiers hold is adopted
(``CacheProtocol.adopt``) before its turn starts, and after it the chunk-aligned prefixes it
computed are published: every call goes down.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

from hybridcache.policies import Policy
from hybridcache.replay.adapter import CacheAdapter
from hybridcache.replay.budgets import mean_prompt_tokens
from hybridcache.replay.record import FleetMeasures, ReplicaRecord, RunCounters
from hybridcache.replay.routing import AnnouncedReplica
from hybridcache.replay.run_config import RunConfig
from hybridcache.replay.serving import ServedTurn, serve_turn
from hybridcache.replay.tier_run import TierRun, TurnKeys
from hybridcache.replay.tiering import RecomputeRate
from hybridcache.replay.tuning import Tuning, TuningProgress, tuning_for
from hybridcache.router.policy import choose
from hybridcache.router.request_key import RequestKey
from hybridcache.workloads.records import TraceRequest


@dataclass
class Replica:
    """One replica of the run: its device cache, its alpha tuning, what it served."""

    adapter: CacheAdapter
    tuning: Tuning | None  # None: its eviction tunes nothing, or its alpha is chosen
    announced: AnnouncedReplica | None = None  # what a router would know of it (routed runs only)
    requests: int = 0
    hit_tokens: int = 0


class Fleet:
    def __init__(self, config: RunConfig, policy: Policy, requests: SequenceLike[TraceRequest],
                 tuning_progress: TuningProgress | None = None) -> None:
        """``policy``: the run's policy as served (fitted to the pools, with any foresight)."""
        self.config, self.policy = config, policy
        self.counters = RunCounters()
        self.replicas = [self._new_replica(tuning_progress) for _ in range(config.replicas)]
        self.routed = config.replicas > 1 and config.routing != "round-robin"
        if self.routed:
            for replica in self.replicas:
                replica.announced = AnnouncedReplica(replica.adapter.cache, config.block_size)
        self.tiers = None
        if config.tiered:
            rate = RecomputeRate.of(config.profile, config.device_tflops, mean_prompt_tokens(requests))
            self.tiers = TierRun(config.tiers, config.profile, config.block_size, rate, self.adapters)

    def _new_replica(self, tuning_progress: TuningProgress | None) -> Replica:
        config = self.config
        adapter = CacheAdapter(config.geometry, self.policy.eviction.new_state(config.profile))
        return Replica(adapter, tuning_for(adapter, self.policy, config.prefill_chunk, tuning_progress))

    @property
    def adapters(self) -> list[CacheAdapter]:
        return [replica.adapter for replica in self.replicas]

    def serve(self, request: TraceRequest, number: int) -> ServedTurn:
        """Serve the trace's ``number``-th request on the replica the routing chooses (with
        tiers: restore before admission, publish after), then let that replica's router view
        and alpha tuning see it, and count it. The request's tokens are read here once and
        handed down."""
        tiers, prompt = self.tiers, request.prompt
        keys = None if tiers is None else tiers.turn_keys(request.tokens, prompt)
        index = self._route(prompt, number, keys)
        replica = self.replicas[index]
        if tiers is not None:
            tiers.replicas[index].adopt_prefix(keys)  # before the turn starts, as the engine adopts
        served = serve_turn(replica.adapter, prompt, request.output, self.policy, self.config.prefill_chunk)
        if tiers is not None:
            tiers.store_prefix(index, prompt.size, served, keys)
        if replica.announced is not None:
            replica.announced.refresh()
        if replica.tuning is not None and replica.tuning.after(request):
            replica.tuning = None  # alpha chosen: the tuning is done
        self._count(replica, prompt.size, served)
        return served

    def _count(self, replica: Replica, prompt_tokens: int, served: ServedTurn) -> None:
        """The run's totals (in arrival order, so its sums are the same whatever the replica)
        and the replica's share."""
        counters, hit, profile = self.counters, served.turn.hit_tokens, self.config.profile
        counters.requests += 1
        counters.dropped += served.dropped
        counters.checkpoints_written += served.checkpoints_written
        counters.prompt_tokens += prompt_tokens
        counters.hit_tokens += hit
        counters.hit_requests += hit > 0
        counters.flops_saved += profile.prefill_flops(0, hit)
        counters.flops_needed += profile.prefill_flops(0, prompt_tokens)
        replica.requests += 1
        replica.hit_tokens += hit

    def _route(self, prompt, number: int, keys: TurnKeys | None) -> int:
        """The replica serving the request of ``prompt``, chosen by the router's policy from what
        each replica announced; with tiers (``keys``: the request's), ``restorable`` counts the
        steps they make reachable."""
        fleet, routing = self.replicas, self.config.routing
        if not self.routed:
            return number % len(fleet)
        key = RequestKey(prompt.tolist())
        depths = [replica.announced.index.depths(key) for replica in fleet]
        if routing == "restorable" and keys is not None:
            depths = self.tiers.restorable_depths(keys, depths)
        return choose(routing, prompt.size, depths, [0] * len(fleet), number).index  # served one at a time: nothing queued

    def measures(self) -> FleetMeasures:
        one = len(self.replicas) == 1
        per_replica = None if one else tuple(
            ReplicaRecord(r.requests, r.hit_tokens, getattr(r.adapter.eviction, "alpha", None)) for r in self.replicas
        )
        tiers = self.tiers
        return FleetMeasures(
            counters=self.counters,
            stats=self._merged_stats(),
            alpha=getattr(self.replicas[0].adapter.eviction, "alpha", None),
            per_replica=per_replica,
            remote_hit_tokens=tiers.remote_hit_tokens() if tiers is not None else 0,
            tiers=tiers.report() if tiers is not None else None,
        )

    def _merged_stats(self) -> dict:
        """The adapters' statistics summed over replicas (one replica: its own, unchanged)."""
        if len(self.replicas) == 1:
            return self.replicas[0].adapter.stats()
        merged: dict = {}
        for replica in self.replicas:
            for name, value in replica.adapter.stats().items():
                if isinstance(value, dict):
                    bucket = merged.setdefault(name, {})
                    for key, count in value.items():
                        bucket[key] = bucket.get(key, 0) + count
                else:
                    merged[name] = merged.get(name, 0) + value
        merged["hit_rate"] = merged["hit_tokens"] / merged["query_tokens"] if merged["query_tokens"] else 0.0
        return merged

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
