"""Read-only views of hybridcache trie nodes and checkpoint records, shaped as the lmdeploy
``Node`` / ``NodeStateCheckpoint`` fields that lmdeploy's engine and tests read.

Owns: the identity of the views (one view per live node handle and per record, so lmdeploy's
``is`` comparisons between cursors and restore nodes hold). A view reads the trie on every
access, but for its node's depth, read once (fixed while the node's generation lives), and
never writes it.
"""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.types import BASE_NAMESPACE, NO_BLOCK, Namespace


def namespace_of(adapter_name: str | None) -> Namespace:
    return BASE_NAMESPACE if adapter_name is None else Namespace(adapter_name)


class MatchData:
    """``exact_match_data``: the immutable prefix a published checkpoint is verified against."""

    __slots__ = ("_trie", "_record", "_tokens")

    def __init__(self, trie: object, record: CheckpointRecord) -> None:
        self._trie, self._record, self._tokens = trie, record, None

    @property
    def block_ids(self) -> np.ndarray:
        """The canonical trie blocks of the anchor's path, in table order (read-only)."""
        ids = np.asarray(self._trie.nodes.path_blocks(self._record.anchor_path)).astype(np.int64)
        ids.flags.writeable = False
        return ids

    @property
    def token_ids(self) -> np.ndarray:
        """The checkpoint's whole prefix (read-only; assembled once from the trie's rows)."""
        if self._tokens is None:
            runs = self._record.anchor_path.runs
            parts = [self._trie.tokens.run(first, last) for first, last in reversed(runs)]
            tokens = np.concatenate([*parts, self._record.tail_tokens]).astype(np.int64)
            tokens.flags.writeable = False
            self._tokens = tokens
        return self._tokens


class CheckpointView:
    """``node.state_checkpoint``: what the inputs maker reads to build its copy plans."""

    __slots__ = ("record", "_trie", "_match_data", "external_pins")

    def __init__(self, record: CheckpointRecord, trie: object) -> None:
        self.record = record
        self._trie = trie
        self._match_data: MatchData | None = None  # built when first read: the inputs maker never does
        self.external_pins = 0  # pins set through ``pin_count``, held by no sequence

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

    @pin_count.setter
    def pin_count(self, value: int) -> None:
        """Pins held outside any sequence (lmdeploy's field is writable and its tests pin a
        checkpoint this way); counted as restore pins beside the producer's."""
        target = max(0, int(value) - int(self.record.producer_pins))
        self.external_pins = max(0, self.external_pins + target - int(self.record.restore_pins))
        self.record.restore_pins = target

    @property
    def exact_match_data(self) -> object:
        """The immutable path a published checkpoint is verified against (None before)."""
        if not self.record.is_published:
            return None
        if self._match_data is None:
            self._match_data = MatchData(self._trie, self.record)
        return self._match_data

    @property
    def last_access_time(self) -> int:
        return int(self.record.stamp)


