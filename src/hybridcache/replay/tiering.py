"""The replay's side of the tier client (``hybridcache.tiers.client``), the one the engine
uses, with virtual payloads: the client restores the deepest verified prefix before admission
and publishes the chunk-aligned prefixes a turn computed; this module supplies its stand-ins.

Owns, per replica (``ReplicaTiers``): its ``TieredStore`` with its own host and disk stores (the
shared store belongs to the run and is only borrowed), its ``TierClient`` (which owns the
restore and publish statistics), and what its lookups moved and would cost. The device cache is
changed only through ``CacheAdapter.adopt``.

Payloads are virtual. Every object carries a real header (the namespace fingerprint, the token
ids it covers, its own key, a payload checksum), so every tier hit is verified by the same code
the engine uses; its payload is a one-byte stand-in. What an object *stands for* is accounted
from the model profile: a KV chunk weighs ``kv_bytes_per_token * chunk`` bytes, a checkpoint one
profile state. Host and disk budgets are charged those nominal sizes (the stores' ``charge``),
the cost model is told them (both through ``restore_cost.StandInSizes``, data rather than
callbacks, so the tiers never call back into the replay for a size), and its per-byte rates are fixed (no smoothing: the loopback's speed on stand-in bytes says nothing
about a real link).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter, Turn
from hybridcache.sequence import Sequence
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.client import DeviceAdoption, TierClient
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE, NamespaceFingerprint
from hybridcache.tiers.payload import StandInPayloads
from hybridcache.tiers.restore_cost import RestoreCost, StandInSizes
from hybridcache.tiers.restore_values import Restore
from hybridcache.tiers.tier_calls import TIER_NAMES
from hybridcache.tiers.tiered import TieredStore

DEFAULT_TIER_CHUNK = DEFAULT_CHUNK_SIZE  # 256: the default, LMCache's chunk; see docs/tiers.md
DEFAULT_SHARED_BANDWIDTH = 12.5e9  # bytes/s: one 100 Gb/s NIC between a replica and the shared store
STAND_INS = StandInPayloads({"virtual": np.zeros(1, dtype=np.uint8)})  # every replay object's payload


@dataclass(frozen=True)
class TierSetup:
    """Tiers every replica of one run gets: ``host_bytes`` and ``disk_bytes`` of its own (0: none,
    nominal bytes), the run's ``shared`` store (None: no sharing), objects of ``chunk_size``
    tokens, the link to the shared store at ``shared_bandwidth`` bytes/s."""

    chunk_size: int = DEFAULT_TIER_CHUNK
    host_bytes: int = 0
    disk_bytes: int = 0
    shared: ObjectStore | None = None
    shared_name: str = "none"
    shared_bandwidth: float = DEFAULT_SHARED_BANDWIDTH
    disk_root: Path | None = None  # the run's scratch directory; required with disk_bytes

    def __post_init__(self) -> None:
        for name in ("chunk_size", "host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
        if self.chunk_size < 1:
            raise InvalidArgumentError(f"the tier chunk must be >= 1 token, got {self.chunk_size}")
        if self.shared is not None and not isinstance(self.shared, ObjectStore):
            raise InvalidTypeError("the shared tier must be an ObjectStore")
        if (self.shared is None) != (self.shared_name == "none"):
            raise InvalidArgumentError("name the shared tier exactly when one is given")
        if self.disk_bytes and not self.host_bytes:
            raise InvalidArgumentError("a disk tier needs a host tier above it: it holds host demotions")
        if self.disk_bytes and self.disk_root is None:
            raise InvalidArgumentError("a disk tier needs a scratch directory (disk_root)")
        if isinstance(self.shared_bandwidth, bool) or not self.shared_bandwidth > 0:
            raise InvalidArgumentError(f"the shared link bandwidth must be > 0, got {self.shared_bandwidth!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.shared is not None)


def replay_fingerprint(profile: ModelProfile, block_size: int, chunk_size: int, run_id: str) -> NamespaceFingerprint:
    """The run's namespace. ``run_id`` is unique per run, so runs sharing one store never hit
    each other's objects (and a run's cleanup removes only its own)."""
    return NamespaceFingerprint(
        model_id=profile.name,
        weights_revision=f"replay-{run_id}",
        dtype="virtual",
        kv_layout=f"virtual:{profile.kv_bytes_per_token}B/token",
        state_layout=f"virtual:{profile.state_bytes}B",
        block_size=block_size,
        chunk_size=chunk_size,
    )


@dataclass(frozen=True)
class RecomputeRate:
    """What recomputing costs in the replay's model: ``device_flops`` FLOP/s sustained, and
    ``s_per_token``, the mean per-token cost of a mean prompt (the cost model's recompute rate)."""

    device_flops: float
    s_per_token: float

    @classmethod
    def of(cls, profile: ModelProfile, device_tflops: float, mean_prompt: float) -> RecomputeRate:
        tokens = max(1, round(mean_prompt))
        flops = device_tflops * 1e12
        return cls(flops, profile.prefill_flops(0, tokens) / tokens / flops)


@dataclass(frozen=True)
class RunTiers:
    """What every replica's tiers of one run share: the setup, nominal sizes, namespace,
    recompute rate and profile."""

    setup: TierSetup
    sizes: StandInSizes
    fingerprint: NamespaceFingerprint
    rate: RecomputeRate
    profile: ModelProfile


class ReplayDevice:
    """A replica's device cache (its ``CacheAdapter``) as a ``TierDevice``: publishes read
    stand-ins, adoptions write nothing."""

    def __init__(self, adapter: CacheAdapter) -> None:
        self.adapter = adapter

    def cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        return self.adapter.cache.cached_prefix(seq)

    def adopt(self, prefix: Sequence, restore: Restore) -> DeviceAdoption:
        return DeviceAdoption(self.adapter.adopt(prefix.tokens, restore.step))

    def payloads(self, seq: Sequence, slot: int) -> StandInPayloads:
        return STAND_INS


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
        self.client = TierClient(self.store, run.fingerprint, ReplayDevice(adapter))
        self.moved = MovedBytes()
        self.restore_s = 0.0  # nominal seconds the adopted restores' reads take at the stated rates
        self.recompute_s = 0.0  # seconds recomputing the tokens they gained takes at the device's FLOP/s

    @property
    def local_stores(self) -> list[ObjectStore]:
        """This replica's own tiers (host, disk), not the borrowed shared one."""
        return [self.store.tiers[name] for name in ("host", "disk") if name in self.store.tiers]

    def store_prefix(self, seq: Sequence, steps: list[int], published: set[str]) -> None:
        """Publish the checkpoints at ``steps`` (chunk-aligned, ascending) of ``seq`` with their
        chunks; every key put is added to ``published`` (the run's cleanup)."""
        chain = self.client.store_prefix(seq, steps)
        if chain is None:
            return
        published.update(chain.checkpoint_names[step] for step in steps)
        published.update(chain.chunk_names[: steps[-1] // chain.chunk_size])

    def adopt_prefix(self, turn: Turn) -> Restore | None:
        """Before admission: adopt the deepest verified restore beyond the device cache's hit
        (the tier client's); the Restore adopted, or None."""
        before = Counter(self.store.counters)
        outcome = self.client.adopt_prefix(turn.seq)
        moved = self._count_reads(before)
        restore = outcome.restore
        if restore is None:
            return None
        self.restore_s += self.store.cost.restore_s(moved)
        flops = self.run.profile.prefill_flops(restore.step - outcome.gained, restore.step)
        self.recompute_s += flops / self.run.rate.device_flops
        self.adapter.remeasure_branch(turn)
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
