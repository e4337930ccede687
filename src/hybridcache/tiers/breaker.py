"""A circuit breaker per tier: a store that timed out or could not be reached is skipped for a
back-off window instead of costing every request its timeout again.

Owns, per tier name: its run of consecutive failures, the end of its back-off window (when
open) and whether a probe is out, and the lock guarding them (one breaker may serve callers on
several threads).

Closed, every call goes through. ``failures_to_open`` consecutive timeouts or
unavailabilities (2 by default: one lost packet is not an outage) open the breaker for
``backoff_s``; calls inside the window are skipped. Once the window has passed, exactly one
call goes through as a probe while the others keep skipping: the probe's success closes the
breaker, its failure opens a new window. Time comes from ``clock`` (``time.monotonic``).
"""

from __future__ import annotations

import enum
import math
import threading
import time
from typing import Callable

from hybridcache.errors import InvalidArgumentError, InvalidTypeError

DEFAULT_BACKOFF_S = 30.0
DEFAULT_FAILURES_TO_OPEN = 2


class BreakerDecision(enum.Enum):
    """What the breaker says about one call."""

    CALL = "call"  # closed: go ahead
    PROBE = "probe"  # open, window passed: this call finds out whether the store is back
    SKIP = "skip"  # open: do not call the store


class CircuitBreaker:
    def __init__(
        self,
        backoff_s: float = DEFAULT_BACKOFF_S,
        failures_to_open: int = DEFAULT_FAILURES_TO_OPEN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)):
            raise InvalidTypeError(f"backoff_s must be a number of seconds, got {type(backoff_s).__name__}")
        if not math.isfinite(backoff_s) or backoff_s <= 0:
            raise InvalidArgumentError(f"backoff_s must be positive and finite, got {backoff_s}")
        if isinstance(failures_to_open, bool) or not isinstance(failures_to_open, int):
            raise InvalidTypeError("failures_to_open must be an int")
        if failures_to_open < 1:
            raise InvalidArgumentError(f"failures_to_open must be at least 1, got {failures_to_open}")
        if not callable(clock):
            raise InvalidTypeError("clock must be callable")
        self.backoff_s = float(backoff_s)
        self.failures_to_open = failures_to_open
        self._failures: dict[str, int] = {}
        self._clock = clock
        self._open_until: dict[str, float] = {}
        self._probing: set[str] = set()
        self._lock = threading.Lock()

    def admit(self, tier: str) -> BreakerDecision:
        with self._lock:
            until = self._open_until.get(tier)
            if until is None:
                return BreakerDecision.CALL
            if tier in self._probing or self._clock() < until:
                return BreakerDecision.SKIP
            self._probing.add(tier)
            return BreakerDecision.PROBE

    def answered(self, tier: str) -> None:
        """The store answered (even with an error of its own): close the breaker."""
        with self._lock:
            self._open_until.pop(tier, None)
            self._probing.discard(tier)
            self._failures.pop(tier, None)

    def failed(self, tier: str) -> bool:
        """The store timed out or could not be reached: count it, and open a new window once
        the run is long enough (at once after a probe). True when this opened a closed breaker."""
        with self._lock:
            self._failures[tier] = self._failures.get(tier, 0) + 1
            was_closed = tier not in self._open_until
            if was_closed and self._failures[tier] < self.failures_to_open:
                return False
            self._open_until[tier] = self._clock() + self.backoff_s
            self._probing.discard(tier)
            return was_closed

    def is_open(self, tier: str) -> bool:
        with self._lock:
            return tier in self._open_until

    def check_invariants(self) -> None:
        with self._lock:
            assert self._probing <= set(self._open_until), "a probe is out for a closed breaker"
