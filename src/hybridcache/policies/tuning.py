"""Marconi's weight autotuning: when to tune and which weight to keep.

Owns (``AlphaTuner``): the tuning schedule of one cache: whether an eviction has happened, the
request count then, the window of requests recorded since, and the weights tried.

Marconi tunes alpha (the weight of FLOP efficiency against recency) by replaying recent history:
after the first eviction, once a bootstrap window of ``window_factor`` times the requests seen
so far has arrived (5x in the paper's setup), the window is replayed from a snapshot of the
cache taken at the first eviction once per candidate weight, and the weight with the most hit
tokens is kept. The replay itself belongs to whoever drives requests (``hybridcache.replay``);
this module only decides when, and over which weights. The grid is coarser than the paper's
(0, 0.1, ..., 2.0) to bound the tuning cost: each weight costs one replay of the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.errors import InvalidArgumentError

DEFAULT_GRID = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass
class AlphaTuner:
    window_factor: int = 5
    grid: tuple[float, ...] = DEFAULT_GRID
    seen: int = 0  # requests served
    snapshot_at: int | None = None  # requests served when the first eviction happened
    tuned: bool = False
    window: list = field(default_factory=list)
    results: dict[float, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window_factor < 1 or not self.grid or any(not alpha >= 0 for alpha in self.grid):
            raise InvalidArgumentError("window_factor must be >= 1 and the grid non-empty, weights >= 0")

    def wants_snapshot(self, evicted: bool) -> bool:
        """True once, at the first request after which something was evicted."""
        return evicted and self.snapshot_at is None and not self.tuned

    def took_snapshot(self) -> None:
        self.snapshot_at = self.seen

    def record(self, request) -> None:
        """A request was served; kept when it falls in the bootstrap window."""
        self.seen += 1
        if self.snapshot_at is not None and not self.tuned:
            self.window.append(request)

    def due(self) -> bool:
        """The bootstrap window is complete: replay it now."""
        if self.snapshot_at is None or self.tuned:
            return False
        return len(self.window) >= self.window_factor * max(1, self.snapshot_at)

    def choose(self, hits_by_alpha: dict[float, int]) -> float:
        """Keep the weight with the most hit tokens (the smallest on ties); tuning is over."""
        if not hits_by_alpha:
            raise InvalidArgumentError("nothing was replayed")
        self.results = dict(hits_by_alpha)
        self.tuned = True
        self.window = []
        return max(sorted(hits_by_alpha), key=lambda alpha: hits_by_alpha[alpha])
