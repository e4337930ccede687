"""The online learner of ``auto`` (``policies.reuse``): what counts as a reuse, and decisions
that flip when the traffic does."""

from types import SimpleNamespace

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.policies import BRANCH, SPECULATIVE, TURN_END, resolve_policy
from hybridcache.policies.reuse import ReuseLearner, save_class
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from hybridcache.prefix_cache.identity import BlockKeyer
from hybridcache.sequence import Sequence
from tests.replay._helpers import budget, checked_replay, config, request

BLOCK = 4


def _record(record_id, step, tokens, hits=0, producer=0):
    start = step - step % BLOCK
    return SimpleNamespace(
        record_id=record_id, step=step, hits=hits, producer_id=producer, state=CheckpointState.PUBLISHED,
        tail_tokens=np.asarray(tokens[start:step], np.int32),
    )


def _keys(keyer):
    return keyer.keys_anew


def _anchor_key(keyer, tokens, step):
    return int(keyer.extend(Sequence(tokens[: step - step % BLOCK]))[step // BLOCK - 1])


def test_a_request_reaching_an_evicted_state_counts_as_its_reuse():
    keyer = BlockKeyer.deterministic(BLOCK)
    learner = ReuseLearner(BLOCK, window=3)
    history = np.arange(100, 130, dtype=np.int32)
    turn_end = _record(1, 18, history)  # mid-block: its tail tokens are compared too
    learner.saved(turn_end, TURN_END, _anchor_key(keyer, history, 18))
    learner.check_invariants()
    turn_end.state = CheckpointState.RELEASED  # evicted: now a ghost
    follow_up = Sequence(np.concatenate([history[:18], [7, 7, 7, 7, 7]]))
    learner.admitted(follow_up, None, _keys(keyer))  # resumed from nothing, would have resumed at 18
    learner.check_invariants()
    assert learner.ghost_hits == 1 and learner.reused[save_class(TURN_END, 0), 0, 0] == 1
    other = Sequence(np.concatenate([history[:16], [9, 9, 9, 9, 9, 9]]))  # differs in the tail
    learner.admitted(other, None, _keys(keyer))
    assert learner.ghost_hits == 1


def test_a_hit_raises_its_class_and_the_window_forgets_what_never_came_back():
    keyer = BlockKeyer.deterministic(BLOCK)
    learner = ReuseLearner(BLOCK, window=2)
    tokens = np.arange(40, dtype=np.int32)
    branch = _record(1, 8, tokens)
    learner.saved(branch, BRANCH, _anchor_key(keyer, tokens, 8))
    branch.hits = 1  # the trie counts the hit before the learner hears of it
    learner.admitted(Sequence(tokens[:20]), branch, _keys(keyer))
    assert learner.reused[save_class(BRANCH, 0), 0, 0] == 1
    assert learner.odds(branch) == pytest.approx(2 / 3)  # its class (one hit so far) has no evidence: its kind's
    for number in (2, 3):
        learner.saved(_record(number, 12, tokens), TURN_END, _anchor_key(keyer, tokens, 12))
        learner.check_invariants()
    assert learner.unused[save_class(BRANCH, 0), 0, 1] == 1  # pushed out of the window unused
    assert learner.expected_interval(branch) == learner.window  # unknown to the learner now
    with pytest.raises(InvalidArgumentError):
        learner.saved(_record(4, 12, tokens), "whim", 0)
    with pytest.raises(InvalidArgumentError):
        ReuseLearner(BLOCK, window=0)


def test_lineage_counts_turns_of_one_conversation_served_in_a_row():
    keyer = BlockKeyer.deterministic(BLOCK)
    learner = ReuseLearner(BLOCK, window=8)
    tokens = np.arange(60, dtype=np.int32)
    first = _record(1, 10, tokens)
    learner.saved(first, TURN_END, _anchor_key(keyer, tokens, 10))
    first.hits = 1
    seq = Sequence(tokens[:30])
    learner.admitted(seq, first, _keys(keyer))
    second = _record(2, 29, tokens, producer=seq.seq_id)
    learner.saved(second, TURN_END, _anchor_key(keyer, tokens, 29))
    assert learner._entries[2].lineage == 1
    learner.check_invariants()


def _fresh(rng, length):
    return rng.integers(0, 50_000, length)


def _phase_shared_prompts(rng, first_index, count):
    """One-off questions over three system prompts: only branch points pay."""
    prompts = [_fresh(rng, 6 * 32) for _ in range(3)]
    return [request(first_index + i, np.concatenate([prompts[i % 3], _fresh(rng, 40)])) for i in range(count)]


def _phase_conversations(rng, first_index, sessions, turns):
    """Interleaved conversations with nothing shared between them: only turn ends pay."""
    requests, last = [], [None] * sessions
    for turn in range(turns):
        for session in range(sessions):
            history = _fresh(rng, 3 * 32 + 5) if last[session] is None else last[session].tokens
            made = request(first_index + len(requests), np.concatenate([history, _fresh(rng, 20)]), output_length=6)
            requests.append(made)
            last[session] = made
    return requests


class _LearnerWatch:
    """After every request (and the exactness check): every learner's invariants; keeps the
    first replica's learner for the assertions."""

    learner = None

    def __call__(self, adapters, request_, turn) -> None:
        for adapter in adapters:
            adapter.eviction.learner.check_invariants()
        self.learner = adapters[0].eviction.learner


@pytest.mark.parametrize("shared_first", [True, False])
def test_auto_follows_the_traffic_from_branch_points_to_turn_ends_and_back(shared_first):
    # four state slots: three system prompts' branch points fit, or four conversations' turn
    # ends, not both. Whichever phase comes first (and fills the learner with its evidence),
    # the states the other phase needs take the slots once ghost hits show their kind pays:
    # each phase's late requests hit as deep as the phase allows
    rng = np.random.default_rng(24)
    if shared_first:
        shared = _phase_shared_prompts(rng, 0, 45)
        talks = _phase_conversations(rng, len(shared), sessions=4, turns=28)
        requests = shared + talks
    else:
        talks = _phase_conversations(rng, 0, sessions=4, turns=28)
        shared = _phase_shared_prompts(rng, len(talks), 45)
        requests = talks + shared
    check = _LearnerWatch()
    _, hits = checked_replay(requests, config(resolve_policy("auto"), budget(400, 4)), observer=check)
    assert all(hits[r.index] >= 6 * 32 for r in shared[-6:])  # every late question resumes past its system prompt
    for r in talks[-8:]:  # the last two rounds of the conversations
        before = requests[r.index - 4]  # the same session's previous turn
        assert hits[r.index] == before.prompt_length + before.output_length - 1  # resumed at its turn end
    assert check.learner.reused[save_class(TURN_END, 0)].sum() > 0 and check.learner.reused[save_class(BRANCH, 0)].sum() > 0


def _phase_documents(rng, first_index, count, shared):
    """Long prompts past the first grid points of ``auto`` (every 2,048 tokens). ``shared``:
    questions over the first part of one of three documents, cut at a different point each
    time (the grid states are what the first reuse of each cut resumes from); otherwise
    one-off documents (a grid state dies unused)."""
    documents = [_fresh(rng, 4_600) for _ in range(3)]
    requests = []
    for i in range(count):
        body = documents[i % 3][: int(rng.integers(4_150, 4_600))] if shared else _fresh(rng, 4_400)
        requests.append(request(first_index + i, np.concatenate([body, _fresh(rng, 30)])))
    return requests


class _AdmissionWatch(_LearnerWatch):
    """After every request, the learner's invariants and whether it would admit a grid save
    at 2,048 and at 4,096 tokens (a fresh sequence: lineage 0)."""

    def __init__(self) -> None:
        self.admits = []

    def __call__(self, adapters, request_, turn) -> None:
        super().__call__(adapters, request_, turn)
        probe = Sequence(np.zeros(8, np.int32))
        self.admits.append(tuple(self.learner.admits(probe, step, SPECULATIVE) for step in (2048, 4096)))


@pytest.mark.parametrize("shared_first", [True, False])
def test_auto_admission_learns_whether_its_grid_pays(shared_first):
    # nine state slots, 560 KV blocks (the grid is not spaced out by ``fitted``), every
    # slot contended. One-off long prompts leave every grid state unused, so the learner
    # declines grid saves; questions over shared documents then reach the ghosts of the
    # declined grid points and the one that pays (4,096: the deepest below every cut) is
    # admitted again. In the other order both grid levels are admitted while the questions
    # run, and the one-off prompts that follow make the learner decline 2,048 (4,096 keeps
    # the evidence the questions gave it: counts are not faded)
    rng = np.random.default_rng(7)
    first = _phase_documents(rng, 0, 36, shared_first)
    second = _phase_documents(rng, 36, 60, not shared_first)
    check = _AdmissionWatch()
    _, hits = checked_replay(first + second, config(resolve_policy("auto"), budget(560, 9)), observer=check)
    at_switch, at_end = check.admits[len(first) - 1], check.admits[-1]
    if shared_first:
        assert check.admits[len(first) // 2] == (True, True) and at_end == (False, True)
    else:
        assert at_switch == (False, False) and at_end == (False, True)
        assert sum(hits[r.index] >= 4096 for r in second[-12:]) >= 8  # two in three late questions resume past it
    assert check.learner.declined_by_class[save_class(SPECULATIVE, 2048 if shared_first else 4096)] > 0


def test_a_declined_save_is_a_ghost_a_later_prompt_can_reach():
    keyer = BlockKeyer.deterministic(BLOCK)
    learner = ReuseLearner(BLOCK, window=4)
    document = np.arange(200, 240, dtype=np.int32)
    first = Sequence(document[:30])
    learner.decline(first, 18, SPECULATIVE, _anchor_key(keyer, document, 18))
    learner.check_invariants()
    assert learner.declined_by_class[save_class(SPECULATIVE, 18)] == 1
    learner.admitted(Sequence(np.concatenate([document[:20], [5, 5, 5]])), None, _keys(keyer))
    learner.check_invariants()
    assert learner.ghost_hits == 1 and learner.reused[save_class(SPECULATIVE, 18), 0, 0] == 1
    assert learner.left_evicted == 0  # a declined save says nothing about pressure
    assert learner.admits(first, 4096, BRANCH)  # only speculative saves are ever declined
    with pytest.raises(InvalidArgumentError):
        learner.decline(first, 31, SPECULATIVE, 0)
    with pytest.raises(InvalidArgumentError):
        learner.admits(first, 8, "whim")


def test_a_save_declined_twice_is_one_ghost_until_it_leaves_the_window():
    keyer = BlockKeyer.deterministic(BLOCK)
    learner = ReuseLearner(BLOCK, window=2)
    document = np.arange(300, 340, dtype=np.int32)
    seq = Sequence(document[:30])
    for _ in range(3):  # a preempted sequence re-plans the same grid step
        learner.decline(seq, 18, SPECULATIVE, _anchor_key(keyer, document, 18))
        learner.check_invariants()
    assert learner.declined == 1 and learner.declined_by_class[save_class(SPECULATIVE, 18)] == 1
    for step in (8, 12):  # two more positions push the first ghost out of the window
        learner.decline(Sequence(document[:20]), step, SPECULATIVE, 0)
        learner.check_invariants()
    learner.decline(seq, 18, SPECULATIVE, _anchor_key(keyer, document, 18))
    learner.check_invariants()
    assert learner.declined == 4  # out of the window, it is a new candidate again
    with pytest.raises(InvalidTypeError):
        learner.admits(seq, 8.5, SPECULATIVE)
