"""Held-out halves of a trace: fit on the first half, report on the second.

Owns no state: returns new immutable request records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceLike

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.types import as_ordered
from hybridcache.workloads.records import TraceRequest

HALVES = ("first", "second")


def half(requests: SequenceLike[TraceRequest], which: str) -> tuple[TraceRequest, ...]:
    """The first or second half of ``requests`` (synthesized from the whole trace, so a turn of
    the second half keeps the history an earlier turn gave it), renumbered from 0 and with
    continuations into the other half dropped: a replay of it starts from an empty cache."""
    if which not in HALVES:
        raise InvalidArgumentError(f"the half must be one of {HALVES}, got {which!r}")
    requests = as_ordered("requests", requests)
    if not all(isinstance(request, TraceRequest) for request in requests):
        raise InvalidTypeError("requests must be TraceRequest records (see synthesize)")
    middle = len(requests) // 2
    start, end = (0, middle) if which == "first" else (middle, len(requests))
    return tuple(
        dataclasses.replace(r, index=r.index - start,
                            continues=r.continues - start if r.continues is not None and r.continues >= start else None)
        for r in requests[start:end]
    )
