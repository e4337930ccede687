"""The restore cost model: is reading a prefix from the tiers faster than recomputing it?

Owns one ``RestoreCost``'s running estimates (seconds per byte and per call of each tier, and
recompute seconds per token) and one ``ObjectSizes``' record of the objects read (count and
bytes per kind, under its lock); ``TieredStore``'s restore path consults and feeds both.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers.keys import Expectation, ObjectKey, ObjectKind


@dataclass(frozen=True)
class StandInSizes:
    """What objects whose stored payloads are stand-ins weigh: ``kv_bytes_per_token`` of KV
    per token (a chunk of ``chunk_size`` tokens), ``checkpoint_bytes`` per checkpoint. The cost
    model reads them (``of``), a host or disk store charges them (``charge``)."""

    kv_bytes_per_token: int
    checkpoint_bytes: int
    chunk_size: int

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "checkpoint_bytes", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "chunk_size"):
                raise InvalidArgumentError(f"{name} must be a non-negative int (chunk_size >= 1), got {value!r}")

    @property
    def chunk(self) -> int:
        return self.kv_bytes_per_token * self.chunk_size

    def of(self, kind: ObjectKind, tokens: int) -> int:
        """The bytes an object of ``kind`` covering ``tokens`` tokens stands for."""
        return self.kv_bytes_per_token * tokens if kind is ObjectKind.KV_CHUNK else self.checkpoint_bytes

    def charge(self, key: str, size: int) -> int:
        """A store's ``charge``: the object named ``key`` counts what it stands for, not ``size``."""
        return self.chunk if ObjectKey.from_name(key).kind is ObjectKind.KV_CHUNK else self.checkpoint_bytes


@dataclass
class RestoreCost:
    """A measured cost model: seconds per byte and per batch call of each tier (exponential
    averages of the reads done so far, from stated priors), against recompute seconds per token
    (the caller's measurement). ``smoothing`` is the weight of the newest observation.
    ``stand_in``: the sizes objects stand for when their stored payloads are stand-ins (the
    replay); None: the mean size of the objects read so far."""

    recompute_s_per_token: float = 0.0  # 0: unknown, never skip
    smoothing: float = 0.2
    s_per_byte: dict[str, float] = field(
        default_factory=lambda: {"host": 1 / 10e9, "disk": 1 / 2e9, "shared": 1 / 1e9}
    )
    s_per_call: dict[str, float] = field(default_factory=lambda: {"host": 1e-6, "disk": 1e-4, "shared": 5e-4})
    recovery: float = 0.5  # each skipped restore moves the estimates this far back toward the priors
    stand_in: StandInSizes | None = None

    def __post_init__(self) -> None:
        if self.stand_in is not None and not isinstance(self.stand_in, StandInSizes):
            raise InvalidTypeError(f"stand_in must be StandInSizes, got {type(self.stand_in).__name__}")
        if isinstance(self.recovery, bool) or not isinstance(self.recovery, (int, float)) or not 0 < self.recovery <= 1:
            raise InvalidArgumentError(f"recovery must lie in (0, 1], got {self.recovery!r}")
        self._priors = (dict(self.s_per_byte), dict(self.s_per_call))

    def recover(self) -> None:
        """A restore was skipped as too slow: decay toward the priors. Skipping means no read
        is measured, so without this one stall would keep a tier switched off for good; with
        it, a tier is tried again after a few skips, and a slow one is measured slow again."""
        for measured, prior in zip((self.s_per_byte, self.s_per_call), self._priors):
            for tier, value in prior.items():
                measured[tier] += self.recovery * (value - measured[tier])

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """One batch read of ``nbytes`` from ``tier`` took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        latency = self.s_per_call[tier]
        per_byte = max(seconds - latency, seconds / 2) / nbytes
        weight = self.smoothing
        self.s_per_byte[tier] += weight * (per_byte - self.s_per_byte[tier])
        self.s_per_call[tier] += weight * (min(latency, seconds) - latency)

    def observe_recompute(self, tokens: int, seconds: float) -> None:
        """A forward computed ``tokens`` tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        measured = seconds / tokens
        if not self.recompute_s_per_token:
            self.recompute_s_per_token = measured
        else:
            self.recompute_s_per_token += self.smoothing * (measured - self.recompute_s_per_token)

    def restore_s(self, bytes_by_tier: Mapping[str, int]) -> float:
        return sum(self.s_per_call[t] + n * self.s_per_byte[t] for t, n in bytes_by_tier.items() if n)

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.recompute_s_per_token

    def worth_restoring(self, bytes_by_tier: Mapping[str, int], tokens: int) -> bool:
        return not self.recompute_s_per_token or self.restore_s(bytes_by_tier) < self.recompute_s(tokens)


class ObjectSizes:
    """The bytes a stored object is expected to carry: what it stands for when the caller's
    payloads are stand-ins (``StandInSizes``, the replay), else the mean of the objects of its
    kind read so far (before any read: 4 bytes per token of a chunk, the token ids the headers
    alone carry)."""

    def __init__(self, stand_in: StandInSizes | None = None) -> None:
        self.stand_in = stand_in
        self._count: Counter[ObjectKind] = Counter()
        self._bytes: Counter[ObjectKind] = Counter()
        self._lock = threading.Lock()

    def observe(self, kind: ObjectKind, nbytes: int) -> None:
        """One object of ``kind`` was read and verified: ``nbytes`` long."""
        with self._lock:
            self._count[kind] += 1
            self._bytes[kind] += nbytes

    def expected(self, expectation: Expectation, chunk_size: int) -> int:
        kind = expectation.key.kind
        if self.stand_in is not None:
            return self.stand_in.of(kind, expectation.step - expectation.start)
        with self._lock:
            count = self._count[kind]
            return self._bytes[kind] // count if count else 4 * chunk_size

    def by_tier(self, needed: list[Expectation], where: Mapping[str, list[str]], chunk_size: int) -> dict[str, int]:
        """The bytes each tier would serve for ``needed``, each object from the first tier
        ``where`` names for it."""
        estimate: Counter[str] = Counter()
        for expectation in needed:
            estimate[where[expectation.key.name][0]] += self.expected(expectation, chunk_size)
        return dict(estimate)

    def check_invariants(self) -> None:
        with self._lock:
            assert set(self._bytes) <= set(self._count), "bytes read of a kind never counted"
            assert all(value >= 0 for value in self._bytes.values()), "negative bytes read"
