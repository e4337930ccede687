"""Admission policies: where each one checkpoints, as pure plans and through the replay."""

import json
import math

import numpy as np
import pytest

from hybridcache.cli import main
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
from hybridcache.profiles import load_profile
from hybridcache.replay import split_budget
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


# --- the grid against the weight of a state ------------------------------------------------


@pytest.mark.parametrize(("state_tokens", "grid"), [
    (409.0, 2048),  # Marconi 7B: a state weighs a fifth of a grid step, the grid stays
    (1608.0, 4096),  # Qwen3-Next: twice 1,608 rounded up to a multiple of 2,048
    (4719.0, 10_240),  # granite-4.0-h-small
    (6234.0, 14_336),  # Nemotron-H 8B
    (0.0, 2048),  # unknown: as it is
])
def test_auto_grid_is_at_least_twice_what_a_state_weighs(state_tokens, grid):
    weighed = AutoAdmission().for_state_weight(state_tokens)
    assert weighed.grid == grid and not weighed.sparse
    assert weighed.for_state_weight(state_tokens) == weighed  # applied once
    # the grid's states over a prefix of one grid step cost at most half its KV
    assert state_tokens <= weighed.grid / 2


def test_the_weight_leaves_free_kv_explicit_grids_and_other_admissions_as_they_are():
    kv_free = AutoAdmission().for_state_weight(math.inf)  # a pure recurrent model: KV costs nothing
    assert kv_free.grid is None and kv_free.sparse and kv_free.kv_free and kv_free.name == "auto"
    assert kv_free.save_steps(view(prompt=10_000, final=10_020, branch=4_000)) == (4_000, 10_020)
    assert kv_free.fitted(10**9, 4) is kv_free  # a free pool says nothing about scarce slots
    assert kv_free.checkpoint_spacing(8_000.0) == 4_000.0
    assert AutoAdmission().for_state_weight(1e308).kv_free  # twice it is beyond a float
    explicit = resolve_policy("auto:512").admission.for_state_weight(math.inf)
    assert explicit.fitted(10**9, 4) == explicit and explicit.grid == 512 and not explicit.sparse
    assert AutoAdmission().fitted(10**6, 10).weighed is False  # a fitted grid is given by the pools
    explicit = resolve_policy("auto:2048").admission
    assert explicit.for_state_weight(4719.0) is explicit  # auto:G is taken as given
    for admission in (ReferenceAdmission(), IntervalAdmission(32), MarconiAdmission()):
        assert admission.for_state_weight(4719.0) is admission


@pytest.mark.parametrize("bad", [-1.0, math.nan, "4719", True, None, 10**400])
def test_a_bad_state_weight_is_refused(bad):
    for admission in (AutoAdmission(), ReferenceAdmission(), MarconiAdmission()):
        with pytest.raises(InvalidArgumentError, match="state_tokens"):
            admission.for_state_weight(bad)


def test_the_split_of_one_budget_follows_the_weighed_grid():
    granite = load_profile("granite-4.0-h-small")
    mean_prompt = 8_000.0
    weighed = split_budget(10**10, granite, resolve_policy("auto"), mean_prompt)
    dense = split_budget(10**10, granite, resolve_policy("auto:2048"), mean_prompt)
    spacing = AutoAdmission(10_240).checkpoint_spacing(mean_prompt)
    share = granite.state_bytes / (granite.state_bytes + granite.kv_bytes_per_token * spacing)
    assert weighed.state_bytes == int(10**10 * share)
    assert weighed.kv_bytes > dense.kv_bytes  # fewer states per prompt: more of the budget to KV


def test_heavy_states_on_the_weighed_grid_beat_the_dense_grid_and_marconi(tmp_path):
    """granite-4.0-h-small (a state weighs 4,719 KV tokens), 60 conversations, one budget: the
    2,048 grid spends the budget on states, the weighed grid keeps the KV their hits need."""
    out = tmp_path / "runs.json"
    assert main(["replay", "--synthesize", "conversation", "--seed", "1", "--sessions", "60", "--limit", "400",
                 "--model", "granite-4.0-h-small", "--policy", "auto,auto:2048,marconi", "--cache-bytes", "2.5GB",
                 "--json", str(out)]) == 0
    rates = {run["policy"]: run["token_hit_rate"] for run in json.loads(out.read_text())}
    assert rates["auto"] > rates["marconi"] > rates["auto:2048"]
