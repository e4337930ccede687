"""What the tiers of one replay run are and what their objects stand for: the setup every
replica gets (``TierSetup``), the run's namespace, the recompute rate the cost model is told,
and the stand-in payload every object carries. ``tier_run`` builds the tiers from these.

Owns no mutable state: every value here is frozen.

Payloads are virtual. Every object carries a real header (the namespace fingerprint, the token
ids it covers, its own key, a payload checksum), so every tier hit is verified by the same code
the engine uses; its payload is a one-byte stand-in. What an object *stands for* is accounted
from the model profile: a KV chunk weighs ``kv_bytes_per_token * chunk`` bytes, a checkpoint one
profile state. Host and disk budgets are charged those nominal sizes (the stores' ``charge``),
the cost model is told them (both through ``restore_cost.StandInSizes``, data rather than
callbacks, so the tiers never call back into the replay for a size), and its per-byte rates
are fixed (no smoothing: the loopback's speed on stand-in bytes says nothing about a real link).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.profiles import ModelProfile
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.fingerprint import DEFAULT_CHUNK_SIZE, NamespaceFingerprint
from hybridcache.tiers.payload import StandInPayloads
from hybridcache.tiers.restore_cost import StandInSizes

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
