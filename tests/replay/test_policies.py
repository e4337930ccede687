import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.policies import TurnView
from hybridcache.replay.policies import IntervalAdmission, LRUEviction, ReferenceAdmission, resolve_policy
from tests.replay._helpers import budget, request, run

rng = np.random.default_rng(7)


def tokens(count):
    return rng.integers(0, 50_000, size=count)


def test_resolve_names():
    policy = resolve_policy("reference")
    assert policy.admission == ReferenceAdmission(2048) and policy.eviction == LRUEviction()
    assert resolve_policy("interval:32").admission == IntervalAdmission(32)
    mixed = resolve_policy("reference", admission="interval:8", eviction="lru")
    assert mixed.admission == IntervalAdmission(8) and mixed.name == "interval:8+lru"
    assert resolve_policy("reference", prefill_chunk=512).admission.prefill_chunk == 512


@pytest.mark.parametrize("policy, admission, eviction, message", [
    ("lfu", None, None, "unknown policy 'lfu'"),
    ("interval", None, None, "positive int argument"),
    ("interval:0", None, None, "positive int argument"),
    ("interval:x", None, None, "positive int argument"),
    ("reference:3", None, None, "takes no argument"),
    ("reference", "branch", None, "unknown admission 'branch'"),
    ("reference", None, "marconi:-1", "alpha"),
    ("", None, None, "non-empty"),
])
def test_unknown_or_malformed_names_are_refused(policy, admission, eviction, message):
    with pytest.raises(InvalidArgumentError, match=message):
        resolve_policy(policy, admission, eviction)


def test_plans():
    reference = ReferenceAdmission(2048)
    assert reference.save_steps(TurnView(0, 5000, 5100, 0, 32)) == (2048, 4096, 5000, 5100)
    assert reference.save_steps(TurnView(1000, 5000, 5000, 0, 32)) == (3048, 5000)
    interval = IntervalAdmission(32)
    assert interval.save_steps(TurnView(0, 100, 130, 0, 32)) == (32, 64, 96, 128)
    assert interval.save_steps(TurnView(64, 96, 96, 0, 32)) == (96,)


def test_reference_identical_prompt_hits_the_last_chunk_end():
    prompt = tokens(5000)
    record, hits = run([request(0, prompt, 10), request(1, prompt, 10)], "reference", budget(4096, 64))
    assert hits == [0, 4096]  # the prompt-end checkpoint sits on the last token: a hit stops before it
    # 2048, 4096, 5000, 5009, then the repeat's own turn end (its output differs); its 5000 exists
    assert record.checkpoints_written == 5
    assert record.token_hit_rate == pytest.approx(4096 / 10_000)
    assert record.request_hit_rate == 0.5


def test_interval_identical_prompt_hits_the_last_multiple():
    prompt = tokens(100)
    _, hits = run([request(0, prompt, 5), request(1, prompt, 5)], "interval:32", budget(512, 64))
    assert hits == [0, 96]


def test_turn_end_checkpoint_serves_the_next_turn():
    first = request(0, tokens(100), 40)  # processed up to 139: the last token is never run
    follow = request(1, np.concatenate([first.tokens, tokens(30)]), 3)
    _, hits = run([first, follow], "reference", budget(512, 64))
    assert hits == [0, 139]
    _, hits = run([first, follow], "interval:32", budget(512, 64))
    assert hits == [0, 128]


def test_lru_evicts_the_least_recent_checkpoints_for_state_slots():
    a, b = tokens(96), tokens(96)
    requests = [request(0, a), request(1, b), request(2, a)]
    record, hits = run(requests, "interval:32", budget(512, 3))  # b's three checkpoints push out a's
    assert hits == [0, 0, 0] and record.evictions.checkpoints_for_state_slots == 6
    record, hits = run(requests, "interval:32", budget(512, 6))
    assert hits == [0, 0, 64] and record.evictions.checkpoints_for_state_slots == 0


def test_lru_evicts_kv_leaves_under_block_pressure():
    a, b = tokens(256), tokens(256)
    requests = [request(0, a), request(1, b), request(2, a)]
    record, hits = run(requests, "interval:32", budget(8, 64))  # room for one request's blocks
    assert hits == [0, 0, 0] and record.evictions.kv_blocks >= 8
    record, hits = run(requests, "interval:32", budget(17, 64))
    assert hits == [0, 0, 224]


def test_recent_use_protects_a_checkpoint():
    a, b, c = tokens(64), tokens(64), tokens(64)
    # a is used again before c arrives, so b's checkpoints are the least recent ones
    requests = [request(0, a), request(1, b), request(2, a), request(3, c), request(4, a), request(5, b)]
    _, hits = run(requests, "interval:32", budget(512, 4))
    assert hits == [0, 0, 32, 0, 32, 0]
