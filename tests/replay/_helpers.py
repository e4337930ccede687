"""Requests, budgets and the debug observer shared by the replay tests."""

from __future__ import annotations

import numpy as np

from hybridcache.profiles import load_profile
from hybridcache.replay import Budget, replay, resolve_policy
from hybridcache.workloads import infinite_cache_bound
from hybridcache.workloads.records import TraceRequest, frozen_array

PROFILE = load_profile("marconi-7b")


def request(index: int, prompt, output_length: int = 1, seed: int = 0) -> TraceRequest:
    output = np.random.default_rng(1000 + index + seed).integers(0, 50_000, size=output_length)
    tokens = frozen_array(np.concatenate([np.asarray(prompt), output]), np.int32)
    return TraceRequest(index, float(index), len(prompt), tokens)


def budget(kv_blocks: int, slots: int, block_size: int = 32) -> Budget:
    return Budget(kv_blocks * PROFILE.kv_bytes_per_token * block_size, slots * PROFILE.state_bytes)


class ExactnessCheck:
    """Debug observer: invariants after every request, every hit compared token by token with
    the request that produced the restored checkpoint, and never above the infinite-cache bound."""

    def __init__(self, requests) -> None:
        self.bound = infinite_cache_bound(requests)
        self.produced: dict[int, np.ndarray] = {}
        self.hits: list[int] = []

    def __call__(self, adapters, request, turn) -> None:
        for adapter in adapters:
            adapter.check_invariants()
        self.produced[turn.seq_id] = request.tokens
        hit = turn.hit_tokens
        self.hits.append(hit)
        if hit:
            assert turn.restored_step == hit
            source = self.produced[turn.restored_from]
            assert np.array_equal(source[:hit], request.tokens[:hit])
            assert hit < request.prompt_length
        assert hit <= self.bound.shared_tokens[request.index]


def run(requests, policy: str, space: Budget, block_size: int = 32, **options):
    check = ExactnessCheck(requests)
    record = replay(requests, PROFILE, resolve_policy(policy, **options), space, block_size, observer=check)
    return record, check.hits


class FleetCheck:
    """Debug observer of a multi-replica run: every replica's invariants after every request
    (so scoring and adoption leak nothing), which replica served each request, its hit, and
    every tier restore compared token by token with the request and with an earlier producer."""

    def __init__(self, requests) -> None:
        self.bound = infinite_cache_bound(requests)
        self.served: list[tuple[int, int]] = []  # (replica, hit tokens) per request
        self.adopted: list[int] = []
        self.earlier: list[np.ndarray] = []

    def __call__(self, adapters, request, turn) -> None:
        for adapter in adapters:
            adapter.check_invariants()
        step = turn.adopted_step
        if step:
            assert np.array_equal(turn.adopted_tokens, request.tokens[:step])
            assert any(len(tokens) >= step and np.array_equal(tokens[:step], turn.adopted_tokens) for tokens in self.earlier)
            assert turn.hit_tokens >= step
        assert turn.hit_tokens < request.prompt_length
        assert turn.hit_tokens <= self.bound.shared_tokens[request.index]
        self.served.append((turn.replica, turn.hit_tokens))
        self.adopted.append(step)
        self.earlier.append(request.tokens)


def run_fleet(requests, policy: str, space: Budget, replicas: int, routing: str = "round-robin", tiers=None, **options):
    check = FleetCheck(requests)
    record = replay(requests, PROFILE, resolve_policy(policy), space, 32, observer=check,
                    replicas=replicas, routing=routing, tiers=tiers, **options)
    return record, check
