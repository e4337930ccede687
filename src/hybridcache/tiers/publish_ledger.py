"""The write phase of a ``TieredStore``: store a prefix into the tiers, keep the ledger of what
was stored, and judge the host tier's evictions by it.

Owns the ledger: a :class:`~hybridcache.tiers.publish_index.PublishIndex` (the chunks each
checkpoint this process published needs, the checkpoints each chunk is needed by, which are in
flight), and the rules on it, dead weight and demotion. An ``EncodedPrefix`` is one
``store_prefix`` call's own: the objects it encoded, each at most once.

Write-through, chunks first: into the top local tier (host, else disk) and the shared tier, the
KV chunks of ``[0, step)`` the tier lacks (put-if-absent), then, only once every one of them is
confirmed stored, the checkpoint. A writer that dies in between leaves orphan chunks, never a
usable partial checkpoint. The host tier's evictions are demoted to the disk tier (write-back)
unless they are dead weight: a checkpoint whose chunks are gone from every tier, or a chunk no
checkpoint in any tier needs (as far as this process knows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridcache.errors import InvalidKeyError, StoreError
from hybridcache.tiers.backends.base import PutOutcome
from hybridcache.tiers.keys import KeyChain, ObjectKey, ObjectKind
from hybridcache.tiers.objects import encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.publish_index import PublishIndex
from hybridcache.tiers.restore_values import PublishReport
from hybridcache.tiers.tier_calls import TierCalls, TierSkipped, failure_reason

ArraysFor = Callable[[int], Mapping[str, np.ndarray]]
_CONFIRMED = (PutOutcome.STORED, PutOutcome.PRESENT)
_DEMOTION_COUNTERS = {
    PutOutcome.STORED: "demoted_to_disk",
    PutOutcome.PRESENT: "demoted_already_on_disk",
    PutOutcome.REJECTED: "disk_demotion_refused",  # full, or a read-only disk tier
}


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
