"""Restore pins that keep what a router predicted until its request is admitted: taken when a
request arrives, and, for the checkpoint a finished request saved at its end, held until the
conversation's next turn has had time to arrive.

Owns: the checkpoint each waiting request pinned on arrival (by its sequence), the turn-end
checkpoints held for a next turn (by the finished sequence holding each, with the schedules
left), and how many pins gave way to pressure. A router predicts a request's restore from the
checkpoints its replica announced before the request was sent (docs/routing.md).

* *Arrival pins.* The request may wait behind running ones, and a save of a request running
  beside it could evict that checkpoint first: the replica would restore less than it
  announced. Pinned at arrival, the checkpoint the admission would have restored then survives
  until the admission, which releases this pin just before its own match (the match pins it
  again, or a deeper one).
* *Turn-end holds.* A pin at arrival comes too late for the checkpoint a conversation's last
  turn saved as it finished: the answer leaves, and the engine schedules its next step at
  once, while the next turn is still on its way back (client, router, the replica's queue:
  at least one round trip, and it is added only between steps). With few checkpoint slots a
  save in that schedule evicted the state the router had just routed the next turn for
  (traced in docs/routing.md, sixth pass). So the finished sequence keeps its turn-end
  checkpoint pinned for ``TURN_HOLD_SCHEDULES`` schedules, or until an arrival pins it.

Every pin here is released when its request is admitted or leaves the queue (a hold: when an
arrival pins its checkpoint, or its schedules run out), or when the cache needs the room pins
hold (``release_all``: an admission refused for room while nothing runs that could make room
by finishing, a running request that cannot extend); a pin is an aid to prediction, never a
reason to refuse for good.
"""

from __future__ import annotations

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord
from hybridcache.protocol import CacheProtocol
from hybridcache.sequence import Sequence

TURN_HOLD_SCHEDULES = 2  # the schedules after a turn's end that cannot evict the state it saved


class ArrivalPins:
    def __init__(self, cache: CacheProtocol) -> None:
        self._cache = cache
        self._pinned: dict[int, tuple[Sequence, CheckpointRecord]] = {}
        self._held: dict[int, tuple[Sequence, CheckpointRecord, int]] = {}  # finished seq -> turn end, schedules left
        self.given_way = 0  # pins released for the room they held (``release_all``)

    def __len__(self) -> int:
        return len(self._pinned)

    def pin(self, seq: Sequence) -> CheckpointRecord | None:
        """Pin the checkpoint ``seq``'s admission would restore now (None: none, or not hybrid);
        a turn-end hold on it is then no longer needed."""
        cache = self._cache
        if not cache.is_hybrid or not cache.enabled or id(seq) in self._pinned:
            return None
        cache.cached_prefix(seq)  # remembers on the sequence the search an admission's match repeats
        search = seq.prefix_state.trie.last_search
        record = None if search is None else search.record
        pinned = None if record is None else self.repin(seq, record)
        if pinned is not None:
            for key in [key for key, (_, held, _) in self._held.items() if held is pinned]:
                self._drop_hold(key)
        return pinned

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

    def hold_turn_end(self, seq: Sequence, record: CheckpointRecord | None) -> bool:
        """Hold ``record``, the checkpoint the finished (and freed) ``seq`` saved at its end, for
        the next ``TURN_HOLD_SCHEDULES`` schedules; False when there is none to hold."""
        cache = self._cache
        if record is None or not cache.is_hybrid or not cache.enabled or not record.is_published:
            return False
        if not cache.checkpoints.hold_restore(seq, record):
            return False
        self._held[id(seq)] = (seq, record, TURN_HOLD_SCHEDULES)
        return True

    def schedule_begins(self) -> None:
        """A schedule begins: holds whose schedules ran out are released, the rest count one."""
        for key, (seq, record, left) in list(self._held.items()):
            if left == 0:
                self._drop_hold(key)
            else:
                self._held[key] = (seq, record, left - 1)

    def _drop_hold(self, key: int) -> None:
        seq, _, _ = self._held.pop(key)
        self._cache.checkpoints.unpin_restore(seq)

    def holders(self) -> list[Sequence]:
        """The finished sequences holding a turn-end checkpoint (their pins are live)."""
        return [seq for seq, _, _ in self._held.values()]

    def release_holds(self) -> int:
        """Release every turn-end hold (the cache is cleared); how many there were."""
        count = len(self._held)
        for key in list(self._held):
            self._drop_hold(key)
        return count

    def release_all(self) -> int:
        """Release every arrival pin and turn-end hold (the cache needs the room); how many."""
        count = len(self._pinned) + self.release_holds()
        for seq, _ in list(self._pinned.values()):
            self.release(seq)
        self.given_way += count
        return count

    def check_invariants(self, waiting: list[Sequence]) -> None:
        """Every arrival pin is held by a waiting sequence, every hold by a finished one, each on
        the record it selected, published."""
        waiting_ids = {id(seq) for seq in waiting}
        for key, (seq, record) in self._pinned.items():
            assert key in waiting_ids, "an arrival pin outlived its request's wait"
            self._check_pin(seq, record)
        for key, (seq, record, left) in self._held.items():
            assert key not in waiting_ids and 0 <= left <= TURN_HOLD_SCHEDULES, "a turn-end hold on a waiting request"
            assert seq.num_blocks == 0, "a turn-end hold by a sequence that was not freed"
            self._check_pin(seq, record)

    @staticmethod
    def _check_pin(seq: Sequence, record: CheckpointRecord) -> None:
        refs = seq.prefix_state.checkpoints
        assert refs.restore is record and refs.restore_pinned, "a pin here is not the sequence's restore pin"
        assert record.is_published, "a pinned checkpoint was released"
