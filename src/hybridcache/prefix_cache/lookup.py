"""Exact path lookup: which trie path equals a sequence's tokens, and how deep.

Owns one memo: which child of a namespace root a first block's tokens led to (its exact
bytes, the root and the child's handle), so a text-only request finds its root's child by one
dict probe instead of hashing its first block and searching the key index: every lookup from a
root makes that step, right after a long comparison has evicted the caches. An entry is taken
only while its child is attached under the same generation (its parent and tokens cannot have
changed), so the memo is never maintained on attach or detach; it keeps the most recent
``_FIRST_BLOCK_MEMO_BYTES`` worth of entries. Otherwise it reads the node table, the token store
and the keyer, and writes only the sequence's verified-node facts (``prefix_state.trie.verified``
and the ``NodePath`` kept for it): caches of what was compared, never tentative state, so a
rolled-back match keeps them.

Keys only narrow the search. A path is accepted after comparing every token beyond the last
verified node (runs of the token store against the sequence, in place), the multimodal
identity of every span block, and that the path leads to the verified node, hence to the
namespace root. A key collision falls back to an exact block-by-block walk.

Nodes attached together get consecutive slots, so a cached prompt's path is one run of the
table. ``descend`` follows that run by comparing tokens alone and hashes only the blocks after
the point where it leaves the sequence: a fully cached prompt costs one comparison and one
block hashed (its first, to find the child), not a key per block on top of the comparison.
"""

from __future__ import annotations

import numpy as np

from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.prefix_cache.node import NodePath, NodeTable, Runs
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.sequence import Sequence
from hybridcache.types import NO_NODE

# The memo of root children by first block keeps at most this many bytes of token rows.
_FIRST_BLOCK_MEMO_BYTES = 1 << 21


