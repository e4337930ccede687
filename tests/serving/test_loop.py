"""The engine loop in process: updates, stop token ids, cancellation and shutdown leave no
engine request behind (``check_invariants`` after each), and overload is refused at once."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.errors import InvalidTokenError, RequestFailedError, RequestTooLargeError, ServerOverloadedError
from hybridcache.serving.loop import EngineLoop, Update

TIMEOUT_S = 120  # a deadline against hangs, not a speed assertion


def new_loop(capacity: int = 8, observe=lambda _: None, **overrides) -> tuple[EngineLoop, Engine]:
    config = dict(block_size=8, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4, max_running=4, max_batch_tokens=64,
                  prefill_chunk=32)
    engine = Engine(EngineConfig(**{**config, **overrides}))
    loop = EngineLoop(engine, capacity=capacity, observe=observe)
    loop.start()
    return loop, engine


def updates_of(loop: EngineLoop, request: Request, stop_ids=frozenset()) -> tuple[int, queue.Queue]:
    inbox: queue.Queue[Update] = queue.Queue()
    return loop.submit(request, frozenset(stop_ids), inbox.put), inbox


def until_final(inbox: queue.Queue) -> list[Update]:
    seen = [inbox.get(timeout=TIMEOUT_S)]
    while not seen[-1].final:
        seen.append(inbox.get(timeout=TIMEOUT_S))
    return seen


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def test_updates_grow_to_the_engines_own_result():
    loop, engine = new_loop()
    request = Request(prompt(30, 1), max_new_tokens=6)
    _, inbox = updates_of(loop, request)
    seen = until_final(inbox)
    loop.stop(drain_s=5)
    assert seen[0].tokens == [] and not seen[0].final  # accepted
    assert [len(u.tokens) for u in seen] == sorted(len(u.tokens) for u in seen)
    assert seen[-1].finish_reason == "length"
    alone = Engine(engine.config).generate([request])[0]
    assert seen[-1].tokens == alone.tokens
    loop.check_invariants()


def test_a_stop_token_ends_the_request_before_it_and_frees_it():
    loop, engine = new_loop()
    request = Request(prompt(30, 2), max_new_tokens=12)
    full = Engine(engine.config).generate([request])[0].tokens
    _, inbox = updates_of(loop, request, {full[3]})
    last = until_final(inbox)[-1]
    loop.stop(drain_s=5)
    assert last.finish_reason == "stop" and last.tokens == full[: full.index(full[3])]
    loop.check_invariants()
    assert not engine.scheduler.has_work


def test_refusals_arrive_as_errors_and_overload_is_refused_at_submit():
    loop, engine = new_loop(capacity=2)
    _, bad = updates_of(loop, Request([1, 2, 600]))
    assert isinstance(until_final(bad)[-1].error, InvalidTokenError)
    _, big = updates_of(loop, Request(prompt(600, 3), max_new_tokens=1))
    assert isinstance(until_final(big)[-1].error, RequestTooLargeError)
    held = [updates_of(loop, Request(prompt(20, 4 + i), max_new_tokens=400)) for i in range(2)]
    with pytest.raises(ServerOverloadedError):
        updates_of(loop, Request(prompt(20, 9)))
    for ticket, _ in held:
        loop.cancel(ticket)
    loop.stop(drain_s=5)
    loop.check_invariants()
    assert not engine.scheduler.has_work


def test_shutdown_cancels_what_did_not_finish_and_refuses_new_requests():
    loop, engine = new_loop()
    _, inbox = updates_of(loop, Request(prompt(20, 5), max_new_tokens=400))
    assert inbox.get(timeout=TIMEOUT_S).tokens == []
    loop.stop(drain_s=0)
    assert isinstance(until_final(inbox)[-1].error, ServerOverloadedError)
    with pytest.raises(ServerOverloadedError):
        updates_of(loop, Request(prompt(20, 6)))
    loop.check_invariants()
    assert not engine.scheduler.has_work


def test_a_bug_outside_the_forward_fails_every_request_and_refuses_new_ones():
    """An observer that raises (a bug on the loop thread, not in a forward): the request in
    flight gets an error instead of waiting for a thread that is gone, new requests are refused
    and ``failure`` says why."""
    calls = []

    def observe(_: Engine) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("a metric the snapshot expected")

    loop, engine = new_loop(observe=observe)
    _, inbox = updates_of(loop, Request(prompt(20, 7), max_new_tokens=400))
    error = until_final(inbox)[-1].error
    assert isinstance(error, RequestFailedError) and isinstance(error.__cause__, KeyError)
    assert loop.failure is error
    with pytest.raises(ServerOverloadedError):
        updates_of(loop, Request(prompt(20, 8)))
    loop.stop(drain_s=0)
    loop.check_invariants()
    assert not engine.scheduler.has_work
