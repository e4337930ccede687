"""Sequence, MultimodalSpan, Namespace and as_token_array."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache import MultimodalSpan, Namespace, Sequence
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidStepError,
    InvalidTokenError,
    InvalidTypeError,
)
from hybridcache.prefix_state import PrefixState
from hybridcache.sequence import MAX_TOKEN_ID, as_token_array

# --- helpers -----------------------------------------------------------------------------------


def span(start: int, end: int, modality: str = "image", content_id: str | None = None) -> MultimodalSpan:
    return MultimodalSpan(start, end, modality, content_id or f"sha-{start}-{end}")


def snapshot(seq: Sequence) -> dict:
    """Everything observable about a sequence, copied so later mutation cannot alter it."""
    experts = seq.routed_experts
    return {
        "num_tokens": seq.num_tokens,
        "tokens": seq.tokens.copy(),
        "num_computed": seq.num_computed,
        "num_blocks": seq.num_blocks,
        "block_table": seq.block_table.copy(),
        "namespace": seq.namespace,
        "spans": seq.spans,
        "num_routed_experts": seq.num_routed_experts,
        "routed_experts": None if experts is None else experts.copy(),
    }


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
            assert after[key].dtype == value.dtype, key
        else:
            assert after[key] == value, key


# --- as_token_array ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.uint8),
        np.array([1, 2, 3], dtype=np.int32),
        [np.int64(1), np.uint16(2), 3],
        (t for t in (1, 2, 3)),
    ],
    ids=["list", "tuple", "range", "int64", "uint8", "int32", "numpy-scalars", "generator"],
)
def test_as_token_array_accepts_integer_inputs_and_returns_int32(tokens):
    array = as_token_array(tokens)
    assert array.dtype == np.int32
    assert array.ndim == 1
    assert array.flags.c_contiguous
    np.testing.assert_array_equal(array, [1, 2, 3])


@pytest.mark.parametrize("tokens", [[], (), np.array([], dtype=np.int64), np.array([], dtype=np.float64)])
def test_as_token_array_accepts_empty_input(tokens):
    array = as_token_array(tokens)
    assert array.dtype == np.int32
    assert array.shape == (0,)


def test_as_token_array_accepts_the_extreme_valid_ids():
    np.testing.assert_array_equal(as_token_array([0, MAX_TOKEN_ID]), [0, 2**31 - 1])
    assert MAX_TOKEN_ID == 2**31 - 1


def test_as_token_array_returns_a_fresh_copy():
    source = np.array([5, 6, 7], dtype=np.int32)
    array = as_token_array(source)
    source[0] = 99
    assert array[0] == 5
    assert not np.shares_memory(array, source)


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [2**31],
        [1, 2, 2**31 + 5],
        [2**63],  # beyond int64: must not leak an OverflowError
        [2**64],
        [-(2**70)],
        [np.uint64(2**63)],
        np.array([0, -3], dtype=np.int64),
        np.array([2**31], dtype=np.int64),
        np.array([2**63], dtype=np.uint64),
    ],
    ids=repr,
)
def test_as_token_array_rejects_ids_outside_int31(tokens):
    with pytest.raises(InvalidTokenError):
        as_token_array(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        [1.0, 2.0],
        [1, 2.5],
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype=np.float32),
        "123",
        b"123",
        42,
        None,
        [True, False],
        [1, True],
        np.array([True, False]),
        [[1, 2], [3, 4]],
        np.array([[1, 2], [3, 4]]),
        np.array(7),
        ["1", "2"],
        np.array([1, 2], dtype=object),
    ],
    ids=repr,
)
def test_as_token_array_rejects_wrong_types(tokens):
    with pytest.raises(InvalidTypeError):
        as_token_array(tokens)


def test_token_errors_belong_to_their_builtin_families():
    with pytest.raises(ValueError):
        as_token_array([-1])
    with pytest.raises(TypeError):
        as_token_array([1.5])


# --- construction and tokens -------------------------------------------------------------------


def test_new_sequence_state():
    seq = Sequence([3, 1, 4, 1, 5])
    assert seq.num_tokens == 5
    assert seq.num_valid == 5
    assert seq.num_computed == 0
    assert seq.num_blocks == 0
    assert seq.block_table.shape == (0,)
    assert seq.namespace == Namespace()
    assert seq.spans == ()
    assert seq.want_routed_experts is False
    assert seq.routed_experts is None
    assert seq.num_routed_experts == 0
    assert isinstance(seq.prefix_state, PrefixState)
    assert seq.tokens.dtype == np.int32
    np.testing.assert_array_equal(seq.tokens, [3, 1, 4, 1, 5])


def test_empty_sequence():
    seq = Sequence([])
    assert seq.num_tokens == 0
    assert seq.tokens.shape == (0,)
    assert seq.is_boundary_safe(0)


def test_sequence_rejects_bad_tokens_at_construction():
    with pytest.raises(InvalidTokenError):
        Sequence([1, -2])
    with pytest.raises(InvalidTypeError):
        Sequence(np.zeros(3))
    with pytest.raises(InvalidTypeError):
        Sequence("hello")


def test_sequence_copies_its_prompt():
    prompt = np.array([1, 2, 3], dtype=np.int32)
    seq = Sequence(prompt)
    prompt[:] = 0
    assert seq.tokens.tolist() == [1, 2, 3]


def test_seq_ids_are_unique_unless_given():
    a, b = Sequence([1]), Sequence([1])
    assert a.seq_id != b.seq_id
    assert Sequence([1], seq_id=1234).seq_id == 1234


def test_each_sequence_gets_its_own_prefix_state():
    a, b = Sequence([1]), Sequence([1])
    a.prefix_state.overlap.trie_block_map[0] = 7
    assert b.prefix_state.overlap.trie_block_map == {}
    assert a.prefix_state is not b.prefix_state


def test_want_routed_experts_is_coerced_to_bool():
    assert Sequence([1], want_routed_experts=1).want_routed_experts is True


def test_repr_mentions_the_counters():
    seq = Sequence([1, 2, 3], seq_id=77)
    text = repr(seq)
    assert "77" in text and "tokens=3" in text


def test_append_tokens_extends_and_keeps_int32():
    seq = Sequence([1, 2])
    seq.append_tokens([3, 4])
    seq.append_tokens(np.array([5], dtype=np.int64))
    seq.append_tokens([])
    assert seq.num_tokens == 5
    assert seq.num_valid == 5
    assert seq.tokens.dtype == np.int32
    np.testing.assert_array_equal(seq.tokens, [1, 2, 3, 4, 5])


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([7, -1], InvalidTokenError),
        ([7, 2**31], InvalidTokenError),
        ([7, 2**64], InvalidTokenError),
        (np.array([7, 2**40]), InvalidTokenError),
        ([7, 1.0], InvalidTypeError),
        (np.array([7.0]), InvalidTypeError),
        ("7", InvalidTypeError),
        ([True], InvalidTypeError),
        (np.array([[7]]), InvalidTypeError),
        (7, InvalidTypeError),
    ],
    ids=repr,
)
def test_append_tokens_with_bad_ids_leaves_the_sequence_unchanged(bad, error):
    seq = Sequence(list(range(10)))
    seq.set_computed(4)
    before = snapshot(seq)
    with pytest.raises(error):
        seq.append_tokens(bad)
    assert_same(before, snapshot(seq))


def test_append_tokens_with_a_bad_id_after_growth_leaves_the_sequence_unchanged():
    seq = Sequence(list(range(64)))  # exactly the initial capacity
    before = snapshot(seq)
    with pytest.raises(InvalidTokenError):
        seq.append_tokens(list(range(100)) + [-1])
    assert_same(before, snapshot(seq))


def test_tokens_and_token_view_are_read_only():
    seq = Sequence([1, 2, 3, 4])
    for view in (seq.tokens, seq.token_view(1, 3)):
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 42
    np.testing.assert_array_equal(seq.tokens, [1, 2, 3, 4])


def test_token_view_covers_the_requested_range():
    seq = Sequence([10, 11, 12, 13, 14])
    np.testing.assert_array_equal(seq.token_view(1, 4), [11, 12, 13])
    assert seq.token_view(2, 2).shape == (0,)
    np.testing.assert_array_equal(seq.token_view(0, 5), seq.tokens)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 6), (6, 6), (-2, -1)])
def test_token_view_rejects_ranges_outside_the_tokens(start, end):
    seq = Sequence([10, 11, 12, 13, 14])
    with pytest.raises(InvalidStepError):
        seq.token_view(start, end)


def test_views_survive_many_appends_that_force_buffer_growth():
    seq = Sequence([7, 8, 9])
    expected_full = [7, 8, 9]
    held = [(seq.tokens, list(expected_full)), (seq.token_view(1, 3), [8, 9])]
    for round_ in range(40):  # grows the 64-token buffer several times over
        chunk = [round_ * 100 + i for i in range(round_ + 1)]
        seq.append_tokens(chunk)
        expected_full.extend(chunk)
        held.append((seq.tokens, list(expected_full)))
        held.append((seq.token_view(seq.num_tokens // 2, seq.num_tokens), expected_full[len(expected_full) // 2 :]))
    assert seq.num_tokens > 8 * 64
    np.testing.assert_array_equal(seq.tokens, expected_full)
    for view, expected in held:
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, expected)


def test_a_large_prompt_grows_on_its_first_append():
    prompt = list(range(1000))
    seq = Sequence(prompt)
    view = seq.tokens
    seq.append_tokens([5])
    assert view.tolist() == prompt
    assert seq.tokens.tolist() == prompt + [5]


@settings(max_examples=60)
@given(st.lists(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=80), max_size=20))
def test_appends_concatenate_and_every_view_keeps_its_contents(chunks):
    seq = Sequence([])
    expected: list[int] = []
    held = []
    for chunk in chunks:
        seq.append_tokens(chunk)
        expected.extend(chunk)
        held.append((seq.tokens, list(expected)))
    np.testing.assert_array_equal(seq.tokens, np.array(expected, dtype=np.int32))
    assert seq.num_tokens == len(expected)
    for view, contents in held:
        np.testing.assert_array_equal(view, np.array(contents, dtype=np.int32))


# --- set_computed --------------------------------------------------------------------------------


def test_set_computed_moves_forward_and_back_within_bounds():
    seq = Sequence(list(range(10)))
    seq.set_computed(10)
    assert seq.num_computed == 10
    seq.set_computed(3)
    assert seq.num_computed == 3
    seq.set_computed(np.int64(0))
    assert seq.num_computed == 0
    assert type(seq.num_computed) is int


@pytest.mark.parametrize("step", [-1, 11, 1000])
def test_set_computed_rejects_out_of_range_steps(step):
    seq = Sequence(list(range(10)))
    seq.set_computed(5)
    with pytest.raises(InvalidStepError):
        seq.set_computed(step)
    assert seq.num_computed == 5


@pytest.mark.parametrize("step", [1.0, "3", None, True])
def test_set_computed_rejects_non_int_steps(step):
    seq = Sequence(list(range(10)))
    seq.set_computed(5)
    with pytest.raises(InvalidTypeError):
        seq.set_computed(step)
    assert seq.num_computed == 5


def test_set_computed_follows_appended_tokens():
    seq = Sequence([1, 2])
    with pytest.raises(InvalidStepError):
        seq.set_computed(3)
    seq.append_tokens([3])
    seq.set_computed(3)
    assert seq.num_computed == 3


def test_set_computed_truncates_the_routed_expert_history():
    seq = Sequence(list(range(8)), want_routed_experts=True)
    rows = np.arange(16, dtype=np.int16).reshape(8, 2)
    seq.append_routed_experts(rows[:6])
    seq.set_computed(6)
    assert seq.num_routed_experts == 6
    seq.set_computed(4)
    assert seq.num_routed_experts == 4
    np.testing.assert_array_equal(seq.routed_experts, rows[:4])
    seq.set_computed(8)  # moving forward does not bring rows back
    assert seq.num_routed_experts == 4
    seq.append_routed_experts(rows[4:8] + 100)  # recomputed rows replace the dropped ones
    np.testing.assert_array_equal(seq.routed_experts[4:], rows[4:8] + 100)
    np.testing.assert_array_equal(seq.routed_experts[:4], rows[:4])


# --- block table ----------------------------------------------------------------------------------


def test_block_table_starts_empty_and_is_read_only():
    seq = Sequence([1])
    seq.write_blocks(0, [4])
    table = seq.block_table
    assert table.dtype == np.int32
    assert not table.flags.writeable
    with pytest.raises(ValueError):
        table[0] = 9
    np.testing.assert_array_equal(seq.block_table, [4])


def test_write_blocks_appends_replaces_and_returns_replaced_ids():
    seq = Sequence([1])
    replaced = seq.write_blocks(0, [5, 6, 7])
    assert replaced.shape == (0,)
    np.testing.assert_array_equal(seq.block_table, [5, 6, 7])

    replaced = seq.write_blocks(1, [8, 9])
    np.testing.assert_array_equal(replaced, [6, 7])
    np.testing.assert_array_equal(seq.block_table, [5, 8, 9])
    assert seq.num_blocks == 3

    replaced = seq.write_blocks(2, [10, 11, 12])  # overwrite one, extend by two
    np.testing.assert_array_equal(replaced, [9])
    np.testing.assert_array_equal(seq.block_table, [5, 8, 10, 11, 12])
    assert seq.num_blocks == 5


def test_write_blocks_at_the_end_appends():
    seq = Sequence([1])
    seq.write_blocks(0, [1, 2])
    assert seq.write_blocks(2, [3]).shape == (0,)
    np.testing.assert_array_equal(seq.block_table, [1, 2, 3])


def test_write_blocks_returns_a_copy_of_the_replaced_ids():
    seq = Sequence([1])
    seq.write_blocks(0, [5, 6])
    replaced = seq.write_blocks(0, [7])
    seq.write_blocks(0, [8])
    assert replaced.tolist() == [5]


def test_write_blocks_accepts_a_scalar_id():
    seq = Sequence([1])
    seq.write_blocks(0, 42)
    assert seq.block_table.tolist() == [42]


@pytest.mark.parametrize("index", [2, 3, 100, -1])
def test_write_blocks_rejects_an_index_that_would_leave_a_hole(index):
    seq = Sequence([1])
    seq.write_blocks(0, [1])
    before = snapshot(seq)
    with pytest.raises(InvalidBlockIdError):
        seq.write_blocks(index, [2])
    assert_same(before, snapshot(seq))


def test_write_blocks_grows_beyond_the_initial_capacity():
    seq = Sequence([1])
    for block_id in range(50):
        seq.write_blocks(seq.num_blocks, [block_id])
    seq.write_blocks(seq.num_blocks, list(range(50, 100)))
    assert seq.num_blocks == 100
    np.testing.assert_array_equal(seq.block_table, np.arange(100))


def test_truncate_blocks_returns_the_removed_ids():
    seq = Sequence([1])
    seq.write_blocks(0, [4, 5, 6, 7])
    removed = seq.truncate_blocks(2)
    np.testing.assert_array_equal(removed, [6, 7])
    np.testing.assert_array_equal(seq.block_table, [4, 5])
    assert seq.truncate_blocks(2).shape == (0,)
    np.testing.assert_array_equal(seq.truncate_blocks(0), [4, 5])
    assert seq.num_blocks == 0


def test_truncate_then_write_does_not_resurrect_old_ids():
    seq = Sequence([1])
    seq.write_blocks(0, [4, 5, 6])
    seq.truncate_blocks(1)
    assert seq.write_blocks(1, [9]).shape == (0,)
    np.testing.assert_array_equal(seq.block_table, [4, 9])


@pytest.mark.parametrize("count", [-1, 4, 100])
def test_truncate_blocks_rejects_counts_outside_the_table(count):
    seq = Sequence([1])
    seq.write_blocks(0, [4, 5, 6])
    before = snapshot(seq)
    with pytest.raises(InvalidBlockIdError):
        seq.truncate_blocks(count)
    assert_same(before, snapshot(seq))


# --- namespace -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapter", "salt"),
    [("", None), (None, ""), (3, None), (None, 3), (b"lora", None), (["lora"], None), (True, None)],
    ids=repr,
)
def test_namespace_rejects_empty_and_non_str_values(adapter, salt):
    with pytest.raises(InvalidNamespaceError):
        Namespace(adapter, salt)
    with pytest.raises(InvalidNamespaceError):
        Sequence([1], adapter=adapter, cache_salt=salt)


def test_namespace_errors_are_value_errors():
    with pytest.raises(ValueError):
        Namespace("")


def test_equal_namespaces_compare_and_hash_equal():
    a = Namespace("lora-a", "tenant-1")
    b = Namespace("lora-a", "tenant-1")
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert Namespace() == Namespace(None, None)


def test_different_namespaces_differ():
    variants = [Namespace(), Namespace("a"), Namespace(None, "a"), Namespace("a", "b"), Namespace("b", "a")]
    assert len(set(variants)) == len(variants)


def test_sequence_namespace_reflects_its_arguments():
    seq = Sequence([1], adapter="lora", cache_salt="salt")
    assert seq.namespace == Namespace("lora", "salt")
    assert Sequence([1]).namespace == Namespace()


def test_namespace_is_frozen():
    ns = Namespace("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.adapter = "b"  # type: ignore[misc]
    assert ns.adapter == "a"


# --- multimodal spans ---------------------------------------------------------------------------


def test_span_accepts_numpy_ints_and_stores_python_ints():
    s = MultimodalSpan(np.int64(2), np.int32(5), "image", "abc")
    assert (s.start, s.end) == (2, 5)
    assert type(s.start) is int and type(s.end) is int


@pytest.mark.parametrize(("start", "end"), [(5, 5), (5, 4), (-1, 3), (-5, -2)])
def test_span_rejects_empty_or_negative_ranges(start, end):
    with pytest.raises(InvalidSpanError):
        MultimodalSpan(start, end, "image", "abc")


@pytest.mark.parametrize(("start", "end"), [(0.0, 4), (0, 4.0), ("0", 4), (None, 4), (True, 4), (0, True)], ids=repr)
def test_span_rejects_non_int_bounds(start, end):
    with pytest.raises(InvalidTypeError):
        MultimodalSpan(start, end, "image", "abc")


@pytest.mark.parametrize(("modality", "content_id"), [(1, "abc"), (None, "abc"), ("image", 1), ("image", None)])
def test_span_rejects_non_str_modality_and_content_id(modality, content_id):
    with pytest.raises(InvalidTypeError):
        MultimodalSpan(0, 4, modality, content_id)


@pytest.mark.parametrize(("modality", "content_id"), [("", "abc"), ("image", "")])
def test_span_rejects_empty_modality_and_content_id(modality, content_id):
    with pytest.raises(InvalidSpanError):
        MultimodalSpan(0, 4, modality, content_id)


def test_a_single_span_instead_of_a_list_is_a_type_error():
    with pytest.raises(InvalidTypeError):
        Sequence(list(range(8)), multimodal=MultimodalSpan(0, 4, "image", "abc"))


@pytest.mark.parametrize("ids", [[-1], [1.5], np.array([2.0])], ids=repr)
def test_write_blocks_rejects_negative_or_non_integer_ids(ids):
    seq = Sequence(list(range(8)))
    with pytest.raises((InvalidBlockIdError, InvalidTypeError)):
        seq.write_blocks(0, ids)
    assert seq.num_blocks == 0


def test_spans_are_kept_sorted_regardless_of_input_order():
    spans = [span(20, 30), span(0, 4), span(10, 12)]
    seq = Sequence(list(range(40)), multimodal=spans)
    assert seq.spans == (span(0, 4), span(10, 12), span(20, 30))
    assert isinstance(seq.spans, tuple)


def test_adjacent_spans_are_allowed():
    seq = Sequence(list(range(40)), multimodal=[span(24, 40), span(8, 24)])
    assert [(s.start, s.end) for s in seq.spans] == [(8, 24), (24, 40)]


def test_span_may_end_exactly_at_the_prompt_end():
    seq = Sequence(list(range(10)), multimodal=[span(2, 10)])
    assert seq.spans[0].end == 10


def test_span_ending_past_the_prompt_is_rejected():
    with pytest.raises(InvalidSpanError):
        Sequence(list(range(10)), multimodal=[span(2, 11)])


@pytest.mark.parametrize(
    "spans",
    [
        [span(0, 10), span(5, 15)],
        [span(5, 15), span(0, 10)],
        [span(0, 20), span(5, 6)],
        [span(3, 8), span(3, 8, content_id="other")],
        [span(3, 8), span(3, 8)],
        [span(0, 4), span(10, 20), span(19, 25)],
    ],
)
def test_overlapping_spans_are_rejected(spans):
    with pytest.raises(InvalidSpanError):
        Sequence(list(range(30)), multimodal=spans)


@pytest.mark.parametrize("bad", [[(0, 4, "image", "a")], ["span"], [None]], ids=repr)
def test_non_span_entries_are_rejected(bad):
    with pytest.raises(InvalidTypeError):
        Sequence(list(range(10)), multimodal=bad)


def test_spans_overlapping_returns_spans_touching_the_range():
    seq = Sequence(list(range(120)), multimodal=[span(16, 32), span(48, 64), span(96, 116)])
    first, second, third = seq.spans
    assert seq.spans_overlapping(0, 16) == ()
    assert seq.spans_overlapping(0, 17) == (first,)
    assert seq.spans_overlapping(31, 48) == (first,)
    assert seq.spans_overlapping(32, 48) == ()
    assert seq.spans_overlapping(20, 50) == (first, second)
    assert seq.spans_overlapping(50, 52) == (second,)  # range strictly inside a span
    assert seq.spans_overlapping(0, 120) == (first, second, third)
    assert seq.spans_overlapping(116, 120) == ()


def test_spans_overlapping_an_empty_or_inverted_range_is_empty():
    seq = Sequence(list(range(40)), multimodal=[span(8, 24)])
    assert seq.spans_overlapping(10, 10) == ()
    assert seq.spans_overlapping(20, 12) == ()


def test_spans_overlapping_without_spans_is_empty():
    assert Sequence(list(range(10))).spans_overlapping(0, 10) == ()


def test_is_boundary_safe():
    seq = Sequence(list(range(40)), multimodal=[span(8, 24), span(24, 30)])
    assert seq.is_boundary_safe(0)
    assert seq.is_boundary_safe(8)  # span start
    assert not seq.is_boundary_safe(9)
    assert not seq.is_boundary_safe(16)
    assert not seq.is_boundary_safe(23)
    assert seq.is_boundary_safe(24)  # end of one span and start of the next
    assert not seq.is_boundary_safe(25)
    assert seq.is_boundary_safe(30)  # span end
    assert seq.is_boundary_safe(40)


def test_is_boundary_safe_without_spans():
    seq = Sequence(list(range(10)))
    assert all(seq.is_boundary_safe(step) for step in range(11))


def test_clamp_rounds_down_to_a_block_boundary_outside_every_image():
    seq = Sequence(list(range(128)), multimodal=[span(16, 32), span(48, 64), span(96, 116)])
    assert seq.clamp_to_safe_block_boundary(112, 16) == 96
    assert seq.clamp_to_safe_block_boundary(127, 16) == 96  # rounds to 112, still inside the image
    assert seq.clamp_to_safe_block_boundary(128, 16) == 128
    assert seq.clamp_to_safe_block_boundary(96, 16) == 96
    assert seq.clamp_to_safe_block_boundary(70, 16) == 64
    assert seq.clamp_to_safe_block_boundary(63, 16) == 48
    assert seq.clamp_to_safe_block_boundary(40, 16) == 32
    assert seq.clamp_to_safe_block_boundary(31, 16) == 16
    assert seq.clamp_to_safe_block_boundary(15, 16) == 0


def test_clamp_repeats_when_the_rounded_step_falls_in_an_earlier_image():
    # 32 is inside [24, 40) -> its start 24 rounds to 16, inside [8, 24) -> 8 rounds to 0.
    seq = Sequence(list(range(48)), multimodal=[span(8, 24), span(24, 40)])
    assert seq.clamp_to_safe_block_boundary(32, 16) == 0
    assert seq.clamp_to_safe_block_boundary(47, 16) == 0
    assert seq.clamp_to_safe_block_boundary(48, 16) == 48


def test_clamp_without_spans_rounds_down_to_a_block_boundary():
    seq = Sequence(list(range(100)))
    assert seq.clamp_to_safe_block_boundary(100, 16) == 96
    assert seq.clamp_to_safe_block_boundary(15, 16) == 0
    assert seq.clamp_to_safe_block_boundary(0, 16) == 0
    assert seq.clamp_to_safe_block_boundary(-5, 16) == 0


@st.composite
def spans_and_length(draw):
    """Non-overlapping spans (given in a shuffled order) and a prompt length that covers them."""
    spans, position = [], 0
    for _ in range(draw(st.integers(0, 6))):
        start = position + draw(st.integers(0, 40))
        end = start + draw(st.integers(1, 40))
        spans.append(span(start, end, content_id=f"c{len(spans)}"))
        position = end
    length = position + draw(st.integers(0, 40))
    draw(st.randoms()).shuffle(spans)
    return spans, length


def _brute_force_safe(spans, step):
    return not any(s.start < step < s.end for s in spans)


@settings(max_examples=200)
@given(spans_and_length(), st.sampled_from([2, 4, 8, 16]), st.data())
def test_clamp_returns_the_deepest_safe_block_boundary(case, block_size, data):
    spans, length = case
    seq = Sequence(list(range(length)), multimodal=spans)
    step = data.draw(st.integers(0, length + 20))
    clamped = seq.clamp_to_safe_block_boundary(step, block_size)
    expected = max(b for b in range(0, step + 1, block_size) if _brute_force_safe(spans, b))
    assert clamped == expected
    assert clamped % block_size == 0
    assert seq.is_boundary_safe(clamped)


@settings(max_examples=200)
@given(spans_and_length(), st.data())
def test_span_queries_agree_with_brute_force(case, data):
    spans, length = case
    seq = Sequence(list(range(length)), multimodal=spans)
    assert list(seq.spans) == sorted(spans, key=lambda s: s.start)
    step = data.draw(st.integers(-2, length + 2))
    assert seq.is_boundary_safe(step) == _brute_force_safe(spans, step)
    start = data.draw(st.integers(-2, length + 2))
    end = data.draw(st.integers(-2, length + 2))
    expected = tuple(s for s in seq.spans if s.start < end and s.end > start and start < end)
    assert seq.spans_overlapping(start, end) == expected


# --- routed experts -----------------------------------------------------------------------------


def test_routed_experts_append_rows_as_int16():
    seq = Sequence(list(range(5)), want_routed_experts=True)
    seq.append_routed_experts([[1, 2], [3, 4]])
    seq.append_routed_experts(np.array([[5, 6]], dtype=np.int64))
    experts = seq.routed_experts
    assert experts.dtype == np.int16
    assert experts.shape == (3, 2)
    np.testing.assert_array_equal(experts, [[1, 2], [3, 4], [5, 6]])
    assert seq.num_routed_experts == 3


def test_routed_experts_view_is_read_only():
    seq = Sequence(list(range(5)))
    seq.append_routed_experts([[1, 2]])
    view = seq.routed_experts
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 9
    np.testing.assert_array_equal(seq.routed_experts, [[1, 2]])


def test_routed_experts_keep_earlier_rows_across_growth():
    seq = Sequence(list(range(300)))
    rows = (np.arange(600) % 32000).reshape(300, 2)
    for i in range(0, 300, 7):
        seq.append_routed_experts(rows[i : i + 7])
    assert seq.routed_experts.tolist() == rows.tolist()


def test_routed_expert_width_change_is_rejected():
    seq = Sequence(list(range(5)))
    seq.append_routed_experts([[1, 2]])
    before = snapshot(seq)
    with pytest.raises(InvalidArgumentError):
        seq.append_routed_experts([[1, 2, 3]])
    assert_same(before, snapshot(seq))


@pytest.mark.parametrize("bad_id", [-1, 2**15, 2**31])
def test_routed_expert_ids_outside_int16_are_rejected(bad_id):
    seq = Sequence(list(range(5)))
    seq.append_routed_experts([[1, 2]])
    before = snapshot(seq)
    with pytest.raises(InvalidArgumentError):
        seq.append_routed_experts(np.array([[3, bad_id]], dtype=np.int64))
    assert_same(before, snapshot(seq))


def test_routed_expert_max_id_is_accepted():
    seq = Sequence([1])
    seq.append_routed_experts([[0, 2**15 - 1]])
    assert seq.routed_experts.tolist() == [[0, 32767]]


@pytest.mark.parametrize(
    "bad", [[1, 2], [[1.0, 2.0]], np.array([[True, False]]), np.zeros((1, 2, 2), dtype=np.int16), 3], ids=repr
)
def test_routed_experts_must_be_a_2d_integer_array(bad):
    seq = Sequence(list(range(5)))
    before = snapshot(seq)
    with pytest.raises(InvalidTypeError):
        seq.append_routed_experts(bad)
    assert_same(before, snapshot(seq))


def test_routed_expert_rows_beyond_the_known_tokens_are_rejected():
    seq = Sequence([1, 2])
    seq.append_routed_experts([[1]])
    before = snapshot(seq)
    with pytest.raises(InvalidStepError):
        seq.append_routed_experts([[2], [3]])
    assert_same(before, snapshot(seq))
    seq.append_tokens([3])
    seq.append_routed_experts([[2], [3]])
    assert seq.num_routed_experts == 3


def test_first_routed_expert_append_beyond_tokens_leaves_history_empty():
    seq = Sequence([1])
    with pytest.raises(InvalidStepError):
        seq.append_routed_experts([[1], [2]])
    assert seq.routed_experts is None
    assert seq.num_routed_experts == 0


def test_mixed_operations_keep_every_error_side_effect_free():
    rng = random.Random(7)
    seq = Sequence(list(range(20)), multimodal=[span(4, 8)])
    bad_calls = [
        lambda: seq.append_tokens([-1]),
        lambda: seq.set_computed(10_000),
        lambda: seq.write_blocks(seq.num_blocks + 1, [1]),
        lambda: seq.truncate_blocks(seq.num_blocks + 1),
        lambda: seq.append_routed_experts([[1.5]]),
        lambda: seq.token_view(0, seq.num_tokens + 1),
    ]
    for _ in range(50):
        seq.append_tokens([rng.randrange(1000)])
        seq.write_blocks(seq.num_blocks, [rng.randrange(100)])
        before = snapshot(seq)
        with pytest.raises((InvalidArgumentError, InvalidTypeError, InvalidBlockIdError)):
            rng.choice(bad_calls)()
        assert_same(before, snapshot(seq))


def test_token_address_points_at_the_tokens_and_follows_growth():
    seq = Sequence([1, 2, 3])
    assert seq.token_address(1, 3) == seq.token_view(1, 3).ctypes.data
    seq.append_tokens(list(range(5000)))  # the buffer moves
    assert seq.token_address(0, 5003) == seq.token_view(0, 5003).ctypes.data
    with pytest.raises(InvalidStepError):
        seq.token_address(2, 5004)
    with pytest.raises(InvalidStepError):
        seq.token_address(3, 2)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda seq: pickle.loads(pickle.dumps(seq))])
def test_a_copied_sequence_reads_its_own_tokens(clone):
    """The cached buffer address follows a copy: the clone's native reads never touch the
    original's buffer (which may grow or be freed)."""
    seq = Sequence(list(range(100)))
    twin = clone(seq)
    seq.append_tokens(list(range(10_000)))  # the original's buffer moves
    assert twin.token_address(0, 100) == twin.token_view(0, 100).ctypes.data


