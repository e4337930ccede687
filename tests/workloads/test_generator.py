import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
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
    with pytest.raises(InvalidArgumentError, match="unknown trace shape"):
        generate(["conversation"])


@pytest.mark.parametrize("lines, path, error, message", [
    ([{"a": {1}}], "t.jsonl", InvalidArgumentError, "cannot be written as JSON"),
    ([{"a": float("nan")}], "t.jsonl", InvalidArgumentError, "cannot be written as JSON"),
    ([[1, 2]], "t.jsonl", InvalidTypeError, "every line must be a dict"),
    (5, "t.jsonl", InvalidTypeError, "lines must be an ordered sequence"),
    ([], None, InvalidTypeError, "path must be a str or a Path"),
    ([], "a\x00b.jsonl", InvalidArgumentError, "cannot write"),
])
def test_write_trace_refuses_what_it_cannot_write_and_writes_nothing(tmp_path, monkeypatch, lines, path, error, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=message):
        write_trace(lines, path)
    assert list(tmp_path.iterdir()) == []


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
    assert half(iter(requests), "second") == second
    with pytest.raises(InvalidTypeError, match="TraceRequest records"):
        half([1, 2], "first")
    with pytest.raises(InvalidTypeError, match="ordered sequence"):
        half(None, "first")


def _long_context(tmp_path, seed):
    """The first 1,000 requests of a ``long-context`` trace, as the issue-24 trace is measured."""
    path = tmp_path / f"long-{seed}.jsonl"
    write_trace(generate("long-context", seed, 900), path)
    return synthesize(read_trace(str(path), limit=1000))


@pytest.mark.parametrize("seed", [1, 3])
def test_long_context_matches_the_held_out_production_trace(tmp_path, seed):
    out = _long_context(tmp_path, seed)
    requests = out.requests
    assert len(requests) == 1000
    assert 12_700 <= np.mean([r.prompt_length for r in requests]) <= 14_700  # the trace: ~13,700
    assert 120 <= out.stats.continuations <= 150  # the trace: 144
    assert 0.22 <= infinite_cache_bound(requests).token_hit_rate <= 0.255  # the trace: 22.2 %


def test_long_context_continuations_resume_the_whole_previous_turn(tmp_path):
    requests = _long_context(tmp_path, 1).requests
    continuations = [r for r in requests if r.continues is not None]
    assert continuations
    for request in continuations:
        parent = requests[request.continues]
        assert parent.index < request.index
        assert np.array_equal(request.prompt[: parent.prompt_length], parent.prompt)  # its whole prompt
        assert np.array_equal(request.prompt[: parent.tokens.size], parent.tokens)  # and its answer


def test_long_context_is_deterministic_from_the_seed():
    assert generate("long-context", 7, 50) == generate("long-context", 7, 50)
    assert generate("long-context", 7, 50) != generate("long-context", 8, 50)
