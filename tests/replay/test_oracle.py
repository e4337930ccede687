"""The offline oracle: its plan, its Belady order, and a brute force over every admission choice."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, LifecycleError
from hybridcache.policies import LRUEviction, Policy, TurnView
from hybridcache.replay import replay
from hybridcache.replay.oracle import (
    Foresight,
    OracleAdmission,
    OracleEviction,
    OracleState,
    final_end,
    resume_points,
)
from hybridcache.replay.policies import resolve_policy
from hybridcache.workloads import infinite_cache_bound
from tests.replay._helpers import PROFILE, budget, checked_replay, config, request

BLOCK = 4
rng = np.random.default_rng(24)


def tokens(count):
    return rng.integers(0, 50_000, size=count)


def tiny_trace():
    """Four turns over one 12-token prefix: a branch at 8, a continuation of the whole first turn,
    a branch off the second turn's prompt."""
    a, b = tokens(12), tokens(6)
    first = request(0, a, 3)
    second = request(1, np.concatenate([a[:8], b]), 2)
    third = request(2, np.concatenate([first.tokens, tokens(4)]), 2)
    fourth = request(3, np.concatenate([a[:8], b[:5], tokens(5)]), 2)
    return [first, second, third, fourth]


@dataclass(frozen=True)
class PlannedAdmission:
    """Saves the steps a plan names per turn, told apart by (prompt, final end)."""

    plan: dict
    name: str = "planned"

    def save_steps(self, view: TurnView):
        return view.inside(self.plan.get((view.prompt_length, view.final_end), ()))

    def chunk_tokens(self):
        return 0

    def fitted(self, kv_tokens, checkpoint_slots):
        return self

    def for_state_weight(self, state_tokens):
        return self


def hits(requests, policy, space):
    def observe(adapters, request, turn):
        for adapter in adapters:
            if isinstance(adapter.eviction, OracleState):
                adapter.eviction.check_invariants()

    record, _ = checked_replay(requests, config(policy, space, BLOCK), observe)
    return record.prefill_tokens_saved, record


def candidates(trace, index):
    """Where a brute force may save in turn ``index``: the prompt end, the turn end, every later
    turn's resume point on its path and the block boundary below each of them."""
    r = trace[index]
    points = {r.prompt_length, final_end(r)}
    for q, p in enumerate(resume_points(trace).tolist()):
        if q > index and 0 < p <= final_end(r) and np.array_equal(r.tokens[:p], trace[q].tokens[:p]):
            points.add(p)
    points |= {p - p % BLOCK for p in points if p % BLOCK}
    return sorted(p for p in points if 0 < p <= final_end(r))


def brute_force(trace, space, eviction):
    keys = [(r.prompt_length, final_end(r)) for r in trace[:-1]]  # the last turn's saves serve nobody
    choices = [[combo for size in range(len(c) + 1) for combo in itertools.combinations(c, size)]
               for c in (candidates(trace, i) for i in range(len(trace) - 1))]
    best = 0
    for plan in itertools.product(*choices):
        admission = PlannedAdmission(dict(zip(keys, plan)))
        record = replay(trace, config(Policy("planned", admission, eviction), space, BLOCK))
        best = max(best, record.prefill_tokens_saved)
    return best


def test_resume_points_stop_where_the_producer_stopped_and_before_the_prompt_end():
    trace = tiny_trace()
    assert resume_points(trace).tolist() == [0, 8, 14, 13]  # 14: the first turn's last processed position
    assert infinite_cache_bound(trace).shared_tokens[2] == 15  # the bound counts its never-run last token


def test_plan_saves_only_where_a_later_turn_resumes():
    foresight = Foresight(tuple(tiny_trace()), BLOCK)
    assert foresight.plan == ((8, 14), (13,), (), ())


def test_brute_force_candidates():
    trace = tiny_trace()
    assert [candidates(trace, i) for i in range(3)] == [[8, 12, 14], [12, 13, 14, 15], [16, 19, 20]]