def test_an_unpickled_namespace_hashes_like_a_new_one():
    """A namespace's cached hash is recomputed when unpickled (str hashes differ between
    processes), so it finds the same dictionary entries as one built here."""
    namespace = Namespace("lora", "tenant")
    object.__setattr__(namespace, "_hash", 12345)  # as if hashed by another process
    restored = pickle.loads(pickle.dumps(namespace))
    assert restored == Namespace("lora", "tenant") and hash(restored) == hash(Namespace("lora", "tenant"))
    assert {Namespace("lora", "tenant"): 1}[restored] == 1


def test_set_computed_accepts_int_subclasses():
    import enum

    class Where(enum.IntEnum):
        THREE = 3

    seq = Sequence(list(range(8)))
    seq.set_computed(Where.THREE)
    assert seq.num_computed == 3 and type(seq.num_computed) is int
    seq.set_computed(np.int64(5))
    assert seq.num_computed == 5 and type(seq.num_computed) is int


def test_write_blocks_returns_a_writable_array_even_when_nothing_is_replaced():
    seq = Sequence(list(range(8)))
    replaced = seq.write_blocks(0, [4, 5])
    assert replaced.size == 0 and replaced.dtype == np.int32 and replaced.flags.writeable


@pytest.mark.parametrize("size", [1, 63, 64, 65, 127])
def test_token_words_pack_token_pairs_and_follow_appends_and_copies(size):
    seq = Sequence(list(range(size)))
    even = size - size % 2
    expected = seq.token_view(0, even).view(np.uint64)
    assert np.array_equal(seq.token_words(0, even), expected) and not seq.token_words(0, even).flags.writeable
    seq.append_tokens(list(range(1000, 1000 + 3 * size)))  # the buffer may move
    total = seq.num_tokens - seq.num_tokens % 2
    assert np.array_equal(seq.token_words(0, total), seq.token_view(0, total).view(np.uint64))
    for twin in (copy.deepcopy(seq), pickle.loads(pickle.dumps(seq))):
        assert np.array_equal(twin.token_words(0, total), seq.token_words(0, total))
        assert twin.token_words(0, total).ctypes.data != seq.token_words(0, total).ctypes.data
    with pytest.raises(InvalidStepError):
        seq.token_words(1, 3)  # odd bounds
    with pytest.raises(InvalidStepError):
        seq.token_words(0, total + 2)


