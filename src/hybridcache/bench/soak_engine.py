"""``soak-engine``: the reference engine serves a long mixed workload on tiny pools.

Requests arrive in waves: new conversations on a few shared system prompts, follow-up turns of
earlier conversations (their history plus the reply plus new tokens), adapters, tenant salts,
images and routed-expert requests. The pools are small, so eviction, preemption and failed
admissions happen constantly. Invariants are checked every few steps; at the end the cache is
cleared and every pool must be full. A sample of requests is served again by an engine without
prefix caching to show the outputs are exact.
"""

from __future__ import annotations

import resource
import time
from typing import Callable

import numpy as np

from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, TinyHybridConfig


def soak_config(prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(
        block_size=8,
        num_kv_blocks=80,
        num_state_slots=16,
        checkpoint_budget=6,
        prefix_caching=prefix_caching,
        max_batch_tokens=96,
        max_running=8,
        prefill_chunk=24,
        decode_checkpoint_interval=16,
        async_depth=1,
        model=TinyHybridConfig(),
        adapters=("a", "b"),
    )


class _Workload:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.systems = [self.tokens(int(self.rng.integers(8, 40))) for _ in range(4)]
        self.conversations: list[tuple[Request, list[int]]] = []

    def tokens(self, count: int) -> list[int]:
        return self.rng.integers(0, 512, count).tolist()

    def request(self) -> Request:
        rng = self.rng
        if self.conversations and rng.random() < 0.5:
            previous, reply = self.conversations[int(rng.integers(0, len(self.conversations)))]
            prompt = [*previous.prompt, *reply, *self.tokens(int(rng.integers(1, 12)))]
            if len(prompt) > 160:  # a conversation that grew too long starts over
                return self.request_new()
            return Request(prompt=prompt, max_new_tokens=int(rng.integers(1, 12)), adapter=previous.adapter,
                           cache_salt=previous.cache_salt, return_routed_experts=previous.return_routed_experts)
        return self.request_new()

    def request_new(self) -> Request:
        rng = self.rng
        prompt = [*self.systems[int(rng.integers(0, len(self.systems)))], *self.tokens(int(rng.integers(1, 24)))]
        multimodal = ()
        if rng.random() < 0.15 and len(prompt) > 10:
            start = int(rng.integers(0, len(prompt) - 6))
            multimodal = (MultimodalInput(start, start + 4, bytes([int(rng.integers(0, 4))])),)
        return Request(
            prompt=prompt,
            max_new_tokens=int(rng.integers(1, 12)),
            adapter=[None, None, "a", "b"][int(rng.integers(0, 4))],
            cache_salt="tenant" if rng.random() < 0.1 else None,
            multimodal=multimodal,
            return_routed_experts=bool(rng.random() < 0.1),
        )

    def remember(self, request: Request, tokens: list[int]) -> None:
        self.conversations.append((request, tokens))
        if len(self.conversations) > 64:
            self.conversations.pop(0)


def run_soak_engine(requests: int, seed: int = 0, check_every: int = 25, exact_sample_every: int = 50,
                    progress: Callable[[], None] = lambda: None) -> dict:
    engine = Engine(soak_config())
    reference = Engine(soak_config(prefix_caching=False))
    workload = _Workload(seed)
    started = time.perf_counter()
    served = steps = checks = exact = sampled = 0
    wave = 24
    while served < requests:
        batch = [workload.request() for _ in range(min(wave, requests - served))]
        ids = {engine.add_request(r): r for r in batch}
        done = 0
        while done < len(ids):
            for result in engine.step():
                request = ids[result.request_id]
                workload.remember(request, result.tokens)
                done += 1
                served += 1
                progress()
                if served % exact_sample_every == 0:
                    (expected,) = reference.generate([request])
                    sampled += 1
                    exact += expected.tokens == result.tokens
            steps += 1
            if steps % check_every == 0:
                engine.check_invariants()
                checks += 1
    engine.check_invariants()
    stats = engine.stats()
    engine.clear_cache()
    engine.check_invariants()
    leaked = (engine.config.num_kv_blocks - engine.pool.num_free) + (engine.config.num_state_slots - 1 - engine.states.num_free)
    return {
        "scenario": "soak-engine",
        "impl": "hybridcache",
        "requests": served,
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "hit_rate": stats["hit_rate"],
        "query_tokens": stats["query_tokens"],
        "hit_tokens": stats["hit_tokens"],
        "misses": stats["misses"],
        "evicted_blocks": stats["evicted_blocks"],
        "evicted_checkpoints": stats["evicted_checkpoints"],
        "preemptions": stats["preemptions"],
        "invariant_checks": checks,
        "invariant_violations": 0,
        "leaked_pool_entries": leaked,
        "exact_samples": f"{exact}/{sampled}",
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
