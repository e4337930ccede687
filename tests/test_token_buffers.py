"""Spare token buffers: a dead sequence's buffer serves the next one, never while a view of
it lives, within the byte bound."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache import token_buffers
from hybridcache.sequence import Sequence

LONG = token_buffers.MIN_SPARE_TOKENS + 100


@pytest.fixture(autouse=True)
def no_spares():
    token_buffers.clear()
    yield
    token_buffers.clear()


def _address(seq: Sequence) -> int:
    return seq.token_address(0, 0)


def test_dead_sequence_buffer_serves_next_and_holds_its_tokens():
    first = Sequence(np.arange(LONG))
    address = _address(first)
    del first
    assert token_buffers.spare_bytes() > 0
    second = Sequence(np.arange(LONG)[::-1].copy())
    assert _address(second) == address
    assert token_buffers.spare_bytes() == 0
    assert np.array_equal(second.tokens, np.arange(LONG)[::-1])


def test_live_view_keeps_buffer_out_of_spares():
    first = Sequence(np.arange(LONG))
    view = first.token_view(10, 20)
    del first
    assert token_buffers.spare_bytes() == 0
    Sequence(np.full(LONG, 7))
    assert np.array_equal(view, np.arange(10, 20))


def test_outgrown_buffer_is_kept_and_views_of_it_stay_valid():
    seq = Sequence(np.arange(LONG))
    early = seq.tokens
    seq.append_tokens(np.arange(2 * LONG))  # grows: the old buffer has a live view
    assert token_buffers.spare_bytes() == 0
    del early
    seq.append_tokens(np.arange(4 * LONG))  # grows again: nothing views the old buffer
    assert token_buffers.spare_bytes() > 0
    assert np.array_equal(seq.tokens, np.concatenate([np.arange(LONG), np.arange(2 * LONG), np.arange(4 * LONG)]))


def test_short_buffers_are_not_kept_and_spares_stay_bounded(monkeypatch):
    short = Sequence(np.arange(100))
    del short
    assert token_buffers.spare_bytes() == 0
    one = token_buffers.capacity_class(LONG) * 4
    monkeypatch.setattr(token_buffers, "MAX_SPARE_BYTES", 2 * one)
    seqs = [Sequence(np.zeros(LONG, dtype=np.int32)) for _ in range(5)]
    del seqs
    assert token_buffers.spare_bytes() == 2 * one


def test_capacity_classes_are_even_and_at_most_an_eighth_larger():
    for tokens in (1, 63, 64, 65, LONG, 65_537, 131_073, 1_000_001):
        capacity = token_buffers.capacity_class(tokens)
        assert capacity >= tokens and capacity % 2 == 0
        assert capacity <= max(tokens + 1, tokens * 9 // 8 + 2)
        assert token_buffers.capacity_class(capacity) == capacity