def test_a_pickle_carries_the_tokens_once_and_an_odd_sized_old_buffer_still_loads():
    seq = Sequence(list(range(100_000)))
    assert len(pickle.dumps(seq)) < 1.2 * seq.token_view(0, 100_000).nbytes
    state = seq.__getstate__()
    assert "_words" not in state and "_tokens_address" not in state
    state["_tokens"] = np.arange(65, dtype=np.int32)  # as an older version could leave it
    state["_num_tokens"] = 65
    old = Sequence.__new__(Sequence)
    old.__setstate__(state)
    assert old.num_tokens == 65 and old.tokens.tolist() == list(range(65))
    assert np.array_equal(old.token_words(0, 64), old.token_view(0, 64).view(np.uint64))


def test_out_of_range_ids_are_refused_in_every_width():
    for bad in (np.array([3, -1], np.int64), np.array([-1], np.int32), np.array([-1], np.int8), np.array([2**31], np.uint64)):
        with pytest.raises(InvalidTokenError):
            Sequence(bad)
    assert np.array_equal(Sequence(np.arange(10, dtype=">i8")[::3]).tokens, [0, 3, 6, 9])


# --- bad arguments: a specific error, nothing changed ---------------------------------------------


@pytest.mark.parametrize("seq_id, error", [("abc", InvalidTypeError), (float("nan"), InvalidTypeError),
                                           (float("inf"), InvalidTypeError), ([1], InvalidTypeError),
                                           (1.5, InvalidTypeError), (True, InvalidTypeError)], ids=repr)
