"""The infinite-cache bound of a synthesized trace, computed exactly at token level.

Owns, during one call, a list of the earlier requests' indices kept in lexicographic order of
their tokens. For each request, the longest prefix its prompt shares with any earlier request
(prompt plus output) is the longer of its common prefixes with its two neighbours in that order
(the string of a sorted set sharing the longest prefix with a probe is adjacent to the probe's
insertion point). Every comparison is on the tokens themselves, so the bound is exact and
independent of the trie: no hashing at all.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import numpy as np

from hybridcache.errors import InvalidTypeError
from hybridcache.types import as_ordered
from hybridcache.workloads.records import TraceRequest


@dataclass(frozen=True)
class Bound:
    """Per-request shared-prefix lengths (capped at the prompt) and their token fraction."""

    shared_tokens: np.ndarray
    prompt_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return float(self.shared_tokens.sum()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        size = self.shared_tokens.size
        return float(np.count_nonzero(self.shared_tokens)) / size if size else 0.0


def _compare(probe: np.ndarray, other: np.ndarray) -> tuple[int, int]:
    """(sign of probe - other in lexicographic order, length of their common prefix)."""
    common = min(probe.size, other.size)
    differ = np.flatnonzero(probe[:common] != other[:common])
    if differ.size:
        at = int(differ[0])
        return (-1 if probe[at] < other[at] else 1), at
    return (probe.size > other.size) - (probe.size < other.size), common


def _insertion_point(order: list[int], requests: SequenceLike[TraceRequest], probe: np.ndarray) -> int:
    low, high = 0, len(order)
    while low < high:
        middle = (low + high) // 2
        sign, _ = _compare(probe, requests[order[middle]].tokens)
        if sign < 0:
            high = middle
        else:
            low = middle + 1
    return low


def infinite_cache_bound(requests: SequenceLike[TraceRequest]) -> Bound:
    """For every request, the tokens of its prompt's longest prefix that any earlier request's
    tokens (prompt and output) start with."""
    requests = as_ordered("requests", requests)
    if any(not isinstance(request, TraceRequest) for request in requests):
        raise InvalidTypeError("requests must be TraceRequest records (see synthesize)")
    order: list[int] = []
    shared = np.zeros(len(requests), dtype=np.int64)
    for position, request in enumerate(requests):
        probe = request.tokens
        at = _insertion_point(order, requests, probe)
        best = 0
        for neighbour in order[max(0, at - 1) : at + 1]:
            best = max(best, _compare(probe, requests[neighbour].tokens)[1])
        shared[position] = min(best, request.prompt_length)
        order.insert(at, position)
    return Bound(shared, int(sum(request.prompt_length for request in requests)))
