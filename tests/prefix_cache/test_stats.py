"""PrefixCacheStats and the miss reasons the trie records."""

from __future__ import annotations

from hybridcache.prefix_cache import MissReason, PrefixCacheStats
from hybridcache.sequence import MultimodalSpan, Sequence

from ._helpers import B, make_trie, prefill, produce, tokens


def test_record_hits_misses_and_shortened():
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record_match(100, 0, None)
    stats.record_match(50, 0, MissReason.NOTHING_TO_MATCH)
    stats.record_match(40, 32, None)
    stats.record_match(49, 32, MissReason.RECOMPUTE_OVERLAP)
    m = stats.match
    assert (m.query_tokens, m.hit_tokens, m.matches, m.hits) == (239, 64, 4, 2)
    assert dict(m.misses) == {"no_cached_prefix": 1, "nothing_to_match": 1}
    assert dict(m.shortened) == {"recompute_overlap": 1}
    assert stats.hit_rate == 64 / 239


def test_snapshot_restore_are_independent_copies():
    stats = PrefixCacheStats()
    stats.record_match(10, 0, MissReason.NO_CACHED_PREFIX)
    snap = stats.snapshot()
    stats.record_match(20, 16, MissReason.MULTIMODAL_BOUNDARY)
    stats.record_match(5, 0, MissReason.NO_CACHED_PREFIX)
    assert snap.query_tokens == 10 and dict(snap.misses) == {"no_cached_prefix": 1} and not snap.shortened
    stats.evicted_blocks = 7
    stats.restore(snap)
    assert stats.match == snap and stats.match is not snap
    stats.record_match(1, 0, None)
    assert snap.misses["no_cached_prefix"] == 1  # the snapshot is not aliased after restore
    assert stats.evicted_blocks == 7  # restore does not touch eviction counters


def test_reset_and_as_dict():
    stats = PrefixCacheStats()
    stats.record_match(32, 16, MissReason.ROUTED_EXPERTS)
    stats.evicted_blocks = 3
    d = stats.as_dict()
    assert d.items() >= {
        "query_tokens": 32,
        "hit_tokens": 16,
        "hit_rate": 0.5,
        "matches": 1,
        "hits": 1,
        "misses": {},
        "shortened": {"routed_experts": 1},
        "evicted_blocks": 3,
    }.items()
    stats.reset()
    assert stats.as_dict()["matches"] == 0 and stats.evicted_blocks == 0 and stats.hit_rate == 0.0


def test_miss_reasons_recorded_by_the_trie():
    pool, trie = make_trie(64)
    # nothing before the last token: a one-block prompt
    txn = trie.match(Sequence(tokens(B)))
    trie.rollback(txn)
    assert trie.stats.match.matches == 0  # rolled back
    trie.commit(trie.match(Sequence(tokens(B))))
    assert dict(trie.stats.match.misses) == {"nothing_to_match": 1}
    # a cold prefix
    produce(trie, tokens(3 * B + 1))
    assert trie.stats.match.misses["no_cached_prefix"] == 1
    # overlap shortens a hit
    seq = Sequence(tokens(3 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    trie.commit(trie.match(seq))
    assert trie.stats.match.shortened["recompute_overlap"] == 1
    trie.free_sequence(seq)
    # overlap removes the whole hit: a miss because of the overlap
    seq = Sequence(tokens(B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    trie.commit(trie.match(seq))
    assert trie.stats.match.misses["recompute_overlap"] == 1
    trie.free_sequence(seq)


def test_multimodal_and_routed_expert_reasons():
    pool, trie = make_trie(64)
    short = [MultimodalSpan(24, 33, "image", "img")]
    produce(trie, tokens(2 * B + 1), multimodal=short)
    seq = Sequence(tokens(2 * B + 1), multimodal=short)
    trie.commit(trie.match(seq))
    assert seq.num_computed == B  # 32 lies inside [24, 33): back to 24, rounded down to 16
    assert trie.stats.match.shortened["multimodal_boundary"] == 1
    trie.free_sequence(seq)
    long = [MultimodalSpan(8, 33, "image", "img")]
    produce(trie, tokens(2 * B + 1, start=500), multimodal=long)
    seq = Sequence(tokens(2 * B + 1, start=500), multimodal=long)
    trie.commit(trie.match(seq))
    assert seq.num_computed == 0
    assert trie.stats.match.misses["multimodal_boundary"] == 1
    trie.free_sequence(seq)
    experts = Sequence(tokens(2 * B + 1), want_routed_experts=True)
    trie.commit(trie.match(experts))
    assert experts.num_computed == 0
    assert trie.stats.match.misses["routed_experts"] == 1


def test_suppressed_match_records_nothing():
    pool, trie = make_trie(64)
    produce(trie, tokens(2 * B + 1))
    before = trie.stats.snapshot()
    seq = Sequence(tokens(2 * B + 1))
    seq.prefix_state.suppress_stats = True
    trie.commit(trie.match(seq))
    assert seq.num_computed == 2 * B
    assert trie.stats.match == before


def test_disabled_trie_records_no_hit():
    pool, trie = make_trie(64, enabled=False)
    seq = Sequence(tokens(3 * B + 1))
    prefill(trie, seq)
    trie.free_sequence(seq)
    seq = Sequence(tokens(3 * B + 1))
    trie.commit(trie.match(seq))
    m = trie.stats.match
    assert seq.num_computed == 0 and m.hits == 0 and m.hit_tokens == 0
    assert not m.misses  # a disabled trie records no match at all
    assert trie.nodes.num_attached == 0


def test_rollback_restores_match_counters_but_not_evictions():
    pool, trie = make_trie(8)
    produce(trie, tokens(3 * B + 1))
    produce(trie, tokens(2 * B + 1, start=900))
    before = trie.stats.snapshot()
    seq = Sequence(tokens(3 * B + 1))
    txn = trie.match(seq)
    assert trie.stats.match.hits == before.hits + 1
    # admission tries to make room: the other prompt's path is evicted for real
    assert trie.free_kv_blocks(2) == 2
    trie.rollback(txn)
    assert trie.stats.match == before
    assert trie.stats.evicted_blocks == 2
    assert pool.num_free == 8 - 3


def test_interleaved_transactions_roll_back_only_their_own_counters():
    """Two sequences matched in one scheduling pass: rolling back the first must not erase the
    counters of the second, already committed, match."""
    pool, trie = make_trie(64)
    produce(trie, tokens(3 * B + 1))
    base = trie.stats.snapshot()
    first, second = Sequence(tokens(3 * B + 1)), Sequence(tokens(2 * B + 5, start=700))
    first_txn = trie.match(first)
    second_txn = trie.match(second)
    trie.commit(second_txn)
    trie.rollback(first_txn)
    m = trie.stats.snapshot()
    assert m.matches == base.matches + 1
    assert m.query_tokens == base.query_tokens + second.num_tokens
    assert m.hits == base.hits and m.hit_tokens == base.hit_tokens
    assert m.misses["no_cached_prefix"] == base.misses["no_cached_prefix"] + 1
    # and rolling back in match order works too
    third, fourth = Sequence(tokens(3 * B + 1)), Sequence(tokens(3 * B + 1))
    third_txn, fourth_txn = trie.match(third), trie.match(fourth)
    trie.rollback(third_txn)
    assert trie.stats.match.hits == m.hits + 1
    trie.rollback(fourth_txn)
    assert trie.stats.match == m
