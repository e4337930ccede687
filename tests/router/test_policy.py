"""The routing cost: restorable depth first, KV overlap second, load in tokens, round robin."""

from __future__ import annotations

import random

import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.router.policy import Decision, check_policy, choose
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


def test_restorable_never_restores_less_than_kv_overlaps_choice():
    # kv-overlap takes replica 1 (the deepest KV, its state at 160); by cost alone restorable
    # would take replica 0 (less queued, state at 100) and restore less than kv-overlap does.
    depths, queued = [Depths(160, 100), Depths(800, 160)], [0.0, 100.0]
    assert choose("kv-overlap", 1000, depths, queued, 0).index == 1
    assert choose("restorable", 1000, depths, queued, 0) == Decision(1, "restorable", 160, 160)


def test_every_decision_names_the_deepest_restore_any_replica_offered():
    depths, queued = [Depths(0, 0), Depths(512, 0), Depths(64, 48)], [0.0, 0.0, 0.0]
    for policy in ("round-robin", "kv-overlap", "restorable"):
        decision = choose(policy, 600, depths, queued, 0)
        assert decision.deepest_tokens == 48 >= decision.predicted_tokens
    assert choose("kv-overlap", 600, depths, queued, 0).predicted_tokens == 0  # KV with no state inside it


def test_among_replicas_restoring_as_deep_load_decides():
    depths, queued = [Depths(800, 160), Depths(160, 160), Depths(0, 0)], [300.0, 0.0, 0.0]
    assert choose("kv-overlap", 1000, depths, queued, 0).index == 0
    assert choose("restorable", 1000, depths, queued, 0).index == 1  # as deep a restore, less queued


def test_restorable_is_at_least_as_deep_as_kv_overlap_on_random_fleets():
    rng = random.Random(23)
    for number in range(2000):
        count = rng.randint(2, 8)
        kv = [rng.randrange(0, 65) * 16 for _ in range(count)]
        depths = [Depths(k, rng.choice([0, k, rng.randrange(0, k + 1)])) for k in kv]
        queued = [float(rng.choice([0, rng.randrange(0, 2000)])) for _ in range(count)]
        overlap = choose("kv-overlap", 1024, depths, queued, number)
        assert choose("restorable", 1024, depths, queued, number).predicted_tokens >= overlap.predicted_tokens
