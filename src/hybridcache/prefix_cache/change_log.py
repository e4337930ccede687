"""The changes an observer of the cache has not taken yet (for event publishers).

Owns: four lists, in the order things happened: nodes that became matchable (``(slot,
generation)``), matchable nodes detached since, checkpoint records published, and the ids of
published records released since. Off unless ``BlockTrie.record_changes`` switched it on: the
node table and the checkpoint store append to it only when it exists. ``take`` turns the
entries into values that stay valid after the call (handles, copied tokens), dropping a node
or record that came and went between two calls, so an observer only ever hears of what it can
still find.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.types import Namespace

Handle = tuple[int, int]  # (slot, generation)


@dataclass(frozen=True)
class StoredBlock:
    """A node whose full block became matchable: below ``parent`` (None: a namespace root)."""

    node: Handle
    parent: Handle | None
    namespace: Namespace
    token_ids: list[int]
    content_ids: tuple[str, ...]  # multimodal identity of the block, in span order


@dataclass(frozen=True)
class PublishedCheckpoint:
    """A published checkpoint record: the state after ``step`` tokens, on node ``anchor``
    (None: the namespace root, ``step`` below one block), with the tokens past the anchor."""

    checkpoint_id: int
    step: int
    anchor: Handle | None
    namespace: Namespace
    tail_token_ids: np.ndarray


@dataclass(frozen=True)
class CacheChanges:
    stored: list[StoredBlock]  # parents before children
    removed: list[Handle]
    published: list[PublishedCheckpoint]
    released: list[int]  # checkpoint ids

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.published or self.released)


class ChangeLog:
    def __init__(self) -> None:
        self.ready: list[Handle] = []
        self.detached: list[Handle] = []
        self.published: list[CheckpointRecord] = []
        self.released: list[int] = []

    def nodes_ready(self, nodes: NodeTable, slots: np.ndarray) -> None:
        self.ready.extend(zip(slots.tolist(), nodes.generation[slots].tolist()))

    def take(self, nodes: NodeTable, tokens: TokenStore) -> CacheChanges:
        """Everything since the last ``take``, as values; the log is empty afterwards."""
        published = [self._published(nodes, record) for record in self.published if record.state is CheckpointState.PUBLISHED]
        changes = CacheChanges(self._stored(nodes, tokens), self.detached, published, self.released)
        self.ready, self.detached, self.published, self.released = [], [], [], []
        return changes

    def _stored(self, nodes: NodeTable, tokens: TokenStore) -> list[StoredBlock]:
        """The ready nodes still attached with their generation, parents first (one gather
        per column, not one per node)."""
        if not self.ready:
            return []
        handles = np.array(self.ready, dtype=np.int64)
        slots, generations = handles[:, 0], handles[:, 1]
        live = nodes.attached[slots] & (nodes.generation[slots] == generations)
        slots, generations = slots[live], generations[live]
        order = np.argsort(nodes.depth[slots], kind="stable")
        slots, generations = slots[order], generations[order]
        parents = nodes.parent[slots]
        columns = zip(
            slots.tolist(), generations.tolist(), parents.tolist(), nodes.is_root[parents].tolist(),
            nodes.generation[parents].tolist(), tokens.rows(slots).tolist(),
        )
        namespaces: dict[int, Namespace] = {}  # slot -> namespace, inherited from a parent in this take
        stored = []
        for slot, generation, parent, parent_is_root, parent_generation, token_ids in columns:
            namespace = namespaces.get(parent) or nodes.namespace_of(slot)
            namespaces[slot] = namespace
            spans = nodes.extra_identity.get(slot, ())
            stored.append(StoredBlock(
                (slot, generation), None if parent_is_root else (parent, parent_generation), namespace, token_ids,
                tuple(span.content_id for span in spans),
            ))
        return stored

    @staticmethod
    def _published(nodes: NodeTable, record: CheckpointRecord) -> PublishedCheckpoint:
        anchor = None if nodes.is_root[record.anchor] else (record.anchor, record.anchor_generation)
        return PublishedCheckpoint(record.record_id, record.step, anchor, record.namespace, record.tail_tokens.copy())
