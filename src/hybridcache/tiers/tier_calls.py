"""Every call a ``TieredStore`` makes on its tiers: one batch call each, through the tier's
circuit breaker, counted.

Owns the counters and miss counts of one store (``<tier>_skipped``, ``<tier>_probes``, bytes read
and written, each miss by reason), the lock that makes ``+=`` on them atomic across threads, and
the one listener told of each change to the tiers' contents (``on_change``).
The stores own their contents and the :class:`~hybridcache.tiers.breaker.CircuitBreaker` its
windows; this module only routes calls through them. After a timeout or unavailability a tier is
skipped for a back-off window (counted ``<tier>_skipped``) and probed once per window
(``<tier>_probes``); a skipped call raises ``TierSkipped``, which never leaves ``tiers``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hybridcache.errors import InvalidTypeError, StoreError, StoreTimeoutError, StoreUnavailableError
from hybridcache.tiers.backends.base import ObjectStore, checked_timeout
from hybridcache.tiers.breaker import BreakerDecision, CircuitBreaker
from hybridcache.tiers.objects import check_auth_key
from hybridcache.tiers.verify import FetchMiss

TIER_NAMES = ("host", "disk", "shared")


class TierSkipped(StoreUnavailableError):
    """A call not made: the tier's breaker is open. Never leaves ``hybridcache.tiers``."""


@dataclass(frozen=True)
class TierAccess:
    """How a ``TieredStore`` calls its tiers: ``timeout`` bounds each batch call (None: each
    store's default), ``breaker`` skips a failing tier for a back-off window (None: a fresh
    30 s one per store), and ``deployment_key`` (16 to 64 bytes) seals every object written and
    is required of every object read (None: objects are checksummed, not sealed). Checked and
    normalized when built."""

    timeout: float | None = None
    breaker: CircuitBreaker | None = None
    deployment_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            object.__setattr__(self, "timeout", checked_timeout(self.timeout))
        if self.breaker is not None and not isinstance(self.breaker, CircuitBreaker):
            raise InvalidTypeError("breaker must be a CircuitBreaker")
        object.__setattr__(self, "deployment_key", check_auth_key(self.deployment_key))


def failure_reason(error: StoreError) -> FetchMiss:
    return FetchMiss.TIMEOUT if isinstance(error, StoreTimeoutError) else FetchMiss.UNAVAILABLE


class TierCalls:
    def __init__(self, tiers: Mapping[str, ObjectStore], breaker: CircuitBreaker, timeout: float | None) -> None:
        """``tiers`` by name, in tier order; ``timeout`` bounds each batch call (None: each
        store's default)."""
        self.tiers = dict(tiers)
        self.breaker = breaker
        self.timeout = timeout
        self.counters: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self._counting = threading.Lock()
        self.on_change: Callable[[str, list[str], list[str]], None] | None = None

    def changed(self, tier: str, stored: list[str], removed: list[str]) -> None:
        """Tell the listener (if any) that ``tier`` now holds ``stored`` and lost ``removed``."""
        if self.on_change is not None:
            self.on_change(tier, stored, removed)

    def count(self, name: str, amount: int = 1) -> None:
        with self._counting:
            self.counters[name] += amount

    def count_miss(self, reason: str) -> None:
        with self._counting:
            self.misses[reason] += 1

    def call(self, tier: str, operation: str, argument: list):
        """One batch call on ``tier`` through its breaker; raises StoreError (``TierSkipped``
        when the breaker is open), nothing else."""
        decision = self.breaker.admit(tier)
        if decision is BreakerDecision.SKIP:
            self.count(f"{tier}_skipped")
            raise TierSkipped(f"the {tier} tier is skipped: it failed within the last {self.breaker.backoff_s:g} s")
        if decision is BreakerDecision.PROBE:
            self.count(f"{tier}_probes")
        try:
            result = getattr(self.tiers[tier], operation)(argument, timeout=self.timeout)
        except (StoreTimeoutError, StoreUnavailableError):
            if self.breaker.failed(tier):
                self.count(f"{tier}_breaker_opened")
            raise
        except StoreError:
            self.breaker.answered(tier)
            raise
        self.breaker.answered(tier)
        return result

    def locate(self, names: list[str], tiers: list[str]) -> tuple[dict[str, list[str]], dict[str, FetchMiss]]:
        """Which of ``tiers`` hold each name (one batch ``exists`` per tier), and the tiers
        that could not answer, with why (a failing or skipped tier holds nothing, counted)."""
        where: dict[str, list[str]] = {name: [] for name in names}
        failed: dict[str, FetchMiss] = {}
        for tier in tiers:
            try:
                present = self.call(tier, "exists", names)
            except StoreError as error:
                self.count(f"{tier}_exists_failed")
                failed[tier] = failure_reason(error)
                continue
            for name, here in zip(names, present):
                if here:
                    where[name].append(tier)
        return where, failed

    def present_anywhere(self, names: list[str]) -> list[bool]:
        """Which names some tier holds; a tier that cannot answer counts as holding them all
        (never drop what might still serve)."""
        found = [False] * len(names)
        for tier in self.tiers:
            try:
                here = self.call(tier, "exists", names)
            except StoreError:
                return [True] * len(names)
            found = [seen or present for seen, present in zip(found, here)]
        return found

    def check_invariants(self) -> None:
        self.breaker.check_invariants()
        assert set(self.tiers) <= set(TIER_NAMES), "an unknown tier name"
        with self._counting:
            assert all(value >= 0 for value in self.counters.values()), "a counter went negative"
            assert all(value > 0 for value in self.misses.values()), "a miss reason counted zero times"
