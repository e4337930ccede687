"""Trie topology.

Owns: every trie node record (struct of arrays indexed by slot), the namespace roots, the
prefix-key index of attached nodes and a bounded memo of recently taken ``NodePath``s.

Topology is monotonic: a node attaches once and only leaves detach, so while a node is
attached its whole ancestry is attached and unchanged. A node handle is ``(slot,
generation)``; the generation changes when the slot is detached, so "is this handle still
valid" is O(1). ``version`` counts every topology or readiness change, so a caller can tell in
O(1) that nothing it derived from the table can have changed.

Runs: ``run_head[s]`` is the first slot of the longest run ``h, h+1, ..., s`` in which every
slot is the parent of the next. A path is walked run by run (``path_runs``) rather than node by
node, and nodes attached together get consecutive slots, so a path made by one request is a
single run. A path grown a chunk at a time into reused slots is one run per chunk, so
``path_to`` starts from the memoized path of the nearest ancestor it meets (the previous chunk's
end, typically): a path of r runs costs one run walked plus one list copy, not r walks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridcache.errors import TopologyError
from hybridcache.prefix_cache.key_index import KeyIndex
from hybridcache.types import NO_SLOT, MultimodalSpan, Namespace

Runs = list[tuple[int, int]]

# Paths remembered by ``path_to``: enough for every sequence of a large batch growing at once.
RECENT_PATHS = 1024


@dataclass(eq=False)
class NodePath:
    """The path from a namespace root down to ``node``: its runs (deepest first) and root.

    A node's path cannot change while it is attached, so one is shared by everyone who
    verified up to that node (a checkpoint record keeps its anchor's) and reused while
    ``generation`` is the node's. ``blocks`` caches the block ids of a one-run path
    (``NodeTable.path_blocks``): a read-only view of the block column, never a copy, which
    keeps a column the table has since outgrown alive while the path lives.
    """

    node: int
    depth: int
    runs: Runs
    root: int
    generation: int = -1  # the node's generation when the path was taken (-1: do not reuse)
    blocks: np.ndarray | None = None

    def __getstate__(self) -> dict:  # the cached view is derived; a copy would hold a writable array
        return {**self.__dict__, "blocks": None}

    def slot_at(self, nodes: NodeTable, depth: int) -> int:
        """The path's node at ``depth`` (the namespace root at 0)."""
        if depth == 0:
            return self.root
        return NodeTable.slot_at_depth(self.runs, nodes.depth, depth)


class NodeTable:
    def __init__(self, capacity: int = 256) -> None:
        # int32 fields: slots, depths and block ids stay below 2**31; lean at a million nodes.
        self.parent = np.zeros(capacity, dtype=np.int32)
        self.depth = np.zeros(capacity, dtype=np.int32)
        self.block = np.zeros(capacity, dtype=np.int32)
        self.key = np.zeros(capacity, dtype=np.uint64)
        self.key_sums = np.zeros(capacity, dtype=np.uint64)  # running key sum (keys resume from here)
        self.run_head = np.zeros(capacity, dtype=np.int32)
        self.generation = np.zeros(capacity, dtype=np.int32)
        self.num_children = np.zeros(capacity, dtype=np.int32)
        self.attached = np.zeros(capacity, dtype=bool)
        self.is_root = np.zeros(capacity, dtype=bool)
        # A pending node's block is not computed yet: it is attached (so its producer can
        # checkpoint on it) but must not be matched until the forward that writes it completes.
        self.pending = np.zeros(capacity, dtype=bool)
        # Number of nodes with multimodal identity on the path root..slot (inclusive).
        self.mm_count = np.zeros(capacity, dtype=np.int32)
        self.extra_identity: dict[int, tuple[MultimodalSpan, ...]] = {}
        self._index = KeyIndex()
        self._roots: dict[Namespace, int] = {}
        self._root_namespaces: dict[int, Namespace] = {}  # the inverse of ``_roots``
        # Roots with no child: a namespace that caches nothing below its root can go.
        self._childless_roots: set[int] = set()
        # slot -> the last NodePath taken to it, oldest first (dict order); an entry is used only
        # while its node keeps the generation stamped on it.
        self._recent_paths: dict[int, NodePath] = {}
        self._free_slots: list[int] = []
        self._high = 0
        self._num_attached = 0
        self.version = 0
        # Set by ``BlockTrie.record_changes``: readiness changes are appended for an observer.
        self.changes = None

    # --- capacity ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.parent.size

    @property
    def num_attached(self) -> int:
        """Attached non-root nodes."""
        return self._num_attached

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        for name in ("parent", "depth", "block", "key", "key_sums", "run_head", "generation", "num_children",
                     "attached", "is_root", "pending", "mm_count"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)  # zeroed lazily by the OS: untouched rows cost nothing
            new[: old.size] = old
            setattr(self, name, new)

    def _take_slots(self, count: int) -> np.ndarray:
        reused = min(count, len(self._free_slots))
        taken = self._free_slots[len(self._free_slots) - reused :]
        del self._free_slots[len(self._free_slots) - reused :]
        fresh = count - reused
        if self._high + fresh > self.capacity:
            self._grow(self._high + fresh)
        slots = np.array(sorted(taken) + list(range(self._high, self._high + fresh)), dtype=np.int64)
        self._high += fresh
        return slots

    # --- roots and handles ---------------------------------------------------------------------

    def find_root(self, namespace: Namespace) -> int | None:
        return self._roots.get(namespace)

    def root(self, namespace: Namespace, key: int = 0) -> int:
        """The namespace's root, created with ``key`` (the namespace seed) on first use."""
        slot = self._roots.get(namespace)
        if slot is None:
            slot = int(self._take_slots(1)[0])
            self.key[slot] = key
            self.key_sums[slot] = key
            self.parent[slot] = NO_SLOT
            self.depth[slot] = 0
            self.block[slot] = NO_SLOT
            self.run_head[slot] = slot
            self.num_children[slot] = 0
            self.attached[slot] = True
            self.is_root[slot] = True
            self.mm_count[slot] = 0
            self._roots[namespace] = slot
            self._root_namespaces[slot] = namespace
            self._childless_roots.add(slot)
        return slot

    def childless_roots(self) -> list[tuple[Namespace, int]]:
        """Namespaces whose root has no child, with the root's slot."""
        return [(self._root_namespaces[slot], slot) for slot in sorted(self._childless_roots)]

    def release_root(self, namespace: Namespace) -> None:
        """Free a childless namespace root (its handles go stale: generation += 1). The next
        use of the namespace creates a new root with the same key."""
        slot = self._roots.get(namespace)
        if slot is None or self.num_children[slot]:
            raise TopologyError(f"namespace {namespace} has no childless root")
        del self._roots[namespace]
        del self._root_namespaces[slot]
        self._childless_roots.discard(slot)
        self.attached[slot] = False
        self.is_root[slot] = False
        self.generation[slot] += 1
        self._recent_paths.pop(slot, None)
        self._free_slots.append(slot)
        self.version += 1

    def namespace_of(self, slot: int) -> Namespace:
        """The namespace of an attached node (its root's)."""
        _, root = self.path_runs(slot, 0)
        return self._root_namespaces[root]

    def is_valid(self, slot: int, generation: int) -> bool:
        return 0 <= slot < self._high and self.attached.item(slot) and self.generation.item(slot) == generation

    def candidates(self, key: int) -> list[int]:
        """Attached nodes whose prefix key is ``key`` (more than one only on a collision)."""
        return self._index.all(key)

    def has_key(self, key: int) -> bool:
        return self._index.first(key) is not None

    # --- topology changes ----------------------------------------------------------------------

    def attach_run(self, parent: int, keys: np.ndarray, blocks: np.ndarray, identities: dict[int, tuple[MultimodalSpan, ...]],
                   pending: np.ndarray | bool = False, sums: np.ndarray | None = None) -> np.ndarray:
        """Attach a chain of new nodes below ``parent`` (each the parent of the next).

        ``identities`` maps a position in the chain to that node's multimodal identity.
        Returns the new slots, shallowest first.
        """
        if not self.attached[parent]:
            raise TopologyError(f"cannot attach below detached node {parent}")
        count = keys.size
        slots = self._take_slots(count)
        parents = np.empty(count, dtype=np.int64)
        parents[0] = parent
        parents[1:] = slots[:-1]
        self.parent[slots] = parents
        self.depth[slots] = self.depth[parent] + 1 + np.arange(count)
        self.block[slots] = blocks
        self.key[slots] = keys
        if sums is not None:
            self.key_sums[slots] = sums
        continues = (slots == parents + 1) & ~self.is_root[parents]
        heads = np.where(continues, -1, slots)
        if continues[0]:
            heads[0] = self.run_head[parent]
        self.run_head[slots] = np.maximum.accumulate(heads)
        self.num_children[parent] += 1
        self._childless_roots.discard(parent)
        self.num_children[slots] = 1
        self.num_children[slots[-1]] = 0
        self.attached[slots] = True
        self.is_root[slots] = False
        self.pending[slots] = pending
        has_mm = np.zeros(count, dtype=np.int64)
        for position, spans in identities.items():
            has_mm[position] = 1
            self.extra_identity[int(slots[position])] = spans
        self.mm_count[slots] = self.mm_count[parent] + np.cumsum(has_mm)
        self._index.insert_many(keys, slots, root_child=bool(self.is_root[parent]))
        self._num_attached += count
        self.version += 1
        if self.changes is not None:
            self.changes.nodes_ready(self, slots[~self.pending[slots]])
        return slots

    def detach_leaf(self, slot: int) -> int:
        """Detach an attached non-root leaf; returns its former parent."""
        if not (0 <= slot < self._high) or not self.attached[slot] or self.is_root[slot]:
            raise TopologyError(f"node {slot} is not an attached non-root node")
        if self.num_children[slot]:
            raise TopologyError(f"cannot detach non-leaf node {slot}")
        if self.changes is not None and not self.pending[slot]:
            self.changes.detached.append((slot, int(self.generation[slot])))
        self._index.remove(int(self.key[slot]), slot)
        parent = int(self.parent[slot])
        self.num_children[parent] -= 1
        if self.is_root[parent] and self.num_children[parent] == 0:
            self._childless_roots.add(parent)
        self.attached[slot] = False
        self.generation[slot] += 1
        self.parent[slot] = NO_SLOT
        self.block[slot] = NO_SLOT
        self.extra_identity.pop(slot, None)
        self._free_slots.append(slot)
        self._num_attached -= 1
        self.version += 1
        return parent

    def mark_ready(self, slots: np.ndarray) -> None:
        """Pending nodes whose blocks are now computed become matchable."""
        if self.changes is not None:
            self.changes.nodes_ready(self, slots[self.pending[slots]])
        self.pending[slots] = False
        self.version += 1

    # --- paths ---------------------------------------------------------------------------------

    def path_runs(self, slot: int, stop_depth: int) -> tuple[list[tuple[int, int]], int]:
        """Runs ``(first, last)`` of the path from ``slot`` up to depth ``stop_depth`` (exclusive),
        deepest run first, and the ancestor at ``stop_depth``. A negative ``stop_depth`` stops
        at the root, whose parent is no node: the walk cannot climb past it."""
        runs = []
        if stop_depth < 0:
            stop_depth = 0
        depth, run_head, parent = self.depth.item, self.run_head.item, self.parent.item  # Python ints
        while (slot_depth := depth(slot)) > stop_depth:
            head = run_head(slot)
            if slot_depth - (slot - head) <= stop_depth:  # a run's depths are consecutive
                head = slot - (slot_depth - stop_depth - 1)
            runs.append((head, slot))
            slot = parent(head)
        return runs, slot

    def path_to(self, slot: int) -> NodePath:
        """The path root..``slot`` of an attached node, stamped with its generation.

        Walks runs up from ``slot`` until it meets a node whose path is remembered and still
        valid, then copies that path's runs; the result is remembered in turn (the oldest memo
        entry goes past ``RECENT_PATHS``). A remembered path of ``slot`` itself is returned as
        is: a path is shared by everyone who holds it, and never mutated.
        """
        recent = self._recent_paths
        known = recent.get(slot)
        if known is not None and self.is_valid(slot, known.generation):
            return known
        depth, run_head, parent = self.depth, self.run_head, self.parent
        runs: Runs = []
        node = slot
        while depth[node] > 0:
            head = int(run_head[node])
            runs.append((head, node))
            node = int(parent[head])
            known = recent.get(node)
            if known is not None and self.is_valid(node, known.generation):
                runs.extend(known.runs)
                node = known.root
                break
        path = NodePath(slot, int(depth[slot]), runs, node, int(self.generation[slot]))
        recent.pop(slot, None)
        if not self.attached[slot]:  # a freed slot's path would pass for the node that reuses it
            return path
        recent[slot] = path
        if len(recent) > RECENT_PATHS:
            del recent[next(iter(recent))]
        return path

    @staticmethod
    def _along(column: np.ndarray, runs: Runs) -> np.ndarray:
        """Read-only entries of ``column`` along runs (deepest first) in table order: a view of
        the column for one run, a copy for several (callers that keep them copy them)."""
        if len(runs) == 1:  # a path attached at once: no list, no concatenate
            values = column[runs[0][0] : runs[0][1] + 1]
        else:
            values = np.concatenate([column[first : last + 1] for first, last in reversed(runs)]) if runs else column[:0]
        values.flags.writeable = False
        return values

    def run_blocks(self, runs: Runs) -> np.ndarray:
        """Block ids of runs in table order (``_along``)."""
        return self._along(self.block, runs)

    def run_pending(self, runs: Runs) -> np.ndarray:
        """Which nodes of runs, in table order, are still pending (``_along``)."""
        return self._along(self.pending, runs)

    def path_blocks(self, path: NodePath) -> np.ndarray:
        """Block ids of a whole path in table order (read-only). A one-run path keeps its view
        (an attached node's block never changes); a path of several runs is gathered each
        time, so a long-lived path never holds a copy of its prefix's ids."""
        if path.blocks is None:
            ids = self.run_blocks(path.runs)
            if len(path.runs) != 1:
                return ids
            path.blocks = ids
        return path.blocks

    def check_path(self, path: NodePath) -> None:
        """A kept path whose node still has its generation equals a fresh walk, and its cached
        block ids (a one-run path only, read-only) equal the path's blocks."""
        if path.generation < 0 or not self.is_valid(path.node, path.generation):
            return
        runs, root = self.path_runs(path.node, 0)
        assert (path.runs, path.root, path.depth) == (runs, root, int(self.depth[path.node])), "kept path drifted"
        if path.blocks is not None:
            assert len(runs) == 1 and not path.blocks.flags.writeable, "a bent or writable path caches ids"
            assert np.array_equal(path.blocks, self.run_blocks(runs)), "a kept path's block ids differ"

    @staticmethod
    def slot_at_depth(runs: list[tuple[int, int]], depth: np.ndarray, target: int) -> int:
        """The slot at ``target`` depth on a path given as runs."""
        for first, last in runs:
            low = depth.item(first)
            if low <= target <= low + last - first:  # a run's depths are consecutive
                return first + target - low
        raise KeyError(target)

    def clip_runs(self, runs: list[tuple[int, int]], max_depth: int, min_depth: int = 0) -> list[tuple[int, int]]:
        """The part of a path (runs, deepest first) at depths in ``(min_depth, max_depth]``."""
        depth = self.depth.item
        clipped = []
        for first, last in runs:
            low = depth(first)
            high = low + last - first  # a run's depths are consecutive
            if low > max_depth or high <= min_depth:
                continue
            clipped.append((first + max(0, min_depth + 1 - low), last - max(0, high - max_depth)))
        return clipped

    def last_block_value(self, slot: int) -> int:
        """The keyed value of a node's own block (its running sum minus its parent's); for a
        root, the namespace seed. Checkpoints anchored on the node are keyed by it."""
        if self.is_root[slot]:
            return int(self.key_sums[slot])
        return (int(self.key_sums[slot]) - int(self.key_sums[self.parent[slot]])) % 2**64

    def first_pending_depth(self, runs: list[tuple[int, int]]) -> int | None:
        """Shallowest depth on a path (runs, deepest first) whose node is still pending."""
        for first, last in reversed(runs):
            waiting = np.flatnonzero(self.pending[first : last + 1])
            if waiting.size:
                return int(self.depth[first] + waiting[0])
        return None

    def attached_slots(self) -> np.ndarray:
        """Attached non-root slots."""
        return np.flatnonzero(self.attached[: self._high] & ~self.is_root[: self._high])

    def check_invariants(self) -> None:
        high = self._high
        attached = self.attached[:high]
        roots = self.is_root[:high]
        nodes = np.flatnonzero(attached & ~roots)
        assert nodes.size == self._num_attached, "attached-node count drifted"
        parents = self.parent[nodes]
        assert np.all(parents >= 0) and np.all(self.attached[parents]), "attached node under a detached parent"
        assert np.all(self.depth[nodes] == self.depth[parents] + 1), "depth is not parent depth + 1"
        counts = np.bincount(parents, minlength=high)[:high]
        assert np.array_equal(counts[attached], self.num_children[:high][attached]), "child counts drifted"
        heads = self.run_head[nodes]
        assert np.all(heads <= nodes), "run head after its node"
        for slot, head in zip(nodes.tolist(), heads.tolist()):
            if slot != head:
                assert self.parent[slot] == slot - 1 and self.run_head[slot - 1] == head, "broken run"
        has_mm = np.zeros(high, dtype=np.int64)
        has_mm[list(self.extra_identity)] = 1
        assert set(self.extra_identity) <= set(nodes.tolist()), "identity kept for a detached node"
        assert np.array_equal(self.mm_count[nodes], self.mm_count[parents] + has_mm[nodes]), "mm counts drifted"
        self._index.check_invariants()
        assert len(self._recent_paths) <= RECENT_PATHS, "path memo over its bound"
        for slot, path in self._recent_paths.items():
            assert path.node == slot, "path memo filed under another slot"
            self.check_path(path)
        entries = self._index.items()
        assert sorted(slot for _, slot in entries) == nodes.tolist(), "key index differs from attached nodes"
        assert all(int(self.key[slot]) == key for key, slot in entries), "index key differs from node key"
        assert not set(self._free_slots) & set(np.flatnonzero(attached).tolist()), "free slot in use"
        assert len(set(self._free_slots)) == len(self._free_slots), "slot freed twice"
        assert len(self._free_slots) + int(attached.sum()) == high, "slot leaked"
        root_slots = set(self._roots.values())
        assert self._root_namespaces == {slot: ns for ns, slot in self._roots.items()}, "root inverse drifted"
        assert root_slots == set(np.flatnonzero(attached & roots).tolist()), "a root is not its namespace's"
        assert self._childless_roots == {s for s in root_slots if self.num_children[s] == 0}, "childless roots drifted"
