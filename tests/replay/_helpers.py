"""Requests, budgets and the debug observers shared by the replay tests."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np

from hybridcache.profiles import load_profile
from hybridcache.protocol import CacheProtocol
from hybridcache.replay import Budget, RunConfig, replay, resolve_policy
from hybridcache.replay.adapter import CacheAdapter
from hybridcache.workloads import infinite_cache_bound
from hybridcache.workloads.records import TraceRequest, frozen_array

PROFILE = load_profile("marconi-7b")


def request(index: int, prompt, output_length: int = 1, seed: int = 0) -> TraceRequest:
    output = np.random.default_rng(1000 + index + seed).integers(0, 50_000, size=output_length)
    tokens = frozen_array(np.concatenate([np.asarray(prompt), output]), np.int32)
    return TraceRequest(index, float(index), len(prompt), tokens)


def budget(kv_blocks: int, slots: int, block_size: int = 32) -> Budget:
    return Budget(kv_blocks * PROFILE.kv_bytes_per_token * block_size, slots * PROFILE.state_bytes)


class TurnLog:
    """What a replay's turns did beyond what ``Turn`` says, watched from outside: per sequence
    id, the checkpoint its admission restored (producer sequence id, step), the adapter that
    served it, and the prefix it adopted from a tier (step, tokens). Patches ``CacheProtocol.admit``,
    ``CacheAdapter.start_turn`` and ``CacheAdapter.adopt`` inside ``watching()`` only; a turn
    is served whole before the next starts and its tier restore is adopted just before it
    starts, so an adoption belongs to the turn started next."""

    def __init__(self) -> None:
        self.restored: dict[int, tuple[int, int]] = {}
        self.served_by: dict[int, CacheAdapter] = {}
        self.adopted: dict[int, tuple[int, np.ndarray]] = {}
        self._pending: tuple[int, np.ndarray] | None = None

    @contextlib.contextmanager
    def watching(self):
        admit, start_turn, adopt = CacheProtocol.admit, CacheAdapter.start_turn, CacheAdapter.adopt
        log = self

        def watched_admit(cache, seq, *args, **kwargs):
            admitted = admit(cache, seq, *args, **kwargs)
            if admitted.admitted and admitted.restore is not None:
                log.restored[seq.seq_id] = (admitted.restore.producer_id, admitted.restore.step)
            return admitted

        def watched_start_turn(adapter, prompt):
            turn = start_turn(adapter, prompt)
            log.served_by[turn.seq_id] = adapter
            if log._pending is not None:
                log.adopted[turn.seq_id], log._pending = log._pending, None
            return turn

        def watched_adopt(adapter, prefix, restore):
            adoption = adopt(adapter, prefix, restore)
            if adoption.gained:
                log._pending = (restore.step, np.array(prefix.tokens))
            return adoption

        with mock.patch.object(CacheProtocol, "admit", watched_admit), \
                mock.patch.object(CacheAdapter, "start_turn", watched_start_turn), \
                mock.patch.object(CacheAdapter, "adopt", watched_adopt):
            yield self


def config(policy, space: Budget, block_size: int = 32, **options) -> RunConfig:
    return RunConfig(PROFILE, policy, space, block_size=block_size, **options)


class ExactnessCheck:
    """Debug observer: invariants after every request, every hit compared token by token with
    the request that produced the restored checkpoint, and never above the infinite-cache bound."""

    def __init__(self, requests, log: TurnLog) -> None:
        self.bound = infinite_cache_bound(requests)
        self.log = log
        self.produced: dict[int, np.ndarray] = {}
        self.hits: list[int] = []

    def __call__(self, adapters, request, turn) -> None:
        for adapter in adapters:
            adapter.check_invariants()
        self.produced[turn.seq_id] = request.tokens
        hit = turn.hit_tokens
        self.hits.append(hit)
        if hit:
            producer, step = self.log.restored[turn.seq_id]
            assert step == hit
            source = self.produced[producer]
            assert np.array_equal(source[:hit], request.tokens[:hit])
            assert hit < request.prompt_length
        assert hit <= self.bound.shared_tokens[request.index]


def checked_replay(requests, run_config: RunConfig, observer=None, **hooks):
    """``replay`` with an ``ExactnessCheck`` after every request (then ``observer``, if given)."""
    with TurnLog().watching() as log:
        check = ExactnessCheck(requests, log)

        def observe(adapters, request, turn):
            check(adapters, request, turn)
            if observer is not None:
                observer(adapters, request, turn)

        return replay(requests, run_config, observer=observe, **hooks), check.hits


def run(requests, policy: str, space: Budget, block_size: int = 32, **options):
    prefill_chunk = options.pop("prefill_chunk", 2048)
    run_config = config(resolve_policy(policy, **options), space, block_size, prefill_chunk=prefill_chunk)
    return checked_replay(requests, run_config)


class FleetCheck:
    """Debug observer of a multi-replica run: every replica's invariants after every request
    (so scoring and adoption leak nothing), which replica served each request, its hit, and
    every tier restore compared token by token with the request and with an earlier producer."""

    def __init__(self, requests, log: TurnLog) -> None:
        self.bound = infinite_cache_bound(requests)
        self.log = log
        self.served: list[tuple[int, int]] = []  # (replica, hit tokens) per request
        self.adopted: list[int] = []
        self.earlier: list[np.ndarray] = []

    def __call__(self, adapters, request, turn) -> None:
        for adapter in adapters:
            adapter.check_invariants()
        step, tokens = self.log.adopted.get(turn.seq_id, (0, None))
        if step:
            assert np.array_equal(tokens, request.tokens[:step])
            assert any(len(earlier) >= step and np.array_equal(earlier[:step], tokens) for earlier in self.earlier)
            assert turn.hit_tokens >= step
        assert turn.hit_tokens < request.prompt_length
        assert turn.hit_tokens <= self.bound.shared_tokens[request.index]
        self.served.append((adapters.index(self.log.served_by[turn.seq_id]), turn.hit_tokens))
        self.adopted.append(step)
        self.earlier.append(request.tokens)


def run_fleet(requests, policy: str, space: Budget, replicas: int, routing: str = "round-robin", tiers=None, **options):
    with TurnLog().watching() as log:
        check = FleetCheck(requests, log)
        run_config = config(resolve_policy(policy), space, replicas=replicas, routing=routing, tiers=tiers, **options)
        return replay(requests, run_config, observer=check), check