class PathLookup:
    def __init__(self, nodes: NodeTable, tokens: TokenStore, keyer: BlockKeyer, block_size: int, track_pending: bool) -> None:
        self.nodes = nodes
        self.tokens = tokens
        self.keyer = keyer
        self.block_size = block_size
        self.track_pending = track_pending
        self._root_children: dict[tuple[int, bytes], tuple[int, int]] = {}  # (root, first block) -> child handle
        self._memo_entries = max(64, _FIRST_BLOCK_MEMO_BYTES // (4 * block_size))

    def root(self, namespace) -> int:
        slot = self.nodes.find_root(namespace)
        return self.nodes.root(namespace, self.keyer.namespace_seed(namespace)) if slot is None else slot

    def handle(self, node: int) -> tuple[int, int]:
        """``(slot, generation)`` of an attached node: what a cursor remembers."""
        return node, int(self.nodes.generation[node])

    def verified_or_root(self, seq: Sequence) -> tuple[int, int]:
        state = seq.prefix_state
        position = state.trie
        if self.nodes.is_valid(position.verified, position.verified_generation):
            return position.verified, int(self.nodes.depth[position.verified])
        return self.root(seq.namespace), 0

    def resume_point(self, seq: Sequence) -> tuple[int, int]:
        """The deepest node known to match ``seq`` at or below its computed blocks."""
        state = seq.prefix_state
        position = state.trie
        if position.cursor != NO_NODE and self.nodes.is_valid(position.cursor, position.cursor_generation):
            node = position.cursor
            depth = int(self.nodes.depth[node])
            computed_blocks = seq.num_computed // self.block_size
            if depth > computed_blocks:
                _, node = self.nodes.path_runs(node, computed_blocks)
                depth = computed_blocks
            return node, depth
        return self.root(seq.namespace), 0

    def path_of(self, seq: Sequence, node: int, depth: int, known: NodePath | None = None) -> NodePath:
        """The path of a verified node, reused while the node is unchanged; ``known`` is that
        path when the caller holds it (a checkpoint record's anchor path)."""
        state = seq.prefix_state
        position = state.trie
        if known is None:
            generation = int(self.nodes.generation[node])
            cached = position.verified_path
            if cached is not None and (cached.node, cached.generation, cached.depth) == (node, generation, depth):
                return cached  # the path of an attached node never changes (monotonic topology)
            runs, root = self.nodes.path_runs(node, 0)
            known = NodePath(node, depth, runs, root, generation)
        waiting = self.nodes.first_pending_depth(known.runs) if self.track_pending else None
        if waiting is not None:
            # Verified only up to the first node still pending; that node's readiness changes
            # without the topology changing, so the clipped path is recomputed next time
            # (generation -1). A node that is not pending never becomes pending again.
            runs, root = known.runs, known.root
            depth = waiting - 1
            node = root if depth == 0 else NodeTable.slot_at_depth(runs, self.nodes.depth, depth)
            known = NodePath(node, depth, self.nodes.clip_runs(runs, depth), root)
        position.verified_path = known
        return known

    def base_path(self, seq: Sequence) -> NodePath:
        return self.path_of(seq, *self.verified_or_root(seq))

    def extend_verified(self, seq: Sequence, limit: int) -> tuple[int, int]:
        """The deepest node at or above ``limit`` whose path equals the sequence's tokens,
        hashing and comparing only blocks beyond the node verified before."""
        nodes, state = self.nodes, seq.prefix_state
        position = state.trie
        if nodes.is_valid(position.verified, position.verified_generation):
            node = position.verified
        elif nodes.is_valid(position.cursor, position.cursor_generation):
            node = position.cursor
        else:
            node = self.root(seq.namespace)
        depth = int(nodes.depth[node])
        if depth > limit:
            _, node = nodes.path_runs(node, limit)
            return node, limit
        if depth < limit:  # else as deep as asked already (a match right after ingest): keys
            # resume where they are needed (attach, descend), so nothing else is owed here
            node, depth = self.descend(seq, node, depth, limit)
        position.verified, position.verified_generation = node, int(nodes.generation[node])
        return node, depth

    def fresh_from_root(self, seq: Sequence) -> bool:
        """Whether ``extend_verified`` would start ``seq`` at its namespace root: nothing
        verified or cursored yet (a request arriving), and no pending node to clip paths at."""
        position = seq.prefix_state.trie
        return position.verified == NO_NODE and position.cursor == NO_NODE and not self.track_pending

    def verify_from_root(self, seq: Sequence, limit: int) -> NodePath:
        """``path_of(extend_verified(seq, limit))`` of a ``fresh_from_root`` request as one
        chain: the same descent from the root, verified node, resumed keys and path, without
        the validity checks that cannot hold for it; a path the run from the root's child
        covers alone is that one run, built without walking it up."""
        nodes = self.nodes
        root = self.root(seq.namespace)
        node, depth = self._along_run(seq, root, 0, limit)
        self.keyer.resume_at(seq, depth, nodes.key_sums.item(node))
        run_depth = depth
        if depth < limit:
            depth, node, _ = self.deepest_cached(seq, self.keyer.extend(seq), node, depth, limit)
        position = seq.prefix_state.trie
        generation = nodes.generation.item(node)
        position.verified, position.verified_generation = node, generation
        if depth != run_depth:
            return self.path_of(seq, node, depth)
        position.verified_path = path = NodePath(node, depth, [(node - depth + 1, node)] if depth else [], root, generation)
        return path

    def descend(self, seq: Sequence, base: int, base_depth: int, limit: int) -> tuple[int, int]:
        """The deepest node at or above ``limit`` below ``base`` whose path equals the
        sequence's tokens: first along one run of consecutive slots, by comparing tokens only
        (a path attached at once is one run: no block of it is hashed), then, where the run
        leaves the sequence's path, by the keys of the blocks after it. The sequence's keys
        resume from the node reached."""
        node, depth = self._along_run(seq, base, base_depth, limit)
        self.keyer.resume_at(seq, depth, int(self.nodes.key_sums[node]))
        if depth < limit:
            depth, node, _ = self.deepest_cached(seq, self.keyer.extend(seq), node, depth, limit)
        return node, depth

    def _along_run(self, seq: Sequence, base: int, base_depth: int, limit: int) -> tuple[int, int]:
        """How far below ``base`` (towards ``limit``) the sequence follows one run of the table
        exactly: the run continues from ``base``'s next slot when that slot is its child, else
        from the child the next block's key names (one block hashed). Tokens are compared in
        place; multimodal identity is checked for the part taken."""
        if limit <= base_depth:
            return base, base_depth
        self.keyer.identity(seq)  # the sequence's multimodal blocks, for same_identity
        child = self._run_child(seq, base, base_depth)
        if child < 0:
            return base, base_depth
        tokens, size = self.tokens, self.block_size
        length = self._run_length(child, limit - base_depth)
        last = child + length - 1
        if not tokens.equals(child, last, seq, base_depth * size):
            length = tokens.matching_rows(child, last, seq, base_depth * size)
            last = child + length - 1
        if length == 0:
            return base, base_depth
        depth = base_depth + length
        if not self.same_identity(seq, [(child, last)], base, last, base_depth, depth):
            return base, base_depth
        return last, depth

    def _run_length(self, child: int, most: int) -> int:
        """How many slots from ``child`` on (at most ``most``) stay in ``child``'s run."""
        nodes = self.nodes
        last = child + most - 1
        head = nodes.run_head.item(child)
        if last < nodes.capacity and nodes.attached.item(last) and nodes.run_head.item(last) == head:
            # an attached run member's parent is the slot before it, attached, in the same run
            # (NodeTable.check_invariants): every slot from ``child`` to ``last`` stays in it
            return most
        window = slice(child, min(child + most, nodes.capacity))
        same_run = (nodes.run_head[window] == head) & nodes.attached[window]
        # the first slot leaving the run; argmin (a C method) instead of ``all`` (a Python
        # wrapper, ~0.8 µs) then argmin: 0 also when every slot stays in the run
        length = int(same_run.argmin())
        return same_run.size if same_run[length] else length

    def _run_child(self, seq: Sequence, node: int, depth: int) -> int:
        """The child of ``node`` a run along the sequence starts at: the next slot when it is
        a child (consecutive slots), else the child keyed like the sequence's next block; -1
        when neither is. Below a root, for text on both sides, first the memo's child for the
        sequence's first block."""
        nodes = self.nodes
        if depth == 0 and not seq.spans and not nodes.extra_identity:
            return self._root_child(seq, node)
        return self._next_or_keyed_child(seq, node, depth)

    def _root_child(self, seq: Sequence, root: int) -> int:
        """``_next_or_keyed_child`` of a root for a text-only sequence in a text-only trie,
        through the memo. Text children of one root have distinct first blocks (equal tokens
        make equal keys, and an exact path is attached once), so the child whose first block
        is the sequence's is the one the general probe finds; where the key of the first block
        collides with a sibling's that the key index lists first, the general probe takes the
        sibling and misses where the memo finds the equal child (a hit either way is exact)."""
        first_block = (root, seq.token_words(0, self.block_size).tobytes())
        memo = self._root_children
        known = memo.get(first_block)
        if known is not None and self.nodes.is_valid(*known):
            return known[0]
        child = self._next_or_keyed_child(seq, root, 0)
        if child >= 0:
            if len(memo) >= self._memo_entries:
                del memo[next(iter(memo))]  # the oldest entry
            memo[first_block] = child, self.nodes.generation.item(child)
        return child

    def _next_or_keyed_child(self, seq: Sequence, node: int, depth: int) -> int:
        nodes = self.nodes
        following = node + 1
        if following < nodes.capacity and nodes.attached.item(following) and nodes.parent.item(following) == node:
            if self.tokens.equals(following, following, seq, depth * self.block_size):
                return following
        if (depth + 1) * self.block_size > seq.num_valid:
            return -1
        key = self.keyer.key_after(seq, depth, nodes.key_sums.item(node))
        for candidate in nodes.candidates(key):
            if nodes.parent.item(candidate) == node:
                return candidate
        return -1

    def deepest_cached(
        self, seq: Sequence, keys: np.ndarray, base: int, base_depth: int, limit: int
    ) -> tuple[int, int, Runs]:
        """Deepest depth in (base_depth, limit] whose node is an exact match of ``seq`` below
        ``base``; returns (depth, node, runs of the path from that node up to base_depth)."""
        nodes = self.nodes
        if limit <= base_depth or not nodes.has_key(int(keys[base_depth])):
            return base_depth, base, []
        low, high = base_depth + 1, limit
        if nodes.has_key(int(keys[high - 1])):
            low = high
        while low < high:  # invariant: depth `low` is present, everything above `high` absent
            middle = (low + high + 1) // 2
            if nodes.has_key(int(keys[middle - 1])):
                low = middle
            else:
                high = middle - 1
        for candidate in nodes.candidates(int(keys[low - 1])):
            if nodes.depth[candidate] != low:
                continue
            runs, ancestor = nodes.path_runs(candidate, base_depth)
            if ancestor == base and self.same_tokens(seq, runs) and self.same_identity(seq, runs, base, candidate, base_depth, low):
                return low, candidate, runs
        return self._walk(seq, keys, base, base_depth, limit)

    def _walk(self, seq: Sequence, keys: np.ndarray, base: int, base_depth: int, limit: int) -> tuple[int, int, Runs]:
        """Block-by-block exact walk; only taken when a key collision defeated the fast path."""
        nodes, size = self.nodes, self.block_size
        identities = seq.prefix_state.keys.mm_blocks
        node, depth = base, base_depth
        while depth < limit:
            expected_identity = identities.get(depth)
            for candidate in nodes.candidates(int(keys[depth])):
                if (
                    nodes.parent[candidate] == node
                    and nodes.extra_identity.get(candidate) == expected_identity
                    and self.tokens.equals(candidate, candidate, seq, depth * size)
                ):
                    node, depth = candidate, depth + 1
                    break
            else:
                break
        runs, _ = nodes.path_runs(node, base_depth)
        return depth, node, runs

    def same_tokens(self, seq: Sequence, runs: Runs) -> bool:
        depth, size, equals = self.nodes.depth, self.block_size, self.tokens.equals
        for first, last in runs:
            if not equals(first, last, seq, (int(depth[first]) - 1) * size):
                return False
        return True

    def same_identity(self, seq: Sequence, runs: Runs, base: int, node: int, base_depth: int, depth: int) -> bool:
        nodes = self.nodes
        if not nodes.extra_identity and not seq.prefix_state.keys.mm_blocks:
            return True  # text only on both sides
        expected = {i: spans for i, spans in seq.prefix_state.keys.mm_blocks.items() if base_depth <= i < depth}
        if int(nodes.mm_count[node] - nodes.mm_count[base]) != len(expected):
            return False
        return all(
            nodes.extra_identity.get(NodeTable.slot_at_depth(runs, nodes.depth, index + 1)) == spans
            for index, spans in expected.items()
        )

    def path_blocks(self, runs: Runs, max_depth: int) -> np.ndarray:
        """Block ids of a path in table order, up to ``max_depth``."""
        return self.nodes.run_blocks(self.nodes.clip_runs(runs, max_depth))

    def path_pending(self, runs: Runs, max_depth: int) -> np.ndarray:
        """Which nodes of a path (table order, up to ``max_depth``) are still pending."""
        return self.nodes.run_pending(self.nodes.clip_runs(runs, max_depth))

    def first_block_cached(self, seq: Sequence, base_path: NodePath) -> bool:
        """Whether the request's first block is cached at all (tells "no checkpoint" from
        "nothing cached" in the miss statistics)."""
        if base_path.depth > 0 or seq.num_valid < self.block_size:
            return base_path.depth > 0
        nodes = self.nodes
        first_key = self.keyer.key_after(seq, 0, int(nodes.key_sums[base_path.root]))
        return any(
            nodes.parent[slot] == base_path.root and not (self.track_pending and nodes.pending[slot])
            for slot in nodes.candidates(first_key)
        )

    def cached_depth(self, seq: Sequence, path: NodePath) -> int:
        """How deep the KV trie holds the request's prefix beyond a verified anchor (hashing
        only the blocks after it). Only a request that recomputes an overlap (MTP) needs KV
        beyond the anchor; for any other the anchor's depth is the answer, without a lookup."""
        limit = (seq.num_valid - 1) // self.block_size
        if limit <= path.depth or not seq.prefix_state.overlap.recompute_blocks:
            return path.depth
        node, depth = self.descend(seq, path.node, path.depth, limit)
        if self.track_pending:
            waiting = self.nodes.first_pending_depth(self.nodes.path_runs(node, path.depth)[0])
            if waiting is not None:
                depth = waiting - 1  # blocks nobody has computed yet are not cached KV
        return depth