def test_seq_id_must_be_an_int(seq_id, error):
    with pytest.raises(error):
        Sequence([1, 2], seq_id=seq_id)
    assert Sequence([1, 2], seq_id=np.int64(7)).seq_id == 7 and type(Sequence([1], seq_id=np.int64(7)).seq_id) is int


@pytest.mark.parametrize("method", ["token_view", "token_words", "token_address"])
@pytest.mark.parametrize("start, end", [(0.5, 2), (0, 2.5), ("a", 1), (None, 1), (True, 2), (0, None)], ids=repr)
def test_token_ranges_must_be_ints(method, start, end):
    seq = Sequence(list(range(10)))
    before = snapshot(seq)
    with pytest.raises(InvalidTypeError):
        getattr(seq, method)(start, end)
    assert_same(before, snapshot(seq))


def test_token_ranges_accept_numpy_ints():
    seq = Sequence(list(range(10)))
    assert seq.token_view(np.int64(0), np.int64(3)).tolist() == [0, 1, 2]
    assert seq.token_words(np.int64(0), np.int64(4)).size == 2
    assert type(seq.token_address(np.int64(1), np.int64(3))) is int


@pytest.mark.parametrize("count, error", [(1.5, InvalidTypeError), ("a", InvalidTypeError), (None, InvalidTypeError),
                                          (True, InvalidTypeError), (-1, InvalidBlockIdError), (4, InvalidBlockIdError)],
                         ids=repr)
