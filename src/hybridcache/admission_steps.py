"""How one admission is decided and taken: the match, the restore pin, the room a chunk needs
(a runtime state slot, its blocks, made by eviction), the allocation and the commit; the same
room for a running sequence's next chunk.

Owns nothing between calls: every structure belongs to the pools and the trie it is handed.
Check, then mutate: every reason an admission can be refused for is checked before its first
allocation (a need eviction could never meet before any slot is freed), so a refusal only
rolls back the tentative match, which is exact.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridcache.batch_admission import admission_of
from hybridcache.cache import CacheComponents
from hybridcache.errors import InvalidArgumentError
from hybridcache.prefix_cache.match_txn import MatchTxn
from hybridcache.protocol_args import called_back
from hybridcache.protocol_values import Admission, Refusal
from hybridcache.sequence import Sequence
from hybridcache.types import as_int, ceil_div

StopAt = Callable[[int], "int | None"]


class AdmissionSteps:
    def __init__(self, components: CacheComponents) -> None:
        self.pool, self.states, self.trie = components.pool, components.states, components.trie
        self.checkpoints = components.trie.checkpoints
        self.block_size = components.trie.block_size

    def admit(self, seq: Sequence, tokens: int, stop_at: StopAt | None) -> Admission:
        """``CacheProtocol.admit`` of a validated budget, without the producer's notes."""
        txn = self.trie.match(seq)
        pinned = seq.prefix_state.checkpoints.restore is None or self.checkpoints.pin_restore(seq)
        return self.admit_matched(seq, txn, pinned, tokens, stop_at)

    def admit_matched(self, seq: Sequence, txn: MatchTxn, pinned: bool, tokens: int, stop_at: StopAt | None) -> Admission:
        """The rest of an admission after the match ``txn`` and the restore pin (``pinned``:
        the pin held, or no restore selected)."""
        trie = self.trie
        if not pinned:
            trie.rollback(txn)  # the checkpoint vanished since the match; retry once without it
            txn = trie.match(seq)
            if seq.prefix_state.checkpoints.restore is not None and not self.checkpoints.pin_restore(seq):
                trie.rollback(txn)
                return Admission(refused=Refusal.RESTORE_GONE)
        start = seq.num_computed
        end = min(seq.num_tokens, start + tokens)
        hint = None if stop_at is None else self._stop_hint(txn, stop_at, start)
        if hint is not None and start < hint < end:
            end = hint
        needed = self.blocks_needed(seq, end)
        refused = None
        if end <= start:
            refused = Refusal.NOTHING_TO_RUN
        elif not self._could_fit(needed):  # never fits: refused before any state slot is freed
            refused = Refusal.NO_KV_BLOCKS
        elif not self._make_state_room():
            refused = Refusal.NO_STATE_SLOT
        elif not self.make_block_room(needed):
            refused = Refusal.NO_KV_BLOCKS
        if refused is not None:
            trie.rollback(txn)
            return Admission(refused=refused)
        self.pool.grow_table(seq, end, self.block_size)
        runtime_slot = self.states.allocate_runtime()
        trie.allocate(seq, upto=end)
        trie.commit(txn)
        return admission_of(seq, txn, start, end, runtime_slot)

    def _stop_hint(self, txn: MatchTxn, stop_at: StopAt, start: int) -> int | None:
        """``stop_at(start)`` as None or an int; on anything else, or an error, ``txn`` is
        rolled back first (its blocks, step, restore pin and counted hit given back)."""
        def hint() -> int | None:
            value = stop_at(start)
            return None if value is None else as_int("stop_at(start)", value)

        return called_back(hint, InvalidArgumentError, "stop_at", lambda: self.trie.rollback(txn))

    def extend(self, seq: Sequence, end: int) -> bool:
        """The blocks of a running sequence's chunk up to ``end`` (a validated count)."""
        if not self.make_block_room(self.blocks_needed(seq, end)):
            return False
        self.pool.grow_table(seq, end, self.block_size)
        self.trie.allocate(seq, upto=end)
        return True

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        return max(0, ceil_div(tokens, self.block_size) - seq.num_blocks)

    def _could_fit(self, needed: int) -> bool:
        """Whether evicting everything the cache holds could leave ``needed`` blocks free."""
        free = self.pool.num_free
        return needed <= free or needed - free <= self.trie.reclaimable_kv_blocks()

    def make_block_room(self, needed: int) -> bool:
        """Free blocks until ``needed`` are (a validated count); a need eviction could never
        meet evicts nothing."""
        free = self.pool.num_free
        if free >= needed or not self._could_fit(needed):
            return free >= needed
        self.trie.free_kv_blocks(needed - free)
        return self.pool.num_free >= needed

    def _make_state_room(self) -> bool:
        if self.states.num_free_runtime == 0:
            self.trie.free_state_slots(1)
        return self.states.num_free_runtime > 0
