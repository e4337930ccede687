"""Stateful test of the hybrid prefix cache through its public API.

Random interleavings of the scheduler protocol (ingest -> match -> pin_restore -> allocate -> commit or
rollback, reserve_save -> forward -> publish / discard -> unpin_save, decode saves, KV and
checkpoint eviction, freeing) over a small block pool and few state slots. After every step the
trie's invariants hold; every hit is exact against a plain model of what each published record
saved; a request with no recompute overlap hits the deepest exactly matching published
checkpoint; at teardown every block and state slot comes back.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridcache.errors import OutOfBlocksError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import SlotRole, StatePool
from hybridcache.prefix_cache import BlockTrie, MatchTxn
from hybridcache.prefix_cache.checkpoint_record import CheckpointRecord, CheckpointState
from hybridcache.sequence import MultimodalSpan, Sequence
from tests.reliability.protocol_machine import assert_refused_without_change

B = 4
NUM_BLOCKS = 24
NUM_SLOTS = 5  # 4 usable rows
MAX_SEQUENCES = 8
DECODE_INTERVAL = 2 * B
BASES = (
    list(range(1, 41)),
    [1, 2, 3, 4, 5, 6] + list(range(100, 134)),  # shares 1.5 blocks with base 0
    list(range(200, 240)),
)


SPAN = st.none() | st.tuples(st.integers(0, 12), st.integers(1, 6), st.sampled_from(["a", "b"]))
BASE_REQUEST = st.tuples(
    st.integers(0, len(BASES) - 1),  # base
    st.integers(1, 22),  # length
    st.lists(st.integers(0, 2), max_size=3),  # extra tokens
    st.booleans(),  # adapter "lora"
    SPAN,
)
FOLLOW_UP = st.tuples(st.integers(0, 99), st.lists(st.integers(0, 2), min_size=1, max_size=6), st.booleans())
NEW_SEQUENCE = st.tuples(st.just("base"), BASE_REQUEST) | st.tuples(st.just("follow_up"), FOLLOW_UP)
NEW_DEFAULT = ("follow_up", (0, [1], True))
BASE_DEFAULT = (0, 10, [], False, None)
RECOMPUTE = st.sampled_from([0, 0, 1])


@dataclass
class Entry:
    seq: Sequence
    phase: str = "idle"  # idle | matched | admitted (table ready, forward pending) | running
    txn: MatchTxn | None = None


@dataclass(frozen=True)
class Saved:
    """What a published record must describe: its producer's namespace, tokens and spans."""

    record: CheckpointRecord
    namespace: object
    tokens: tuple[int, ...]
    spans: tuple[MultimodalSpan, ...]


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.states = StatePool(NUM_SLOTS, checkpoint_budget=2)
        self.trie = BlockTrie(self.pool, B, state_pool=self.states, max_checkpoints_per_anchor=2)
        self.cp = self.trie.checkpoints
        self.entries: list[Entry] = []
        self.model: dict[int, Saved] = {}
        self.hits = 0
        self.publishes = 0

    # --- helpers -------------------------------------------------------------------------------

    def _pick(self, phases, index: int, where=lambda e: True) -> Entry | None:
        chosen = [e for e in self.entries if e.phase in phases and where(e)]
        return chosen[-1 - index % len(chosen)] if chosen else None  # small indices: the newest

    def _has(self, *phases, where=lambda e: True) -> bool:
        return any(e.phase in phases and where(e) for e in self.entries)

    def _record_publish(self, seq: Sequence, record: CheckpointRecord, trimmed: bool = True) -> None:
        self.model[record.record_id] = Saved(
            record, seq.namespace, tuple(seq.token_view(0, record.step).tolist()), seq.spans_overlapping(0, record.step)
        )
        self.publishes += 1
        if trimmed:  # an in-flight save is trimmed when it lands (unpin_save)
            self._check_anchor_cap(record)

    def _check_anchor_cap(self, record: CheckpointRecord) -> None:
        # the anchor cap (2) holds right after a publish, unless only pinned records could go
        published = [r for r in self.cp.records_at(record.anchor) if r.is_published]
        releasable = [r for r in published if r is not record and r.pin_count == 0]
        assert len(published) <= 2 or not releasable, "the per-anchor cap was not enforced"

    def _exact_for(self, seq: Sequence, saved: Saved) -> bool:
        step = saved.record.step
        return (
            saved.record.ready  # an in-flight save is not usable yet
            and saved.namespace == seq.namespace
            and step <= seq.num_valid - 1
            and tuple(seq.token_view(0, step).tolist()) == saved.tokens
            and seq.spans_overlapping(0, step) == saved.spans
        )

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        needed = -(-num_tokens // B) - seq.num_blocks
        if self.pool.num_free < needed:
            self.trie.free_kv_blocks(needed - self.pool.num_free)
        return self.pool.num_free >= needed

    # --- rules ---------------------------------------------------------------------------------

    def _new_sequence(self, source) -> Sequence:
        kind, args = source
        if kind == "follow_up" and self.entries:
            # the next turn of a conversation: a request that published, plus a few tokens
            index, extra, same_spans = args
            producers = {saved.record.producer_id for saved in self.model.values()}
            parents = [e.seq for e in self.entries if e.seq.seq_id in producers] or [e.seq for e in self.entries]
            parent = parents[-1 - index % len(parents)]
            spans = parent.spans if same_spans else [
                MultimodalSpan(s.start, s.end, s.modality, s.content_id + "'") for s in parent.spans
            ]
            return Sequence(
                parent.tokens.tolist() + extra,
                adapter=parent.namespace.adapter,
                cache_salt=parent.namespace.cache_salt,
                multimodal=spans,
            )
        base, length, extra, lora, span = args if kind == "base" else BASE_DEFAULT
        prompt = BASES[base][:length] + extra
        spans = []
        if span is not None:
            start, size, content = span
            if start + size <= len(prompt):
                spans.append(MultimodalSpan(start, start + size, "image", content))
        return Sequence(prompt, adapter="lora" if lora else None, multimodal=spans)

    @precondition(lambda self: len(self.entries) < MAX_SEQUENCES)
    @rule(source=NEW_SEQUENCE, recompute=RECOMPUTE)
    def create(self, source, recompute):
        self._add(self._new_sequence(source), recompute)

    def _add(self, seq: Sequence, recompute: int) -> None:
        seq.prefix_state.overlap.recompute_blocks = recompute
        self.entries.append(Entry(seq))

    def _match(self, entry: Entry) -> None:
        seq = entry.seq
        assert seq.num_computed == 0 and seq.num_blocks == 0
        exact = [s.record.step for s in self.model.values() if self._exact_for(seq, s)]
        txn = self.trie.match(seq)
        record = seq.prefix_state.checkpoints.restore
        if record is None:
            assert seq.num_computed == 0 and seq.num_blocks == 0
            if seq.prefix_state.overlap.recompute_blocks == 0:
                assert not exact, f"missed an exact published checkpoint at {exact}"
        else:
            saved = self.model.get(record.record_id)
            assert saved is not None and saved.record is record and record.is_published and record.ready
            assert self._exact_for(seq, saved), "a hit on a checkpoint of other tokens"
            assert seq.num_computed == record.step and seq.is_boundary_safe(record.step)
            assert seq.num_blocks == record.step // B
            fresh_start, fresh_end = seq.prefix_state.overlap.fresh_range
            assert fresh_start == record.step // B and fresh_end >= -(-record.step // B)
            if seq.prefix_state.overlap.recompute_blocks == 0:
                assert record.step == max(exact), "not the deepest exact checkpoint"
            assert self.cp.pin_restore(seq)
            self.hits += 1
        entry.txn, entry.phase = txn, "matched"

    def _ingest(self, entry: Entry) -> None:
        """``prepare`` (at arrival, outside the scheduler loop): the path it returns lies on the
        request's tokens, and the checkpoint it found (if any) is an exact published one."""
        seq = entry.seq
        path = self.trie.prepare(seq)
        nodes = self.trie.nodes
        assert path.root == nodes.find_root(seq.namespace) and int(nodes.depth[path.node]) == path.depth
        assert path.depth * B <= seq.num_valid
        slot, rows = path.node, []
        while not nodes.is_root[slot]:
            rows.append(self.trie.tokens.run(slot, slot).tolist())
            slot = int(nodes.parent[slot])
        assert slot == path.root
        assert [t for row in reversed(rows) for t in row] == seq.token_view(0, path.depth * B).tolist()
        found = seq.prefix_state.trie.last_search
        if found is not None and found.record is not None:
            saved = self.model.get(found.record.record_id)
            assert saved is not None and self._exact_for(seq, saved), "ingest found a checkpoint of other tokens"
            assert found.path.node == found.record.anchor
            assert found.record.step > seq.num_computed

    def _rollback(self, entry: Entry) -> None:
        self.trie.rollback(entry.txn)
        seq = entry.seq
        assert seq.num_computed == 0 and seq.num_blocks == 0
        assert seq.prefix_state.checkpoints.restore is None and not seq.prefix_state.checkpoints.restore_pinned
        entry.txn, entry.phase = None, "idle"

    def _finish_admission(self, entry: Entry) -> bool:
        """The rest of an admission after the machine's own match rule: blocks (evicting first),
        allocate, commit; or roll back when the pool is full (True when admitted)."""
        seq = entry.seq
        self._make_room(seq, seq.num_tokens)
        try:
            self.pool.grow_table(seq, seq.num_tokens, B)
        except OutOfBlocksError:
            self._rollback(entry)
            return False
        self.trie.allocate(seq)
        self.trie.commit(entry.txn)
        entry.txn, entry.phase = None, "admitted"
        return True

    def _reserve(self, entry: Entry, choice: int | None, wild: bool = False) -> None:
        seq = entry.seq
        if choice is None:
            step = seq.num_valid  # the prompt end (the default step)
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
        if not 0 < step <= seq.num_valid or not seq.is_boundary_safe(step):
            assert slot < 0

    def _forward(self, entry: Entry) -> None:
        seq = entry.seq
        seq.set_computed(seq.num_tokens)
        pinned = seq.prefix_state.checkpoints.restore_pinned
        assert self.cp.unpin_restore(seq) == pinned
        assert seq.prefix_state.checkpoints.restore is None
        entry.phase = "running"

    def _publish(self, entry: Entry, pin: bool, in_flight: bool = False) -> None:
        seq = entry.seq
        record = seq.prefix_state.checkpoints.pending_save
        pin = pin and seq.prefix_state.checkpoints.producer_pin is None
        in_flight = in_flight and pin
        reserved = record.state is CheckpointState.RESERVED
        ok = self.cp.publish_save(seq, pin=pin, in_flight=in_flight)
        assert ok == reserved, "a live reservation must publish; a released one must not"
        assert seq.prefix_state.checkpoints.pending_save is None
        if ok:
            assert record.is_published
            self._record_publish(seq, record, trimmed=not in_flight)
            if pin:
                assert seq.prefix_state.checkpoints.producer_pin is record and record.producer_pins == 1
            assert record.ready == (not in_flight)
        else:
            assert record.state is CheckpointState.RELEASED

    # --- rules: one protocol step each, so other sequences interleave anywhere -----------------

    @precondition(lambda self: self._has("idle"))
    @rule(index=st.integers(0, 99))
    def ingest(self, index):
        self._ingest(self._pick(("idle",), index))

    @precondition(lambda self: self._has("idle"))
    @rule(index=st.integers(0, 99))
    def match(self, index):
        self._match(self._pick(("idle",), index))

    @precondition(lambda self: self._has("matched"))
    @rule(index=st.integers(0, 99), admit=st.booleans())
    def finish_match(self, index, admit):
        """Commit the admission (grow, allocate, commit) or roll the match back."""
        entry = self._pick(("matched",), index)
        if admit:
            self._finish_admission(entry)
        else:
            self._rollback(entry)

    @precondition(lambda self: self._has("admitted"))
    @rule(index=st.integers(0, 99), choice=st.integers(0, 1000), wild=st.booleans())
    def reserve_save(self, index, choice, wild):
        self._reserve(self._pick(("admitted",), index), choice, wild)

    @precondition(lambda self: self._has("admitted"))
    @rule(index=st.integers(0, 99))
    def forward(self, index):
        self._forward(self._pick(("admitted",), index))

    @precondition(lambda self: self._has("running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save is not None))
    @rule(index=st.integers(0, 99), pin=st.booleans(), in_flight=st.booleans())
    def publish(self, index, pin, in_flight):
        entry = self._pick(("running",), index, lambda e: e.seq.prefix_state.checkpoints.pending_save is not None)
        self._publish(entry, pin, in_flight)

    # --- a whole prefill in one rule (so runs reach hits), stopping at a random stage ----------

    @precondition(lambda self: self._has("idle") or len(self.entries) < MAX_SEQUENCES)
    @rule(
        source=st.none() | NEW_SEQUENCE,
        recompute=RECOMPUTE,
        index=st.integers(0, 99),
        stop=st.sampled_from(["published"] * 4 + ["matched", "rolled back", "admitted", "pending"]),
        choice=st.none() | st.integers(0, 1000),
        wild=st.booleans(),
        save=st.booleans(),
        pin=st.booleans(),
        in_flight=st.booleans(),
        ingest=st.booleans(),
    )
    def prefill(self, source, recompute, index, stop, choice, wild, save, pin, in_flight, ingest):
        """A new (or an idle) request is ingested or not, matched, then stops at a random stage
        of its prefill; a save defaults to the prompt end."""
        if len(self.entries) < MAX_SEQUENCES and (source is not None or not self._has("idle")):
            self._add(self._new_sequence(source or NEW_DEFAULT), recompute)
        entry = self._pick(("idle",), index)
        if ingest:
            self._ingest(entry)
        self._match(entry)
        if stop == "matched":
            return
        if stop == "rolled back":
            self._rollback(entry)
            return
        if not self._finish_admission(entry):
            return
        if save or stop in ("pending", "published"):
            self._reserve(entry, choice, wild and not save)
        if stop == "admitted":
            return
        self._forward(entry)
        if stop == "published" and entry.seq.prefix_state.checkpoints.pending_save is not None:
            self._publish(entry, pin, in_flight)

    @precondition(lambda self: self._has("admitted", "running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save))
    @rule(index=st.integers(0, 99))
    def discard(self, index):
        seq = self._pick(("admitted", "running"), index, lambda e: e.seq.prefix_state.checkpoints.pending_save).seq
        record = seq.prefix_state.checkpoints.pending_save
        reserved = record.state is CheckpointState.RESERVED
        assert self.cp.release_reservation(seq) == reserved
        assert record.state is CheckpointState.RELEASED and seq.prefix_state.checkpoints.pending_save is None

    @precondition(lambda self: self._has("idle", "matched", "admitted", "running", where=lambda e: e.seq.prefix_state.checkpoints.producer_pin))
    @rule(index=st.integers(0, 99))
    def unpin_save(self, index):
        phases = ("idle", "matched", "admitted", "running")
        seq = self._pick(phases, index, lambda e: e.seq.prefix_state.checkpoints.producer_pin).seq
        record = seq.prefix_state.checkpoints.producer_pin
        assert self.cp.unpin_save(seq)
        assert record.producer_pins == 0 and seq.prefix_state.checkpoints.producer_pin is None
        assert record.ready  # the save copy completed: usable from now on
        if record.is_published:
            self._check_anchor_cap(record)  # a save published in flight is trimmed now

    @precondition(
        lambda self: self._has(
            "admitted", "running", where=lambda e: e.seq.prefix_state.checkpoints.producer_pin or e.seq.prefix_state.checkpoints.pending_save
        )
    )
    @rule(index=st.integers(0, 99))
    def abandon(self, index):
        """The forward carrying the save failed: its reservation or in-flight record goes."""
        state_of = lambda e: e.seq.prefix_state  # noqa: E731
        entry = self._pick(("admitted", "running"), index, lambda e: state_of(e).checkpoints.producer_pin or state_of(e).checkpoints.pending_save)
        state = entry.seq.prefix_state
        dropped = [r for r in (state.checkpoints.producer_pin, state.checkpoints.pending_save) if r is not None]
        self.cp.release_failed_save(entry.seq)
        assert state.checkpoints.producer_pin is None and state.checkpoints.pending_save is None
        for record in dropped:
            assert record.state is CheckpointState.RELEASED or record.pin_count > 0

    @precondition(lambda self: self._has("running", where=lambda e: e.seq.prefix_state.checkpoints.pending_save is None))
    @rule(index=st.integers(0, 99), count=st.integers(1, B + 1), token=st.integers(0, 3))
    def decode(self, index, count, token):
        seq = self._pick(("running",), index, lambda e: e.seq.prefix_state.checkpoints.pending_save is None).seq
        if seq.num_tokens > 60 or not self._make_room(seq, seq.num_tokens + count):
            return
        seq.append_tokens([token] * count)
        self.pool.grow_table(seq, seq.num_tokens, B)
        self.trie.allocate(seq)
        slot = self.cp.reserve_decode_save(seq, DECODE_INTERVAL)
        seq.set_computed(seq.num_tokens)
        if slot > 0:
            record = seq.prefix_state.checkpoints.pending_save
            assert record.is_decode and record.step == seq.num_tokens
            assert self.cp.publish_save(seq)
            assert seq.prefix_state.checkpoints.decode_checkpoint is record
            self._record_publish(seq, record)

    @rule(count=st.integers(1, 6), checkpoints=st.booleans())
    def evict(self, count, checkpoints):
        """KV pressure (frozen blocks first, then leaves) or state-slot pressure."""
        if checkpoints:
            live = len(self.cp.live_records())
            released = self.trie.free_state_slots(count)
            assert 0 <= released <= count and len(self.cp.live_records()) == live - released
        else:
            free = self.pool.num_free
            freed = self.trie.free_kv_blocks(count)
            assert self.pool.num_free == free + freed

    @precondition(lambda self: self._has("idle", "admitted", "running"))
    @rule(index=st.integers(0, 99))
    def free(self, index):
        entry = self._pick(("idle", "admitted", "running"), index)
        seq = entry.seq
        producer_pin = seq.prefix_state.checkpoints.producer_pin
        self.trie.free_sequence(seq)
        assert seq.num_blocks == 0 and seq.num_computed == 0
        assert seq.prefix_state.checkpoints.pending_save is None and seq.prefix_state.checkpoints.restore is None
        assert not seq.prefix_state.checkpoints.restore_pinned
        assert seq.prefix_state.checkpoints.producer_pin is producer_pin  # kept until the output boundary
        entry.phase = "idle"

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        self.trie.check_invariants([e.seq for e in self.entries])
        self.model = {k: v for k, v in self.model.items() if v.record.is_published}
        published = {r.record_id for r in self.cp.live_records() if r.is_published}
        assert published == set(self.model), "a record was published behind the model's back"

    def teardown(self):
        for entry in self.entries:
            if entry.phase == "matched":
                self.trie.rollback(entry.txn)
        for entry in self.entries:
            self.trie.free_sequence(entry.seq)
            self.cp.unpin_save(entry.seq)
        self.trie.check_invariants([e.seq for e in self.entries])
        self.trie.clear()
        assert self.cp.live_records() == [] and len(self.trie.index) == 0
        assert self.trie.nodes.num_attached == 0
        assert self.pool.num_free == NUM_BLOCKS
        assert self.states.num_free == NUM_SLOTS - 1 and self.states.num_checkpoint == 0
        self.trie.check_invariants([])


TestHybridStateful = HybridMachine.TestCase
TestHybridStateful.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
