"""``bench router``: the router's scoring cost per request against large replica indexes.

Builds ``replicas`` indexes of about ``blocks`` announced KV blocks each (conversations of
``prompt_tokens`` tokens on a few shared system prompts, a checkpoint every few blocks and at
each conversation's end), then times, per request, what the router does before it forwards:
hash the prompt (``RequestKey``), compute every replica's depths and choose. The requests are
follow-ups of indexed conversations (deep matches) and new ones (shallow), alternately.
"""

from __future__ import annotations

import time

import numpy as np

from hybridcache.events.hashing import chain_hashes
from hybridcache.events.schema import BlockStored, CheckpointStored
from hybridcache.router.policy import choose
from hybridcache.router.replica_index import ReplicaIndex
from hybridcache.router.request_key import RequestKey

_SYSTEM_PROMPTS = 8
_CHECKPOINT_EVERY = 8  # blocks


def _conversation(rng, systems, prompt_tokens: int) -> list[int]:
    system = systems[int(rng.integers(len(systems)))]
    return system + rng.integers(0, 150_000, prompt_tokens - len(system)).tolist()


def _index(rng, systems, blocks: int, prompt_tokens: int, block_size: int) -> tuple[ReplicaIndex, list[list[int]]]:
    index = ReplicaIndex(block_size)
    conversations = []
    next_id = 0
    while len(index.blocks) < blocks:
        tokens = _conversation(rng, systems, prompt_tokens)
        chain = chain_hashes(tokens, block_size)
        index.apply_kv([BlockStored(chain, None, tokens[: len(chain) * block_size], block_size, None, "GPU", None)])
        stored = []
        for depth in range(_CHECKPOINT_EVERY, len(chain) + 1, _CHECKPOINT_EVERY):
            stored.append(CheckpointStored(next_id, depth * block_size, chain[depth - 1], [], block_size, "GPU", None))
            next_id += 1
        index.apply_state(stored)
        conversations.append(tokens)
    return index, conversations


def run_router_bench(replicas: int = 4, blocks: int = 100_000, requests: int = 2_000, prompt_tokens: int = 2_048,
                     block_size: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 150_000, prompt_tokens // 4).tolist() for _ in range(_SYSTEM_PROMPTS)]
    built = [_index(rng, systems, blocks, prompt_tokens, block_size) for _ in range(replicas)]
    indexes = [index for index, _ in built]
    timings = []
    for number in range(requests):
        if number % 2:
            source = built[number % replicas][1]
            tokens = source[int(rng.integers(len(source)))] + rng.integers(0, 150_000, 64).tolist()
        else:
            tokens = _conversation(rng, systems, prompt_tokens)
        began = time.perf_counter()
        key = RequestKey(tokens)
        depths = [index.depths(key) for index in indexes]
        choose("restorable", len(tokens), depths, [0.0] * replicas, number)
        timings.append(time.perf_counter() - began)
    ms = np.array(timings) * 1000
    return {
        "replicas": replicas,
        "blocks_per_replica": min(len(index.blocks) for index in indexes),
        "checkpoints_per_replica": min(len(index.checkpoints) for index in indexes),
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }
