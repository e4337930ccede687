import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError
from hybridcache.workloads import SHAPES, generate, half, infinite_cache_bound, read_trace, synthesize, write_trace
from hybridcache.workloads.generator import BLOCK, MAX_MESSAGE


def _synthesized(tmp_path, kind, sessions=12, seed=3):
    lines = generate(kind, seed, sessions)
    path = tmp_path / f"{kind}.jsonl"
    write_trace(lines, path)
    return lines, synthesize(read_trace(str(path)))


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_every_turn_after_the_first_continues_its_session_exactly(tmp_path, kind):
    lines, out = _synthesized(tmp_path, kind)
    firsts = [i for i, r in enumerate(out.requests) if r.continues is None]
    assert len(firsts) == 12  # one per session: the readers' rule recovers every other turn
    assert out.stats.continuations == len(lines) - 12 and out.stats.conflicting_blocks == 0
    for request in out.requests:
        if request.continues is not None:
            parent = out.requests[request.continues]
            assert np.array_equal(request.prompt[: parent.tokens.size], parent.tokens)
            assert 0 < request.prompt_length - parent.tokens.size <= MAX_MESSAGE
    times = [line["timestamp"] for line in lines]
    assert times == sorted(times)
    assert all(line["input_length"] <= SHAPES[kind].context for line in lines)


def test_system_prompts_are_shared_across_sessions_and_shapes_differ(tmp_path):
    _, chat = _synthesized(tmp_path, "conversation", sessions=30)
    _, agent = _synthesized(tmp_path, "tool-agent", sessions=30)
    for out, shape in ((chat, SHAPES["conversation"]), (agent, SHAPES["tool-agent"])):
        firsts = [r for r in out.requests if r.continues is None]
        bound = infinite_cache_bound(firsts).shared_tokens
        assert np.count_nonzero(bound) >= len(firsts) // 2  # most first turns reuse a system prompt
        assert bound.max() >= shape.system_blocks[0] * BLOCK
    assert np.mean([r.prompt_length for r in agent.requests if r.continues is None]) > 2 * np.mean(
        [r.prompt_length for r in chat.requests if r.continues is None])  # long shared tool descriptions
    turns = lambda out: len(out.requests) / sum(r.continues is None for r in out.requests)  # noqa: E731
    assert turns(agent) > turns(chat)


def test_generation_is_seeded_and_validated():
    assert generate("conversation", 5, 4) == generate("conversation", 5, 4)
    assert generate("conversation", 5, 4) != generate("conversation", 6, 4)
    for kind, seed, sessions in (("chat", 0, 4), ("conversation", -1, 4), ("conversation", 0, 0),
                                 ("conversation", True, 4), ("conversation", 0, 2.5)):
        with pytest.raises(InvalidArgumentError):
            generate(kind, seed, sessions)
    with pytest.raises(InvalidArgumentError, match="cannot write"):
        write_trace([], "/nonexistent-dir/t.jsonl")


def test_halves_renumber_and_cut_continuations_into_the_other_half(tmp_path):
    _, out = _synthesized(tmp_path, "conversation")
    requests = out.requests
    first, second = half(requests, "first"), half(requests, "second")
    assert len(first) + len(second) == len(requests)
    assert [r.index for r in second] == list(range(len(second)))
    middle = len(requests) // 2
    for r, original in zip(second, requests[middle:]):
        assert np.array_equal(r.tokens, original.tokens)
        expected = None if original.continues is None or original.continues < middle else original.continues - middle
        assert r.continues == expected
    with pytest.raises(InvalidArgumentError):
        half(requests, "third")
