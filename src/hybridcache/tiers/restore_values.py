"""The values a tier lookup and a publish return: a verified ``Restore``, the outcome of one
``lookup_prefix`` with its miss reason, and a ``PublishReport``.

Owns no mutable state: every value here is frozen. (One lookup's working state is a
:class:`~hybridcache.tiers.restore_attempt.RestoreAttempt`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridcache.tiers.objects import StoredObject

SLOWER_THAN_RECOMPUTE = "slower_than_recompute"


@dataclass(frozen=True)
class Restore:
    """A verified restore: the checkpoint at ``step`` and the chunks ``[first_chunk, step/C)``
    (by index), the bytes read from each tier, and the tier each object came from."""

    step: int
    first_chunk: int
    checkpoint: StoredObject
    chunks: Mapping[int, StoredObject]
    bytes_by_tier: Mapping[str, int]
    checkpoint_tier: str = ""
    chunk_tiers: Mapping[int, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_tier.values())

    def tokens_by_tier(self, start: int, chunk_size: int) -> dict[str, int]:
        """The tokens of ``[start, step)`` by the tier that served them: a token's KV chunk's
        tier, or the checkpoint's where the device already held its KV (no chunk was read)."""
        counts: Counter[str] = Counter()
        for index in range(start // chunk_size, -(-self.step // chunk_size)):
            low, high = max(start, index * chunk_size), min(self.step, (index + 1) * chunk_size)
            if high > low:
                counts[self.chunk_tiers.get(index, self.checkpoint_tier)] += high - low
        return dict(counts)


EVICTED = "evicted"  # a checkpoint this process published is gone from every tier


@dataclass(frozen=True)
class RestoreLookup:
    """What one ``lookup_prefix`` found: the restore, or (``restore`` None) why the deepest
    step the tiers were expected to serve was not served: a ``FetchMiss`` value,
    ``EVICTED`` or ``SLOWER_THAN_RECOMPUTE``; ``miss`` None when no tier ever held a deeper
    step as far as this process knows."""

    restore: Restore | None
    miss: str | None = None


@dataclass(frozen=True)
class PublishReport:
    """What one ``store_prefix`` did, per tier: chunks newly stored, and whether the checkpoint is
    stored there (False: a chunk was refused or the store failed, so it was never put)."""

    chunks_stored: Mapping[str, int]
    checkpoint_stored: Mapping[str, bool]
    bytes_written: Mapping[str, int]
