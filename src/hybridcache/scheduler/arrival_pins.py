"""Restore pins taken when a request arrives, so that what it was routed for is still there when
it is admitted.

Owns: the checkpoint each waiting request pinned on arrival (by its sequence), and how many
pins gave way to pressure. A router predicts
a request's restore from the checkpoints its replica announced before the request was sent
(docs/routing.md). The request may then wait behind running ones, and a save of a request
running beside it could evict that checkpoint first: the replica would restore less than it
announced. Pinned at arrival, the checkpoint the admission would have restored then survives
until the admission, which releases this pin just before its own match (the match pins it
again, or a deeper one). Every pin here is released when its request is admitted, leaves the
queue, or when the cache needs the room pins hold (``release_all``: an admission refused for
room while nothing runs that could make room by finishing, a running request that cannot
extend); a pin is an aid to prediction, never a reason to refuse for good.
"""

from __future__ import annotations

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence


class ArrivalPins:
    def __init__(self, cache: CacheProtocol) -> None:
        self._cache = cache
        self._pinned: dict[int, tuple[Sequence, CheckpointRecord]] = {}
        self.given_way = 0  # pins released for the room they held (``release_all``)

    def __len__(self) -> int:
        return len(self._pinned)

    def pin(self, seq: Sequence) -> CheckpointRecord | None:
        """Pin the checkpoint ``seq``'s admission would restore now (None: none, or not hybrid)."""
        cache = self._cache
        if not cache.is_hybrid or not cache.enabled or id(seq) in self._pinned:
            return None
        cache.cached_prefix(seq)  # remembers on the sequence the search an admission's match repeats
        search = seq.prefix_state.trie.last_search
        record = None if search is None else search.record
        return None if record is None else self.repin(seq, record)

    def repin(self, seq: Sequence, record: CheckpointRecord) -> CheckpointRecord | None:
        """Pin ``record`` for ``seq`` again (after a refused admission), while it is published."""
        if not self._cache.checkpoints.hold_restore(seq, record):
            return None
        self._pinned[id(seq)] = (seq, record)
        return record

    def release(self, seq: Sequence) -> CheckpointRecord | None:
        """Release ``seq``'s arrival pin; the record it held (None: it held none)."""
        held = self._pinned.pop(id(seq), None)
        if held is None:
            return None
        self._cache.checkpoints.unpin_restore(seq)
        return held[1]

    def release_all(self) -> int:
        """Release every arrival pin (the cache needs the room); how many there were."""
        count = len(self._pinned)
        for seq, _ in list(self._pinned.values()):
            self.release(seq)
        self.given_way += count
        return count

    def check_invariants(self, waiting: list[Sequence]) -> None:
        """Every pin is held by a waiting sequence, on the record it selected."""
        waiting_ids = {id(seq) for seq in waiting}
        for key, (seq, record) in self._pinned.items():
            assert key in waiting_ids, "an arrival pin outlived its request's wait"
            refs = seq.prefix_state.checkpoints
            assert refs.restore is record and refs.restore_pinned, "an arrival pin is not the sequence's restore pin"
            assert record.is_published, "an arrival-pinned checkpoint was released"