class NodeView:
    """One trie node (``slot`` at ``generation``), or an adapter's root."""

    __slots__ = ("_views", "slot", "generation", "adapter_name", "depth")

    def __init__(self, views: "ViewBook", slot: int, generation: int, adapter_name: str | None) -> None:
        self._views = views
        self.slot = slot
        self.generation = generation
        self.adapter_name = adapter_name
        # A node's depth never changes while its generation lives: read once, not per access.
        self.depth = int(views.trie.nodes.depth[slot]) if slot >= 0 else 0

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
        return self.depth * self._views.trie.block_size if self.is_live else 0

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

    def path_from_root(self) -> list["NodeView"]:
        """The nodes from the root's child down to this one."""
        path, node = [], self
        while node is not None and node.is_live:
            path.append(node)
            node = node.parent
        return path[::-1]

    @property
    def routed_experts(self) -> np.ndarray | None:
        """The block's cached routed-expert rows in lmdeploy's row shape, or None."""
        trie = self._views.trie
        experts = trie.experts
        if not self.is_live or self.slot >= experts.has_rows.size or not experts.has_rows[self.slot]:
            return None
        rows = experts.gather([(self.slot, self.slot)])
        shape, dtype = self._views.expert_layout()
        return rows if shape is None else rows.astype(dtype).reshape((-1, *shape))

    def live_checkpoints(self) -> list[CheckpointRecord]:
        """Every live checkpoint record anchored here: reserved and published (while a new
        save's record waits for its publish, an anchor holds two)."""
        anchor = self._anchor_slot()
        if anchor is None:
            return []
        return [r for r in self._views.trie.checkpoints.records_at(anchor) if r.state is not CheckpointState.RELEASED]

    @property
    def state_checkpoint(self) -> CheckpointView | None:
        """The newest live checkpoint anchored here (lmdeploy keeps one per node)."""
        records = self.live_checkpoints()
        if not records:
            return None
        return self._views.checkpoint(max(records, key=lambda record: record.record_id))

    def __repr__(self) -> str:
        return f"NodeView(slot={self.slot}, prefix_len={self.prefix_len})"


class ViewBook:
    """Hands out one view per node handle and per live record. A node slot's view is kept
    until the slot's generation changes (it is then replaced, and a holder of the old view
    sees it dead): a cursor's view serves every request that reaches the node, instead of one
    built per request after lmdeploy dropped the last."""

    def __init__(self, trie: object, expert_layout) -> None:
        """``expert_layout()``: lmdeploy's per-token expert row shape and dtype, or (None, None)."""
        self.trie = trie
        self.expert_layout = expert_layout
        self._nodes: dict[int, NodeView] = {}  # node slot -> the view of its current generation
        self._records: dict[int, CheckpointView] = {}
        self._roots: dict[str | None, NodeView] = {}

    def node(self, slot: int, adapter_name: str | None) -> NodeView:
        """The view of ``slot`` now; a root (or no node) is the adapter's root view."""
        nodes = self.trie.nodes
        if slot < 0 or not nodes.attached[slot] or nodes.is_root[slot]:
            return self.root(adapter_name)
        return self._view_of(slot, int(nodes.generation[slot]), adapter_name)

    def live_node(self, slot: int, generation: int, adapter_name: str | None) -> NodeView:
        """The view of the node handle ``(slot, generation)`` while that node is attached with
        that generation (a cursor), else the adapter's root view: ``node`` with the handle's
        validity read in the same pass."""
        nodes = self.trie.nodes
        if not nodes.is_valid(slot, generation) or nodes.is_root[slot]:
            return self.root(adapter_name)
        return self._view_of(slot, generation, adapter_name)

    def _view_of(self, slot: int, generation: int, adapter_name: str | None) -> NodeView:
        """The one view of attached node ``slot`` at ``generation`` (made when it changed)."""
        view = self._nodes.get(slot)
        if view is None or view.generation != generation:
            view = self._nodes[slot] = NodeView(self, slot, generation, adapter_name)
        return view

    def root(self, adapter_name: str | None) -> NodeView:
        view = self._roots.get(adapter_name)
        if view is None:
            view = self._roots[adapter_name] = NodeView(self, -1, -1, adapter_name)
        return view

    def external_pins(self) -> list[tuple[CheckpointRecord, int]]:
        """Records pinned through ``pin_count`` by no sequence, and how many such pins."""
        return [(v.record, v.external_pins) for v in self._records.values() if v.external_pins and v.record.state is not CheckpointState.RELEASED]

    def checkpoint(self, record: CheckpointRecord) -> CheckpointView:
        view = self._records.get(record.record_id)
        if view is None:
            if len(self._records) > 2 * self.trie.checkpoints.num_live + 64:
                self._records = {k: v for k, v in self._records.items() if v.record.state is not CheckpointState.RELEASED or v.external_pins}
            view = CheckpointView(record, self.trie)
            self._records[record.record_id] = view
        return view