@pytest.mark.parametrize("kv_blocks, slots, best", [(64, 8, 35), (8, 1, 24), (6, 1, 24), (7, 2, 30)])
def test_oracle_against_the_best_admission_a_brute_force_finds(kv_blocks, slots, best):
    """Equal to the brute force's best, with its own eviction or LRU, except where KV and slot
    pressure meet (7 blocks, 2 slots): there it is an estimate, 24 of 30 tokens (80 %)."""
    trace, space = tiny_trace(), budget(kv_blocks, slots, BLOCK)
    oracle, record = hits(trace, resolve_policy("oracle"), space)
    assert brute_force(trace, space, OracleEviction()) == best
    assert oracle == (24 if (kv_blocks, slots) == (7, 2) else best)
    if kv_blocks == 64:  # no pressure: every reusable token is reused
        assert oracle == int(resume_points(trace).sum())
        assert record.checkpoints_written == 3


def test_belady_keeps_the_block_needed_soonest():
    """A third prompt pushes one of two cached ones out: the oracle drops the one never asked
    for again, LRU the older one, which the fourth request needed."""
    a, b, c = tokens(16), tokens(17), tokens(18)
    trace = [request(0, a, 1), request(1, b, 1), request(2, c, 1), request(3, np.concatenate([a[:12], tokens(6)]), 1)]
    space = budget(9, 2, BLOCK)
    oracle = hits(trace, resolve_policy("oracle"), space)[0]
    lru = hits(trace, Policy("planned-lru", PlannedAdmission({(16, 16): (12,)}), LRUEviction()), space)[0]
    assert oracle == 12 and lru == 0


def test_the_oracle_needs_the_trace_and_cannot_be_mixed():
    view = TurnView(0, 8, 9, 0, BLOCK)
    with pytest.raises(LifecycleError, match="whole trace"):
        OracleAdmission().save_steps(view)
    with pytest.raises(LifecycleError, match="whole trace"):
        OracleEviction().new_state(PROFILE)
    with pytest.raises(InvalidArgumentError, match="overridden"):
        resolve_policy("oracle", eviction="lru")
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        Foresight((), BLOCK)
    foresight = Foresight(tuple(tiny_trace()), BLOCK)
    foresight.advance(1)
    with pytest.raises(InvalidArgumentError, match="not after"):
        foresight.advance(1)


def test_records_carry_their_fraction_of_the_oracle_at_the_same_setting():
    from hybridcache.replay.report import add_oracle_fractions

    def record(policy, rate, cache_bytes):
        return {"trace": "t", "model": "m", "policy": policy, "token_hit_rate": rate, "cache_bytes": cache_bytes,
                "kv_bytes": 1, "state_bytes": 1, "replicas": 1, "routing": "round-robin", "shared_tier": "none"}

    records = [record("auto", 0.2, 10), record("oracle", 0.4, 10), record("auto", 0.3, 20)]
    add_oracle_fractions(records)
    assert [r["oracle_fraction"] for r in records] == [0.5, 1.0, None]


def test_cli_synthesizes_splits_and_reports_the_oracle_fraction(tmp_path, capsys):
    import json

    from hybridcache.cli import main

    out = tmp_path / "r.json"
    rc = main(["replay", "--synthesize", "conversation", "--sessions", "6", "--seed", "2", "--split", "second",
               "--policy", "reference,oracle", "--cache-bytes", "1GB", "--json", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert [r["policy"] for r in records] == ["reference", "oracle"]
    assert records[0]["trace"] == "synthesized:conversation:seed2:sessions6 (second half)"
    assert records[1]["oracle_fraction"] == 1.0
    assert records[0]["oracle_fraction"] == records[0]["token_hit_rate"] / records[1]["token_hit_rate"]
    assert f"{100 * records[0]['oracle_fraction']:.1f}%" in capsys.readouterr().out  # the "of oracle" column
    assert main(["replay", "--cache-bytes", "1GB"]) == 2  # neither a trace nor --synthesize
    assert main(["replay", "t.jsonl", "--synthesize", "conversation", "--cache-bytes", "1GB"]) == 2
    with pytest.raises(SystemExit):  # argparse refuses an unknown shape
        main(["replay", "--synthesize", "chat", "--cache-bytes", "1GB"])
