"""Sparse lookup of published checkpoints and their exact verification.

Owns: the buckets ``(namespace, step, anchor block value) -> records`` and, per namespace, the
sorted list of steps that have at least one bucket (with a count per step). A request's own key
at step ``s`` is ``(s, the keyed value of its block ending at the anchor)`` (the namespace seed
for a root anchor): one block hashed per probe. The prefix before the anchor is then compared
exactly against the anchor's trie path, and the tail of a mid-block checkpoint against the
record's tail tokens; keys only narrow the search. Candidate steps are read from the sorted list with bisect (never
re-sorted per request); removal is O(bucket) through the key stored in the record.

The index is auxiliary: an entry may go stale (its record released, its anchor evicted). The
records are the source of truth; ``verify`` reports what it found and the lifecycle cleans up.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import dataclass

import numpy as np

from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.prefix_cache.node import NodeTable
from hybridcache.prefix_cache.routed_experts import RoutedExpertStore
from hybridcache.sequence import Sequence
from hybridcache.types import Namespace

_EPOCHS = itertools.count()


class VerifyStatus(enum.Enum):
    HIT = "hit"
    REQUEST_MISMATCH = "request_mismatch"  # a valid checkpoint that does not fit this request
    STALE_INDEX_ENTRY = "stale_index_entry"  # the entry does not describe its record any more
    STALE_CHECKPOINT = "stale_checkpoint"  # the record is not a usable published checkpoint


@dataclass(frozen=True)
class Verdict:
    status: VerifyStatus
    reason: str = ""


HIT = Verdict(VerifyStatus.HIT)


class CheckpointIndex:
    def __init__(self, nodes: NodeTable, experts: RoutedExpertStore, block_size: int) -> None:
        self._nodes = nodes
        self._experts = experts
        self._block_size = block_size
        self._buckets: dict[tuple[Namespace, int, int], list[CheckpointRecord]] = {}
        self._steps: dict[Namespace, list[int]] = {}
        self._step_counts: dict[tuple[Namespace, int], int] = {}
        # Advances whenever a miss could turn into a hit (a record indexed or made ready, blocks
        # computed, routed experts cached): a remembered miss is reused only while it has not
        # moved. Drawn from one process-wide counter, so two indexes never share an epoch and
        # a search remembered by another trie never passes for this one's.
        self.epoch = next(_EPOCHS)

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    def add(self, record: CheckpointRecord, key: tuple[int, int] | None = None) -> None:
        """Index ``record`` under ``key`` (its own key by default); adding twice is a no-op."""
        key = record.key if key is None else key
        bucket = self._buckets.setdefault((record.namespace, *key), [])
        if any(entry is record for entry in bucket):
            return
        bucket.append(record)
        self.invalidate_searches()
        if len(bucket) == 1:
            self._count_step(record.namespace, key[0], +1)

    def remove(self, record: CheckpointRecord, key: tuple[int, int] | None = None) -> bool:
        """Remove the entry of ``record`` under ``key`` (its own key by default)."""
        key = record.key if key is None else key
        full_key = (record.namespace, *key)
        bucket = self._buckets.get(full_key)
        if bucket is None:
            return False
        kept = [entry for entry in bucket if entry is not record]
        if len(kept) == len(bucket):
            return False
        if kept:
            self._buckets[full_key] = kept
        else:
            del self._buckets[full_key]
            self._count_step(record.namespace, key[0], -1)
        return True

    def invalidate_searches(self) -> None:
        self.epoch = next(_EPOCHS)

    def _count_step(self, namespace: Namespace, step: int, delta: int) -> None:
        count = self._step_counts.get((namespace, step), 0) + delta
        steps = self._steps.setdefault(namespace, [])
        if count == 0:
            del self._step_counts[(namespace, step)]
            del steps[bisect.bisect_left(steps, step)]
            if not steps:
                del self._steps[namespace]
        else:
            if delta > 0 and count == 1:
                bisect.insort(steps, step)
            self._step_counts[(namespace, step)] = count

    def candidate_steps(self, namespace: Namespace, after: int, up_to: int) -> list[int]:
        """Indexed steps ``s`` with ``after < s <= up_to``, deepest first."""
        steps = self._steps.get(namespace)
        if not steps:
            return []
        low = bisect.bisect_right(steps, after)
        high = bisect.bisect_right(steps, up_to)
        return steps[low:high][::-1]

    def bucket(self, namespace: Namespace, key: tuple[int, int]) -> tuple[CheckpointRecord, ...]:
        return tuple(self._buckets.get((namespace, *key), ()))

    def entries(self):
        """Every (key, record) entry, for cleanup and invariant checks."""
        for (_, *key), bucket in self._buckets.items():
            for record in bucket:
                yield tuple(key), record

    def num_steps(self, namespace: Namespace) -> int:
        return len(self._steps.get(namespace, ()))

    # --- exact verification ----------------------------------------------------------------

    def verify(self, record: CheckpointRecord, key: tuple[int, int], seq: Sequence) -> Verdict:
        """Decide whether ``record`` is a usable published checkpoint that fits the request at
        its step: everything but the prefix before the anchor, which the trie compares against
        the anchor's path (``BlockTrie._path_to_anchor``). A hit is always the shared ``HIT``
        verdict, so callers may test it by identity."""
        nodes, size = self._nodes, self._block_size
        step, tail = record.step, record.tail_tokens.size
        anchor_depth = step // size
        if record.state is not CheckpointState.PUBLISHED or record.slot < 0:
            return Verdict(VerifyStatus.STALE_CHECKPOINT, f"record {record.record_id} is {record.state.value}")
        if step <= 0 or (tail > 0) != (record.frozen_block >= 0):
            return Verdict(VerifyStatus.STALE_CHECKPOINT, "partial checkpoint without frozen block, or the reverse")
        if not nodes.is_valid(record.anchor, record.anchor_generation):
            return Verdict(VerifyStatus.STALE_CHECKPOINT, "anchor detached")
        if record.anchor_path.depth != anchor_depth or tail != step % size:
            return Verdict(VerifyStatus.STALE_CHECKPOINT, "anchor depth or tail length disagrees with the step")
        if not record.ready:
            return Verdict(VerifyStatus.REQUEST_MISMATCH, "the producer's save is still in flight")
        if key != record.key:
            return Verdict(VerifyStatus.STALE_INDEX_ENTRY, "index key differs from the record's key")
        if record.namespace is not seq.namespace and record.namespace != seq.namespace:
            return Verdict(VerifyStatus.STALE_INDEX_ENTRY, "namespace differs")
        if step > seq.num_valid - 1:
            return Verdict(VerifyStatus.REQUEST_MISMATCH, "step not before the request's last token")
        if not seq.is_boundary_safe(step):
            return Verdict(VerifyStatus.REQUEST_MISMATCH, "step inside a multimodal span of the request")
        if tail:
            anchor_tokens = anchor_depth * size
            if not np.array_equal(record.tail_tokens, seq.token_view(anchor_tokens, step)):
                return Verdict(VerifyStatus.REQUEST_MISMATCH, "tail tokens differ")
            if record.tail_identity != seq.spans_overlapping(anchor_tokens, step):
                return Verdict(VerifyStatus.REQUEST_MISMATCH, "tail multimodal identity differs")
            if seq.want_routed_experts and record.tail_experts is None:
                return Verdict(VerifyStatus.REQUEST_MISMATCH, "tail has no routed experts")
        return HIT
