"""Arrivals: lmdeploy's ``SequenceManager``, announcing to the scheduler's trie each sequence
that starts waiting for admission, and each sequence lmdeploy removes.

Owns nothing: the subclass keeps lmdeploy's maps unchanged and only, after lmdeploy's own
bookkeeping, hands the sequence to ``LmdeployBlockTrie.sequence_waiting`` or
``sequence_removed`` (lmdeploy removes a sequence only after freeing its blocks and state). lmdeploy's
``Scheduler`` builds its manager by the name ``SequenceManager`` in its module, so ``install``
rebinds that name as it rebinds ``BlockTrie``. A sequence waits when it arrives
(``add_sequence``), when a stopped one gets a new turn and when a running one is evicted
(``update_sequence_status`` to ``WAITING``): every way into the prefill step's match.
"""

from __future__ import annotations

from hybridcache.integrations.lmdeploy.trie import LmdeployBlockTrie

_made: dict[type, type] = {}


class _Announcing:
    def add_sequence(self, seq: object) -> None:
        super().add_sequence(seq)
        _announce(seq)

    def update_sequence_status(self, seq: object, new_status: object) -> None:
        super().update_sequence_status(seq, new_status)
        if getattr(new_status, "name", None) == "WAITING":
            _announce(seq)

    def remove_sequence(self, seq: object) -> None:
        super().remove_sequence(seq)
        trie = _trie_of(seq)
        if trie is not None:
            trie.sequence_removed(seq)


def _trie_of(seq: object) -> LmdeployBlockTrie | None:
    trie = getattr(getattr(seq.session, "scheduler", None), "block_trie", None)
    return trie if isinstance(trie, LmdeployBlockTrie) else None


def _announce(seq: object) -> None:
    trie = _trie_of(seq)
    if trie is not None:
        trie.sequence_waiting(seq)


def announcing_manager(manager_class: type) -> type:
    """``manager_class`` (lmdeploy's ``SequenceManager``) announcing waiting sequences; one
    class per base, so installing twice rebinds the same class."""
    made = _made.get(manager_class)
    if made is None:
        made = _made[manager_class] = type("AnnouncingSequenceManager", (_Announcing, manager_class), {})
    return made
