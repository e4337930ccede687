"""Shadow sequences: one hybridcache ``Sequence`` per lmdeploy ``SchedulerSequence``.

Owns: the shadows (kept on the lmdeploy sequence, so they live and die with it), the open
match transaction of each, what each last verified of its lmdeploy sequence's tokens, and the
registry of live lmdeploy sequences the trie has seen.

A shadow mirrors what the cache reads of its lmdeploy sequence: the tokens lmdeploy may
cache (``history_cache[:num_valid_ids]``), the computed step (``num_history_ids``), the
adapter, the multimodal spans (identity), the routed-expert rows, the recompute overlap and
the block table (``logical_blocks``). The shadow's table entries are the lmdeploy
sequence's own allocator references (the trie runs with one reference per block per holder),
so when lmdeploy frees a sequence's blocks itself (rollback of a refused admission, finish,
eviction) the shadow forgets its table without dropping references, and starts over.

A shadow is built (or extended) when its sequence starts waiting for admission (``prepare``,
called from ``arrivals``), as lmdeploy copies the prompt into the sequence itself, so the
scheduler step reads no prompt it has not seen. ``prepare`` touches no trie state; the first
sync after it trusts the tokens it verified while lmdeploy's token buffer is the same object
of the same length (``TokenStamp``), and every later sync compares the uncomputed tail.
"""

from __future__ import annotations

import weakref

import numpy as np

from hybridcache.prefix_cache.match_txn import MatchTxn
from hybridcache.sequence import Sequence
from hybridcache.types import NO_NODE, MultimodalSpan

_ATTRIBUTE = "_hybridcache_shadow"
_LIST_COMPARE_TOKENS = 64  # below this, comparing Python lists beats NumPy's call overhead


class TokenStamp:
    """What identifies lmdeploy's token buffer as ``prepare`` verified it: the history object,
    the array behind it (lmdeploy reallocates it to grow) and the counts. Held by reference,
    so no freed object's id can be mistaken for it."""

    __slots__ = ("history", "buffer", "length", "num_valid", "num_history")

    def __init__(self, lmd_seq: object) -> None:
        self.history = lmd_seq.history_cache
        self.buffer = self.history.get_real().base
        self.length = len(self.history)
        self.num_valid = int(lmd_seq.num_valid_ids)
        self.num_history = int(lmd_seq.num_history_ids)

    def holds_for(self, lmd_seq: object, num_valid: int) -> bool:
        history = lmd_seq.history_cache
        return (
            history is self.history
            and history.get_real().base is self.buffer
            and len(history) == self.length
            and num_valid == self.num_valid
            and int(lmd_seq.num_history_ids) == self.num_history
        )


class Shadow:
    """The hybridcache side of one lmdeploy sequence."""

    __slots__ = ("seq", "txn", "num_spans", "adapter_name", "verified")

    def __init__(self, seq: Sequence, num_spans: int, adapter_name: str | None) -> None:
        self.seq = seq
        self.txn: MatchTxn | None = None
        self.num_spans = num_spans
        self.adapter_name = adapter_name
        self.verified: TokenStamp | None = None  # set by ``prepare``, spent by the next sync


def _spans(lmd_seq: object) -> tuple[MultimodalSpan, ...]:
    return tuple(
        MultimodalSpan(int(span.start), int(span.end), str(span.modality), str(span.content_hash))
        for span in lmd_seq.prefix_cache.multimodal_spans
    )


def _table(lmd_seq: object, start: int = 0) -> np.ndarray:
    """lmdeploy's block ids from table index ``start`` on (only those are converted)."""
    blocks = lmd_seq.logical_blocks
    if len(blocks) <= start:
        return np.empty(0, dtype=np.int32)
    return np.asarray(blocks.get_real_blocks()[start:]).astype(np.int32)


