"""The cache protocol as a Hypothesis state machine, checked against a plain reference model.

``CacheProtocolMachine`` is a ``RuleBasedStateMachine`` that drives the library's public API
the way a scheduler and an engine would, without the engine: sequences in random namespaces
(adapter, cache salt), with shared prefixes and multimodal spans, are matched, admitted
(runtime slot, eviction under pressure, block table, allocate, commit) or rejected
(rollback); they run forwards, extend by decode, reserve / publish / discard / abandon
checkpoint saves (prompt-end, mid-block, decode), pin and unpin restores and producer pins,
evict KV blocks and checkpoints, free sequences and clear the cache. Each run draws the trie
mode (hybrid with state checkpoints, or attention-only), whether trie nodes stay pending until
their forward ran (as the engine does), and whether block keys collide massively.

A plain reference model predicts and checks every outcome:

* ``content``: what each KV block holds, position by position. A forward writes a position
  once, with the *content* of that position (namespace, every token up to it, every multimodal
  span starting at or before it), into a block no other live sequence holds; restores and save
  copies move content between blocks exactly as an engine's copy plan would.
* ``kv_prefixes``: every prefix (namespace, tokens, spans) some forward computed, with its
  producer; an attention-only hit is *allowed* only on one of them.
* ``published``: every published checkpoint and the prefix its producer saved; a hybrid hit is
  allowed only on one of them that is ready, of the same namespace, with equal tokens and
  spans, ending before the last token, and when no recompute overlap is asked it must be the
  deepest such checkpoint whose path is computed (a miss with one available is a violation).
* ``state``: what each state slot holds (the prefix its recurrent state summarizes); a hybrid
  forward must start from a runtime state equal to the sequence's computed prefix.

Every hit is checked to be exact (its blocks, frozen block and state slot hold the requesting
sequence's content) and allowed; every step ends with ``check_invariants()`` and a model
consistency check; a ``clear`` leaves nothing evictable; at teardown, after everything is
released and the cache cleared, every pool is full.

The machine runs in CI as ``test_protocol_machine.TestCacheProtocol`` (a few dozen examples)
and for as long as asked through ``soak.py`` (``make soak``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridcache.cache import CacheComponents
from hybridcache.errors import InvalidStepError, OutOfBlocksError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import SlotRole, StatePool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie, MatchTxn
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.protocol import CacheProtocol
from hybridcache.protocol_values import Admission
from hybridcache.types import NO_BLOCK
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.keyers import TwoBitKeyer

__all__ = ["COUNTERS", "CacheProtocolMachine"]

B = 4
NUM_BLOCKS = 30
NUM_SLOTS = 8  # slot 0 reserved: 7 usable rows
CHECKPOINT_BUDGET = 3  # runtime cap 4
MAX_PER_ANCHOR = 2
MAX_SEQUENCES = 8
MAX_TOKENS = 56
DECODE_INTERVAL = 2 * B
NAMESPACES = ((None, None), ("lora-a", None), (None, "salt-1"), ("lora-a", "salt-1"))
BASES = (
    list(range(1, 41)),
    [1, 2, 3, 4, 5, 6] + list(range(100, 134)),  # shares 1.5 blocks with base 0
    [1, 2, 3, 4, 5, 6, 7, 8] + [9] * 32,  # shares 2 blocks with base 0
    list(range(200, 240)),
)
TOKEN = st.integers(0, 3)
SPAN = st.none() | st.tuples(st.integers(0, 12), st.integers(1, 6), st.sampled_from(["img-a", "img-b"]))
BASE_REQUEST = st.tuples(
    st.integers(0, len(BASES) - 1),  # base
    st.integers(1, 26),  # length taken from the base
    st.lists(TOKEN, max_size=4),  # extra tokens
    st.integers(0, len(NAMESPACES) - 1),  # namespace
    SPAN,
)
FOLLOW_UP = st.tuples(
    st.integers(0, 99),  # which earlier request
    st.lists(TOKEN, min_size=1, max_size=6),  # new tokens
    st.booleans(),  # same multimodal content
    st.none() | st.integers(1, MAX_TOKENS),  # cut the earlier request's tokens first
)
NEW_SEQUENCE = st.tuples(st.just("base"), BASE_REQUEST) | st.tuples(st.just("follow_up"), FOLLOW_UP)
RECOMPUTE = st.sampled_from([0, 0, 0, 1])
BATCH_BUDGET = st.sampled_from([0, 1, B - 1, B, 2 * B + 1, MAX_TOKENS, MAX_TOKENS])  # 0: nothing to run
STOP = st.sampled_from(["published"] * 5 + ["running"] * 2 + ["matched", "rolled back", "admitted"])


# --- counters shared by every machine instance (read by the soak runner) --------------------------------

COUNTERS = {"steps": 0, "examples": 0, "hits": 0, "publishes": 0}


def _step(method):
    """A rule: counted, and marks the machine broken while it runs so that teardown does not
    bury the first failure under a consequence of it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.broken = True
        COUNTERS["steps"] += 1
        result = method(self, *args, **kwargs)
        self.broken = False
        return result

    return wrapper


def assert_refused_without_change(checkpoints, seq, step: int) -> None:
    """A reservation at an impossible step raises ``InvalidStepError`` and keeps the
    sequence's current reservation (bad input changes nothing)."""
    held = seq.prefix_state.checkpoints.pending_save
    try:
        checkpoints.reserve_save(seq, step)
    except InvalidStepError:
        assert seq.prefix_state.checkpoints.pending_save is held, "a refused step changed the reservation"
        return
    raise AssertionError("a save at an impossible step was not refused")


# --- the reference model --------------------------------------------------------------------------


