"""Read-only views of hybridcache trie nodes and checkpoint records, shaped as the lmdeploy
``Node`` / ``NodeStateCheckpoint`` fields that lmdeploy's engine and tests read.

Owns: the identity of the views (one view per live node handle and per record, so lmdeploy's
``is`` comparisons between cursors and restore nodes hold). A view reads the trie on every
access and never writes it.
"""

from __future__ import annotations

import weakref

import numpy as np

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.types import BASE_NAMESPACE, NO_BLOCK, Namespace


def namespace_of(adapter_name: str | None) -> Namespace:
    return BASE_NAMESPACE if adapter_name is None else Namespace(adapter_name)


class CheckpointView:
    """``node.state_checkpoint``: what the inputs maker reads to build its copy plans."""

    __slots__ = ("record", "__weakref__")

    def __init__(self, record: CheckpointRecord) -> None:
        self.record = record

    @property
    def slot(self) -> int:
        return -1 if self.record.state is CheckpointState.RELEASED else int(self.record.slot)

    @property
    def step(self) -> int:
        return int(self.record.step)

    @property
    def frozen_block_id(self) -> int:
        block = self.record.frozen_block
        return -1 if block == NO_BLOCK or self.record.state is CheckpointState.RELEASED else int(block)

    @property
    def published(self) -> bool:
        return self.record.is_published

    @property
    def pin_count(self) -> int:
        return int(self.record.pin_count)

    @property
    def exact_match_data(self) -> object:
        """The immutable path a published checkpoint is verified against (None before)."""
        return self.record.anchor_path if self.record.is_published else None

    @property
    def last_access_time(self) -> int:
        return int(self.record.stamp)


class NodeView:
    """One trie node (``slot`` at ``generation``), or an adapter's root."""

    __slots__ = ("_views", "slot", "generation", "adapter_name", "__weakref__")

    def __init__(self, views: "ViewBook", slot: int, generation: int, adapter_name: str | None) -> None:
        self._views = views
        self.slot = slot
        self.generation = generation
        self.adapter_name = adapter_name

    @property
    def is_live(self) -> bool:
        return self.slot >= 0 and self._views.trie.nodes.is_valid(self.slot, self.generation)

    def _anchor_slot(self) -> int | None:
        """The node's slot, or the adapter root's current one (checkpoints before the first
        full block anchor at the root)."""
        if self.slot < 0:
            return self._views.trie.nodes.find_root(namespace_of(self.adapter_name))
        return self.slot if self.is_live else None

    @property
    def prefix_len(self) -> int:
        if not self.is_live:
            return 0
        trie = self._views.trie
        return int(trie.nodes.depth[self.slot]) * trie.block_size

    @property
    def block_id(self) -> int:
        if not self.is_live or self._views.trie.nodes.is_root[self.slot]:
            return -1
        return int(self._views.trie.nodes.block[self.slot])

    @property
    def token_ids(self) -> np.ndarray:
        trie = self._views.trie
        if not self.is_live or trie.nodes.is_root[self.slot]:
            return np.empty(0, dtype=np.int64)
        return trie.tokens.run(self.slot, self.slot).astype(np.int64)

    @property
    def parent(self) -> "NodeView | None":
        nodes = self._views.trie.nodes
        if not self.is_live or nodes.is_root[self.slot]:
            return None
        return self._views.node(int(nodes.parent[self.slot]), self.adapter_name)

    @property
    def state_checkpoint(self) -> CheckpointView | None:
        """The newest live checkpoint anchored here (lmdeploy keeps one per node)."""
        anchor = self._anchor_slot()
        if anchor is None:
            return None
        records = [r for r in self._views.trie.checkpoints.records_at(anchor) if r.state is not CheckpointState.RELEASED]
        if not records:
            return None
        return self._views.checkpoint(max(records, key=lambda record: record.record_id))

    def __repr__(self) -> str:
        return f"NodeView(slot={self.slot}, prefix_len={self.prefix_len})"


class ViewBook:
    """Hands out one view per node handle and per record while anything holds it."""

    def __init__(self, trie: object) -> None:
        self.trie = trie
        self._nodes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._records: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._roots: dict[str | None, NodeView] = {}

    def node(self, slot: int, adapter_name: str | None) -> NodeView:
        """The view of ``slot`` now; a root (or no node) is the adapter's root view."""
        nodes = self.trie.nodes
        if slot < 0 or not nodes.attached[slot] or nodes.is_root[slot]:
            return self.root(adapter_name)
        key = (slot, int(nodes.generation[slot]))
        view = self._nodes.get(key)
        if view is None:
            view = NodeView(self, slot, key[1], adapter_name)
            self._nodes[key] = view
        return view

    def root(self, adapter_name: str | None) -> NodeView:
        view = self._roots.get(adapter_name)
        if view is None:
            view = self._roots[adapter_name] = NodeView(self, -1, -1, adapter_name)
        return view

    def checkpoint(self, record: CheckpointRecord) -> CheckpointView:
        view = self._records.get(record.record_id)
        if view is None:
            view = CheckpointView(record)
            self._records[record.record_id] = view
        return view