class ShadowBook:
    def __init__(self, trie: object) -> None:
        self.trie = trie  # the hybridcache BlockTrie the shadows belong to
        self._trie_id = trie.trie_id
        self._live: dict[int, weakref.ref] = {}
        self.expert_shape: tuple[int, ...] | None = None  # lmdeploy's per-token expert row shape
        self.expert_dtype: np.dtype | None = None

    def existing(self, lmd_seq: object) -> Shadow | None:
        """The shadow as it is (pins and reservations act on it without a resync)."""
        shadow = getattr(lmd_seq, _ATTRIBUTE, None)
        if not isinstance(shadow, Shadow):
            return None
        owner = shadow.seq.prefix_state.trie.owner
        return shadow if owner == self._trie_id or owner == -1 else None

    def prepare(self, lmd_seq: object) -> None:
        """Build or extend the shadow's tokens as the lmdeploy sequence starts waiting; no trie
        state changes (a shadow whose tokens lmdeploy rewrote is left to the next sync)."""
        shadow = self.existing(lmd_seq)
        num_valid = int(lmd_seq.num_valid_ids)
        if shadow is None:
            shadow = self._new_shadow(lmd_seq, num_valid)
        elif self._same_identity(shadow, lmd_seq, num_valid):
            self._append_tokens(shadow.seq, lmd_seq, num_valid)
        else:
            return
        shadow.verified = TokenStamp(lmd_seq)

    def synced(self, lmd_seq: object, *, with_table: bool = True) -> Shadow:
        """The shadow, brought up to the lmdeploy sequence's tokens, step and table."""
        shadow = self.existing(lmd_seq)
        num_valid = int(lmd_seq.num_valid_ids)
        if shadow is not None and not self._same_identity(shadow, lmd_seq, num_valid):
            self.forget(shadow)
            shadow = None
        if shadow is None:
            shadow = self._new_shadow(lmd_seq, num_valid)
        shadow.verified = None
        seq = shadow.seq
        if seq.num_tokens < num_valid:
            self._append_tokens(seq, lmd_seq, num_valid)
        if self.lmdeploy_released(shadow, lmd_seq):
            self.forget(shadow)
        if with_table and len(lmd_seq.logical_blocks) > seq.num_blocks:
            self.sync_table(shadow, lmd_seq)
        seq.set_computed(min(int(lmd_seq.num_history_ids), seq.num_tokens))
        state, prefix_cache = seq.prefix_state, lmd_seq.prefix_cache
        state.overlap.recompute_blocks = max(0, int(prefix_cache.recompute_overlap.recompute_blocks))
        state.suppress_stats = bool(prefix_cache.suppress_match_stats)
        if seq.want_routed_experts:
            self._sync_experts(shadow, lmd_seq)
        return shadow

    def _new_shadow(self, lmd_seq: object, num_valid: int) -> Shadow:
        spans = _spans(lmd_seq)
        seq = Sequence(
            np.asarray(lmd_seq.history_cache[:num_valid]),
            adapter=lmd_seq.adapter_name,
            multimodal=spans,
            want_routed_experts=bool(lmd_seq.return_routed_experts),
        )
        shadow = Shadow(seq, len(spans), lmd_seq.adapter_name)
        setattr(lmd_seq, _ATTRIBUTE, shadow)
        self._live[id(lmd_seq)] = weakref.ref(lmd_seq)
        return shadow

    @staticmethod
    def _append_tokens(seq: Sequence, lmd_seq: object, num_valid: int) -> None:
        if seq.num_tokens < num_valid:
            seq.append_tokens(np.asarray(lmd_seq.history_cache[seq.num_tokens : num_valid]))

    @staticmethod
    def _same_identity(shadow: Shadow, lmd_seq: object, num_valid: int) -> bool:
        """Tokens known to both agree, and the adapter and spans are unchanged. Only the
        shadow's uncomputed tail is compared (lmdeploy never rewrites computed history), and
        not even that while lmdeploy's buffer is as ``prepare`` verified it."""
        seq = shadow.seq
        if seq.num_tokens > num_valid or shadow.adapter_name != lmd_seq.adapter_name:
            return False
        if len(lmd_seq.prefix_cache.multimodal_spans) != shadow.num_spans:
            return False
        if shadow.verified is not None and shadow.verified.holds_for(lmd_seq, num_valid):
            return True
        start, end = min(seq.num_computed, int(lmd_seq.num_history_ids)), seq.num_tokens
        if start >= end:
            return True
        ours, theirs = seq.token_view(start, end), lmd_seq.history_cache[start:end]
        if end - start <= _LIST_COMPARE_TOKENS:  # a decode step's or a suffix's few tokens
            return ours.tolist() == theirs.tolist()
        return bool(np.array_equal(ours, theirs))

    def lmdeploy_released(self, shadow: Shadow, lmd_seq: object) -> bool:
        """lmdeploy freed the sequence's blocks or reset its cursor since the shadow last saw it."""
        seq = shadow.seq
        held = seq.num_blocks
        if lmd_seq.prefix_cache.trie_cursor is None and (
            held or shadow.txn is not None or seq.prefix_state.trie.cursor != NO_NODE
        ):
            return True
        if not held:
            return False
        theirs = lmd_seq.logical_blocks
        return len(theirs) < held or int(theirs[held - 1]) != int(seq.block_table[held - 1])

    def forget(self, shadow: Shadow) -> None:
        """lmdeploy released the references of the shadow's table itself: close its match,
        empty the table without dropping references, and release its tracking."""
        seq = shadow.seq
        if shadow.txn is not None:
            if shadow.txn.open:
                self.trie.commit(shadow.txn)
            shadow.txn = None
        seq.truncate_blocks(0)
        if seq.prefix_state.trie.owner == self.trie.trie_id:
            self.trie.free_sequence(seq)

    def release(self, lmd_seq: object) -> None:
        """lmdeploy removed the sequence after freeing its blocks and state: forget the shadow
        and drop it, unless it still holds a producer pin (lmdeploy releases that later, at its
        output boundary, through this very shadow)."""
        shadow = self.existing(lmd_seq)
        if shadow is None or shadow.seq.prefix_state.checkpoints.producer_pin is not None:
            return
        self.forget(shadow)
        delattr(lmd_seq, _ATTRIBUTE)
        self._live.pop(id(lmd_seq), None)

    def sync_table(self, shadow: Shadow, lmd_seq: object) -> None:
        """Blocks lmdeploy's block manager appended beyond the shadow's table (not yet
        attached: ``allocate`` attaches them)."""
        seq = shadow.seq
        if len(lmd_seq.logical_blocks) > seq.num_blocks:
            seq.write_blocks(seq.num_blocks, _table(lmd_seq, seq.num_blocks))

    def new_blocks(self, shadow: Shadow, lmd_seq: object) -> np.ndarray:
        return _table(lmd_seq, shadow.seq.num_blocks)

    def _sync_experts(self, shadow: Shadow, lmd_seq: object) -> None:
        seq = shadow.seq
        history = lmd_seq.all_routed_experts
        if history is None or len(history) <= seq.num_routed_experts:
            return
        rows = np.asarray(history.get_real())
        end = min(len(rows), seq.num_tokens)
        if end <= seq.num_routed_experts:
            return
        self.expert_shape, self.expert_dtype = rows.shape[1:], rows.dtype
        seq.append_routed_experts(rows[seq.num_routed_experts : end].reshape(end - seq.num_routed_experts, -1))

    def replay_experts(self, shadow: Shadow, lmd_seq: object) -> None:
        """Give lmdeploy's sequence the routed-expert rows a match replayed onto the shadow
        (one that wants routed experts)."""
        seq = shadow.seq
        rows = seq.routed_experts
        have = len(lmd_seq.all_routed_experts)
        if rows is None or seq.num_routed_experts <= have or self.expert_shape is None:
            return
        replay = np.asarray(rows[have:]).astype(self.expert_dtype).reshape((-1, *self.expert_shape))
        lmd_seq.append_routed_experts(replay.copy())

    def live(self) -> list[tuple[object, Shadow]]:
        """Every lmdeploy sequence still alive with a shadow of this trie."""
        found = []
        for key, ref in list(self._live.items()):
            lmd_seq = ref()
            shadow = None if lmd_seq is None else self.existing(lmd_seq)
            if shadow is None:
                del self._live[key]
            else:
                found.append((lmd_seq, shadow))
        return found
