"""A random scheduler drives the trie: every hit must be exact, nothing may leak or be shared-written.

The machine keeps a model of what each KV block holds. A position of a block is written exactly
once, by the forward of the sequence that holds it, with the *content* of that position: the
namespace, every token up to it and every multimodal span that starts at or before it (what
the KV at that position depends on). Then:

* after a match, every block of the hit holds exactly the matching sequence's content;
* after every step, every live sequence's computed positions hold its own content, every trie
  node's block holds the node's tokens, and ``check_invariants`` passes (refcounts = owners);
* a forward never writes a position twice, nor a block another live sequence holds;
* a rollback restores the sequence, the refcounts and the match counters exactly;
* routed experts replayed by a hit are the ones the producing sequence recorded;
* at teardown, after freeing everything and clearing the trie, the pool is full again.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridcache.errors import OutOfBlocksError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.keyers import TwoBitKeyer

from ._helpers import seq_state

BS = 4
POOL_BLOCKS = 28
MAX_TOKENS = 44
NAMESPACES = [(None, None), ("lora-a", None), (None, "salt-1")]
SPANS = [(1, 3), (2, 7), (5, 10), (9, 13)]
TOKEN = st.integers(0, 3)


def step(method):
    """Mark the machine broken while a rule or check runs, so that teardown does not bury the
    first failure under a consequence of it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.broken = True
        result = method(self, *args, **kwargs)
        self.broken = False
        return result

    return wrapper


def expert_row(token: int, position: int) -> list[int]:
    return [token % 256, position % 256]


class TrieMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.live: list[Sequence] = []
        self.idle: list[Sequence] = []
        self.content: dict[int, list] = {}  # block id -> per-position content (None = unwritten)
        self.expected: dict[int, list] = {}  # seq id -> per-position content
        self.matches = self.query = self.hits = self.evicted = 0
        self.history: list[tuple] = []  # (tokens, namespace, spans) of every request seen
        self.broken = False

    @initialize(
        prefixes=st.lists(st.lists(TOKEN, min_size=3, max_size=14), min_size=2, max_size=3),
        colliding_keys=st.booleans(),
    )
    @step
    def setup(self, prefixes, colliding_keys):
        self.prefixes = prefixes
        self.pool = BlockPool(POOL_BLOCKS)
        # deterministic secrets keep examples reproducible (the per-process secret only changes
        # which keys collide, which test_identity covers)
        keyer = TwoBitKeyer(BS, secret=b"few-bits") if colliding_keys else BlockKeyer.deterministic(BS)
        self.trie = BlockTrie(self.pool, BS, keyer=keyer)

    # --- model ---------------------------------------------------------------------------------

    def content_of(self, seq: Sequence, position: int):
        known = self.expected.setdefault(seq.seq_id, [])
        toks = seq.tokens
        ns = (seq.namespace.adapter, seq.namespace.cache_salt)
        for p in range(len(known), seq.num_tokens):
            spans = tuple((s.start, s.end, s.modality, s.content_id) for s in seq.spans if s.start <= p)
            known.append((ns, toks[: p + 1].tobytes(), spans))
        return known[position]

    def block_holds(self, block: int, seq: Sequence, index: int, upto: int) -> bool:
        """Positions [index*BS, upto) of ``seq`` are held by ``block``."""
        held = self.content.get(block)
        if held is None:
            return False
        return all(held[p - index * BS] == self.content_of(seq, p) for p in range(index * BS, upto))

    def sweep(self):
        """Blocks back on the free list hold nothing."""
        for block in [b for b in self.content if self.pool.refcount_of(b) == 0]:
            del self.content[block]

    def forward(self, seq: Sequence):
        """The model forward: write positions [computed, tokens) into the table's blocks."""
        start, end = seq.num_computed, seq.num_tokens
        others = {int(b) for other in self.live if other is not seq for b in other.block_table}
        table = seq.block_table
        for p in range(start, end):
            block = int(table[p // BS])
            assert block not in others, f"forward writes block {block} that another live sequence holds"
            row = self.content.setdefault(block, [None] * BS)
            assert row[p % BS] is None, f"position {p} of block {block} written twice"
            row[p % BS] = self.content_of(seq, p)
        seq.set_computed(end)
        if seq.want_routed_experts:
            assert seq.num_routed_experts == start
            toks = seq.tokens
            rows = np.array([expert_row(int(toks[p]), p) for p in range(start, end)], dtype=np.int64).reshape(-1, 2)
            seq.append_routed_experts(rows)
            self.trie.cache_routed_experts(seq)

    def check_hit(self, seq: Sequence, txn):
        computed = seq.num_computed
        assert computed < seq.num_tokens, "a hit must end before the last token"
        if txn.hit_tokens:
            assert computed % BS == 0 and seq.is_boundary_safe(computed)
            overlap = seq.prefix_state.overlap.recompute_blocks
            assert computed // BS <= (seq.num_valid - 1) // BS - overlap, "the hit leaves no recompute overlap"
        table = seq.block_table
        for index in range(txn.table_start, computed // BS):
            assert self.block_holds(int(table[index]), seq, index, (index + 1) * BS), (
                f"block {int(table[index])} at index {index} does not hold the sequence's tokens"
            )
        if seq.want_routed_experts and seq.routed_experts is not None:
            toks = seq.tokens
            expected = [expert_row(int(toks[p]), p) for p in range(seq.num_routed_experts)]
            assert seq.routed_experts.tolist() == expected

    def rollback_exactly(self, txn, seq, before):
        self.trie.rollback(txn)
        self.matches -= 1
        self.query -= txn.seq.num_tokens - txn.step_before
        self.hits -= txn.hit_tokens
        state, refcounts = before
        assert seq_state(seq) == state, "rollback did not restore the sequence"
        expected = np.array(refcounts)
        expected[self.evicted_now] -= 1  # evictions done while trying to admit stay done
        assert self.pool.refcounts(np.arange(POOL_BLOCKS)).tolist() == expected.tolist(), "rollback did not restore refcounts"

    def grow(self, seq: Sequence, evict_first: bool) -> bool:
        self.sweep()
        needed = -(-seq.num_tokens // BS) - seq.num_blocks
        if evict_first and needed > self.pool.num_free:
            nodes = self.trie.nodes
            trie_blocks = set(nodes.block[nodes.attached_slots()].tolist())
            self.evicted += self.trie.free_kv_blocks(needed - self.pool.num_free)
            self.evicted_now = sorted(trie_blocks - set(nodes.block[nodes.attached_slots()].tolist()))
            self.sweep()
        try:
            new = self.pool.grow_table(seq, seq.num_tokens, BS)
        except OutOfBlocksError:
            return False
        assert not any(int(b) in self.content for b in new), "a fresh block still holds data"
        return True

    def prefill_or_roll_back(self, seq: Sequence, data, *, resumed: bool) -> None:
        """match -> (rollback | grow -> allocate -> commit -> forward), checking each step against
        the model: the machine draws voluntary rollbacks and whether a short pool evicts, which
        production admission (``CacheProtocol.admit``) never chooses."""
        before = (seq_state(seq), self.pool.refcounts(np.arange(POOL_BLOCKS)).tolist())
        self.evicted_now = []
        start = seq.num_computed
        txn = self.trie.match(seq)
        self.matches += 1
        self.query += seq.num_tokens - start
        self.hits += txn.hit_tokens
        assert txn.hit_tokens == seq.num_computed - start >= 0
        self.check_hit(seq, txn)
        if data.draw(st.integers(0, 9), label="voluntary rollback") == 0 or not self.grow(
            seq, data.draw(st.booleans(), label="evict when short")
        ):
            self.rollback_exactly(txn, seq, before)
            if resumed:  # it cannot stay live with uncomputed tokens: preempt it
                self.live.remove(seq)
                self.trie.free_sequence(seq)
                self.idle.append(seq)
            elif seq not in self.idle:
                self.idle.append(seq)
            return
        self.trie.allocate(seq)
        assert seq.prefix_state.overlap.fresh_range == (0, 0)
        self.trie.commit(txn)
        self.sweep()
        self.forward(seq)
        if not resumed:
            self.live.append(seq)

    def follow(self, seq: Sequence, count: int, which: int) -> list[int] | None:
        """The next ``count`` tokens of an earlier request that ``seq`` is a prefix of, so decode
        and resumed turns run into blocks other requests already cached."""
        toks = seq.tokens.tolist()
        ns = (seq.namespace.adapter, seq.namespace.cache_salt)
        candidates = [
            t for t, n, spans in self.history
            if n == ns and spans == seq.spans and len(t) > len(toks) and t[: len(toks)] == toks
        ]
        if not candidates:
            return None
        source = candidates[which % len(candidates)]
        return source[len(toks) : len(toks) + count]

    # --- rules ---------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        prefix=st.integers(0, 2),
        repeat=st.none() | st.tuples(st.integers(0, 1000), st.integers(1, MAX_TOKENS)),
        suffix=st.lists(TOKEN, max_size=10),
        namespace=st.sampled_from(NAMESPACES),
        span=st.none() | st.tuples(st.sampled_from(SPANS), st.sampled_from(["img-a", "img-b"])),
        recompute=st.integers(0, 1),
        experts=st.booleans(),
        probe=st.booleans(),
    )
    @step
    def new_request(self, data, prefix, repeat, suffix, namespace, span, recompute, experts, probe):
        toks = self.prefixes[prefix % len(self.prefixes)] + suffix
        spans = []
        if span is not None and span[0][1] <= len(toks):
            (start, end), content_id = span
            spans = [MultimodalSpan(start, end, "image", content_id)]
        if repeat is not None and self.history:
            # a later turn of an earlier conversation: its tokens (cut) plus new ones
            which, cut = repeat
            old, namespace, old_spans = self.history[-1 - which % min(len(self.history), 6)]  # recent ones
            toks = old[:cut] + suffix[: max(0, MAX_TOKENS - cut)]
            spans = [s for s in old_spans if s.end <= len(toks)]
        self.history.append((list(toks), namespace, tuple(spans)))
        seq = Sequence(toks, adapter=namespace[0], cache_salt=namespace[1], multimodal=spans, want_routed_experts=experts)
        seq.prefix_state.overlap.recompute_blocks = recompute
        # optionally a second request is matched first and rolled back after this admission:
        # transactions of several sequences are open at once
        other = other_txn = None
        if probe:
            other = Sequence(self.prefixes[0] + suffix[:3], adapter=namespace[0], cache_salt=namespace[1])
            other_before = seq_state(other)
            other_txn = self.trie.match(other)
            self.matches += 1
            self.query += other.num_tokens
            self.hits += other_txn.hit_tokens
            self.check_hit(other, other_txn)
        self.prefill_or_roll_back(seq, data, resumed=False)
        if other is not None:
            self.trie.rollback(other_txn)
            self.matches -= 1
            self.query -= other.num_tokens
            self.hits -= other_txn.hit_tokens
            assert seq_state(other) == other_before

    @precondition(lambda self: self.idle)
    @rule(data=st.data(), which=st.integers(0, 1000))
    @step
    def readmit(self, data, which):
        seq = self.idle[which % len(self.idle)]
        self.prefill_or_roll_back(seq, data, resumed=False)  # on success the sequence is live again
        if seq in self.live:
            self.idle.remove(seq)

    @precondition(lambda self: self.live)
    @rule(
        which=st.integers(0, 1000),
        new=st.lists(TOKEN, min_size=1, max_size=6),
        follow=st.none() | st.integers(0, 1000),
        evict_first=st.booleans(),
    )
    @step
    def decode(self, which, new, follow, evict_first):
        seq = self.live[which % len(self.live)]
        if follow is not None:
            new = self.follow(seq, len(new), follow) or new
        if seq.num_tokens + len(new) > MAX_TOKENS:
            return
        seq.append_tokens(new)
        self.history.append((seq.tokens.tolist(), (seq.namespace.adapter, seq.namespace.cache_salt), seq.spans))
        if not self.grow(seq, evict_first):
            self.live.remove(seq)  # preempted
            self.trie.free_sequence(seq)
            self.idle.append(seq)
            return
        self.trie.allocate(seq)
        self.forward(seq)

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        which=st.integers(0, 1000),
        new=st.lists(TOKEN, min_size=1, max_size=12),
        follow=st.none() | st.integers(0, 1000),
        preallocate=st.integers(0, 2),
        ahead=st.booleans(),
    )
    @step
    def resume(self, data, which, new, follow, preallocate, ahead):
        """A multi-turn session gets new input and matches again while holding its blocks,
        possibly some preallocated beyond its cursor. With ``ahead``, another request
        first runs the same conversation further, so the session's match finds cached blocks
        at positions where it already holds blocks."""
        seq = self.live[which % len(self.live)]
        if follow is not None:
            new = self.follow(seq, len(new), follow) or new
        if seq.num_tokens + len(new) > MAX_TOKENS:
            return
        if ahead:
            other = Sequence(
                seq.tokens.tolist() + new,
                adapter=seq.namespace.adapter,
                cache_salt=seq.namespace.cache_salt,
                multimodal=seq.spans,
                want_routed_experts=seq.want_routed_experts,
            )
            self.history.append((other.tokens.tolist(), (seq.namespace.adapter, seq.namespace.cache_salt), seq.spans))
            self.prefill_or_roll_back(other, data, resumed=False)
        if preallocate:
            self.sweep()
            try:
                self.pool.grow_table(seq, seq.num_tokens + preallocate * BS, BS)
            except OutOfBlocksError:
                pass
        seq.append_tokens(new)
        self.history.append((seq.tokens.tolist(), (seq.namespace.adapter, seq.namespace.cache_salt), seq.spans))
        self.prefill_or_roll_back(seq, data, resumed=True)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 1000), keep=st.booleans())
    @step
    def free(self, which, keep):
        seq = self.live.pop(which % len(self.live))
        self.trie.free_sequence(seq)
        assert seq.num_blocks == 0 and seq.num_computed == 0
        if keep:
            self.idle.append(seq)

    @rule(count=st.integers(0, 3))
    @step
    def evict(self, count):
        free_before = self.pool.num_free
        evicted = self.trie.free_kv_blocks(count)
        assert 0 <= evicted <= count
        assert self.pool.num_free == free_before + evicted
        self.evicted += evicted

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    @step
    def consistent(self):
        if not hasattr(self, "trie"):
            return
        self.sweep()
        self.trie.check_invariants(self.live)
        for seq in self.live:
            assert seq.num_computed == seq.num_tokens
            table = seq.block_table
            for index in range(-(-seq.num_computed // BS)):
                upto = min((index + 1) * BS, seq.num_computed)
                assert self.block_holds(int(table[index]), seq, index, upto), f"{seq} block {index} lost its data"
        for seq in self.idle:
            assert seq.num_blocks == 0
        nodes = self.trie.nodes
        roots = {slot: ns for ns, slot in nodes._roots.items()}
        for slot in nodes.attached_slots().tolist():
            block = int(nodes.block[slot])
            held = self.content.get(block)
            assert held is not None and all(c is not None for c in held), f"node {slot} owns an unwritten block"
            row = self.trie.tokens.run(slot, slot)
            assert all(c[1][-4 * BS :] == row.tobytes() for c in held[-1:]), f"node {slot} block differs from its tokens"
            top = slot
            while not nodes.is_root[top]:
                top = int(nodes.parent[top])
            ns = roots[top]
            assert held[0][0] == (ns.adapter, ns.cache_salt), "a block is shared across namespaces"
            if self.trie.experts.has_rows[slot]:
                first = (int(nodes.depth[slot]) - 1) * BS
                rows = self.trie.experts.gather([(slot, slot)]).tolist()
                assert rows == [expert_row(int(t), first + i) for i, t in enumerate(row.tolist())]
        m = self.trie.stats.match
        assert (m.matches, m.query_tokens, m.hit_tokens) == (self.matches, self.query, self.hits)
        assert self.trie.stats.evicted_blocks == self.evicted

    def teardown(self):
        if not hasattr(self, "trie") or self.broken:
            return
        for seq in self.live:
            self.trie.free_sequence(seq)
        self.live = []
        self.trie.check_invariants()
        self.trie.clear()
        assert self.pool.num_free == POOL_BLOCKS, "blocks leaked"
        assert self.trie.nodes.num_attached == 0
        self.trie.check_invariants()


TrieMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestTrieMachine = TrieMachine.TestCase
