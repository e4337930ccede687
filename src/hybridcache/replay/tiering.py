"""The replay's side of the host, disk and shared tiers, as ``engine.tiering`` does it for the
engine, with virtual payloads: publish chunk-aligned prefixes a turn computed, restore the
deepest verified one before admission.

Owns, per replica (``ReplicaTiers``): its ``TieredStore`` with its own host and disk stores (the
shared store belongs to the run and is only borrowed), and the counters of what its restores
gained and moved. The device cache is changed only through ``CacheAdapter.adopt``.

Payloads are virtual. Every object carries a real header (the namespace fingerprint, the token
ids it covers, its own key, a payload checksum), so every tier hit is verified by the same code
the engine uses; its payload is a one-byte stand-in. What an object *stands for* is accounted
from the model profile: a KV chunk weighs ``kv_bytes_per_token * chunk`` bytes, a checkpoint one
profile state. Host and disk budgets are charged those nominal sizes (the stores' ``charge``),
the cost model is told them through ``TieredStore``'s ``size_hint``, and its
per-byte rates are fixed (no smoothing: the loopback's speed on stand-in bytes says nothing
about a real link).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.profiles import ModelProfile
from hybridcache.replay.adapter import CacheAdapter, Turn
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.backends.disk import DiskStore
from hybridcache.tiers.backends.host import HostMemoryStore
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE, NamespaceFingerprint
from hybridcache.tiers.keys import KeyChain, ObjectKey, ObjectKind
from hybridcache.tiers.tiered import RestoreCost, Restore, TieredStore

DEFAULT_TIER_CHUNK = DEFAULT_CHUNK_SIZE  # 256: the default, LMCache's chunk; see docs/tiers.md
DEFAULT_SHARED_BANDWIDTH = 12.5e9  # bytes/s: one 100 Gb/s NIC between a replica and the shared store
STAND_IN = {"virtual": np.zeros(1, dtype=np.uint8)}  # the payload every replay object carries
TIER_NAMES = ("host", "disk", "shared")


def _stand_in(*_: object) -> dict[str, np.ndarray]:
    return STAND_IN


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


class NominalSizes:
    """The bytes a replay object stands for, by kind (one chunk of KV; one profile state)."""

    def __init__(self, profile: ModelProfile, chunk_size: int) -> None:
        self.chunk = profile.kv_bytes_per_token * chunk_size
        self.checkpoint = profile.state_bytes
        self.kv_per_token = profile.kv_bytes_per_token

    def of_hint(self, kind: ObjectKind, tokens: int) -> int:
        """``TieredStore``'s size_hint: what an object of ``kind`` covering ``tokens`` carries."""
        return self.kv_per_token * tokens if kind is ObjectKind.KV_CHUNK else self.checkpoint

    def of_key(self, key: str, size: int) -> int:
        """A host or disk store's ``charge``: an object counts what it stands for, not ``size``."""
        return self.chunk if ObjectKey.from_name(key).kind is ObjectKind.KV_CHUNK else self.checkpoint


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


