"""Prefix-cache statistics.

Owns: the match counters (query and hit tokens, hits and misses by reason, hits shortened by
reason) and the eviction counters. Match counters take part in admission rollback (a rolled-back
match is undone with ``unrecord_match``); eviction counters do not, because an eviction done
while trying to admit a request really happened even when the admission is rolled back.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass, field


class MissReason(str, enum.Enum):
    """Why a match returned fewer tokens than the trie holds (or none at all)."""

    NOTHING_TO_MATCH = "nothing_to_match"  # the request has no complete block before its last token
    NO_CACHED_PREFIX = "no_cached_prefix"  # nothing beyond what the request computed is cached
    RECOMPUTE_OVERLAP = "recompute_overlap"  # dropped so the forward recomputes the overlap blocks
    MULTIMODAL_BOUNDARY = "multimodal_boundary"  # dropped so the suffix does not start inside a span
    ROUTED_EXPERTS = "routed_experts"  # dropped because cached blocks lack routed experts
    NO_CHECKPOINT = "no_checkpoint"  # hybrid model: KV blocks cached (or verified), but no usable checkpoint


@dataclass
class MatchCounters:
    query_tokens: int = 0
    hit_tokens: int = 0
    matches: int = 0
    hits: int = 0
    misses: Counter = field(default_factory=Counter)
    shortened: Counter = field(default_factory=Counter)


def _copy(counters: MatchCounters) -> MatchCounters:
    return dataclasses.replace(counters, misses=Counter(counters.misses), shortened=Counter(counters.shortened))


def _decrement(counter: Counter, key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


@dataclass
class PrefixCacheStats:
    match: MatchCounters = field(default_factory=MatchCounters)
    evicted_blocks: int = 0
    evicted_checkpoints: int = 0
    written_checkpoints: int = 0  # saves published (matchable once their forward's output is in)

    @property
    def hit_rate(self) -> float:
        query = self.match.query_tokens
        return self.match.hit_tokens / query if query > 0 else 0.0

    def record_hits(self, count: int, query: int, hit: int) -> None:
        """``record_match`` of ``count`` full hits (no miss reason) of ``query`` tokens asked
        and ``hit`` reused in all."""
        counters = self.match
        counters.matches += count
        counters.query_tokens += query
        counters.hit_tokens += hit
        counters.hits += count

    def record_match(self, query: int, hit: int, reason: MissReason | None) -> None:
        counters = self.match
        counters.matches += 1
        counters.query_tokens += query
        counters.hit_tokens += hit
        if hit > 0:
            counters.hits += 1
            if reason is not None:
                counters.shortened[reason.value] += 1
        else:
            counters.misses[(reason or MissReason.NO_CACHED_PREFIX).value] += 1

    def unrecord_match(self, query: int, hit: int, reason: MissReason | None) -> None:
        """Exact inverse of one ``record_match`` with the same arguments (a rolled-back match).

        Undoing a delta, rather than restoring a snapshot, keeps the counters of other matches
        recorded in between (transactions of several sequences can be open at once).
        """
        counters = self.match
        counters.matches -= 1
        counters.query_tokens -= query
        counters.hit_tokens -= hit
        if hit > 0:
            counters.hits -= 1
            if reason is not None:
                _decrement(counters.shortened, reason.value)
        else:
            _decrement(counters.misses, (reason or MissReason.NO_CACHED_PREFIX).value)

    def snapshot(self) -> MatchCounters:
        return _copy(self.match)

    def restore(self, snapshot: MatchCounters) -> None:
        self.match = _copy(snapshot)

    def reset(self) -> None:
        self.match = MatchCounters()
        self.evicted_blocks = 0
        self.evicted_checkpoints = 0
        self.written_checkpoints = 0

    def as_dict(self) -> dict:
        counters = self.match
        return {
            "query_tokens": counters.query_tokens,
            "hit_tokens": counters.hit_tokens,
            "hit_rate": self.hit_rate,
            "matches": counters.matches,
            "hits": counters.hits,
            "misses": dict(counters.misses),
            "shortened": dict(counters.shortened),
            "evicted_blocks": self.evicted_blocks,
            "evicted_checkpoints": self.evicted_checkpoints,
            "written_checkpoints": self.written_checkpoints,
        }
