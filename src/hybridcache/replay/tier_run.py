"""The tiers of one replay run, and the tier side of each request it serves: every replica's
``TieredStore`` and ``TierClient`` (the one the engine uses), fed the replay's stand-ins.

Owns, per run: the replicas' tiers and the names of the objects it put into the shared store
(removed at its end, so a sweep's runs each start from an empty store; the shared store itself
is the caller's). Per replica (``ReplicaTiers``): its ``TieredStore`` with its own host and disk
stores (the shared one is only borrowed), its ``TierClient`` (which owns the restore and
publish statistics; the replica's ``CacheAdapter`` is its device side), and what its lookups
moved and would cost. The device cache is changed only through ``CacheAdapter.adopt``. What
the run's tiers are and what they stand for (setup, namespace, nominal sizes, recompute rate)
are values of ``tiering``.

One request's tier work goes through here, downward only: its keys are made once
(``turn_keys``: the prompt as a sequence, the key chain of prompt and output) and carried into
the routing's presence query, the restore before its turn starts and the publish after it,
each a call to the tier client.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hybridcache.errors import StoreError
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter
from hybridcache.replay.serving import ServedTurn
from hybridcache.replay.tiering import RecomputeRate, RunTiers, TierSetup, replay_fingerprint
from hybridcache.router.replica_index import Depths
from hybridcache.sequence import Sequence
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.client import TierClient
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.restore_cost import RestoreCost, StandInSizes
from hybridcache.tiers.restore import Restore
from hybridcache.tiers.tier_calls import TIER_NAMES
from hybridcache.tiers.tiered import TieredStore

_REMOVE_BATCH = 512


class TurnKeys(NamedTuple):
    """What one request's tier work carries from the routing to the restore and the publish:
    its prompt as a sequence holding no blocks (probed, never served: its turn is started on
    the replica chosen, after the restore) and the key chain of its whole turn."""

    prompt: Sequence
    chain: KeyChain


@dataclass
class MovedBytes:
    """Bytes the lookups of one replica read, by tier: what they stand for, what was sent."""

    nominal: Counter[str] = field(default_factory=Counter)
    actual: Counter[str] = field(default_factory=Counter)


class ReplicaTiers:
    def __init__(self, run: RunTiers, adapter: CacheAdapter, index: int) -> None:
        """The tiers of replica ``index``, serving ``adapter``'s device cache."""
        setup, sizes = run.setup, run.sizes
        self.run, self.adapter = run, adapter
        host = HostMemoryStore(setup.host_bytes, charge=sizes.charge) if setup.host_bytes else None
        disk = None
        if setup.disk_bytes:
            disk = DiskStore(Path(setup.disk_root) / f"replica-{index}", setup.disk_bytes, charge=sizes.charge)
        priors = RestoreCost()
        cost = RestoreCost(
            recompute_s_per_token=run.rate.s_per_token,
            smoothing=0.0,  # fixed rates: the stand-in bytes' timings are not a link's
            s_per_byte={**priors.s_per_byte, "shared": 1 / setup.shared_bandwidth},
            stand_in=sizes,
        )
        self.store = TieredStore(host=host, disk=disk, shared=setup.shared, cost=cost)
        self.client = TierClient(self.store, run.fingerprint, adapter)
        self.moved = MovedBytes()
        self.restore_s = 0.0  # nominal seconds the adopted restores' reads take at the stated rates
        self.recompute_s = 0.0  # seconds recomputing the tokens they gained takes at the device's FLOP/s

    @property
    def local_stores(self) -> list[ObjectStore]:
        """This replica's own tiers (host, disk), not the borrowed shared one."""
        return [self.store.tiers[name] for name in ("host", "disk") if name in self.store.tiers]

    def store_prefix(self, seq: Sequence, steps: list[int], chain: KeyChain, published: set[str]) -> None:
        """Publish the checkpoints at ``steps`` (chunk-aligned, ascending) of ``seq``, keyed by
        ``chain`` (its turn's), with their chunks; every key put is added to ``published`` (the
        run's cleanup)."""
        chain = self.client.store_prefix(seq, steps, made=chain)
        if chain is None:
            return
        published.update(chain.checkpoint_names[step] for step in steps)
        published.update(chain.chunk_names[: steps[-1] // chain.chunk_size])

    def adopt_prefix(self, keys: TurnKeys) -> Restore | None:
        """Before the turn of ``keys`` starts: adopt the deepest verified restore of its prompt
        beyond the device cache's hit (the tier client's, cutting the turn's chain), so the
        turn is measured once, after it; the Restore adopted, or None."""
        before = Counter(self.store.counters)
        outcome = self.client.adopt_prefix(keys.prompt, keys.chain)
        moved = self._count_reads(before)
        restore = outcome.restore
        if restore is None:
            return None
        self.restore_s += self.store.cost.restore_s(moved)
        flops = self.run.profile.prefill_flops(restore.step - outcome.gained, restore.step)
        self.recompute_s += flops / self.run.rate.device_flops
        return restore

    def _count_reads(self, before: Counter) -> dict[str, int]:
        """Bytes one lookup moved, by tier (nominal and actual; a read that then failed
        verification moved them too); returns the nominal ones."""
        after, sizes, nominal = self.store.counters, self.run.sizes, {}
        for tier in TIER_NAMES:
            chunks = after[f"{tier}_read_count_kv"] - before[f"{tier}_read_count_kv"]
            checkpoints = after[f"{tier}_read_count_ck"] - before[f"{tier}_read_count_ck"]
            nominal[tier] = chunks * sizes.chunk + checkpoints * sizes.checkpoint_bytes
            self.moved.nominal[tier] += nominal[tier]
            self.moved.actual[tier] += after[f"{tier}_bytes_read"] - before[f"{tier}_bytes_read"]
        return nominal

    def close(self) -> None:
        """Close this replica's own tiers; the shared store is the run's to close."""
        for store in self.local_stores:
            store.close()


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

    def turn_keys(self, tokens: np.ndarray, prompt: np.ndarray) -> TurnKeys:
        """What the tier work of a request (its ``tokens``, ``prompt`` then output) carries, made
        once: its prompt as a sequence and the key chain of its whole turn."""
        chain = self.replicas[0].client.chain(Sequence(tokens), tokens.size)
        return TurnKeys(Sequence(prompt), chain)

    def restorable_depths(self, keys: TurnKeys, depths: list[Depths]) -> list[Depths]:
        """``depths`` (what each replica's device cache announced) deepened by the steps each
        replica's tiers make reachable for the request of ``keys``, by existence only; the
        shared tier is asked once. ``depths`` itself when its prompt holds no whole chunk."""
        first = self.replicas[0].client
        restore = first.restore_chain(keys.prompt, keys.chain)
        if restore is None:
            return depths
        located = first.shared_presence(restore)
        return [
            Depths(d.kv_tokens, tiers.client.reachable_step(restore, (d.restorable, d.kv_tokens), located))
            for tiers, d in zip(self.replicas, depths)
        ]

    def store_prefix(self, replica: int, prompt_length: int, served: ServedTurn, keys: TurnKeys) -> None:
        """Publish what the turn computed beyond its hit: every chunk-aligned chunk end (the engine
        publishes those), the deepest aligned step of the prompt and of the turn end."""
        ends, turn = served.ends, served.turn
        if not ends:
            return
        computed, chunk = ends[-1], self.shared.setup.chunk_size
        wanted = {end for end in ends if end % chunk == 0}
        wanted |= {min(prompt_length, computed) // chunk * chunk, computed // chunk * chunk}
        steps = sorted(step for step in wanted if step > turn.hit_tokens)
        if steps:
            self.replicas[replica].store_prefix(turn.seq, steps, keys.chain, self.published)

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