def restore_limit(prompt_length: int, chunk_size: int) -> int:
    """The deepest chunk-aligned step below the prompt's last token (one must be computed)."""
    return ((prompt_length - 1) // chunk_size) * chunk_size


class ReplicaTiers:
    def __init__(
        self,
        setup: TierSetup,
        sizes: NominalSizes,
        fingerprint: NamespaceFingerprint,
        recompute_s_per_token: float,
        device_flops: float,
        profile: ModelProfile,
        index: int,
    ) -> None:
        """``recompute_s_per_token``: the cost model's recompute rate; ``device_flops``: FLOP/s
        of the recompute estimate reported per restore (from the profile's FLOPs)."""
        self.fingerprint, self.sizes, self.profile, self.device_flops = fingerprint, sizes, profile, device_flops
        host = HostMemoryStore(setup.host_bytes, charge=sizes.of_key) if setup.host_bytes else None
        disk = None
        if setup.disk_bytes:
            disk = DiskStore(Path(setup.disk_root) / f"replica-{index}", setup.disk_bytes, charge=sizes.of_key)
        priors = RestoreCost()
        cost = RestoreCost(
            recompute_s_per_token=recompute_s_per_token,
            smoothing=0.0,  # fixed rates: the stand-in bytes' timings are not a link's
            s_per_byte={**priors.s_per_byte, "shared": 1 / setup.shared_bandwidth},
        )
        self.store = TieredStore(host=host, disk=disk, shared=setup.shared, cost=cost, size_hint=sizes.of_hint)
        self.counters: Counter[str] = Counter()
        self.restore_s = 0.0  # nominal seconds the adopted restores' reads take at the stated rates
        self.recompute_s = 0.0  # seconds recomputing the tokens they gained takes at the device's FLOP/s

    @property
    def local_stores(self) -> list[ObjectStore]:
        """This replica's own tiers (host, disk), not the borrowed shared one."""
        return [self.store.tiers[name] for name in ("host", "disk") if name in self.store.tiers]

    # --- write path ------------------------------------------------------------------------------

    def publish(self, tokens: np.ndarray, steps: list[int], published: set[str]) -> None:
        """Publish the checkpoints at ``steps`` (chunk-aligned, ascending) of ``tokens`` with
        their chunks, chunks first; every key put is added to ``published`` (the run's cleanup)."""
        if not steps:
            return
        chain = KeyChain(self.fingerprint, tokens[: steps[-1]])
        for step in steps:
            self.store.publish(chain, step, _stand_in, _stand_in)
            published.add(chain.checkpoint_key(step).name)
        published.update(chain.chunk_key(index).name for index in range(steps[-1] // chain.chunk_size))
        self.counters["published_steps"] += len(steps)

    # --- read path -------------------------------------------------------------------------------

    def restore(self, adapter: CacheAdapter, turn: Turn, prompt_chain: KeyChain | None) -> Restore | None:
        """Before admission: adopt the deepest verified restore beyond the device cache's hit;
        the Restore adopted, or None."""
        if prompt_chain is None:
            return None
        local_step, local_kv = adapter.cache.cached_prefix(turn.seq)
        if prompt_chain.num_chunks * prompt_chain.chunk_size <= local_step:
            return None
        before = Counter(self.store.counters)
        restore = self.store.find_restore(prompt_chain, local_step=local_step, local_kv_tokens=local_kv)
        moved = self._count_reads(before)
        if restore is None:
            return None
        gained = adapter.adopt(turn.seq.tokens[: restore.step], restore.step)
        if not gained:
            self.counters["adoptions_refused"] += 1
            return None
        counters = self.counters
        counters["restores"] += 1
        counters["remote_hit_tokens"] += gained
        for tier in restore.bytes_by_tier:
            counters[f"restores_using_{tier}"] += 1
        self.restore_s += self.store.cost.restore_s(moved)
        self.recompute_s += self.profile.prefill_flops(restore.step - gained, restore.step) / self.device_flops
        adapter.remeasure_branch(turn)
        return restore

    def _count_reads(self, before: Counter) -> dict[str, int]:
        """Bytes one lookup moved, by tier (nominal and actual; a read that then failed
        verification moved them too); returns the nominal ones."""
        after, nominal = self.store.counters, {}
        for tier in TIER_NAMES:
            chunks = after[f"{tier}_read_count_kv"] - before[f"{tier}_read_count_kv"]
            checkpoints = after[f"{tier}_read_count_ck"] - before[f"{tier}_read_count_ck"]
            nominal[tier] = chunks * self.sizes.chunk + checkpoints * self.sizes.checkpoint
            self.counters[f"{tier}_read_bytes_nominal"] += nominal[tier]
            self.counters[f"{tier}_read_bytes_actual"] += after[f"{tier}_bytes_read"] - before[f"{tier}_bytes_read"]
        return nominal

    def stats(self) -> dict:
        return {**self.counters, "store": self.store.stats()}

    def close(self) -> None:
        """Close this replica's own tiers; the shared store is the run's to close."""
        for store in self.local_stores:
            store.close()


def tier_report(setup: TierSetup, sizes: NominalSizes, replicas: list[ReplicaTiers]) -> dict:
    """The run's tier measurements, summed over replicas: restores and what they gained, bytes
    moved (nominal and actual), restore against recompute time, bytes stored, misses by reason."""
    counters: Counter[str] = Counter()
    store_counters: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    held = {"host": 0, "disk": 0}
    for replica in replicas:
        counters.update(replica.counters)
        store_counters.update(replica.store.counters)
        misses.update(replica.store.misses)
        for name in held:
            store = replica.store.tiers.get(name)
            held[name] += store.used_bytes if store is not None else 0
    restores = counters["restores"]
    moved_nominal = {tier: counters[f"{tier}_read_bytes_nominal"] for tier in TIER_NAMES}
    moved_actual = {tier: counters[f"{tier}_read_bytes_actual"] for tier in TIER_NAMES}
    stored_nominal = {
        tier: store_counters[f"{tier}_chunks_stored"] * sizes.chunk + store_counters[f"{tier}_checkpoints_stored"] * sizes.checkpoint
        for tier in ("host", "shared")
    }
    restore_s = sum(replica.restore_s for replica in replicas)
    recompute_s = sum(replica.recompute_s for replica in replicas)
    return {
        "tier_chunk": setup.chunk_size,
        "host_bytes": setup.host_bytes,
        "disk_bytes": setup.disk_bytes,
        "shared_bandwidth": setup.shared_bandwidth,
        "nominal_chunk_bytes": sizes.chunk,
        "nominal_checkpoint_bytes": sizes.checkpoint,
        "restores": restores,
        "restores_using": {tier: counters[f"restores_using_{tier}"] for tier in TIER_NAMES},
        "adoptions_refused": counters["adoptions_refused"],
        "published_steps": counters["published_steps"],
        "bytes_moved_nominal": moved_nominal,
        "bytes_moved_actual": moved_actual,
        "bytes_moved_per_hit_nominal": sum(moved_nominal.values()) / restores if restores else 0.0,
        "bytes_moved_per_hit_actual": sum(moved_actual.values()) / restores if restores else 0.0,
        "restore_s": restore_s,
        "recompute_s": recompute_s,
        "restore_over_recompute": restore_s / recompute_s if recompute_s else 0.0,
        "stored_bytes_nominal": stored_nominal,
        "stored_bytes_actual": {tier: store_counters[f"{tier}_bytes_written"] for tier in ("host", "shared")},
        "held_bytes_nominal": held,
        "misses": dict(misses),
        "store_counters": dict(store_counters),
    }
