"""Which replica serves a request: round robin, or the best score with ties by round robin.

Owns no state. Scores are computed by the caller (``driver``) without changing any cache:

* ``kv-overlap``: whole-block KV tokens of the prompt the replica's device cache holds (what
  KV-aware routers of attention-only engines score; on a hybrid model KV without a checkpoint
  at its end serves no hit);
* ``restorable``: the deepest step with a checkpoint and all of its KV reachable: in the device
  cache, in the replica's host or disk tier, or in the shared tier;
* ``round-robin``: every replica scores alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridcache.errors import InvalidArgumentError

ROUTINGS = ("round-robin", "kv-overlap", "restorable")


def check_routing(name: object) -> str:
    if name not in ROUTINGS:
        raise InvalidArgumentError(f"unknown routing {name!r}; choose one of {', '.join(ROUTINGS)}")
    return name


def choose(scores: Sequence[int], turn_number: int) -> int:
    """The replica with the highest score; among equals the first at or after the round-robin
    position of this request, so equal scores spread requests as round robin does."""
    best = max(scores)
    count = len(scores)
    start = turn_number % count
    return next(i % count for i in range(start, start + count) if scores[i % count] == best)