@dataclass
class Entry:
    seq: Sequence
    phase: str = "idle"  # idle | matched | admitted (table ready, forward pending) | running
    txn: MatchTxn | None = None
    runtime_slot: int | None = None
    before_match: tuple | None = None  # (step, table) before the open match


@dataclass(frozen=True)
class Published:
    """What a published record must describe: the prefix its producer saved."""

    record: CheckpointRecord
    prefix: tuple
    producer: int


def _ns(seq: Sequence) -> tuple:
    return (seq.namespace.adapter, seq.namespace.cache_salt)


class CacheProtocolMachine(RuleBasedStateMachine):
    """The cache protocol against a plain reference model (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        COUNTERS["examples"] += 1
        self.entries: list[Entry] = []
        self.content: dict[int, list] = {}  # block id -> per-position content (None = unwritten)
        self.state: dict[int, tuple | None] = {}  # state slot -> prefix its state summarizes (None: zero)
        self.published: dict[int, Published] = {}  # record id -> what it saved
        self.kv_prefixes: dict[tuple, int] = {}  # computed prefix -> producer seq id
        self.history: list[tuple] = []  # (tokens, namespace, spans) of every request seen
        self._expected: dict[int, list] = {}  # seq id -> per-position content (memo)
        self.broken = False
        self.ready = False

    @initialize(hybrid=st.sampled_from([True, True, True, False]), pending=st.booleans(), colliding=st.booleans())
    @_step
    def setup(self, hybrid: bool, pending: bool, colliding: bool) -> None:
        self.hybrid, self.pending = hybrid, pending
        self.pool = BlockPool(NUM_BLOCKS)
        self.states = StatePool(NUM_SLOTS, checkpoint_budget=CHECKPOINT_BUDGET)
        # fixed secrets keep examples reproducible; the per-process secret only changes which
        # keys collide (tests/reliability/test_collisions.py covers it)
        keyer = TwoBitKeyer(B, secret=b"soak") if colliding else BlockKeyer.deterministic(B)
        self.trie = BlockTrie(
            self.pool,
            B,
            keyer=keyer,
            state_pool=self.states if hybrid else None,
            max_checkpoints_per_anchor=MAX_PER_ANCHOR,
            track_pending=pending,
        )
        self.cp = self.trie.checkpoints
        self.protocol = CacheProtocol(CacheComponents(self.pool, self.states, self.trie))
        self.ready = True

    # --- model helpers ---------------------------------------------------------------------------

    def content_of(self, seq: Sequence, position: int) -> tuple:
        """What the KV at ``position`` of ``seq`` depends on."""
        known = self._expected.setdefault(seq.seq_id, [])
        tokens = seq.tokens
        for p in range(len(known), seq.num_tokens):
            spans = tuple((s.start, s.end, s.modality, s.content_id) for s in seq.spans if s.start <= p)
            known.append((_ns(seq), tokens[: p + 1].tobytes(), spans))
        return known[position]

    def prefix_id(self, seq: Sequence, length: int) -> tuple | None:
        """Identity of the first ``length`` tokens (namespace, tokens, overlapping spans)."""
        return None if length == 0 else self.content_of(seq, length - 1)

    def block_holds(self, block: int, seq: Sequence, index: int, start: int, end: int) -> bool:
        """Positions ``[start, end)`` (within block ``index``) of ``seq`` are held by ``block``."""
        held = self.content.get(block)
        if held is None:
            return end <= start
        return all(held[p - index * B] == self.content_of(seq, p) for p in range(start, end))

    def live(self) -> list[Sequence]:
        return [e.seq for e in self.entries]

    def _pick(self, phases, index: int, where=lambda e: True) -> Entry | None:
        chosen = [e for e in self.entries if e.phase in phases and where(e)]
        return chosen[-1 - index % len(chosen)] if chosen else None  # small indices: the newest

    def _has(self, *phases, where=lambda e: True) -> bool:
        return self.ready and any(e.phase in phases and where(e) for e in self.entries)

    def _sweep(self) -> None:
        """Blocks back on the free list hold nothing; freed state slots hold nothing."""
        for block in [b for b in self.content if self.pool.refcount_of(b) == 0]:
            del self.content[block]
        for slot in [s for s in self.state if self.states.role_of(s) is SlotRole.FREE]:
            del self.state[slot]

    def _path_computed(self, record: CheckpointRecord) -> bool:
        """No node on the record's anchor path still waits for its forward."""
        nodes, slot = self.trie.nodes, record.anchor
        while not nodes.is_root[slot]:
            if nodes.pending[slot]:
                return False
            slot = int(nodes.parent[slot])
        return True

    def _exact_steps(self, seq: Sequence, start: int) -> list[int]:
        """Steps of published, ready checkpoints a match of ``seq`` from ``start`` may use."""
        return [record.step for record in self._exact_records(seq, start)]

    def _exact_records(self, seq: Sequence, start: int) -> list[CheckpointRecord]:
        records = []
        for saved in self.published.values():
            step = saved.record.step
            if (
                saved.record.is_published
                and saved.record.ready
                and start < step <= seq.num_valid - 1
                and saved.prefix == self.prefix_id(seq, step)
                and self._path_computed(saved.record)
            ):
                records.append(saved.record)
        return records

    # --- protocol helpers --------------------------------------------------------------------

    def _new_sequence(self, source) -> Sequence:
        kind, args = source
        if kind == "follow_up" and self.entries:
            # the next turn of a conversation: a request that published (or any), plus a few tokens
            index, extra, same_spans, cut = args
            producers = {saved.producer for saved in self.published.values()}
            parents = [e.seq for e in self.entries if e.seq.seq_id in producers] or self.live()
            parent = parents[-1 - index % len(parents)]
            spans = parent.spans if same_spans else [
                MultimodalSpan(s.start, s.end, s.modality, s.content_id + "'") for s in parent.spans
            ]
            tokens = parent.tokens.tolist()[: min(cut or MAX_TOKENS, MAX_TOKENS - len(extra))] + extra
            spans = [s for s in spans if s.end <= len(tokens)]
            adapter, salt = _ns(parent)
        else:
            base, length, extra, namespace, span = args if kind == "base" else (0, 10, [], 0, None)
            tokens = BASES[base][:length] + extra
            spans = []
            if span is not None:
                start, size, content = span
                if start + size <= len(tokens):
                    spans.append(MultimodalSpan(start, start + size, "image", content))
            adapter, salt = NAMESPACES[namespace]
        seq = Sequence(tokens, adapter=adapter, cache_salt=salt, multimodal=spans)
        self.history.append((seq.tokens.tolist(), _ns(seq), seq.spans))
        return seq

    def _add(self, seq: Sequence, recompute: int) -> Entry:
        seq.prefix_state.overlap.recompute_blocks = recompute
        entry = Entry(seq)
        self.entries.append(entry)
        return entry

    def _follow(self, seq: Sequence, count: int, which: int) -> list[int] | None:
        """The next tokens of an earlier request ``seq`` is a prefix of (so decode runs into
        blocks and checkpoints other requests cached)."""
        tokens = seq.tokens.tolist()
        candidates = [
            t for t, ns, spans in self.history
            if ns == _ns(seq) and spans == seq.spans and len(t) > len(tokens) and t[: len(tokens)] == tokens
        ]
        if not candidates:
            return None
        source = candidates[which % len(candidates)]
        return source[len(tokens) : len(tokens) + count]

    def _make_room(self, needed: int, evict: bool) -> None:
        if evict and self.pool.num_free < needed:
            self._sweep()
            self.trie.free_kv_blocks(needed - self.pool.num_free)
        self._sweep()

    def _match(self, entry: Entry) -> None:
        """Tentative match; checks the hit is exact and allowed, then pins the restore."""
        seq = entry.seq
        start = seq.num_computed
        entry.before_match = (start, seq.block_table.copy())
        expected = self._exact_steps(seq, start) if self.hybrid else []
        txn = self.trie.match(seq)
        entry.txn, entry.phase = txn, "matched"
        hit = seq.num_computed - start
        assert txn.hit_tokens == hit >= 0, "hit tokens disagree with the step"
        assert hit or seq.num_blocks == entry.before_match[1].size, "a miss changed the block table"
        if self._check_hit(entry, txn.table_start, expected):
            assert self.cp.pin_restore(seq), "could not pin a checkpoint the match selected"
            assert not self.cp.pin_restore(seq), "pinned twice"
            COUNTERS["hits"] += 1

    def _check_hit(self, entry: Entry, table_start: int, expected: list[int]) -> bool:
        """The match of ``entry`` (from ``entry.before_match``) is exact and allowed; True on a
        hybrid hit (a restore to pin)."""
        seq = entry.seq
        state = seq.prefix_state
        start = entry.before_match[0]
        hit = seq.num_computed - start
        record = state.checkpoints.restore
        if hit == 0:
            assert record is None, "a restore selected without a hit"
            before = entry.before_match[1]  # an admission grows the table beyond it
            assert np.array_equal(seq.block_table[: before.size], before), "a miss changed the block table"
            if self.hybrid and state.overlap.recompute_blocks == 0:
                assert not expected, f"missed exact published checkpoints at {expected}"
            return False
        step = seq.num_computed
        assert step < seq.num_valid, "a hit must end before the last token"
        assert seq.is_boundary_safe(step), "the uncached suffix starts inside a multimodal span"
        table = seq.block_table
        for index in range(table_start, step // B):
            assert self.block_holds(int(table[index]), seq, index, index * B, (index + 1) * B), (
                f"block {int(table[index])} at index {index} does not hold the sequence's tokens"
            )
        if not self.hybrid:
            assert step % B == 0
            assert self.prefix_id(seq, step) in self.kv_prefixes, "a hit on a prefix nobody computed"
            limit = (seq.num_valid - 1) // B - state.overlap.recompute_blocks
            assert step // B <= max(limit, start // B), "the hit leaves no recompute overlap"
            return False
        assert record is not None, "a hybrid hit without a checkpoint"
        saved = self.published.get(record.record_id)
        assert saved is not None and saved.record is record, "a hit on a checkpoint nobody published"
        assert record.is_published and record.ready, "a hit on an unusable checkpoint"
        assert record.step == step and saved.prefix == self.prefix_id(seq, step), "a hit on a checkpoint of other tokens"
        assert self.state.get(record.slot) == saved.prefix, "the checkpoint's state slot holds another state"
        if record.is_partial:
            assert self.block_holds(record.frozen_block, seq, step // B, step - step % B, step), (
                "the frozen block does not hold the checkpoint's tail"
            )
        assert seq.num_blocks >= step // B
        assert step in expected, f"hit at {step}, which the model does not allow ({expected})"
        if state.overlap.recompute_blocks == 0:
            assert step == max(expected), f"hit at {step}, not the deepest exact checkpoint of {expected}"
        return True

    def _rollback(self, entry: Entry) -> None:
        seq = entry.seq
        self.trie.rollback(entry.txn)
        step, table = entry.before_match
        assert seq.num_computed == step and np.array_equal(seq.block_table, table), "rollback did not restore the sequence"
        assert seq.prefix_state.checkpoints.restore is None and not seq.prefix_state.checkpoints.restore_pinned
        entry.txn, entry.before_match = None, None
        if entry.runtime_slot is not None:  # a resumed session that cannot run: preempt it
            self._free(entry)
        entry.phase = "idle"

    def _finish_admission(self, entry: Entry, evict: bool, evict_checkpoints: bool) -> bool:
        """The rest of an admission after ``_match``: runtime slot, blocks, allocate, commit; or
        reject and roll back (True when admitted). Production admission (``CacheProtocol.admit``) does
        all of it in one call and always frees what pressure needs; the machine splits the match
        off as its own rule and draws whether pressure is relieved, to reach the states between
        the two and the refusals."""
        seq = entry.seq
        if entry.runtime_slot is None:
            if self.states.num_free_runtime == 0 and evict_checkpoints:
                self.trie.free_state_slots(1)
            if self.states.num_free_runtime == 0:
                self._rollback(entry)
                return False
        needed = max(0, -(-seq.num_tokens // B) - seq.num_blocks)
        self._make_room(needed, evict)
        try:
            new = self.pool.grow_table(seq, seq.num_tokens, B)
        except OutOfBlocksError:
            assert self.pool.num_free < needed
            self._rollback(entry)
            return False
        assert not any(int(b) in self.content for b in new), "a fresh block still holds data"
        if entry.runtime_slot is None:
            entry.runtime_slot = self.states.allocate_runtime()
            self.state[entry.runtime_slot] = None  # zeroed
        self.trie.allocate(seq)
        assert seq.prefix_state.overlap.fresh_range == (0, 0)
        self.trie.commit(entry.txn)
        entry.txn, entry.before_match, entry.phase = None, None, "admitted"
        return True

    def _reserve(self, entry: Entry, choice: int | None, wild: bool) -> None:
        seq = entry.seq
        if choice is None:
            step = seq.num_valid
        elif wild:
            step = choice % (seq.num_tokens + 2)  # 0 and num_tokens + 1 included
        else:
            step = seq.num_computed + 1 + choice % (seq.num_tokens - seq.num_computed)
        if not 0 < step <= seq.num_valid:
            assert_refused_without_change(self.cp, seq, step)
            return
        slot = self.cp.reserve_save(seq, None if choice is None else step)
        record = seq.prefix_state.checkpoints.pending_save
        if slot < 0:
            assert record is None
        else:
            assert record.state is CheckpointState.RESERVED and record.step == step
            assert record.slot == slot and self.states.role_of(slot) is SlotRole.CHECKPOINT
            assert (record.frozen_block != NO_BLOCK) == (step % B != 0)
            self.state[slot] = None  # nothing saved yet
            # a frozen block comes off the free list (maybe freed by this very call, before the
            # model's sweep saw it): whatever the model remembers of it is stale. That nobody
            # else holds it is checked by the refcount invariants.
            self.content.pop(record.frozen_block, None)
        if not 0 < step <= seq.num_valid or not seq.is_boundary_safe(step):
            assert slot < 0, "a save at an impossible step was reserved"

    def _forward(self, entry: Entry) -> None:
        """Restore copies, the forward (writes its positions once, into blocks it may write),
        then the step moves and the runtime state summarizes the computed prefix."""
        seq, state = entry.seq, entry.seq.prefix_state
        slot = entry.runtime_slot
        start, end = seq.num_computed, seq.num_tokens
        table = seq.block_table
        record = state.checkpoints.restore
        if record is not None:
            assert self.hybrid and state.checkpoints.restore_pinned and record.is_published and record.step == start
            if record.is_partial:
                index = record.step // B
                destination = int(table[index])
                others = {int(b) for other in self.live() if other is not seq for b in other.block_table}
                assert destination not in others, f"a restore writes block {destination} another sequence holds"
                if self.pending:  # as the engine's copy plan guard checks it
                    assert destination in self.trie.exclusive_blocks(seq, record.step, record.step + 1), (
                        f"restore into shared block {destination}"
                    )
                frozen = self.content.get(record.frozen_block)
                assert frozen is not None, "restore from an unwritten frozen block"
                row = self.content.setdefault(destination, [None] * B)
                for p in range(index * B, record.step):
                    assert row[p % B] in (None, frozen[p % B]), "a restore overwrote other content"
                    row[p % B] = frozen[p % B]
            self.state[slot] = self.state.get(record.slot)
        if self.hybrid:
            assert self.state.get(slot) == self.prefix_id(seq, start), (
                "the forward starts from a recurrent state of another prefix"
            )
        others = {int(b) for other in self.live() if other is not seq for b in other.block_table}
        writable = self.trie.exclusive_blocks(seq, start, end) if self.pending else None
        for p in range(start, end):
            block = int(table[p // B])
            assert block not in others, f"a forward writes block {block} that another live sequence holds"
            if writable is not None:
                assert block in writable, f"a forward writes block {block} it does not own"
            row = self.content.setdefault(block, [None] * B)
            assert row[p % B] is None, f"position {p} of block {block} written twice"
            row[p % B] = self.content_of(seq, p)
        seq.set_computed(end)
        if self.pending:
            self.trie.mark_computed(seq, start)
        self.state[slot] = self.prefix_id(seq, end)
        for depth in range(1, end // B + 1):
            self.kv_prefixes.setdefault(self.prefix_id(seq, depth * B), seq.seq_id)
        if self.hybrid:
            pinned = state.checkpoints.restore_pinned
            assert self.cp.unpin_restore(seq) == pinned
            assert not self.cp.unpin_restore(seq)
        assert state.checkpoints.restore is None
        entry.phase = "running"

    def _publish(self, entry: Entry, pin: bool, in_flight: bool) -> None:
        seq = entry.seq
        state = seq.prefix_state
        record = state.checkpoints.pending_save
        pin = pin and state.checkpoints.producer_pin is None
        in_flight = in_flight and pin
        reserved = record.state is CheckpointState.RESERVED
        if reserved:  # the save copy: runtime state and, mid-block, the producer's partial block
            step = record.step
            assert self.state.get(entry.runtime_slot) == self.prefix_id(seq, seq.num_computed)
            self.state[record.slot] = self.prefix_id(seq, step)
            if record.is_partial:
                index = step // B
                assert self.block_holds(int(seq.block_table[index]), seq, index, index * B, step)
                assert record.frozen_block not in self.content, "a frozen block already holds data"
                row = [None] * B
                for p in range(index * B, step):
                    row[p % B] = self.content_of(seq, p)
                self.content[record.frozen_block] = row
        ok = self.cp.publish_save(seq, pin=pin, in_flight=in_flight)
        assert ok == reserved, "a live reservation must publish; a released one must not"
        assert state.checkpoints.pending_save is None
        if not ok:
            assert record.state is CheckpointState.RELEASED
            return
        assert record.is_published and record.ready == (not in_flight)
        if pin:
            assert state.checkpoints.producer_pin is record and record.producer_pins == 1
        self.published[record.record_id] = Published(record, self.prefix_id(seq, record.step), seq.seq_id)
        COUNTERS["publishes"] += 1
        if not in_flight:  # the per-anchor cap holds right after a publish, unless only pinned records could go
            published = [r for r in self.cp.records_at(record.anchor) if r.is_published]
            releasable = [r for r in published if r is not record and r.pin_count == 0]
            assert len(published) <= MAX_PER_ANCHOR or not releasable, "the per-anchor cap was not enforced"

    def _free(self, entry: Entry) -> None:
        seq = entry.seq
        producer_pin = seq.prefix_state.checkpoints.producer_pin
        if entry.phase == "admitted":  # its forward never runs: drop what it would have produced
            if self.hybrid:
                self.cp.release_failed_save(seq)
                producer_pin = None
            if self.pending:
                self.trie.discard_pending(seq)
        self.trie.free_sequence(seq)
        assert seq.num_blocks == 0 and seq.num_computed == 0
        state = seq.prefix_state
        assert state.checkpoints.pending_save is None and state.checkpoints.restore is None and not state.checkpoints.restore_pinned
        assert state.checkpoints.producer_pin is producer_pin, "the producer pin is kept until the output boundary"
        if entry.runtime_slot is not None:
            self.states.free_runtime(entry.runtime_slot)
            entry.runtime_slot = None
        entry.phase = "idle"

    # --- rules -------------------------------------------------------------------------------

    @precondition(lambda self: self.ready and len(self.entries) < MAX_SEQUENCES)
    @rule(source=NEW_SEQUENCE, recompute=RECOMPUTE)
    @_step
    def create(self, source, recompute):
        self._add(self._new_sequence(source), recompute)

    def _request(self, entry, stop, choice, wild, save, pin, in_flight, evict) -> None:
        """Match, then admit, reserve, forward and publish, stopping at ``stop``."""
        self._match(entry)
        if stop == "matched":
            return
        if stop == "rolled back":
            self._rollback(entry)
            return
        if not self._finish_admission(entry, evict, evict):
            return
        if self.hybrid and (save or stop == "published"):
            self._reserve(entry, choice, wild and not save)
        if stop == "admitted" and self.pending:
            return
        self._forward(entry)
        if stop == "published" and entry.seq.prefix_state.checkpoints.pending_save is not None:
            self._publish(entry, pin, in_flight)

    @precondition(lambda self: self._has("idle") or (self.ready and len(self.entries) < MAX_SEQUENCES))
    @rule(
        source=st.none() | NEW_SEQUENCE,
        recompute=RECOMPUTE,
        index=st.integers(0, 99),
        stop=STOP,
        choice=st.none() | st.integers(0, 1000),
        wild=st.booleans(),
        save=st.booleans(),
        pin=st.booleans(),
        in_flight=st.booleans(),
        evict=st.sampled_from([True, True, True, False]),
    )
    @_step
    def request(self, source, recompute, index, stop, choice, wild, save, pin, in_flight, evict):
        """A new (or an idle) request goes through its prefill and stops at a random stage."""
        if len(self.entries) < MAX_SEQUENCES and (source is not None or not self._has("idle")):
            self._add(self._new_sequence(source or ("base", (0, 10, [], 0, None))), recompute)
        self._request(self._pick(("idle",), index), stop, choice, wild, save, pin, in_flight, evict)

    @precondition(lambda self: self.ready and self.entries)
    @rule(
        follow_up=FOLLOW_UP,
        recompute=RECOMPUTE,
        stop=STOP,
        choice=st.none() | st.integers(0, 1000),
        pin=st.booleans(),
        in_flight=st.booleans(),
    )
    @_step
    def converse(self, follow_up, recompute, stop, choice, pin, in_flight):
        """The next turn of an earlier conversation (a new request extending an earlier one's
        tokens, preferably one that published) goes through its prefill."""
        seq = self._new_sequence(("follow_up", follow_up))
        if self._entry_room():
            self._request(self._add(seq, recompute), stop, choice, False, False, pin, in_flight, True)

    def _entry_room(self) -> bool:
        """Room for one more sequence, forgetting the oldest idle one if needed."""
        if len(self.entries) < MAX_SEQUENCES:
            return True
        idle = [e for e in self.entries if e.phase == "idle"]
        if not idle:
            return False
        self._free(idle[0])
        if self.hybrid:
            self.cp.unpin_save(idle[0].seq)
        self.entries.remove(idle[0])
        return True

    @precondition(lambda self: self._has("running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save is None))
    @rule(
        index=st.integers(0, 99),
        extra=st.lists(TOKEN, min_size=1, max_size=2 * B + 2),
        step=st.none() | st.integers(1, 2 * B + 2),
        beyond=st.lists(TOKEN, min_size=1, max_size=3),
        admit=st.sampled_from([True, True, True, False]),
    )
    @_step
    def overtake(self, index, extra, step, beyond, admit):
        """Another request runs a session's conversation further and saves; then the session
        resumes into it: a resumed match that displaces blocks the session holds."""
        entry = self._pick(("running",), index, lambda e: e.seq.prefix_state.checkpoints.pending_save is None)
        seq = entry.seq
        if seq.num_tokens + len(extra) + len(beyond) > MAX_TOKENS or not self._entry_room():
            return
        adapter, salt = _ns(seq)
        other = Sequence(seq.tokens.tolist() + extra, adapter=adapter, cache_salt=salt, multimodal=seq.spans)
        self.history.append((other.tokens.tolist(), _ns(other), other.spans))
        choice = None if step is None else seq.num_tokens + step - 1
        self._request(self._add(other, 0), "published", choice, True, False, False, False, True)
        seq.append_tokens(extra + beyond)
        self.history.append((seq.tokens.tolist(), _ns(seq), seq.spans))
        self._match(entry)
        if not admit:
            self._rollback(entry)
        elif self._finish_admission(entry, True, False) and not self.pending:
            self._forward(entry)

    @precondition(lambda self: self._has("idle"))
    @rule(index=st.integers(0, 99))
    @_step
    def match(self, index):
        self._match(self._pick(("idle",), index))

    @precondition(lambda self: self._has("matched"))
    @rule(index=st.integers(0, 99), admit=st.booleans(), evict=st.booleans(), evict_checkpoints=st.booleans())
    @_step
    def finish_match(self, index, admit, evict, evict_checkpoints):
        """Admit (and, unless nodes wait for their forward, run the forward at once) or reject."""
        entry = self._pick(("matched",), index)
        if not admit:
            self._rollback(entry)
        elif self._finish_admission(entry, evict, evict_checkpoints) and not self.pending:
            self._forward(entry)

    @precondition(lambda self: self.pending and self._has("idle"))
    @rule(
        picks=st.lists(st.integers(0, 99), min_size=1, max_size=5),  # the runtime cap is 4: some refused
        budgets=st.lists(BATCH_BUDGET, min_size=5, max_size=5),
        extend=st.booleans(),
    )
    @_step
    def admit_many(self, picks, budgets, extend):
        """One scheduler step admits several idle requests with ``CacheProtocol.admit_many``:
        budgets that fit what is free (the deferred batch path) mixed with ones that need
        eviction, refusals and chunks shorter than the prompt (then extended to the whole
        prompt, or preempted). Every hit is checked as ``match`` checks it; a refusal left
        its sequence as it was. Nodes stay pending until the forwards run (another rule), so
        no request of the batch can hit what an earlier one of it attached."""
        idle = [e for e in self.entries if e.phase == "idle"]
        batch = list({id(e): e for e in (idle[-1 - p % len(idle)] for p in picks)}.values())
        self._sweep()
        expected = []
        for entry in batch:
            entry.before_match = (entry.seq.num_computed, entry.seq.block_table.copy())
            expected.append(self._exact_records(entry.seq, entry.seq.num_computed) if self.hybrid else [])
        with self._sweeping_allocations():
            admissions = self.protocol.admit_many([e.seq for e in batch], budgets[: len(batch)])
        assert len(admissions) == len(batch)
        for entry, admission, records in zip(batch, admissions, expected):
            self._check_batch_admission(entry, admission, records, extend)

    def _check_batch_admission(self, entry: Entry, admission: Admission, records: list, extend: bool) -> None:
        seq = entry.seq
        start, table = entry.before_match
        if not admission.admitted:
            assert seq.num_computed == start and np.array_equal(seq.block_table, table), "a refusal changed the sequence"
            assert seq.prefix_state.checkpoints.restore is None and not seq.prefix_state.checkpoints.restore_pinned
            entry.before_match = None
            return
        assert admission.start == seq.num_computed and admission.hit_tokens == seq.num_computed - start
        assert start < admission.end <= seq.num_tokens and seq.num_blocks >= -(-admission.end // B)
        assert admission.restore is seq.prefix_state.checkpoints.restore
        # a checkpoint evicted for an earlier admission of the batch is no longer expected
        if self._check_hit(entry, start // B, [r.step for r in records if r.is_published]):
            assert seq.prefix_state.checkpoints.restore_pinned, "admit_many left its restore unpinned"
            COUNTERS["hits"] += 1
        entry.runtime_slot = admission.runtime_slot
        assert self.states.role_of(entry.runtime_slot) is SlotRole.RUNTIME
        self.state[entry.runtime_slot] = None  # zeroed
        entry.before_match, entry.phase = None, "admitted"
        if admission.end < seq.num_tokens:  # the machine's forwards run to the prompt's end
            with self._sweeping_allocations():
                extended = extend and self.protocol.extend(seq, seq.num_tokens)
            if not extended:
                self._free(entry)

    @contextlib.contextmanager
    def _sweeping_allocations(self):
        """While one protocol call evicts and allocates, forget the content of freed blocks
        before each allocation hands them out again (the rules sweep between their calls)."""
        pool = self.pool
        for name in ("allocate", "allocate_stamped"):
            method = getattr(pool, name)
            setattr(pool, name, functools.partial(self._swept_then, method))
        try:
            yield
        finally:
            del pool.allocate, pool.allocate_stamped

    def _swept_then(self, method, *args, **kwargs):
        self._sweep()
        return method(*args, **kwargs)

    @precondition(lambda self: self.hybrid and self._has("admitted"))
    @rule(index=st.integers(0, 99), choice=st.none() | st.integers(0, 1000), wild=st.booleans())
    @_step
    def reserve_save(self, index, choice, wild):
        self._reserve(self._pick(("admitted",), index), choice, wild)

    @precondition(lambda self: self._has("admitted"))
    @rule(index=st.integers(0, 99))
    @_step
    def forward(self, index):
        self._forward(self._pick(("admitted",), index))

    @precondition(lambda self: self._has("running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save is not None))
    @rule(index=st.integers(0, 99), pin=st.booleans(), in_flight=st.booleans())
    @_step
    def publish(self, index, pin, in_flight):
        self._publish(self._pick(("running",), index, lambda e: e.seq.prefix_state.checkpoints.pending_save is not None), pin, in_flight)

    @precondition(lambda self: self._has("admitted", "running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save))
    @rule(index=st.integers(0, 99))
    @_step
    def discard(self, index):
        seq = self._pick(("admitted", "running"), index, lambda e: e.seq.prefix_state.checkpoints.pending_save).seq
        record = seq.prefix_state.checkpoints.pending_save
        reserved = record.state is CheckpointState.RESERVED
        assert self.cp.release_reservation(seq) == reserved
        assert record.state is CheckpointState.RELEASED and seq.prefix_state.checkpoints.pending_save is None
        assert not self.cp.release_reservation(seq)

    @precondition(lambda self: self._has("idle", "matched", "admitted", "running", where=lambda e: e.seq.prefix_state.checkpoints.producer_pin))
    @rule(index=st.integers(0, 99))
    @_step
    def unpin_save(self, index):
        """The output boundary: the save copy completed."""
        phases = ("idle", "matched", "admitted", "running")
        seq = self._pick(phases, index, lambda e: e.seq.prefix_state.checkpoints.producer_pin).seq
        record = seq.prefix_state.checkpoints.producer_pin
        assert self.cp.unpin_save(seq)
        assert record.producer_pins == 0 and seq.prefix_state.checkpoints.producer_pin is None and record.ready
        assert not self.cp.unpin_save(seq)

    @precondition(
        lambda self: self._has(
            "idle", "admitted", "running",
            where=lambda e: e.seq.prefix_state.checkpoints.producer_pin or e.seq.prefix_state.checkpoints.pending_save,
        )
    )
    @rule(index=st.integers(0, 99))
    @_step
    def abandon(self, index):
        """The forward carrying the save failed: its reservation or in-flight record goes."""
        state_of = lambda e: e.seq.prefix_state  # noqa: E731
        entry = self._pick(
            ("idle", "admitted", "running"), index, lambda e: state_of(e).checkpoints.producer_pin or state_of(e).checkpoints.pending_save
        )
        state = entry.seq.prefix_state
        dropped = [r for r in (state.checkpoints.producer_pin, state.checkpoints.pending_save) if r is not None]
        self.cp.release_failed_save(entry.seq)
        assert state.checkpoints.producer_pin is None and state.checkpoints.pending_save is None
        for record in dropped:
            assert record.state is CheckpointState.RELEASED or record.pin_count > 0

    @precondition(lambda self: self._has("running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save is None))
    @rule(
        index=st.integers(0, 99),
        tokens=st.lists(TOKEN, min_size=1, max_size=B + 1),
        follow=st.none() | st.integers(0, 99),
        evict=st.booleans(),
        pin=st.booleans(),
        in_flight=st.booleans(),
    )
    @_step
    def decode(self, index, tokens, follow, evict, pin, in_flight):
        """Extend by decode: append, grow, allocate, decode save, forward, publish."""
        entry = self._pick(("running",), index, lambda e: e.seq.prefix_state.checkpoints.pending_save is None)
        seq = entry.seq
        if follow is not None:
            tokens = self._follow(seq, len(tokens), follow) or tokens
        if seq.num_tokens + len(tokens) > MAX_TOKENS:
            return
        seq.append_tokens(tokens)
        self.history.append((seq.tokens.tolist(), _ns(seq), seq.spans))
        self._make_room(max(0, -(-seq.num_tokens // B) - seq.num_blocks), evict)
        try:
            self.pool.grow_table(seq, seq.num_tokens, B)
        except OutOfBlocksError:
            self._free(entry)  # preempted: recompute later
            return
        self.trie.allocate(seq)
        slot = self.cp.reserve_decode_save(seq, DECODE_INTERVAL) if self.hybrid else -1
        if slot > 0:
            record = seq.prefix_state.checkpoints.pending_save
            assert record.is_decode and record.step == seq.num_tokens and not record.is_partial
        else:
            assert seq.prefix_state.checkpoints.pending_save is None
        self._forward(entry)
        if slot > 0:
            previous = seq.prefix_state.checkpoints.decode_checkpoint
            record = seq.prefix_state.checkpoints.pending_save
            self._publish(entry, pin, in_flight)
            assert record.is_published and seq.prefix_state.checkpoints.decode_checkpoint is record
            if previous is not None and record.ready:
                assert not previous.is_published or previous.pin_count > 0, "the replaced decode checkpoint lingers"

    @precondition(lambda self: self._has("running"))
    @rule(
        index=st.integers(0, 99),
        tokens=st.lists(TOKEN, min_size=1, max_size=12),
        follow=st.none() | st.integers(0, 99),
        admit=st.sampled_from([True, True, True, False]),
        evict=st.booleans(),
    )
    @_step
    def resume(self, index, tokens, follow, admit, evict):
        """A session gets new input and matches again while holding its blocks, then is
        admitted or rejected in the same step: a resumed match may displace blocks the session
        held, and those stay referenced by the open transaction, which ``check_invariants``
        (refcounts = sequence tables + nodes + frozen blocks) does not see."""
        entry = self._pick(("running",), index)
        seq = entry.seq
        if follow is not None:  # run into what others cached, and one token beyond
            tokens = (self._follow(seq, len(tokens), follow) or []) + tokens[:1]
        if seq.num_tokens + len(tokens) > MAX_TOKENS or seq.prefix_state.checkpoints.pending_save is not None:
            return
        seq.append_tokens(tokens)
        self.history.append((seq.tokens.tolist(), _ns(seq), seq.spans))
        self._match(entry)
        if not admit:
            self._rollback(entry)
        elif self._finish_admission(entry, evict, False) and not self.pending:
            self._forward(entry)

    @precondition(lambda self: self.ready)
    @rule(count=st.integers(1, 6), checkpoints=st.booleans())
    @_step
    def evict(self, count, checkpoints):
        """KV pressure (frozen blocks first, then leaves) or state-slot pressure."""
        if checkpoints:
            live = len(self.cp.live_records()) if self.hybrid else 0
            released = self.trie.free_state_slots(count)
            assert 0 <= released <= count
            if self.hybrid:
                assert len(self.cp.live_records()) == live - released
        else:
            free = self.pool.num_free
            freed = self.trie.free_kv_blocks(count)
            assert 0 <= freed and self.pool.num_free == free + freed

    @precondition(lambda self: self._has("idle", "admitted", "running"))
    @rule(index=st.integers(0, 99))
    @_step
    def free(self, index):
        self._free(self._pick(("idle", "admitted", "running"), index))

    @precondition(lambda self: self.ready)
    @rule()
    @_step
    def clear(self):
        """Clear the cache while requests run: afterwards nothing more is evictable."""
        self.trie.clear()
        assert self.trie.free_state_slots(1) == 0 and self.trie.free_kv_blocks(1) == 0, "clear left evictable entries"
        if self.hybrid:
            for record in self.cp.live_records():
                assert record.pin_count or record.state is CheckpointState.RESERVED, f"{record} survived a clear"
        nodes = self.trie.nodes
        borrowed = self.trie.kv.pins()
        for slot in nodes.attached_slots().tolist():
            if nodes.num_children[slot] == 0:
                assert (
                    self.pool.refcount_of(int(nodes.block[slot])) > 1
                    or slot in borrowed
                    or (self.hybrid and self.cp.is_anchor_protected(slot))
                ), f"leaf {slot} survived a clear"

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if not self.ready:
            return
        self.broken = True
        self._sweep()
        self.trie.check_invariants(self.live())
        if self.hybrid:
            self.published = {k: v for k, v in self.published.items() if v.record.is_published}
            published = {r.record_id for r in self.cp.live_records() if r.is_published}
            assert published == set(self.published), "a record was published behind the model's back"
            for record in self.cp.live_records():
                if record.is_published:
                    assert self.state.get(record.slot) == self.published[record.record_id].prefix, (
                        "a published checkpoint's state slot was overwritten"
                    )
                else:
                    assert record.pin_count == 0, "a reservation is pinned"
            for seq in self.live():  # a pinned checkpoint is never released
                state = seq.prefix_state
                if state.checkpoints.restore_pinned:
                    assert state.checkpoints.restore.is_published, "a restore-pinned checkpoint was released"
                if state.checkpoints.producer_pin is not None:
                    assert state.checkpoints.producer_pin.is_published, "a producer-pinned checkpoint was released"
        for entry in self.entries:
            seq = entry.seq
            if entry.phase == "idle":
                assert seq.num_blocks == 0 and seq.num_computed == 0 and entry.runtime_slot is None
                continue
            upto = seq.num_computed
            if entry.phase in ("matched", "admitted") and seq.prefix_state.checkpoints.restore is not None:
                upto -= upto % B  # the partial tail arrives with the restore copy
            table = seq.block_table
            for index in range(-(-upto // B)):
                end = min((index + 1) * B, upto)
                assert self.block_holds(int(table[index]), seq, index, index * B, end), f"{seq} block {index} lost its data"
            if entry.phase == "running":
                assert seq.num_computed == seq.num_tokens
                if self.hybrid:
                    assert self.state.get(entry.runtime_slot) == self.prefix_id(seq, seq.num_computed)
        self._check_nodes()
        self.broken = False

    def _check_nodes(self) -> None:
        """Every computed trie node's block holds exactly the node's path, in its namespace."""
        nodes = self.trie.nodes
        roots = {slot: ns for ns, slot in nodes._roots.items()}
        for slot in nodes.attached_slots().tolist():
            if nodes.pending[slot]:
                continue
            held = self.content.get(int(nodes.block[slot]))
            assert held is not None and all(c is not None for c in held), f"node {slot} owns an unwritten block"
            path, top = [], slot
            while not nodes.is_root[top]:
                path.append(self.trie.tokens.run(top, top))
                top = int(nodes.parent[top])
            namespace = roots[top]
            tokens = np.concatenate(path[::-1]).astype(np.int32).tobytes()
            ns, held_tokens, _ = held[-1]
            assert ns == (namespace.adapter, namespace.cache_salt), "a block is shared across namespaces"
            assert held_tokens == tokens, f"node {slot}'s block holds other tokens than its path"

    def teardown(self):
        if not self.ready or self.broken:
            return  # the failure is reported as it happened
        for entry in self.entries:
            if entry.phase == "matched":
                self._rollback(entry)
        for entry in self.entries:
            self._free(entry)
            if self.hybrid:
                self.cp.unpin_save(entry.seq)
        self.trie.check_invariants(self.live())
        self.trie.clear()
        assert self.trie.nodes.num_attached == 0, "nodes survived the final clear"
        if self.hybrid:
            assert self.cp.live_records() == [] and len(self.trie.index) == 0
        assert self.pool.num_free == NUM_BLOCKS, f"{NUM_BLOCKS - self.pool.num_free} blocks leaked"
        assert self.states.num_free == NUM_SLOTS - 1, "state slots leaked"
        assert self.states.num_checkpoint == 0 and self.states.num_runtime == 0
        self.trie.check_invariants([])
