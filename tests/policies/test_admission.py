"""Admission policies: where each one checkpoints, as pure plans and through the replay."""

import numpy as np
import pytest

from hybridcache.errors import HybridCacheError, InvalidArgumentError
from hybridcache.policies import (
    BRANCH,
    PROMPT_END,
    SPECULATIVE,
    TURN_END,
    AutoAdmission,
    IntervalAdmission,
    MarconiAdmission,
    ReferenceAdmission,
    TurnView,
    first_end,
    kind_of_step,
    resolve_policy,
)
from tests.replay._helpers import budget, request, run

rng = np.random.default_rng(13)


def tokens(count):
    return rng.integers(0, 50_000, size=count)


def view(start=0, prompt=100, final=120, branch=0, block=8):
    return TurnView(start, prompt, final, branch, block)


def test_reference_plan_is_todays_rule():
    assert ReferenceAdmission(32).save_steps(view(start=8)) == (40, 72, 100, 120)


def test_interval_plan_is_aligned():
    assert IntervalAdmission(32).save_steps(view(start=40)) == (64, 96)


def test_marconi_plans_branch_point_and_turn_end():
    assert MarconiAdmission().save_steps(view(branch=48)) == (48, 120)
    # a checkpoint sits at the branch point already (the match resumed there): only the turn end
    assert MarconiAdmission().save_steps(view(start=48, branch=48)) == (120,)
    assert MarconiAdmission().save_steps(view(branch=0)) == (120,)


def test_auto_plan_adds_grid_last_boundary_and_prompt_end():
    plan = AutoAdmission(32).save_steps(view(branch=40))
    assert plan == (32, 40, 64, 96, 100, 120)
    assert kind_of_step(view(branch=40), 40) == BRANCH
    assert kind_of_step(view(branch=40), 32) == SPECULATIVE
    assert kind_of_step(view(branch=40), 100) == PROMPT_END
    assert kind_of_step(view(branch=40), 120) == TURN_END
    # an identical prompt sent again can resume at the last block boundary before its end
    assert 96 in AutoAdmission(1024).save_steps(view())
    assert first_end(plan, view()) == 32


def test_auto_fits_its_grid_to_scarce_state_slots():
    auto = AutoAdmission(2048)
    assert auto.fitted(100_000, 100) is auto  # 1,000 KV tokens per slot: the grid stays
    sparse = auto.fitted(4_000_000, 250)  # 16,000 per slot: spaced out, speculative extras off
    assert sparse.grid == 16_384 and sparse.sparse
    assert sparse.save_steps(view(prompt=40_000, final=40_010, branch=0)) == (16_384, 32_768, 40_010)


def test_turn_view_is_validated():
    with pytest.raises(InvalidArgumentError):
        TurnView(10, 5, 5, 0, 8)
    with pytest.raises(HybridCacheError):
        TurnView(0, -1, 5, 0, 8)


def test_policy_names():
    auto = resolve_policy("auto")
    assert auto.admission == AutoAdmission() and auto.eviction.name == "auto"
    assert resolve_policy("marconi").eviction.alpha == 1.0
    assert resolve_policy("marconi", eviction="marconi:0.5").eviction.alpha == 0.5
    assert resolve_policy("auto:512").admission.grid == 512
    with pytest.raises(InvalidArgumentError, match="alpha"):
        resolve_policy("marconi", eviction="marconi:x")
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        resolve_policy("lfu")


# --- through the replay (every hit checked exact, invariants after every request) -----------


def test_marconi_branch_point_gets_a_checkpoint():
    shared = tokens(4 * 32)
    first = request(0, np.concatenate([shared, tokens(70)]))
    second = request(1, np.concatenate([shared, tokens(50)]))  # reveals the branch at 128
    third = request(2, np.concatenate([shared, tokens(40)]))  # resumes there
    _, hits = run([first, second, third], "marconi", budget(64, 16))
    assert hits == [0, 0, 128]


def test_marconi_turn_end_gets_a_checkpoint():
    first = request(0, tokens(100), output_length=9)
    follow_up = request(1, np.concatenate([first.tokens, tokens(30)]))
    _, hits = run([first, follow_up], "marconi", budget(64, 16))
    assert hits == [0, 100 + 9 - 1]  # the state after the last decoded token (its forward never runs)


def test_auto_first_reuse_of_a_shared_prefix_hits():
    shared = tokens(6 * 32 + 5)
    first = request(0, np.concatenate([shared, tokens(70)]))
    second = request(1, np.concatenate([shared, tokens(50)]))
    _, hits = run([first, second], "auto:64", budget(64, 64))
    assert hits == [0, 192]  # the grid checkpoint at 192; Marconi finds none on a first reuse
    _, marconi_hits = run([first, second], "marconi", budget(64, 16))
    assert marconi_hits == [0, 0]


def test_auto_identical_prompt_hits_up_to_its_last_block_boundary():
    prompt = tokens(3 * 32 + 1)
    _, hits = run([request(0, prompt), request(1, prompt)], "auto", budget(64, 16))
    assert hits == [0, 96]  # = prompt length - 1 here
