"""BlockTrie scenarios (AR / VLM, recompute overlap, routed experts, namespaces, rollback).

The rules these scenarios pin: a hit ends strictly before the last valid token, block tables
are written by index, a match is a transaction, and allocate deduplicates only blocks the
sequence has already computed.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.types import NO_NODE
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.keyers import CONSTANT, ConstantKeyer

from ._helpers import (
    B,
    admit,
    cursor_depth,
    decode,
    grow_attach_commit,
    leaves,
    make_trie,
    node_tokens,
    path_blocks,
    prefill,
    produce,
    refs,
    seq_state,
    slots_at_depth,
    snapshot,
    tokens,
)


def expert_rows(n: int, start: int = 0, width: int = 4) -> np.ndarray:
    """Deterministic routed-expert rows for positions [start, start + n)."""
    positions = np.arange(start, start + n)[:, None]
    return ((positions * 7 + np.arange(width)[None, :] * 3) % 256).astype(np.int16)


# --- AR: allocate, match, decode ------------------------------------------------------------


def test_allocate_partial_prompt_then_decode():
    """Allocating 2.5 blocks shares the two complete ones with the trie (refs [2, 2, 1]); a
    decode that completes block 2 attaches it too (refs [2, 2, 2, 1])."""
    pool, trie = make_trie(16)
    seq = Sequence(tokens(2 * B + 8))
    txn = trie.match(seq)
    assert txn.hit_tokens == 0 and seq.num_computed == 0
    grow_attach_commit(trie, seq, txn)
    assert seq.num_blocks == 3 and refs(pool, seq) == [2, 2, 1]
    assert cursor_depth(trie, seq) == 2
    cursor = seq.prefix_state.trie.cursor
    assert node_tokens(trie, cursor) == tokens(B, start=B + 1)
    assert leaves(trie) == [cursor]
    trie.check_invariants([seq])
    seq.set_computed(seq.num_tokens)
    decode(trie, seq, tokens(B, start=1000))
    assert seq.num_blocks == 4 and refs(pool, seq) == [2, 2, 2, 1]
    (leaf,) = leaves(trie)
    assert trie.nodes.depth[leaf] == 3
    assert node_tokens(trie, leaf) == tokens(8, start=2 * B + 1) + tokens(8, start=1000)
    trie.check_invariants([seq])


def test_decode_fast_path_attaches_nothing_until_a_block_completes():
    pool, trie = make_trie(16)
    seq = Sequence(tokens(B + 1))
    prefill(trie, seq)
    before = trie.nodes.num_attached
    for i in range(B - 2):
        decode(trie, seq, [500 + i])
        assert trie.nodes.num_attached == before
    decode(trie, seq, [499])
    assert seq.num_tokens == 2 * B and trie.nodes.num_attached == before + 1
    trie.check_invariants([seq])


def test_branching_match_shares_the_common_block():
    """[1]*16 + [3]*16 against a cache of [1]*16 [2]*16 [3]*8 shares only the first block (the
    owner's reference, the trie's, and the matcher's pin on its path); the trie ends with 2 leaves."""
    pool, trie = make_trie(16)
    owner = Sequence([1] * B + [2] * B + [3] * 8)
    prefill(trie, owner)
    other = Sequence([1] * B + [3] * B + [4])
    txn = trie.match(other)
    assert txn.hit_tokens == B and other.num_computed == B
    assert other.block_table.tolist() == owner.block_table[:1].tolist()
    assert pool.refcounts(other.block_table).tolist() == [2]
    assert trie.kv.pins() == {other.prefix_state.borrow.node: 1} and other.prefix_state.borrow.depth == 1
    assert cursor_depth(trie, other) == 1
    grow_attach_commit(trie, other, txn)
    assert len(leaves(trie)) == 2
    trie.check_invariants([owner, other])
    third = Sequence([1] * B + [3] * B + [9] * 4)
    prefill(trie, third)
    assert third.block_table[:2].tolist() == other.block_table[:2].tolist()
    assert refs(pool, third)[:2] == [2, 2]  # owner + trie, other + trie; the matchers hold pins
    assert sorted(trie.kv.pins().values()) == [1, 1] and third.prefix_state.borrow.depth == 2
    trie.check_invariants([owner, other, third])


def test_free_then_rematch():
    """A sequence freed after allocate (nothing computed, no blocks, no cursor) matches its own
    2 cached blocks again."""
    pool, trie = make_trie(16)
    seq = Sequence(tokens(2 * B + 8))
    prefill(trie, seq)
    trie.free_sequence(seq)
    assert seq.num_computed == 0 and seq.num_blocks == 0
    assert seq.prefix_state.trie.cursor == NO_NODE and seq.prefix_state.overlap.trie_block_map == {}
    assert pool.num_free == 16 - 2
    trie.check_invariants([seq])
    txn = trie.match(seq)
    assert txn.hit_tokens == 2 * B and seq.num_computed == 2 * B and seq.num_blocks == 2
    trie.commit(txn)
    trie.check_invariants([seq])


@pytest.mark.parametrize("extra", [0, 1, B - 1])
def test_hit_never_covers_the_last_token(extra):
    pool, trie = make_trie(32)
    produce(trie, tokens(4 * B))
    seq = Sequence(tokens(3 * B + extra))
    txn = trie.match(seq)
    expected = 3 * B if extra else 2 * B
    assert seq.num_computed == expected < seq.num_tokens
    assert txn.hit_tokens == expected
    trie.rollback(txn)


def test_exact_block_count_prompt_keeps_last_block_private():
    """A prompt of exactly 3 cached blocks hits 2; its own block 2 is still written by the
    forward, so allocate keeps it private and maps it to the canonical block."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B))
    canonical = path_blocks_of_tokens(trie, tokens(3 * B))
    seq = Sequence(tokens(3 * B))
    txn = trie.match(seq)
    assert seq.num_computed == 2 * B and seq.prefix_state.overlap.fresh_range == (0, 0)
    grow_attach_commit(trie, seq, txn)
    private = int(seq.block_table[2])
    assert private != canonical[2]
    assert seq.prefix_state.overlap.trie_block_map == {2: canonical[2]}
    assert pool.refcount_of(private) == 1 and cursor_depth(trie, seq) == 3
    trie.check_invariants([seq])
    seq.set_computed(seq.num_tokens)
    decode(trie, seq, [7])  # the next allocate swaps the computed private block for the canonical one
    assert seq.block_table[:3].tolist() == canonical
    assert seq.prefix_state.overlap.trie_block_map == {}
    assert pool.refcount_of(private) == 0
    trie.check_invariants([seq])


def path_blocks_of_tokens(trie: BlockTrie, toks) -> list[int]:
    probe = Sequence(list(toks) + [0])
    txn = trie.match(probe)
    blocks = probe.block_table.tolist()
    trie.rollback(txn)
    return blocks


def test_duplicate_computed_block_is_deduplicated_by_allocate():
    """Two sequences compute the same prompt side by side: the second one's computed blocks are
    swapped for the first one's trie blocks on its next allocate."""
    pool, trie = make_trie(32)
    first, second = Sequence(tokens(2 * B + 4)), Sequence(tokens(2 * B + 4))
    t1, t2 = trie.match(first), trie.match(second)
    for seq in (first, second):
        pool.grow_table(seq, seq.num_tokens, B)
    trie.allocate(first)
    trie.allocate(second)  # nothing computed yet: private blocks kept, mapped
    trie.commit(t1)
    trie.commit(t2)
    assert second.prefix_state.overlap.trie_block_map == {0: int(first.block_table[0]), 1: int(first.block_table[1])}
    trie.check_invariants([first, second])
    for seq in (first, second):
        seq.set_computed(seq.num_tokens)
    free_before = pool.num_free
    decode(trie, second, [1])
    assert second.block_table[:2].tolist() == first.block_table[:2].tolist()
    assert pool.num_free == free_before + 2
    assert refs(pool, second) == [3, 3, 1]
    trie.check_invariants([first, second])


# --- recompute overlap ------------------------------------------------------------------------


def test_recompute_overlap_worked_example():
    """7.5 / worked example A: R=1 on a 3-block + 1 cache -> history 32, fresh [2, 3), stats
    query 49 / hit 32; allocate keeps the private overlap block (ref 1) and maps it."""
    pool, trie = make_trie(16)
    owner = Sequence(tokens(3 * B + 1))
    prefill(trie, owner)
    a, b, c = owner.block_table[:3].tolist()
    seq = Sequence(tokens(3 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    before = trie.stats.snapshot()
    txn = trie.match(seq)
    assert seq.num_computed == 2 * B and seq.block_table.tolist() == [a, b]
    assert seq.prefix_state.overlap.fresh_range == (2, 3)
    assert cursor_depth(trie, seq) == 2
    stats = trie.stats.match
    assert stats.query_tokens - before.query_tokens == 49 and stats.hit_tokens - before.hit_tokens == 32
    assert stats.shortened["recompute_overlap"] == 1
    grow_attach_commit(trie, seq, txn)
    private = int(seq.block_table[2])
    assert private != c and pool.refcount_of(private) == 1
    assert pool.refcount_of(c) == 2  # trie + owner
    assert seq.prefix_state.overlap.trie_block_map == {2: c}
    assert seq.prefix_state.overlap.fresh_range == (0, 0)
    assert cursor_depth(trie, seq) == 3
    trie.check_invariants([owner, seq])
    # once the owner is gone the canonical block is held by the trie only
    trie.free_sequence(owner)
    assert pool.refcount_of(c) == 1
    trie.check_invariants([seq])


def test_evicted_overlap_node_resets_the_cursor():
    """When the overlap leaf is evicted after allocate, the next 15 tokens and allocate restart
    the cursor at the root, and the sequence's own blocks become the new path."""
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1))
    seq = Sequence(tokens(3 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    prefill(trie, seq)
    old_c = seq.prefix_state.overlap.trie_block_map[2]
    (overlap_node,) = slots_at_depth(trie, 3)
    assert trie.free_kv_blocks(1) == 1
    assert not trie.nodes.attached[overlap_node]
    assert pool.refcount_of(old_c) == 0
    assert cursor_depth(trie, seq) is None
    trie.check_invariants([seq])
    decode(trie, seq, tokens(15, start=900))
    assert seq.num_tokens == 4 * B
    assert cursor_depth(trie, seq) == 4
    assert seq.prefix_state.overlap.trie_block_map == {}
    assert path_blocks(trie, seq) == seq.block_table.tolist()
    assert seq.prefix_state.borrow.depth == 2  # the first two blocks are borrowed by a path pin
    assert refs(pool, seq) == [1, 1, 2, 2]
    new_parent = int(trie.nodes.parent[seq.prefix_state.trie.cursor])
    assert new_parent != overlap_node or trie.nodes.generation[new_parent] > 0
    assert int(trie.nodes.block[new_parent]) == int(seq.block_table[2])
    trie.check_invariants([seq])


@pytest.mark.parametrize("raw", [1, 2, 5])
def test_recompute_overlap_drops_one_block(raw):
    """A recompute overlap of one block (R=1) on a raw match of 1, 2 or 5 blocks computes
    (raw-1)*B tokens and leaves the fresh range [hist/B, raw)."""
    pool, trie = make_trie(32)
    owner = Sequence(tokens(raw * B + 1))
    prefill(trie, owner)
    seq = Sequence(tokens(raw * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    txn = trie.match(seq)
    assert seq.num_computed == (raw - 1) * B
    assert seq.prefix_state.overlap.fresh_range == (raw - 1, raw)
    grow_attach_commit(trie, seq, txn)
    assert seq.block_table[raw - 1] != owner.block_table[raw - 1]
    assert seq.block_table[: raw - 1].tolist() == owner.block_table[: raw - 1].tolist()
    assert seq.prefix_state.overlap.fresh_range == (0, 0)
    assert cursor_depth(trie, seq) == raw
    trie.check_invariants([owner, seq])


def test_no_recompute_overlap_is_a_full_hit():
    pool, trie = make_trie(16)
    produce(trie, tokens(3 * B + 1))
    seq = Sequence(tokens(3 * B + 1))
    txn = trie.match(seq)
    assert seq.num_computed == 3 * B and seq.prefix_state.overlap.fresh_range == (0, 0)
    assert txn.hit_tokens == 3 * B
    trie.commit(txn)


def test_recompute_overlap_with_image():
    """With an image at [40, 56), R=1 and 4 cached blocks + 1 token, the hit drops the overlap
    and then clamps out of the image to 32 computed tokens; the fresh range is [2, 4), the
    private blocks are kept and the cursor ends at 64."""
    pool, trie = make_trie(32)
    span = [MultimodalSpan(40, 56, "image", "img")]
    produce(trie, tokens(4 * B + 1), multimodal=span)
    canonical = path_blocks_of_tokens_mm(trie, tokens(4 * B + 1), span)
    seq = Sequence(tokens(4 * B + 1), multimodal=span)
    seq.prefix_state.overlap.recompute_blocks = 1
    txn = trie.match(seq)
    assert seq.num_computed == 2 * B
    assert seq.prefix_state.overlap.fresh_range == (2, 4)
    grow_attach_commit(trie, seq, txn)
    assert seq.prefix_state.overlap.trie_block_map == {2: canonical[2], 3: canonical[3]}
    assert all(pool.refcount_of(int(seq.block_table[i])) == 1 for i in (2, 3, 4))
    assert cursor_depth(trie, seq) == 4
    trie.check_invariants([seq])


def path_blocks_of_tokens_mm(trie, toks, spans):
    probe = Sequence(list(toks) + [0] * B, multimodal=spans)
    txn = trie.match(probe)
    blocks = probe.block_table.tolist()
    trie.rollback(txn)
    return blocks


def test_fresh_range_blocks_stay_private_until_computed_then_settle():
    """A mapped private block is swapped for the canonical one only after it was computed and
    outside the fresh range of the current match."""
    pool, trie = make_trie(32)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(4 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 2
    admit(trie, seq)
    assert seq.num_computed == 2 * B
    mapped = dict(seq.prefix_state.overlap.trie_block_map)
    assert sorted(mapped) == [2, 3]
    # allocate again before the forward ran: nothing settles
    trie.allocate(seq)
    assert seq.prefix_state.overlap.trie_block_map == mapped
    trie.check_invariants([seq])
    seq.set_computed(seq.num_tokens)
    decode(trie, seq, [5])
    assert seq.prefix_state.overlap.trie_block_map == {}
    assert seq.block_table[2:4].tolist() == [mapped[2], mapped[3]]
    trie.check_invariants([seq])


def test_computed_block_in_the_fresh_range_stays_private():
    """allocate never deduplicates a block of the current fresh range, even one the sequence
    has already computed; the next allocate (fresh range cleared) settles it."""
    pool, trie = make_trie(32)
    producer = Sequence(tokens(4 * B + 1))
    prefill(trie, producer)
    a, b, c, d = producer.block_table[:4].tolist()
    seq = Sequence(tokens(4 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 2
    prefill(trie, seq)  # hit [a, b], private c', d' mapped to c, d, then the forward runs
    assert seq.prefix_state.overlap.trie_block_map == {2: c, 3: d}
    private_c = int(seq.block_table[2])
    trie.free_sequence(producer)
    assert trie.free_kv_blocks(1) == 1  # node D (held by the trie only) goes: the cursor is gone
    assert cursor_depth(trie, seq) is None
    seq.append_tokens([77])
    txn = trie.match(seq)  # from the root: raw A B C, R=2 -> accepted 2 -> no hit, fresh [2, 3)
    assert txn.hit_tokens == 0 and seq.prefix_state.overlap.fresh_range == (2, 3)
    grow_attach_commit(trie, seq, txn)
    assert int(seq.block_table[2]) == private_c  # computed, but in the fresh range: kept
    assert seq.prefix_state.overlap.trie_block_map == {2: c}
    assert cursor_depth(trie, seq) == 4  # d' became the new node at depth 4
    trie.check_invariants([seq])
    seq.set_computed(seq.num_tokens)
    trie.allocate(seq)  # no fresh range any more: the computed duplicate is settled
    assert int(seq.block_table[2]) == c and seq.prefix_state.overlap.trie_block_map == {}
    assert pool.refcount_of(private_c) == 0
    trie.check_invariants([seq])


# --- resumed sessions: blocks beyond the cursor --------------------------------------------------


def test_match_writes_canonical_blocks_at_the_right_positions():
    """A session that already holds blocks beyond its cursor (a partial block and a
    preallocated one) gets the canonical blocks written by index, not appended."""
    pool, trie = make_trie(32)
    session = Sequence(tokens(2 * B + 8))
    prefill(trie, session)
    pool.grow_table(session, 4 * B, B)  # preallocated block beyond the partial one
    own = session.block_table.tolist()
    assert len(own) == 4 and cursor_depth(trie, session) == 2
    # meanwhile another request completes block 2 and 3 of the same conversation
    produce(trie, tokens(4 * B + 3))
    canonical = path_blocks_of_tokens(trie, tokens(4 * B + 3))
    # the session resumes with new input that continues the same text
    session.append_tokens(tokens(2 * B - 8 + 3, start=2 * B + 9))
    assert session.tokens.tolist() == tokens(4 * B + 3)
    txn = trie.match(session)
    assert session.num_computed == 4 * B and txn.hit_tokens == 2 * B - 8
    assert session.block_table.tolist() == own[:2] + canonical[2:4]
    assert txn.displaced.tolist() == own[2:4]
    # displaced blocks are held by the transaction until commit
    assert pool.refcounts(own[2:4]).tolist() == [1, 1]
    trie.check_invariants([session], [txn])
    with pytest.raises(AssertionError, match="refcount differs"):
        trie.check_invariants([session])  # the transaction's references are owners too
    trie.commit(txn)
    assert pool.refcounts(own[2:4]).tolist() == [0, 0]
    pool.grow_table(session, session.num_tokens, B)
    trie.allocate(session)
    trie.check_invariants([session])
    assert cursor_depth(trie, session) == 4


def test_resumed_session_rollback_puts_its_blocks_back():
    pool, trie = make_trie(32)
    session = Sequence(tokens(2 * B + 8))
    prefill(trie, session)
    produce(trie, tokens(4 * B + 3))
    session.append_tokens(tokens(2 * B - 5, start=2 * B + 9))
    before = (seq_state(session), snapshot(trie.stats.match))
    refs_before = pool.refcounts(np.arange(32)).tolist()
    txn = trie.match(session)
    assert session.num_computed == 4 * B
    trie.rollback(txn)
    assert (seq_state(session), snapshot(trie.stats.match)) == before
    assert pool.refcounts(np.arange(32)).tolist() == refs_before
    trie.check_invariants([session])


def test_match_from_a_cursor_deeper_than_the_computed_step():
    """A sequence rolled back to an earlier step keeps its cursor; match resumes from the
    ancestor at the computed block."""
    pool, trie = make_trie(32)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(4 * B + 1))
    prefill(trie, seq)
    assert cursor_depth(trie, seq) == 4
    seq.set_computed(B + 3)  # e.g. a recompute request
    txn = trie.match(seq)
    assert seq.num_computed == 4 * B and txn.hit_tokens == 3 * B - 3
    assert txn.table_start == 1
    trie.commit(txn)
    trie.check_invariants([seq])


# --- namespaces --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "producer, consumer",
    [
        ({}, {"adapter": "lora-a"}),
        ({"adapter": "lora-a"}, {"adapter": "lora-b"}),
        ({}, {"cache_salt": "tenant"}),
        ({"cache_salt": "t1"}, {"cache_salt": "t2"}),
        ({"adapter": "x"}, {"cache_salt": "x"}),
    ],
)
def test_different_namespaces_never_share(producer, consumer):
    pool, trie = make_trie(32)
    produce(trie, tokens(3 * B + 1), **producer)
    seq = Sequence(tokens(3 * B + 1), **consumer)
    txn = trie.match(seq)
    assert txn.hit_tokens == 0 and seq.num_blocks == 0
    grow_attach_commit(trie, seq, txn)
    assert trie.nodes.num_attached == 6  # two separate paths
    assert pool.refcounts(seq.block_table[:3]).tolist() == [2, 2, 2]
    trie.check_invariants([seq])
    # the same namespace does share
    same = Sequence(tokens(3 * B + 1), **consumer)
    assert trie.match(same).hit_tokens == 3 * B
    assert same.block_table.tolist() == seq.block_table[:3].tolist()


# --- multimodal -------------------------------------------------------------------------------


THREE_IMAGES = [(16, 32), (48, 64), (96, 116)]


def images(ids):
    return [MultimodalSpan(s, e, "image", i) for (s, e), i in zip(THREE_IMAGES, ids)]


@pytest.mark.parametrize(
    "ids, expected",
    [
        (("a", "b", "c"), 96),  # full repeat: stops before the last image's block
        (("a", "b", "z"), 96),  # last image changed
        (("a", "z", "c"), 48),  # middle image changed: stops before its block
        (("z", "b", "c"), 16),
    ],
)
def test_three_images(ids, expected):
    pool, trie = make_trie(32)
    produce(trie, tokens(120), multimodal=images("abc"))
    seq = Sequence(tokens(120), multimodal=images(ids))
    txn = trie.match(seq)
    assert seq.num_computed == expected
    assert seq.is_boundary_safe(seq.num_computed)
    trie.rollback(txn)


def test_image_block_same_and_different_content():
    """An image with the same content gives a 3-block hit; different content shares only
    block 0, before the image."""
    pool, trie = make_trie(32)
    span = lambda cid: [MultimodalSpan(16, 32, "image", cid)]
    produce(trie, tokens(4 * B), multimodal=span("img-a"))
    same = Sequence(tokens(4 * B), multimodal=span("img-a"))
    assert trie.match(same).hit_tokens == 3 * B
    other = Sequence(tokens(4 * B), multimodal=span("img-b"))
    assert trie.match(other).hit_tokens == B
    text = Sequence(tokens(4 * B))
    assert trie.match(text).hit_tokens == B  # the same tokens without the image differ too


def test_image_clamp_to_zero_keeps_refs():
    """With an image at [8, 24) and a differing second block, the one-block hit ends inside the
    image and clamps to 0: nothing computed, no blocks, the cursor at the root, the shared
    block's references unchanged, and the miss counted as a multimodal boundary."""
    pool, trie = make_trie(32)
    span = [MultimodalSpan(8, 24, "image", "img")]
    owner = Sequence(tokens(3 * B + 1), multimodal=span)
    prefill(trie, owner)
    ref0 = pool.refcount_of(int(owner.block_table[0]))
    changed = tokens(3 * B + 1)
    changed[B + 10] = 9999
    seq = Sequence(changed, multimodal=span)
    txn = trie.match(seq)
    assert seq.num_computed == 0 and seq.num_blocks == 0
    assert seq.prefix_state.trie.cursor == trie.nodes.root(seq.namespace)
    assert seq.prefix_state.overlap.fresh_range == (0, 1)
    assert pool.refcount_of(int(owner.block_table[0])) == ref0
    assert trie.stats.match.misses["multimodal_boundary"] == 1
    trie.commit(txn)


def test_clamp_repeats_through_earlier_images():
    pool, trie = make_trie(32)
    spans = [MultimodalSpan(10, 20, "image", "a"), MultimodalSpan(30, 50, "image", "b")]
    produce(trie, tokens(4 * B), multimodal=spans)
    seq = Sequence(tokens(4 * B), multimodal=spans)
    assert trie.match(seq).hit_tokens == 0  # 48 -> 30 -> 16 -> 10 -> 0


def test_span_order_gives_the_same_identity():
    pool, trie = make_trie(32)
    image, video = MultimodalSpan(2, 6, "image", "i"), MultimodalSpan(8, 12, "video", "v")
    produce(trie, tokens(B + 1), multimodal=[image, video])
    seq = Sequence(tokens(B + 1), multimodal=[video, image])
    assert trie.match(seq).hit_tokens == B


def test_multimodal_identity_is_compared_exactly_even_with_colliding_keys():
    pool, trie = make_trie(32, keyer=ConstantKeyer(B))
    produce(trie, tokens(2 * B + 1), multimodal=[MultimodalSpan(0, 4, "image", "a")])
    seq = Sequence(tokens(2 * B + 1), multimodal=[MultimodalSpan(0, 4, "image", "b")])
    assert trie.match(seq).hit_tokens == 0
    seq = Sequence(tokens(2 * B + 1), multimodal=[MultimodalSpan(0, 4, "image", "a")])
    assert trie.match(seq).hit_tokens == 2 * B


# --- key collisions ------------------------------------------------------------------------------


def test_colliding_keys_never_prevent_caching_or_give_false_hits():
    pool, trie = make_trie(64, keyer=ConstantKeyer(B))
    first, second = tokens(3 * B + 1, start=1), tokens(3 * B + 1, start=1000)
    branch = tokens(B, start=1) + tokens(2 * B + 1, start=5000)
    for toks in (first, second, branch):
        produce(trie, toks)
    assert trie.nodes.num_attached == 3 + 3 + 2
    assert len(trie.nodes.candidates(CONSTANT)) == 8
    trie.check_invariants()
    for toks, expected in ((first, 3 * B), (second, 3 * B), (branch, 3 * B), (tokens(3 * B + 1, start=2), 0)):
        seq = Sequence(toks)
        txn = trie.match(seq)
        assert txn.hit_tokens == expected
        assert all(node_tokens_equal(trie, seq, i) for i in range(seq.num_blocks))
        grow_attach_commit(trie, seq, txn)
        trie.check_invariants([seq])
        trie.free_sequence(seq)
    assert trie.nodes.num_attached == 3 + 3 + 2 + 3  # the unseen prompt was cached too
    assert trie.clear() == 11 and pool.num_free == 64


def node_tokens_equal(trie, seq, index):
    """The trie node owning the block at ``index`` holds the sequence's tokens for that block."""
    block = int(seq.block_table[index])
    (slot,) = [s for s in trie.nodes.attached_slots().tolist() if trie.nodes.block[s] == block]
    return trie.tokens.run(slot, slot).tolist() == seq.tokens[index * B : (index + 1) * B].tolist()


def test_collision_on_the_deepest_key_falls_back_to_the_walk():
    """Only one key collides: binary search lands on a foreign node, the walk finds the truth."""

    class OneCollision(BlockKeyer):
        colliding = np.zeros(0, dtype=np.uint64)  # running sums whose keys are made equal

        def prefix_keys(self, block_sums):
            keys = super().prefix_keys(block_sums)
            keys[np.isin(block_sums, self.colliding)] = 12345
            return keys

    keyer = OneCollision(B)
    foreign, ours = Sequence(tokens(3 * B + 1, start=1000)), Sequence(tokens(4 * B + 1, start=1))
    keyer.extend(foreign)
    keyer.extend(ours)
    # the 'foreign' prompt's block 2 and our prompt's block 3 share a key
    keyer.colliding = np.array(
        [foreign.prefix_state.keys.block_sums[2], ours.prefix_state.keys.block_sums[3]], dtype=np.uint64
    )
    pool, trie = make_trie(64, keyer=keyer)
    produce(trie, tokens(3 * B + 1, start=1000))
    produce(trie, tokens(2 * B + 1, start=1))
    seq = Sequence(tokens(4 * B + 1, start=1))
    txn = trie.match(seq)
    assert txn.hit_tokens == 2 * B
    grow_attach_commit(trie, seq, txn)
    assert cursor_depth(trie, seq) == 4
    trie.check_invariants([seq])


# --- routed experts ---------------------------------------------------------------------------


def produce_with_experts(trie, toks, rows=None):
    seq = Sequence(toks, want_routed_experts=True)
    prefill(trie, seq)
    seq.append_routed_experts(expert_rows(len(toks)) if rows is None else rows)
    trie.cache_routed_experts(seq)
    trie.free_sequence(seq)
    return seq


def test_routed_experts_are_replayed_exactly():
    pool, trie = make_trie(32)
    produce_with_experts(trie, tokens(3 * B + 1))
    seq = Sequence(tokens(3 * B + 1), want_routed_experts=True)
    txn = trie.match(seq)
    assert txn.hit_tokens == 3 * B
    assert np.array_equal(seq.routed_experts, expert_rows(3 * B))
    trie.rollback(txn)
    assert seq.num_routed_experts == 0


def test_routed_experts_not_requested_not_returned():
    pool, trie = make_trie(32)
    produce_with_experts(trie, tokens(3 * B + 1))
    seq = Sequence(tokens(3 * B + 1))
    assert trie.match(seq).hit_tokens == 3 * B
    assert seq.routed_experts is None


def test_new_nodes_copy_experts_from_the_inserting_sequence():
    pool, trie = make_trie(32)
    seq = Sequence(tokens(2 * B + 4), want_routed_experts=True)
    seq.append_routed_experts(expert_rows(2 * B + 4))  # experts known before allocate
    txn = trie.match(seq)
    grow_attach_commit(trie, seq, txn)
    assert trie.experts.has_rows[trie.nodes.attached_slots()].all()
    trie.free_sequence(seq)
    other = Sequence(tokens(2 * B + 4), want_routed_experts=True)
    assert trie.match(other).hit_tokens == 2 * B
    assert np.array_equal(other.routed_experts, expert_rows(2 * B))


def test_enrichment_by_a_later_sequence():
    pool, trie = make_trie(32)
    produce(trie, tokens(3 * B + 1))  # no experts
    wants = Sequence(tokens(3 * B + 1), want_routed_experts=True)
    txn = trie.match(wants)
    assert txn.hit_tokens == 0
    assert trie.stats.match.misses["routed_experts"] == 1
    assert wants.prefix_state.overlap.fresh_range == (0, 3)
    trie.commit(txn)
    # it computes everything (into private blocks) and records its experts
    pool.grow_table(wants, wants.num_tokens, B)
    trie.allocate(wants)
    wants.set_computed(wants.num_tokens)
    wants.append_routed_experts(expert_rows(3 * B + 1))
    trie.cache_routed_experts(wants)
    assert trie.experts.has_rows[trie.nodes.attached_slots()].all()
    trie.free_sequence(wants)
    later = Sequence(tokens(3 * B + 1), want_routed_experts=True)
    assert trie.match(later).hit_tokens == 3 * B
    assert np.array_equal(later.routed_experts, expert_rows(3 * B))


def test_experts_only_for_block_zero():
    """With expert rows cached only for block 0, a routed-expert match stops at 16, replays 1
    block of rows and leaves the fresh range [1, 2)."""
    pool, trie = make_trie(32)
    produce_with_experts(trie, tokens(2 * B + 1), rows=expert_rows(B))
    seq = Sequence(tokens(2 * B + 1), want_routed_experts=True)
    txn = trie.match(seq)
    assert txn.hit_tokens == B
    assert np.array_equal(seq.routed_experts, expert_rows(B))
    assert seq.prefix_state.overlap.fresh_range == (1, 2)
    assert trie.stats.match.shortened["routed_experts"] == 1


def test_partial_expert_history_does_not_enrich():
    """A 1-row expert history cannot enrich a 16-token node."""
    pool, trie = make_trie(32)
    produce(trie, tokens(B + 1))
    seq = Sequence(tokens(B + 1), want_routed_experts=True)
    txn = trie.match(seq)
    assert txn.hit_tokens == 0
    trie.commit(txn)
    pool.grow_table(seq, seq.num_tokens, B)
    trie.allocate(seq)
    seq.set_computed(1)
    seq.append_routed_experts(expert_rows(1))
    trie.cache_routed_experts(seq)
    assert not trie.experts.has_rows[trie.nodes.attached_slots()].any()


def test_replay_only_when_history_length_equals_the_match_start():
    pool, trie = make_trie(32)
    produce_with_experts(trie, tokens(3 * B + 1))
    seq = Sequence(tokens(3 * B + 1), want_routed_experts=True)
    seq.set_computed(B)
    seq.append_routed_experts(expert_rows(B - 1))  # one row short of the resume step
    txn = trie.match(seq)
    assert txn.hit_tokens == 2 * B
    assert seq.num_routed_experts == B - 1  # nothing appended
    trie.rollback(txn)
    seq.append_routed_experts(expert_rows(1, start=B - 1))
    txn = trie.match(seq)
    assert np.array_equal(seq.routed_experts, expert_rows(3 * B))


def test_cache_routed_experts_is_incremental():
    pool, trie = make_trie(32)
    seq = Sequence(tokens(B + 1), want_routed_experts=True)
    prefill(trie, seq)
    seq.append_routed_experts(expert_rows(B + 1))
    trie.cache_routed_experts(seq)
    assert seq.prefix_state.trie.experts_cached_blocks == 1
    for i in range(B):
        decode(trie, seq, [3])
        seq.append_routed_experts(expert_rows(1, start=B + 1 + i))
        trie.cache_routed_experts(seq)
    assert seq.prefix_state.trie.experts_cached_blocks == 2
    assert trie.experts.has_rows[trie.nodes.attached_slots()].all()
    (leaf,) = leaves(trie)
    assert np.array_equal(trie.experts.gather([(leaf, leaf)]), expert_rows(B, start=B))


# --- rollback ---------------------------------------------------------------------------------


def test_rollback_restores_everything_exactly():
    pool, trie = make_trie(32)
    produce(trie, tokens(4 * B + 1))
    seq = Sequence(tokens(4 * B + 1))
    seq.prefix_state.overlap.recompute_blocks = 1
    trie.match(seq)  # a first match, rolled back below, to give the state a history
    before = (seq_state(seq), snapshot(trie.stats.match))
    refcounts = pool.refcounts(np.arange(32)).tolist()
    free = pool.num_free
    txn = trie.match(seq)
    assert seq.num_computed == 3 * B
    trie.rollback(txn)
    assert (seq_state(seq), snapshot(trie.stats.match)) == before
    assert pool.refcounts(np.arange(32)).tolist() == refcounts and pool.num_free == free


def test_rollback_after_evictions_in_between():
    """An admission that evicts to make room and then fails still rolls back exactly."""
    pool, trie = make_trie(8)
    produce(trie, tokens(3 * B + 1))
    produce(trie, tokens(3 * B + 1, start=500))
    seq = Sequence(tokens(3 * B + 1))
    before = (seq_state(seq), snapshot(trie.stats.match))
    txn = trie.match(seq)
    assert seq.num_computed == 3 * B
    assert trie.free_kv_blocks(8) == 3  # only the other prompt's path can go
    with pytest.raises(MemoryError):
        pool.grow_table(seq, 100 * B, B)
    trie.rollback(txn)
    assert (seq_state(seq), snapshot(trie.stats.match)) == before
    trie.check_invariants([seq])
    assert trie.free_kv_blocks(8) == 3 and pool.num_free == 8


def test_commit_then_allocate_order_does_not_matter():
    pool, trie = make_trie(32)
    produce(trie, tokens(2 * B + 1))
    a, b = Sequence(tokens(3 * B + 1)), Sequence(tokens(3 * B + 1))
    prefill(trie, a)
    txn = trie.match(b)
    trie.commit(txn)
    pool.grow_table(b, b.num_tokens, B)
    trie.allocate(b)
    trie.check_invariants([a, b])
    assert b.block_table[:2].tolist() == a.block_table[:2].tolist()


# --- disabled ---------------------------------------------------------------------------------


def test_disabled_trie_caches_nothing():
    pool, trie = make_trie(32, enabled=False)
    seq = Sequence(tokens(3 * B + 1), multimodal=[MultimodalSpan(0, 4, "image", "i")])
    prefill(trie, seq)
    assert trie.nodes.num_attached == 0 and refs(pool, seq) == [1, 1, 1, 1]
    assert seq.prefix_state.keys.num_keys == 0  # no key was ever computed
    trie.free_sequence(seq)
    assert pool.num_free == 32
    seq = Sequence(tokens(3 * B + 1))
    assert trie.match(seq).hit_tokens == 0
    trie.cache_routed_experts(seq)
    trie.check_invariants([seq])


# --- many requests ---------------------------------------------------------------------------


def test_many_prompts_share_a_system_prompt():
    rng = np.random.default_rng(0)
    pool, trie = make_trie(256, block_size=8, keyer=BlockKeyer.deterministic(8))
    system = rng.integers(0, 50, 40).tolist()
    live = []
    for i in range(30):
        toks = system + rng.integers(0, 3, int(rng.integers(1, 30))).tolist()
        seq = Sequence(toks, adapter=None if i % 3 else "lora")
        txn = trie.match(seq)
        if i % 3:
            assert seq.num_computed >= (min(len(toks) - 1, 40) // 8) * 8 or i < 3
        grow_attach_commit(trie, seq, txn)
        seq.set_computed(seq.num_tokens)
        live.append(seq)
        if len(live) > 5:
            trie.free_sequence(live.pop(0))
        trie.check_invariants(live)
    for seq in live:
        trie.free_sequence(seq)
    trie.clear()
    assert pool.num_free == 256 and trie.nodes.num_attached == 0


def test_cached_prefix_tokens_is_where_a_prompt_diverges_from_the_cache():
    """The branch point an admission policy may checkpoint: whole verified blocks, in an
    attention-only and a hybrid trie alike (a hybrid trie has no checkpoint there yet)."""
    from hybridcache.memory.block_pool import BlockPool
    from hybridcache.memory.state_pool import StatePool

    for states in (None, StatePool(8, checkpoint_budget=4)):
        trie = BlockTrie(BlockPool(64), B, state_pool=states)
        producer = Sequence(tokens(3 * B + 5))
        prefill(trie, producer)
        trie.free_sequence(producer)
        branch = Sequence(tokens(2 * B + 3) + [7] * B)
        assert trie.cached_prefix_tokens(branch) == 2 * B
        assert trie.cached_prefix_tokens(Sequence(tokens(B - 1))) == 0
        trie.check_invariants([branch])