def test_truncate_blocks_refuses_a_bad_count(count, error):
    seq = Sequence(list(range(10)))
    seq.write_blocks(0, [4, 5, 6])
    before = snapshot(seq)
    with pytest.raises(error):
        seq.truncate_blocks(count)
    assert_same(before, snapshot(seq))


@pytest.mark.parametrize("ids, error", [([2**40], InvalidBlockIdError), (np.array([2**33]), InvalidBlockIdError),
                                        (np.array([2**63 + 1], dtype=np.uint64), InvalidBlockIdError),
                                        ([2**31], InvalidBlockIdError), ([[1, 2], [3]], InvalidTypeError),
                                        (None, InvalidTypeError)], ids=repr)
def test_write_blocks_checks_ids_before_the_int32_cast_could_wrap_them(ids, error):
    seq = Sequence(list(range(10)))
    seq.write_blocks(0, [4])
    before = snapshot(seq)
    with pytest.raises(error):
        seq.write_blocks(0, ids)
    assert_same(before, snapshot(seq))
    seq.write_blocks(1, [2**31 - 1])
    assert seq.block_table.tolist() == [4, 2**31 - 1]


@pytest.mark.parametrize("rows", [[[1], [2, 3]], [[1.5, 2.0]], [1, 2], "ab"], ids=repr)
def test_append_routed_experts_refuses_ragged_or_non_integer_rows(rows):
    seq = Sequence(list(range(10)), want_routed_experts=True)
    seq.append_routed_experts([[1, 2]])
    before = snapshot(seq)
    with pytest.raises(InvalidTypeError):
        seq.append_routed_experts(rows)
    assert_same(before, snapshot(seq))
    assert seq.checked_routed_experts([[3, 4]]).tolist() == [[3, 4]]
    assert_same(before, snapshot(seq))  # checking appends nothing
