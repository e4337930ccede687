"""The routing cost: restorable depth first, KV overlap second, load in tokens, round robin."""

from __future__ import annotations

import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.router.policy import check_policy, choose
from hybridcache.router.replica_index import Depths


def test_restorable_takes_the_deepest_state_whatever_kv_the_others_hold():
    depths = [Depths(800, 0), Depths(160, 160)]
    decision = choose("restorable", 1000, depths, [0, 0], 0)
    assert (decision.index, decision.reason, decision.predicted_tokens) == (1, "restorable", 160)
    assert choose("kv-overlap", 1000, depths, [0, 0], 0).index == 0


def test_equal_depths_go_where_the_kv_is_then_round_robin():
    depths = [Depths(0, 0), Depths(640, 0), Depths(640, 0)]
    assert [choose("restorable", 1000, depths, [0, 0, 0], n).index for n in range(3)] == [1, 1, 2]
    assert choose("restorable", 1000, depths, [0, 0, 0], 0).reason == "kv-overlap"
    flat = [Depths(0, 0)] * 3
    assert [choose("restorable", 10, flat, [0, 0, 0], n).index for n in range(4)] == [0, 1, 2, 0]
    assert choose("restorable", 10, flat, [0, 0, 0], 0).reason == "round-robin"


def test_queued_tokens_count_against_the_hit_they_delay():
    depths = [Depths(320, 320), Depths(0, 0)]
    assert choose("restorable", 1000, depths, [400, 0], 0).index == 1
    assert choose("restorable", 1000, depths, [400, 0], 0).reason == "load"
    assert choose("restorable", 1000, depths, [200, 0], 0).index == 0  # 880 tokens to its first token, not 1000


def test_round_robin_ignores_the_caches():
    depths = [Depths(0, 0), Depths(900, 900)]
    assert [choose("round-robin", 1000, depths, [0, 0], n).index for n in range(3)] == [0, 1, 0]


def test_unknown_policies_are_refused():
    with pytest.raises(InvalidArgumentError):
        check_policy("fastest")
