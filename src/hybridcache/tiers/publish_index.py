"""What one process published, for the dead-weight rule of the host tier's demotions.

Owns the tree of the chunk digests its checkpoints stand on (each known chunk's parent and
children, in insertion order), which of those chunks end a checkpoint it published, which
checkpoints are being published right now, and the lock guarding all three.

Keys chain (``hybridcache.tiers.keys``): the digest of chunk ``i`` names its whole prefix, and the
checkpoint at step ``(i+1)*C`` shares that digest. So the chunks a checkpoint needs are the path
from its digest to the root, and the checkpoints that need a chunk are the marked digests of
its subtree: one 32-byte node per chunk, never a list of names per checkpoint (a 2,048-token
request at chunk size 8 held 5.9 MB of names that way). The tree is bounded in bytes: past the
budget the oldest root is forgotten with its subtree (an object nobody remembers is not judged,
just demoted).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.tiers.keys import KeyChain

# An upper bound of one node's memory (tracemalloc, CPython 3.11, 64-bit): the digest (65 B),
# its OrderedDict entry with the parent reference (~100 B), a child-list slot in its parent
# (~40 B, amortized) and, for a checkpoint, a set entry (~60 B).
NODE_BYTES = 320
DEFAULT_BUDGET_BYTES = 32 << 20
MAX_JUDGED_NODES = 4096  # a subtree larger than this is not judged (its chunk is demoted)


class PublishIndex:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise InvalidTypeError("budget_bytes must be an int")
        if budget_bytes < NODE_BYTES:
            raise InvalidArgumentError(f"budget_bytes must be at least {NODE_BYTES}, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._parent: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._children: dict[bytes, list[bytes]] = {}
        self._checkpoints: set[bytes] = set()
        self._publishing: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The memory the tree may hold, by the per-node bound."""
        return len(self._parent) * NODE_BYTES

    def begin(self, chain: KeyChain, step: int) -> bytes:
        """Remember the checkpoint at ``step`` of ``chain`` and its chunks, marked as being
        published until :meth:`end`; returns the checkpoint's digest."""
        digests = [key.digest for key in chain.chunk_keys[: step // chain.chunk_size]]
        with self._lock:
            for index, digest in enumerate(digests):
                if digest not in self._parent:
                    parent = digests[index - 1] if index else None
                    self._parent[digest] = parent
                    if parent is not None:
                        self._children.setdefault(parent, []).append(digest)
            self._checkpoints.add(digests[-1])
            self._publishing[digests[-1]] += 1
            self._trim()
        return digests[-1]

    def end(self, digest: bytes) -> None:
        with self._lock:
            self._publishing[digest] -= 1
            if self._publishing[digest] <= 0:
                del self._publishing[digest]

    def chunks_needed(self, digest: bytes) -> list[bytes] | None:
        """The chunk digests the checkpoint ``digest`` stands on, root first; None when this
        process did not publish it (or forgot it)."""
        with self._lock:
            if digest not in self._checkpoints:
                return None
            path = []
            node: bytes | None = digest
            while node is not None:
                path.append(node)
                node = self._parent[node]
            return path[::-1]

    def checkpoints_needing(self, digest: bytes) -> list[bytes] | None:
        """The published checkpoints standing on chunk ``digest``; None when it is not ours
        to judge: unknown, needed by no checkpoint we remember, one of them being published
        right now, or too many to ask about."""
        with self._lock:
            if digest not in self._parent:
                return None
            users, stack, seen = [], [digest], 0
            while stack:
                node = stack.pop()
                seen += 1
                if seen > MAX_JUDGED_NODES or node in self._publishing:
                    return None
                if node in self._checkpoints:
                    users.append(node)
                stack.extend(self._children.get(node, ()))
            return users or None

    def forget_checkpoint(self, digest: bytes) -> None:
        with self._lock:
            self._checkpoints.discard(digest)

    def _trim(self) -> None:
        """Forget the oldest roots, with their subtrees, until the tree fits its budget."""
        while self.nbytes > self.budget_bytes:
            root = next(iter(self._parent))  # a parent is always older than its children
            stack = [root]
            while stack:
                node = stack.pop()
                stack.extend(self._children.pop(node, ()))
                del self._parent[node]
                self._checkpoints.discard(node)

    def check_invariants(self) -> None:
        with self._lock:
            assert self.nbytes <= self.budget_bytes, "the publish index is over its byte budget"
            for node, parent in self._parent.items():
                assert parent is None or node in self._children.get(parent, ()), "a node is missing from its parent"
            for parent, children in self._children.items():
                assert parent in self._parent and children, "children of an unknown or childless node"
                assert all(self._parent.get(child) == parent for child in children), "children and parents disagree"
            assert self._checkpoints <= set(self._parent), "a checkpoint stands on a forgotten chunk"
            assert all(count > 0 for count in self._publishing.values()), "a publish ended twice"
