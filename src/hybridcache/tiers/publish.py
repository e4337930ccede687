"""The write phase of a ``TieredStore``: store a prefix into the tiers, keep the ledger of what
was stored, and judge the host tier's evictions by it.

Owns the ledger of what this process published (:class:`PublishIndex`: the tree of the chunk
digests its checkpoints stand on, which of them end a checkpoint it published, which are in
flight, and the lock guarding all three) and the rules on it, dead weight and demotion
(:class:`PublishLedger`). An :class:`EncodedPrefix` is one ``store_prefix`` call's own: the
objects it encoded, each at most once; a :class:`PublishReport` is a frozen value.

Write-through, chunks first: into the top local tier (host, else disk) and the shared tier, the
KV chunks of ``[0, step)`` the tier lacks (put-if-absent), then, only once every one of them is
confirmed stored, the checkpoint. A writer that dies in between leaves orphan chunks, never a
usable partial checkpoint. The host tier's evictions are demoted to the disk tier (write-back)
unless they are dead weight: a checkpoint whose chunks are gone from every tier, or a chunk no
checkpoint in any tier needs (as far as this process knows).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidKeyError, InvalidTypeError, StoreError
from hybridcache.tiers.backends.base import PutOutcome
from hybridcache.tiers.keys import KeyChain, ObjectKey, ObjectKind
from hybridcache.tiers.objects import encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.tier_calls import TierCalls, TierSkipped, failure_reason

ArraysFor = Callable[[int], Mapping[str, np.ndarray]]
_CONFIRMED = (PutOutcome.STORED, PutOutcome.PRESENT)
_DEMOTION_COUNTERS = {
    PutOutcome.STORED: "demoted_to_disk",
    PutOutcome.PRESENT: "demoted_already_on_disk",
    PutOutcome.REJECTED: "disk_demotion_refused",  # full, or a read-only disk tier
}


# An upper bound of one node's memory (tracemalloc, CPython 3.11, 64-bit): the digest (65 B),
# its OrderedDict entry with the parent reference (~100 B), a child-list slot in its parent
# (~40 B, amortized) and, for a checkpoint, a set entry (~60 B).
NODE_BYTES = 320
DEFAULT_BUDGET_BYTES = 32 << 20
MAX_JUDGED_NODES = 4096  # a subtree larger than this is not judged (its chunk is demoted)



@dataclass(frozen=True)
class PublishReport:
    """What one ``store_prefix`` did, per tier: chunks newly stored, and whether the checkpoint is
    stored there (False: a chunk was refused or the store failed, so it was never put)."""

    chunks_stored: Mapping[str, int]
    checkpoint_stored: Mapping[str, bool]
    bytes_written: Mapping[str, int]


@dataclass
class EncodedPrefix:
    """The objects of one prefix (the checkpoint at ``step`` of ``chain`` and the KV chunks of
    ``[0, step)``), encoded on first use and kept for the next tier: ``chunk_arrays(i)`` and
    ``state_arrays()`` are called only for objects some tier lacks."""

    chain: KeyChain
    step: int
    chunk_arrays: ArraysFor
    state_arrays: Callable[[], Mapping[str, np.ndarray]]
    auth_key: bytes | None
    checkpoint_name: str = field(init=False)
    chunk_names: list[str] = field(init=False)
    _index_of: dict[str, int] = field(init=False, repr=False)
    _encoded: dict[str, bytes] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.checkpoint_name = self.chain.checkpoint_names[self.step]
        self.chunk_names = list(self.chain.chunk_names[: self.step // self.chain.chunk_size])
        self._index_of = {name: index for index, name in enumerate(self.chunk_names)}

    def chunk(self, name: str) -> bytes:
        if name not in self._encoded:
            index = self._index_of[name]
            self._encoded[name] = encode_kv_chunk(self.chain, index, self.chunk_arrays(index), auth_key=self.auth_key)
        return self._encoded[name]

    def checkpoint(self) -> bytes:
        if self.checkpoint_name not in self._encoded:
            state = self.state_arrays()
            self._encoded[self.checkpoint_name] = encode_checkpoint(self.chain, self.step, state, auth_key=self.auth_key)
        return self._encoded[self.checkpoint_name]


class PublishLedger:
    def __init__(self, calls: TierCalls, index: PublishIndex | None = None) -> None:
        self.calls = calls
        self.index = PublishIndex() if index is None else index

    # --- write-through ---------------------------------------------------------------------------

    def store(self, prefix: EncodedPrefix) -> PublishReport:
        """Store ``prefix`` into the top local tier and the shared tier, chunks first; in the
        ledger (in flight) while it is written."""
        stored, published, written = {}, {}, {}
        digest = self.index.begin(prefix.chain, prefix.step)
        try:
            for tier in self._write_through_tiers():
                stored[tier], published[tier], written[tier] = self._store_into(tier, prefix)
        finally:
            self.index.end(digest)
        return PublishReport(stored, published, written)

    def _write_through_tiers(self) -> list[str]:
        """The top local tier (host, else disk) and the shared one: disk is otherwise fed by
        the host tier's demotions."""
        tiers = self.calls.tiers
        local = next((tier for tier in ("host", "disk") if tier in tiers), None)
        return [tier for tier in (local, "shared") if tier in tiers]

    def _store_into(self, tier: str, prefix: EncodedPrefix) -> tuple[int, bool, int]:
        """Missing chunks first (also when the checkpoint is there: a store may have evicted
        one part of the entry on its own), then the checkpoint if absent and every chunk is in.
        Returns the chunks newly stored, whether the checkpoint is there, the bytes written."""
        count, call = self.calls.count, self.calls.call
        try:
            present = call(tier, "exists", [prefix.checkpoint_name, *prefix.chunk_names])
            items = [(name, prefix.chunk(name)) for name, here in zip(prefix.chunk_names, present[1:]) if not here]
            outcomes = call(tier, "put_if_absent", items) if items else []
            new_chunks = sum(outcome is PutOutcome.STORED for outcome in outcomes)
            self.calls.changed(tier, [name for (name, _), outcome in zip(items, outcomes) if outcome is PutOutcome.STORED], [])
            written = sum(len(value) for (_, value), outcome in zip(items, outcomes) if outcome is PutOutcome.STORED)
            if any(outcome not in _CONFIRMED for outcome in outcomes):
                count(f"{tier}_publish_refused")
                return new_chunks, False, written
            published = present[0]
            if not published:
                value = prefix.checkpoint()
                (outcome,) = call(tier, "put_if_absent", [(prefix.checkpoint_name, value)])
                published = outcome in _CONFIRMED
                if outcome is PutOutcome.STORED:
                    self.calls.changed(tier, [prefix.checkpoint_name], [])
                    count(f"{tier}_checkpoints_stored")
                    written += len(value)
        except TierSkipped:
            count(f"{tier}_publish_skipped")
            return 0, False, 0
        except StoreError as error:
            count(f"{tier}_publish_failed")
            count(f"{tier}_publish_failed_{failure_reason(error).value}")
            return 0, False, 0
        count(f"{tier}_chunks_stored", new_chunks)
        count(f"{tier}_bytes_written", written)
        return new_chunks, published, written

    # --- demotion --------------------------------------------------------------------------------

    def demote(self, name: str, value: bytes) -> None:
        """The host tier evicted ``name``: write it back to disk unless it is dead weight (the
        disk copy is reported before the host's loss, so a listener never loses sight of it)."""
        self._write_back(name, value)
        self.calls.changed("host", [], [name])

    def _write_back(self, name: str, value: bytes) -> None:
        count = self.calls.count
        if "disk" not in self.calls.tiers:
            count("host_dropped")
            return
        if self.is_dead_weight(name):
            count("host_dropped_dead_weight")
            return
        try:
            (outcome,) = self.calls.call("disk", "put_if_absent", [(name, value)])
            count(_DEMOTION_COUNTERS[outcome])
        except StoreError:
            count("disk_demotion_failed")
            return
        if outcome is PutOutcome.STORED:
            self.calls.changed("disk", [name], [])

    def is_dead_weight(self, name: str) -> bool:
        """A checkpoint a chunk of whose prefix is gone from every tier, or a chunk that no
        checkpoint in any tier needs, can never serve a hit (as far as this process knows)."""
        try:
            key = ObjectKey.from_name(name)
        except InvalidKeyError:
            return False  # not an object of ours to judge
        present_anywhere = self.calls.present_anywhere
        if key.kind is ObjectKind.CHECKPOINT:
            chunks = self.index.chunks_needed(key.digest)
            if chunks is None:
                return False
            dead = not all(present_anywhere([ObjectKey(ObjectKind.KV_CHUNK, d).name for d in chunks]))
            if dead:
                self.index.forget_checkpoint(key.digest)
            return dead
        users = self.index.checkpoints_needing(key.digest)
        if users is None:
            return False  # not ours to judge (fetched, or another process's), or its checkpoint comes next
        return not any(present_anywhere([ObjectKey(ObjectKind.CHECKPOINT, d).name for d in users]))

    def was_published(self, checkpoint: ObjectKey) -> bool:
        """Whether this process published ``checkpoint`` (and still remembers it)."""
        return self.index.chunks_needed(checkpoint.digest) is not None

    def check_invariants(self) -> None:
        self.index.check_invariants()


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
