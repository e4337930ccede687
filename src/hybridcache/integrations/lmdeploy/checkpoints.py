"""lmdeploy's ``state_checkpoints`` surface over hybridcache's checkpoint lifecycle.

Owns: the mirror of each sequence's checkpoint phases on lmdeploy's side
(``prefix_cache.pending_save``, ``restore.pinned``, ``producer_save_pin``,
``decode_checkpoint_node``); the records themselves, their slots, frozen blocks, pins and
eviction order stay in ``CheckpointLifecycle``. lmdeploy's preconditions that only refuse
(step range, decode alignment, multimodal boundaries, an anchor whose checkpoint is pinned,
unpublished or at the save's step) answer -1 / False as lmdeploy does.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import LifecycleError, PinnedError, PinUnderflowError
from hybridcache.integrations.lmdeploy.shadows import ShadowBook
from hybridcache.integrations.lmdeploy.views import NodeView, ViewBook
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.types import NO_SAVE


class StateCheckpoints:
    def __init__(self, trie: object, shadows: ShadowBook, views: ViewBook) -> None:
        self._trie = trie  # the hybridcache BlockTrie
        self._shadows = shadows
        self._views = views

    @property
    def _active(self) -> bool:
        return self._trie.enabled and self._trie.is_hybrid

    # --- saves ---------------------------------------------------------------------------------

    def reserve_save(self, seq: object, step: int | None = None, is_decode: bool = False) -> int:
        self.discard_save(seq)
        if not self._active:
            return -1
        step = int(seq.num_valid_ids) if step is None else int(step)
        block_size = self._trie.block_size
        if step <= 0 or step > seq.num_valid_ids or (is_decode and step % block_size):
            return -1
        if not seq.is_prefix_cache_boundary_safe(step):
            return -1
        if self._anchor_held(seq, step):
            return -1
        shadow = self._shadows.synced(seq)
        slot = self._trie.checkpoints.reserve_save(shadow.seq, step, is_decode=is_decode)
        if slot == NO_SAVE:
            return -1
        record = shadow.seq.prefix_state.checkpoints.pending_save
        seq.prefix_cache.pending_save.reserve(int(slot), step, self._views.node(record.anchor, seq.adapter_name), is_decode)
        return int(slot)

    def _anchor_held(self, seq: object, step: int) -> bool:
        """lmdeploy keeps one checkpoint per anchor and refuses a save at ``step`` while that
        one is pinned (a restore or a save copy in flight), not yet published, or at ``step``
        itself (whatever its tail tokens). A save reserved anyway would, once published and
        unpinned, replace the anchor's checkpoint: an aligned one by a mid-block one holding a
        frozen copy lmdeploy never allocates, or another request's tail by this one's."""
        anchor = self._attached_anchor(seq, step - step % self._trie.block_size)
        if anchor is None:
            return False
        return any(r.pin_count > 0 or not r.is_published or r.step == step for r in anchor.live_checkpoints())

    def reserve_decode_save(self, seq: object, interval: int, step: int | None = None) -> int:
        step = int(seq.num_valid_ids) if step is None else int(step)
        if interval <= 0 or step % interval or not self._active:
            return -1
        if step <= 0 or step % self._trie.block_size or step > seq.num_valid_ids:
            return -1
        if seq.clamp_prefix_cache_match_step(step) != step:
            return -1
        anchor = self._attached_anchor(seq, step)
        if anchor is None or anchor.state_checkpoint is not None:
            return -1
        if not self._release_previous_decode_checkpoint(seq, step):
            return -1
        return self.reserve_save(seq, step=step, is_decode=True)

    @staticmethod
    def _attached_anchor(seq: object, step: int) -> NodeView | None:
        """The node at ``step`` on the sequence's attached path (None when not attached yet)."""
        node = seq.prefix_cache.trie_cursor
        while isinstance(node, NodeView) and node.prefix_len > step:
            node = node.parent
        if not isinstance(node, NodeView) or node.prefix_len != step or (step and not node.is_live):
            return None
        return node

    def _release_previous_decode_checkpoint(self, seq: object, step: int) -> bool:
        """lmdeploy keeps one decode checkpoint per sequence and drops the previous one when
        the next is reserved; refused while the previous is pinned or already at ``step``."""
        prefix_cache = seq.prefix_cache
        previous = prefix_cache.decode_checkpoint_node
        checkpoint = None if previous is None else previous.state_checkpoint
        if checkpoint is None or checkpoint.slot < 0:
            prefix_cache.decode_checkpoint_node = None
            return True
        if (checkpoint.step == step and checkpoint.published) or checkpoint.pin_count > 0:
            return False
        self.release_checkpoint(previous)
        prefix_cache.decode_checkpoint_node = None
        return True

    def discard_save(self, seq: object) -> bool:
        pending = seq.prefix_cache.pending_save
        shadow = self._shadows.existing(seq)
        released = False
        if shadow is not None and self._trie.is_hybrid:
            released = self._trie.checkpoints.release_reservation(shadow.seq)
        pending.clear()
        return released

    def publish_save(self, seq: object, pin_save: bool = False) -> bool:
        pending = seq.prefix_cache.pending_save
        shadow = self._shadows.existing(seq)
        record = None if shadow is None else shadow.seq.prefix_state.checkpoints.pending_save
        if record is None or not self._active:
            pending.clear()
            return False
        self._require_producer_prefix(seq, shadow, record)
        published = self._trie.checkpoints.publish_save(shadow.seq, pin=pin_save)
        pending.clear()
        if not published:
            return False
        node = self._views.node(record.anchor, seq.adapter_name)
        if record.is_decode:
            seq.prefix_cache.decode_checkpoint_node = node
        if pin_save:
            seq.prefix_cache.producer_save_pin.acquire(int(record.slot), node)
        return True

    def _require_producer_prefix(self, seq: object, shadow, record) -> None:
        """A save publishes the prefix it was reserved for: refuse (and release the
        reservation) when the producer's tokens changed below the step since."""
        step = int(record.step)
        if step <= seq.num_valid_ids and np.array_equal(
            shadow.seq.token_view(0, step), np.asarray(seq.history_cache[:step])
        ):
            return
        self.discard_save(seq)
        raise LifecycleError("Cannot publish a checkpoint from a mismatched sequence cursor: its tokens changed")

    def publish_saves(self, seqs: list, pin_saves: bool = False) -> None:
        if self._trie.enabled:
            for seq in seqs:
                self.publish_save(seq, pin_save=pin_saves)

    def unpin_save(self, seq: object) -> bool:
        shadow = self._shadows.existing(seq)
        if shadow is None or not self._trie.checkpoints.unpin_save(shadow.seq):
            return False
        seq.prefix_cache.producer_save_pin.clear()
        return True

    def unpin_saves(self, seqs: list) -> None:
        if self._trie.enabled:
            for seq in seqs:
                self.unpin_save(seq)

    # --- restores ------------------------------------------------------------------------------

    def pin_restore(self, seq: object) -> bool:
        restore = seq.prefix_cache.restore
        shadow = self._shadows.existing(seq)
        if shadow is None or not restore.is_selected or restore.pinned or not self._trie.is_hybrid:
            return False
        if not self._trie.checkpoints.pin_restore(shadow.seq):
            return False
        restore.pinned = True
        return True

    def pin_restores(self, seqs: list) -> None:
        for seq in seqs:
            self.pin_restore(seq)

    def unpin_restore(self, seq: object) -> bool:
        shadow = self._shadows.existing(seq)
        if shadow is None or not self._trie.is_hybrid:
            return False
        try:
            unpinned = self._trie.checkpoints.unpin_restore(shadow.seq)
        except PinUnderflowError:
            raise PinUnderflowError("the pinned restore checkpoint lost its node reference (no pin left)") from None
        if unpinned:
            seq.prefix_cache.restore.clear()
        return unpinned

    def unpin_restores(self, seqs: list) -> None:
        if self._trie.enabled:
            for seq in seqs:
                self.unpin_restore(seq)

    # --- records -------------------------------------------------------------------------------

    @staticmethod
    def is_pinned(node: NodeView) -> bool:
        checkpoint = node.state_checkpoint
        return checkpoint is not None and checkpoint.pin_count > 0

    def release_checkpoint(self, node: NodeView) -> None:
        """Release the checkpoint anchored at ``node``, keeping the node; a pinned one raises."""
        checkpoint = node.state_checkpoint
        if checkpoint is None:
            return
        record = checkpoint.record
        if record.pin_count > 0:
            raise PinnedError("Cannot release a pinned checkpoint")
        if record.state is not CheckpointState.RELEASED:
            self._trie.checkpoints.release(record)

    def evict(self, max_num_checkpoints: int) -> int:
        """State-slot pressure: release least recently used unpinned checkpoints."""
        return self._trie.free_state_slots(int(max_num_checkpoints))

    def evict_frozen_checkpoints(self, max_num_blocks: int) -> int:
        if not self._trie.enabled:
            return 0
        return self._trie.checkpoints.evict_frozen(int(max_num_blocks))
