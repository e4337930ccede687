"""TokenStore: one int32 row per node slot, read in place as contiguous runs."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hybridcache.prefix_cache import token_store
from hybridcache.prefix_cache.token_store import TokenStore
from hybridcache.sequence import TOKEN_DTYPE, Sequence


def test_contiguous_write_and_run_view():
    store = TokenStore(4, capacity=8)
    assert store.capacity == 8 and store.nbytes == 8 * 4 * 4
    flat = np.arange(12, dtype=TOKEN_DTYPE)
    store.write(np.array([2, 3, 4]), flat)
    assert store.run(2, 4).tolist() == list(range(12))
    assert store.run(3, 3).tolist() == [4, 5, 6, 7]
    view = store.run(2, 4)
    assert view.dtype == TOKEN_DTYPE and not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 99
    assert np.shares_memory(view, store.run(2, 2))  # a view, not a copy


def test_scattered_write():
    store = TokenStore(2, capacity=10)
    store.write(np.array([1, 5, 7]), np.array([1, 2, 3, 4, 5, 6], dtype=TOKEN_DTYPE))
    assert store.run(1, 1).tolist() == [1, 2]
    assert store.run(5, 5).tolist() == [3, 4]
    assert store.run(7, 7).tolist() == [5, 6]
    assert store.run(2, 4).tolist() == [0] * 6


def test_empty_write_is_a_no_op():
    store = TokenStore(2, capacity=2)
    store.write(np.array([], dtype=np.int64), np.array([], dtype=TOKEN_DTYPE))
    assert store.run(0, 1).tolist() == [0] * 4


def test_growth_keeps_rows():
    store = TokenStore(4, capacity=0)
    assert store.capacity == 0
    store.ensure_capacity(3)
    assert store.capacity >= 3
    store.write(np.array([0, 1, 2]), np.arange(12, dtype=TOKEN_DTYPE))
    store.ensure_capacity(2)  # never shrinks
    assert store.capacity >= 3
    store.ensure_capacity(100)
    assert store.capacity >= 100
    assert store.run(0, 2).tolist() == list(range(12))
    old = store.capacity
    store.ensure_capacity(old + 1)
    assert store.capacity >= 2 * old  # amortized doubling


@pytest.mark.parametrize("use_memcmp", [True, False])
def test_equals_compares_runs_exactly(monkeypatch, use_memcmp):
    """The exact comparison (memcmp where the C library is reachable, NumPy otherwise) sees
    every token: one changed token anywhere, another offset, or a run beyond the sequence's
    tokens is a mismatch."""
    if not use_memcmp:
        monkeypatch.setattr(token_store, "_MEMCMP", None)
    store = TokenStore(4, capacity=8)
    flat = np.arange(100, 112, dtype=TOKEN_DTYPE)
    store.write(np.array([2, 3, 4]), flat)
    prompt = [7, 7] + flat.tolist()
    assert store.equals(2, 4, Sequence(prompt), 2) and store.equals(3, 3, Sequence(prompt), 6)
    assert not store.equals(2, 4, Sequence(prompt), 1)
    for position in range(12):
        changed = list(prompt)
        changed[2 + position] += 1
        assert not store.equals(2, 4, Sequence(changed), 2)
    assert not store.equals(2, 4, Sequence(prompt[:-1]), 2)  # the run would read past the end


@pytest.mark.parametrize("use_memcmp", [True, False])
def test_matching_rows_is_where_a_run_and_a_sequence_part(monkeypatch, use_memcmp):
    """The count of leading rows equal to the sequence, for a first difference in every row
    (and none), and bounded by the sequence's complete blocks."""
    if not use_memcmp:
        monkeypatch.setattr(token_store, "_MEMCMP", None)
    store = TokenStore(2, capacity=16)
    flat = np.arange(500, 526, dtype=TOKEN_DTYPE)  # 13 rows
    store.write(np.arange(1, 14), flat)
    prompt = [9] + flat.tolist()
    assert store.matching_rows(1, 13, Sequence(prompt), 1) == 13
    for row in range(13):
        for column in range(2):
            changed = list(prompt)
            changed[1 + 2 * row + column] += 1
            assert store.matching_rows(1, 13, Sequence(changed), 1) == row
    assert store.matching_rows(1, 13, Sequence(prompt[:12]), 1) == 5  # 11 tokens: 5 complete rows
    assert store.matching_rows(3, 6, Sequence(prompt), 5) == 4
    assert store.matching_rows(1, 13, Sequence(prompt[:2]), 1) == 0


def test_equals_reads_the_rows_and_tokens_after_they_grow():
    store = TokenStore(2, capacity=1)
    store.write(np.array([0]), np.array([7, 8], dtype=TOKEN_DTYPE))
    store.ensure_capacity(64)  # the rows move
    store.write(np.array([40]), np.array([5, 6], dtype=TOKEN_DTYPE))
    seq = Sequence([7, 8])
    seq.append_tokens(list(range(1000)) + [5, 6])  # the sequence's buffer moves too
    assert store.equals(0, 0, seq, 0) and store.equals(40, 40, seq, 1002)
    assert not store.equals(40, 40, seq, 1001)


def test_a_copied_store_compares_its_own_rows():
    store = TokenStore(2, capacity=4)
    store.write(np.array([1]), np.array([3, 4], dtype=TOKEN_DTYPE))
    twin = copy.deepcopy(store)
    store.write(np.array([1]), np.array([9, 9], dtype=TOKEN_DTYPE))
    assert twin.equals(1, 1, Sequence([3, 4]), 0) and not twin.equals(1, 1, Sequence([9, 9]), 0)
