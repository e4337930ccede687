"""Checkpoint geometry and the record's own fields.

A record lives on its anchor node at depth ``step // B`` (the namespace root when step < B); a
mid-block record copies the tokens of its partial tail ``[anchor, step)``. ``tail_start`` is the
start of the last non-empty block-bounded range ending at the step.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.prefix_cache.checkpoint_record import (
    CheckpointRecord,
    CheckpointState,
    anchor_step,
    tail_start,
)
from hybridcache.prefix_cache.node import NodePath
from hybridcache.sequence import MultimodalSpan, Namespace
from hybridcache.types import NO_BLOCK

from ._helpers import B, tokens
from ._hybrid import make_hybrid, produce

GEOMETRY = [  # step, anchor, tail start (B = 16)
    (1, 0, 0),
    (15, 0, 0),
    (16, 16, 0),
    (17, 16, 16),
    (32, 32, 16),
]


@pytest.mark.parametrize(("step", "anchor", "tail"), GEOMETRY)
def test_geometry_table(step, anchor, tail):
    assert anchor_step(step, B) == anchor
    assert tail_start(step, B) == tail


@pytest.mark.parametrize(("step", "anchor", "tail"), GEOMETRY)
def test_record_geometry_on_a_real_trie(step, anchor, tail):
    """A record saved at ``step`` sits on the node at depth anchor/B (the root below B), owns a
    frozen block exactly when it is mid-block, and copies the tail [anchor, step)."""
    pool, states, trie = make_hybrid()
    prompt = tokens(40)
    seq, record = produce(trie, prompt, step, free=False)
    nodes = trie.nodes
    assert record.step == step
    assert int(nodes.depth[record.anchor]) == anchor // B
    assert bool(nodes.is_root[record.anchor]) == (anchor == 0)
    # keyed by the step and the keyed value of the anchor's own block (the seed at the root)
    if anchor == 0:
        expected = trie.keyer.namespace_seed(record.namespace)
    else:
        expected = int(trie.keyer.block_values(seq, np.array([anchor // B - 1]))[0])
        parent = int(nodes.parent[record.anchor])
        assert expected == (int(nodes.key_sums[record.anchor]) - int(nodes.key_sums[parent])) % 2**64
    assert record.key == (step, expected) == (step, nodes.last_block_value(record.anchor))
    assert record.anchor_generation == int(nodes.generation[record.anchor])
    assert record.is_partial == (step % B != 0)
    assert (record.frozen_block != NO_BLOCK) == record.is_partial
    assert record.tail_tokens.tolist() == prompt[anchor:step]
    assert record.tail_identity == ()
    assert record.namespace == Namespace()
    assert record.producer_id == seq.seq_id
    assert record.is_decode is False
    # the frozen block is a fresh block of its own, not one of the sequence's blocks
    if record.is_partial:
        assert record.frozen_block not in seq.block_table.tolist()
        assert pool.refcount_of(record.frozen_block) == 1
    trie.free_sequence(seq)
    trie.check_invariants([])


def test_tail_is_a_read_only_copy():
    pool, states, trie = make_hybrid()
    seq, record = produce(trie, tokens(40), 37, free=False)
    tail = record.tail_tokens
    assert not tail.flags.writeable
    assert not np.shares_memory(tail, seq.tokens)
    with pytest.raises(ValueError):
        tail[0] = 0
    seq.append_tokens([7] * 100)  # the sequence buffer reallocates; the copy is unaffected
    assert tail.tolist() == tokens(40)[32:37]


def test_tail_identity_holds_the_overlapping_spans():
    pool, states, trie = make_hybrid()
    image = MultimodalSpan(18, 20, "image", "img-a")
    seq, record = produce(trie, tokens(40), 24, multimodal=[image], free=False)
    assert record.tail_identity == (image,)
    # an aligned record has no tail and no tail identity even right after a span
    seq2, record2 = produce(trie, tokens(48), 32, multimodal=[image], free=False)
    assert record2.tail_tokens.size == 0 and record2.tail_identity == ()


def test_metadata_is_o_block_size_not_o_prefix():
    """No per-token copy of the prefix: a deep record's metadata is as small as a shallow one's."""
    pool, states, trie = make_hybrid(num_blocks=128)
    _, shallow = produce(trie, tokens(40), 17)
    _, deep = produce(trie, tokens(1000, start=5000), 993)
    assert shallow.tail_tokens.size == 1 and deep.tail_tokens.size == 993 % B
    assert deep.metadata_bytes - shallow.metadata_bytes == (deep.tail_tokens.nbytes - shallow.tail_tokens.nbytes)
    assert deep.metadata_bytes < 64 * 8 + B * 4
    assert trie.checkpoints.metadata_bytes == shallow.metadata_bytes + deep.metadata_bytes


def test_record_properties_and_defaults():
    record = CheckpointRecord(
        namespace=Namespace(),
        step=20,
        anchor=3,
        anchor_generation=0,
        anchor_path=NodePath(3, 1, [(3, 3)], 0, 0),
        key=(20, 99),
        slot=2,
        frozen_block=5,
        tail_tokens=np.arange(4, dtype=np.int32),
        tail_identity=(),
        producer_id=7,
        is_decode=False,
    )
    assert record.state is CheckpointState.RESERVED and not record.is_published
    assert record.is_partial and record.pin_count == 0
    record.restore_pins, record.producer_pins = 2, 1
    assert record.pin_count == 3
    other = CheckpointRecord(**{**record.__dict__, "record_id": record.record_id + 1})
    assert record != other  # identity equality: two records are never "equal"
    assert "step=20" in repr(record) and "reserved" in repr(record)
