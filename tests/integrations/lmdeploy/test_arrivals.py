"""Shadows are built when a sequence starts waiting (arrival, a new turn), outside the
scheduler step, and a prompt lmdeploy's sequence changed after that is still matched by what
it holds at the step, exactly as lmdeploy's own trie matches it."""

import numpy as np
import torch
from lmdeploy.pytorch.messages import UpdateTokenMode

from tests.integrations.lmdeploy.twins import BLOCK, Twins


def _shadow_tokens(world, name: str) -> list[int] | None:
    shadow = world.scheduler.block_trie._shadows.existing(world.seqs[name])
    return None if shadow is None else shadow.seq.tokens.tolist()


def _serve(twins: Twins, name: str, session: int, tokens: list[int]) -> dict:
    twins.step(lambda w: w.add(name, session, tokens))
    observed = twins.step(lambda w: w.schedule())
    twins.step(lambda w: w.forward())
    return observed


def test_an_arriving_prompt_is_shadowed_before_the_step():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    prompt = [1] * (2 * BLOCK) + [3]
    twins.step(lambda w: w.add("a", 0, prompt))
    assert _shadow_tokens(twins.subject, "a") == prompt  # no trie call has seen it yet
    observed = twins.step(lambda w: w.schedule())
    assert observed["running"] == ["a"]


def test_a_new_turn_extends_the_shadow_when_the_stopped_sequence_waits_again():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    first = [1] * (2 * BLOCK) + [3]
    _serve(twins, "a", 0, first)
    turn = [4] * BLOCK

    def new_turn(world):  # what lmdeploy's engine does with a later message of a session
        seq = world.seqs["a"]
        seq.update_token_ids(torch.tensor(turn), mode=UpdateTokenMode.INPUTS)
        seq.state.activate()

    twins.step(new_turn)
    assert _shadow_tokens(twins.subject, "a") == first + [7] + turn  # the forward sampled 7
    # both resume at turn 1's end (the step is what this test is about); lmdeploy's trie also
    # restores the checkpoint at that very step and counts one hit token, hybridcache does not
    reference, subject = twins.step_both(lambda w: w.schedule())
    for observed in (reference, subject):
        assert observed["running"] == ["a"] and observed["seqs"]["a"]["step"] == len(first)


def test_a_prompt_rewritten_after_arrival_is_matched_as_it_is_at_the_step():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    prompt = [1] * (2 * BLOCK) + [3]
    _serve(twins, "cached", 0, prompt)
    twins.step(lambda w: w.add("b", 1, prompt))
    assert _shadow_tokens(twins.subject, "b") == prompt

    def rewrite(world):  # a new history object whose first token differs: no prefix is cached
        seq = world.seqs["b"]
        seq.history_cache = seq.history_cache.clone()
        seq.history_cache[0] = 9

    twins.step(rewrite)
    observed = twins.step(lambda w: w.schedule())
    assert observed["running"] == ["b"] and observed["seqs"]["b"]["step"] == 0 and observed["hits"] == 0
    assert _shadow_tokens(twins.subject, "b") == [9] + prompt[1:]


def test_an_unchanged_prompt_hits_what_it_arrived_with():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    prompt = [1] * (2 * BLOCK) + [3]
    _serve(twins, "cached", 0, prompt)
    observed = _serve(twins, "b", 1, prompt + [5])
    assert observed["seqs"]["b"]["step"] > 0 and observed["hits"] == observed["seqs"]["b"]["step"]
    assert np.array_equal(_shadow_tokens(twins.subject, "b")[: len(prompt)], prompt)


def test_a_removed_sequence_drops_its_shadow_at_once():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    _serve(twins, "a", 0, [1] * (2 * BLOCK) + [3])
    seq = twins.seq("a")
    after = twins.step(lambda w: w.finish("a"))
    assert twins.subject.scheduler.block_trie._shadows.existing(seq) is None
    assert after["checkpoint_states"] == 1  # the published checkpoint stays cached


def test_a_sequence_removed_under_a_producer_pin_keeps_its_shadow_until_the_unpin():
    twins = Twins(ssm=True, num_gpu_blocks=32)
    twins.step(lambda w: w.add("a", 0, [1] * (2 * BLOCK) + [3]))
    twins.step(lambda w: w.schedule())
    removed = {}

    def publish_then_remove(world):  # the forward's save is published, then the request ends
        seq = world.seqs["a"]
        checkpoints = world.scheduler.block_trie.state_checkpoints
        assert checkpoints.reserve_save(seq) >= 0
        checkpoints.publish_saves([seq], pin_saves=True)
        checkpoints.unpin_restores([seq])
        removed[world] = seq
        world.finish("a")

    twins.step(publish_then_remove)
    assert twins.subject.scheduler.block_trie._shadows.existing(removed[twins.subject]) is not None
    after = twins.step(lambda w: w.scheduler.block_trie.state_checkpoints.unpin_saves([removed[w]]))
    assert after["checkpoint_states"] == 1
    assert removed[twins.subject].prefix_cache.producer_save_pin.slot == -1
