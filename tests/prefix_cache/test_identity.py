"""BlockKeyer: keyed prefix keys, namespaces, multimodal identity, incremental extension."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hybridcache.prefix_cache import BlockKeyer
from hybridcache.sequence import MultimodalSpan, Sequence

from tests.keyers import ConstantKeyer, TwoBitKeyer

from ._helpers import B, tokens


def keys_of(keyer: BlockKeyer, toks, **kwargs) -> list[int]:
    return keyer.extend(Sequence(toks, **kwargs)).tolist()


def test_extend_returns_one_key_per_complete_block():
    keyer = BlockKeyer(B)
    assert len(keys_of(keyer, tokens(0))) == 0
    assert len(keys_of(keyer, tokens(B - 1))) == 0
    assert len(keys_of(keyer, tokens(B))) == 1
    assert len(keys_of(keyer, tokens(5 * B + 3))) == 5
    keys = keyer.extend(Sequence(tokens(4 * B)))
    assert keys.dtype == np.uint64


def test_default_keyers_have_per_process_secrets():
    toks = tokens(3 * B)
    first, second = BlockKeyer(B), BlockKeyer(B)
    assert first.keyer_id != second.keyer_id
    a, b = keys_of(first, toks), keys_of(second, toks)
    assert all(x != y for x, y in zip(a, b))
    # the same keyer is deterministic
    assert keys_of(first, toks) == a


def test_deterministic_keyers_agree_in_process():
    toks = tokens(3 * B)
    a = keys_of(BlockKeyer.deterministic(B), toks)
    b = keys_of(BlockKeyer.deterministic(B), toks)
    assert a == b
    assert a != keys_of(BlockKeyer(B), toks)
    # block size is part of the key material
    assert keys_of(BlockKeyer.deterministic(2 * B), toks)[0] not in a


def test_deterministic_keyers_agree_across_processes():
    toks = tokens(3 * B, start=7)
    code = (
        "from hybridcache.prefix_cache import BlockKeyer\n"
        "from hybridcache.sequence import Sequence\n"
        f"print(BlockKeyer.deterministic({B}).extend(Sequence({toks!r})).tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert eval(out.stdout) == keys_of(BlockKeyer.deterministic(B), toks)


@pytest.mark.parametrize(
    "namespace",
    [
        {"adapter": "lora-a"},
        {"cache_salt": "tenant-1"},
        {"adapter": "lora-a", "cache_salt": "tenant-1"},
        {"adapter": "tenant-1"},  # the same string in the other field is another namespace
    ],
)
def test_namespace_changes_every_key(namespace):
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(3 * B)
    base = keys_of(keyer, toks)
    other = keys_of(keyer, toks, **namespace)
    assert all(x != y for x, y in zip(base, other))
    assert keys_of(keyer, toks, **namespace) == other
    assert keyer.namespace_seed(Sequence(toks).namespace) != keyer.namespace_seed(Sequence(toks, **namespace).namespace)


def test_prefix_keys_chain():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(5 * B)
    base = keys_of(keyer, toks)
    assert len(set(base)) == 5
    # changing one token of block 0 changes every key
    changed = list(toks)
    changed[3] += 1000
    assert all(x != y for x, y in zip(base, keys_of(keyer, changed)))
    # changing a token of block 2 keeps keys 0 and 1 and changes 2, 3, 4
    changed = list(toks)
    changed[2 * B + 5] += 1000
    other = keys_of(keyer, changed)
    assert other[:2] == base[:2]
    assert all(x != y for x, y in zip(base[2:], other[2:]))


def test_position_is_part_of_the_key():
    keyer = BlockKeyer.deterministic(B)
    repeated = [5] * (4 * B)
    keys = keys_of(keyer, repeated)
    assert len(set(keys)) == 4
    values = keyer.block_values(Sequence(repeated), range(0, 4))  # each block's own value
    assert len(set(values.tolist())) == 4


def test_swapping_tokens_inside_a_block_changes_the_key():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(B)
    swapped = list(toks)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert keys_of(keyer, toks) != keys_of(keyer, swapped)
    swapped = list(toks)
    swapped[0], swapped[2] = swapped[2], swapped[0]
    assert keys_of(keyer, toks) != keys_of(keyer, swapped)


def test_multimodal_content_id_changes_keys_from_its_block_on():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(4 * B)
    plain = keys_of(keyer, toks)
    a = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 30, "image", "img-a")])
    a_again = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 30, "image", "img-a")])
    b = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 30, "image", "img-b")])
    assert a == a_again
    # block 0 has no span: identical to text-only
    assert plain[0] == a[0] == b[0]
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain[1:], a[1:], b[1:]))


def test_multimodal_span_geometry_and_modality_change_keys():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(3 * B)
    base = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 30, "image", "x")])
    moved = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 31, "image", "x")])
    video = keys_of(keyer, toks, multimodal=[MultimodalSpan(20, 30, "video", "x")])
    assert base[0] == moved[0] == video[0]
    assert base[1] != moved[1] and base[1] != video[1]


def test_span_order_does_not_matter():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(3 * B)
    image = MultimodalSpan(2, 10, "image", "img")
    video = MultimodalSpan(20, 40, "video", "vid")
    assert keys_of(keyer, toks, multimodal=[image, video]) == keys_of(keyer, toks, multimodal=[video, image])


def test_multimodal_blocks_map_spans_to_the_blocks_they_overlap():
    spans = [MultimodalSpan(4, 20, "image", "a"), MultimodalSpan(36, 40, "image", "b"), MultimodalSpan(50, 60, "video", "c")]
    seq = Sequence(tokens(4 * B), multimodal=spans)
    keyer = BlockKeyer(B)
    keyer.extend(seq)
    blocks = seq.prefix_state.keys.mm_blocks
    assert sorted(blocks) == [0, 1, 2, 3]
    assert blocks[0] == blocks[1] == (spans[0],)
    assert blocks[2] == (spans[1],)
    assert blocks[3] == (spans[2],)
    # the stored spans are the sequence's own span objects, not copies
    assert blocks[0][0] is seq.spans[0] and blocks[3][0] is seq.spans[2]
    assert len({id(s) for spans_ in blocks.values() for s in spans_}) == 3


def test_incremental_extension_equals_one_shot():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(7 * B + 5)
    span = MultimodalSpan(30, 50, "image", "img")
    grown = Sequence(toks[:3], multimodal=[])
    grown_mm = Sequence(toks[:60], multimodal=[span])
    assert keyer.extend(grown).size == 0
    assert keyer.extend(grown_mm).size == 3
    pos = 3
    for step in (1, 13, 16, 2, 40, 0, 30, 12):
        grown.append_tokens(toks[pos : pos + step])
        pos += step
        keyer.extend(grown)
    grown_mm.append_tokens(toks[60:])
    keyer.extend(grown_mm)
    assert pos == len(toks)
    assert keyer.extend(grown).tolist() == keys_of(keyer, toks)
    assert keyer.extend(grown_mm).tolist() == keys_of(keyer, toks, multimodal=[span])
    assert grown.prefix_state.keys.num_keys == 7


def test_switching_keyer_recomputes_keys():
    first, second = BlockKeyer(B), BlockKeyer.deterministic(B)
    seq = Sequence(tokens(3 * B))
    a = first.extend(seq).tolist()
    assert seq.prefix_state.keys.keyer_id == first.keyer_id
    b = second.extend(seq).tolist()
    assert seq.prefix_state.keys.keyer_id == second.keyer_id
    assert b == keys_of(second, tokens(3 * B)) and a != b


def test_small_block_size():
    keyer = BlockKeyer.deterministic(2)
    assert len(set(keys_of(keyer, [1, 2, 1, 2, 1, 2]))) == 3
    assert keys_of(keyer, [1, 2, 3, 4])[0] == keys_of(keyer, [1, 2, 4, 3])[0]
    assert keys_of(keyer, [1, 2, 3, 4])[1] != keys_of(keyer, [1, 2, 4, 3])[1]


def test_block_values_make_the_prefix_keys():
    """A prefix key is the finalized running sum (seeded by the namespace) of the blocks' own
    values; listed blocks are hashed alone and agree with a range of blocks."""
    keyer = BlockKeyer.deterministic(B)
    seq = Sequence(tokens(5 * B + 3), multimodal=[MultimodalSpan(20, 40, "image", "img")], adapter="lora")
    values = keyer.block_values(seq, range(0, 5))
    assert values.dtype == np.uint64 and values.size == 5
    assert keyer.block_values(seq, range(2, 4)).tolist() == values[2:4].tolist()
    assert keyer.block_values(seq, np.array([3, 1, 4])).tolist() == values[[3, 1, 4]].tolist()
    assert keyer.block_values(seq, np.array([0])).tolist() == values[:1].tolist()
    keys = keyer.extend(seq)
    sums = np.cumsum(values, dtype=np.uint64) + np.uint64(keyer.namespace_seed(seq.namespace))
    assert seq.prefix_state.keys.block_sums[:5].tolist() == sums.tolist()
    assert keys.tolist() == [keyer.finalize(int(total)) for total in sums]
    # a block's value depends on its own tokens, position and spans, not on earlier blocks
    other = Sequence(
        [0] * B + tokens(4 * B + 3, start=B + 1), multimodal=[MultimodalSpan(20, 40, "image", "img")], adapter="lora"
    )
    assert keyer.block_values(other, np.array([2, 3, 4])).tolist() == values[2:].tolist()
    assert keyer.block_values(other, np.array([0]))[0] != values[0]
    plain = Sequence(tokens(5 * B + 3), adapter="lora")
    assert keyer.block_values(plain, np.array([1, 2])).tolist() != values[1:3].tolist()  # the image
    assert keyer.block_values(plain, np.array([3])).tolist() == values[3:4].tolist()


def test_resume_at_continues_keys_without_hashing_the_prefix():
    keyer = BlockKeyer.deterministic(B)
    toks = tokens(6 * B + 5)
    full = keyer.extend(Sequence(toks)).tolist()
    donor = Sequence(toks[: 2 * B])
    keyer.extend(donor)
    resumed = Sequence(toks)
    keyer.resume_at(resumed, 2, int(donor.prefix_state.keys.block_sums[1]))
    state = resumed.prefix_state
    assert (state.keys.keys_from, state.keys.num_keys) == (2, 2)
    keys = keyer.extend(resumed)
    assert keys.size == 6 and keys[2:].tolist() == full[2:]
    assert state.keys.num_keys == 6 and state.keys.keys_from == 2
    # keys already cover depths 2..6: resuming there is a no-op
    before = (state.keys.keys_from, state.keys.num_keys, state.keys.key_sum)
    keyer.resume_at(resumed, 4, 12345)
    assert (state.keys.keys_from, state.keys.num_keys, state.keys.key_sum) == before
    # a depth outside them restarts from that node
    keyer.resume_at(resumed, 1, int(donor.prefix_state.keys.block_sums[0]))
    assert (state.keys.keys_from, state.keys.num_keys) == (1, 1)
    assert keyer.extend(resumed)[1:].tolist() == full[1:]


def test_probe_values_equal_block_values_one_block_or_many():
    """Checkpoint probes hash few blocks in Python integers and many blocks with NumPy; both
    give exactly the values the running sums were made of, multimodal blocks included."""
    keyer = BlockKeyer(B)
    spans = [MultimodalSpan(20, 30, "image", "a"), MultimodalSpan(5 * B + 1, 5 * B + 4, "video", "b")]
    seq = Sequence(tokens(12 * B + 3, start=11), multimodal=spans)
    expected = keyer.block_values(seq, range(0, 12))
    one_by_one = [keyer.value_of(seq, index) for index in range(12)]
    assert one_by_one == expected.tolist()
    assert keyer.block_values(seq, np.arange(12)).tolist() == expected.tolist()


def test_finalize_is_the_key_of_a_running_sum():
    keyer = BlockKeyer(B)
    seq = Sequence(tokens(3 * B))
    keys = keyer.extend(seq)
    assert [keyer.finalize(int(total)) for total in seq.prefix_state.keys.block_sums[:3]] == keys.tolist()


def test_key_after_continues_a_running_sum_by_one_block():
    """The key of block i from the running sum before it equals the extended key, in any
    namespace (the sum carries the namespace seed)."""
    keyer = BlockKeyer(B)
    for seq in (Sequence(tokens(4 * B)), Sequence(tokens(4 * B), adapter="lora")):
        keys = keyer.extend(seq).tolist()
        sums = [keyer.namespace_seed(seq.namespace)] + [int(s) for s in seq.prefix_state.keys.block_sums[:3]]
        assert [keyer.key_after(seq, index, sums[index]) for index in range(4)] == keys


@pytest.mark.parametrize(
    "keyer",
    [BlockKeyer(B), BlockKeyer.deterministic(B), ConstantKeyer(B), TwoBitKeyer(B, secret=b"few-bits")],
    ids=["per-process", "deterministic", "constant", "two-bit"],
)
def test_every_derivation_of_a_key_or_value_agrees(keyer):
    """A key or block value is computed on several paths (vectorized for many blocks, scalar
    for one probe, continued from a node's running sum); the trie finds a node or checkpoint
    only when they agree, so they must for the real keyer and for the colliding ones the tests
    use."""
    spans = [MultimodalSpan(B + 2, 2 * B + 1, "image", "a")]
    seq = Sequence(tokens(5 * B + 3), multimodal=spans, adapter="lora")
    keys = keyer.extend(seq).tolist()
    sums = seq.prefix_state.keys.block_sums[:5]
    assert keyer.prefix_keys(sums).tolist() == keys == [keyer.finalize(int(total)) for total in sums]
    before = [keyer.namespace_seed(seq.namespace)] + [int(total) for total in sums[:4]]
    fresh = Sequence(tokens(5 * B + 3), multimodal=spans, adapter="lora")
    assert [keyer.key_after(fresh, index, before[index]) for index in range(5)] == keys
    values = keyer.block_values(seq, range(0, 5)).tolist()
    assert [keyer.value_of(seq, index) for index in range(5)] == values
    assert keyer.block_values(seq, np.arange(5)).tolist() == values


def test_a_keyer_that_changes_block_values_changes_every_value():
    """``block_values`` is the one derivation of a block's value: a subclass that overrides
    only it changes the checkpoint probe's scalar ``value_of`` and the running sums alike."""

    class OffsetValues(BlockKeyer):
        def block_values(self, seq, blocks):
            return super().block_values(seq, blocks) ^ np.uint64(0xF0)

    plain, offset = BlockKeyer(B, secret=b"same"), OffsetValues(B, secret=b"same")
    seq = Sequence(tokens(4 * B + 1))
    expected = (plain.block_values(seq, range(0, 4)) ^ np.uint64(0xF0)).tolist()
    assert [offset.value_of(seq, index) for index in range(4)] == expected
    offset.extend(seq)
    sums = np.cumsum(np.array(expected, dtype=np.uint64), dtype=np.uint64) + np.uint64(offset.namespace_seed(seq.namespace))
    assert seq.prefix_state.keys.block_sums[:4].tolist() == sums.tolist()
