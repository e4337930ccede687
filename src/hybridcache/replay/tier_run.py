"""The tiers of one replay run: every replica's ``ReplicaTiers`` (``tiering``), the run's
namespace, which steps of a turn are published, and what the run measured of its tiers.

Owns the replicas' tiers of one run and the names of the objects it put into the shared store
(removed at its end, so a sweep's runs each start from an empty store). The shared store itself
is the caller's.
"""

from __future__ import annotations

import uuid
from collections import Counter

from hybridcache.errors import StoreError
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter, Turn
from hybridcache.replay.tiering import (
    RecomputeRate,
    ReplicaTiers,
    RunTiers,
    TierSetup,
    replay_fingerprint,
)
from hybridcache.router.replica_index import Depths
from hybridcache.sequence import Sequence
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.restore_cost import StandInSizes
from hybridcache.tiers.tier_calls import TIER_NAMES
from hybridcache.workloads.records import TraceRequest

_REMOVE_BATCH = 512


class TierRun:
    def __init__(self, setup: TierSetup, profile: ModelProfile, block_size: int, rate: RecomputeRate,
                 adapters: list[CacheAdapter]) -> None:
        """Tiers for the replicas serving ``adapters``, in one fresh namespace."""
        chunk = setup.chunk_size
        fingerprint = replay_fingerprint(profile, block_size, chunk, uuid.uuid4().hex[:16])
        sizes = StandInSizes(profile.kv_bytes_per_token, profile.state_bytes, chunk)
        self.shared = RunTiers(setup, sizes, fingerprint, rate, profile)
        self.replicas: list[ReplicaTiers] = []
        self.published: set[str] = set()
        try:
            for index, adapter in enumerate(adapters):
                self.replicas.append(ReplicaTiers(self.shared, adapter, index))
        except BaseException:
            self.close()
            raise

    def prompt_chain(self, request: TraceRequest) -> KeyChain | None:
        """The key chain a restore of ``request`` looks up (the tier client's; None: too short
        for one chunk), for scoring replicas."""
        return self.replicas[0].client.restore_chain(Sequence(request.prompt))

    def restorable_depths(self, chain: KeyChain, depths: list[Depths]) -> list[Depths]:
        """``depths`` (what each replica's device cache announced) deepened by the steps each
        replica's tiers make reachable, by existence only; the shared tier is asked once."""
        located = self.replicas[0].client.shared_presence(chain)
        return [
            Depths(d.kv_tokens, tiers.client.reachable_step(chain, (d.restorable, d.kv_tokens), located))
            for tiers, d in zip(self.replicas, depths)
        ]

    def store_prefix(self, replica: int, request: TraceRequest, turn: Turn, ends: list[int]) -> None:
        """Publish what the turn computed beyond its hit: every chunk-aligned chunk end (the engine
        publishes those), the deepest aligned step of the prompt and of the turn end."""
        if not ends:
            return
        computed, chunk = ends[-1], self.shared.setup.chunk_size
        wanted = {end for end in ends if end % chunk == 0}
        wanted |= {min(request.prompt_length, computed) // chunk * chunk, computed // chunk * chunk}
        steps = sorted(step for step in wanted if step > turn.hit_tokens)
        if steps:
            self.replicas[replica].store_prefix(turn.seq, steps, self.published)

    def remote_hit_tokens(self) -> int:
        return sum(tiers.client.stats.remote_hit_tokens for tiers in self.replicas)

    def report(self) -> dict:
        return tier_report(self.shared, self.replicas)

    def close(self) -> None:
        """Remove this run's objects from the shared store and close every replica's own tiers."""
        shared = self.shared.setup.shared
        if shared is not None and self.published:
            names = sorted(self.published)
            for at in range(0, len(names), _REMOVE_BATCH):
                try:
                    shared.remove(names[at : at + _REMOVE_BATCH])
                except StoreError:
                    break  # the store is gone; so is what it held
        self.published.clear()
        for tiers in self.replicas:
            tiers.close()


def tier_report(run: RunTiers, replicas: list[ReplicaTiers]) -> dict:
    """The run's tier measurements, summed over replicas: restores and what they gained, bytes
    moved (nominal and actual), restore against recompute time, bytes stored, misses by reason."""
    setup, sizes = run.setup, run.sizes
    summed = _Summed(replicas)
    stored, moved_nominal, moved_actual = summed.store_counters, summed.moved_nominal, summed.moved_actual
    restores = summed.restores
    restore_s = sum(replica.restore_s for replica in replicas)
    recompute_s = sum(replica.recompute_s for replica in replicas)
    return {
        "tier_chunk": setup.chunk_size,
        "host_bytes": setup.host_bytes,
        "disk_bytes": setup.disk_bytes,
        "shared_bandwidth": setup.shared_bandwidth,
        "nominal_chunk_bytes": sizes.chunk,
        "nominal_checkpoint_bytes": sizes.checkpoint_bytes,
        "restores": restores,
        "restores_using": {tier: summed.using[tier] for tier in TIER_NAMES},
        "adoptions_refused": summed.adoptions_refused,
        "published_steps": summed.published_steps,
        "tier_side_failures": summed.failures,
        "bytes_moved_nominal": {tier: moved_nominal[tier] for tier in TIER_NAMES},
        "bytes_moved_actual": {tier: moved_actual[tier] for tier in TIER_NAMES},
        "bytes_moved_per_hit_nominal": moved_nominal.total() / restores if restores else 0.0,
        "bytes_moved_per_hit_actual": moved_actual.total() / restores if restores else 0.0,
        "restore_s": restore_s,
        "recompute_s": recompute_s,
        "restore_over_recompute": restore_s / recompute_s if recompute_s else 0.0,
        "stored_bytes_nominal": {
            tier: stored[f"{tier}_chunks_stored"] * sizes.chunk + stored[f"{tier}_checkpoints_stored"] * sizes.checkpoint_bytes
            for tier in ("host", "shared")
        },
        "stored_bytes_actual": {tier: stored[f"{tier}_bytes_written"] for tier in ("host", "shared")},
        "held_bytes_nominal": summed.held,
        "misses": dict(summed.misses),
        "store_counters": dict(stored),
    }


class _Summed:
    """The replicas' tier statistics, store counters, bytes moved and bytes held, summed."""

    def __init__(self, replicas: list[ReplicaTiers]) -> None:
        self.store_counters: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.using: Counter[str] = Counter()
        self.moved_nominal: Counter[str] = Counter()
        self.moved_actual: Counter[str] = Counter()
        self.held = {"host": 0, "disk": 0}
        for replica in replicas:
            self.store_counters.update(replica.store.counters)
            self.misses.update(replica.store.misses)
            self.using.update(replica.client.stats.restores_using)
            self.moved_nominal.update(replica.moved.nominal)
            self.moved_actual.update(replica.moved.actual)
            for name in self.held:
                store = replica.store.tiers.get(name)
                self.held[name] += store.used_bytes if store is not None else 0
        stats = [replica.client.stats for replica in replicas]
        self.restores = sum(s.restores for s in stats)
        self.adoptions_refused = sum(s.adoptions_refused for s in stats)
        self.published_steps = sum(s.published_steps for s in stats)
        self.failures = sum(s.restore_failed.total() + s.publish_failed.total() for s in stats)
