"""Engine replicas in separate processes sharing one real store (Redis, Mooncake Store).

Each test starts two to four engine processes (:mod:`tiers.engine_worker`) through a replica
hub, serves deterministic requests and compares every output, token for token, with the same
engine with prefix caching off; the tier counters say where each restore came from and why a
step was refused. With ``tier_chunk_size`` 32 and ``prefill_chunk`` 32 every prefill forward
ends on a chunk boundary, so a replica serving a 200-token prompt publishes checkpoints at 32,
64, ..., 192 with the KV chunks below each; a request of that prompt plus a 40-token suffix
asks for steps up to 224, which nobody published.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import replace

import numpy as np
import pytest
import redis

from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.requests import Request
from hybridcache.tiers import local_servers as servers

from .conftest import redis_url
from .engine_worker import CHECKPOINT_EXIT_CODE, ServeReport
from .faults import Fault, FaultKind, Operation
from .replicas import Replica, ReplicaCluster, WorkerDied, uncached_outputs

CHUNK = 32
CONFIG = EngineConfig(block_size=16, tier_chunk_size=CHUNK, prefill_chunk=CHUNK, num_kv_blocks=128)
PROMPT_TOKENS = 200
DEEPEST = 192  # the deepest step a PROMPT_TOKENS prompt publishes
SUFFIX_TOKENS = 40
NEW_TOKENS = 4
VOCAB = CONFIG.model.vocab_size
PROCESS_EXIT_DEADLINE_S = 10.0


def prompts(seed: int, count: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(count)]


def extended(prefix: list[int], seed: int = 0) -> list[int]:
    return prefix + np.random.default_rng(10_000 + seed).integers(0, VOCAB, SUFFIX_TOKENS).tolist()


def request(tokens: list[int], **namespace) -> Request:
    return Request(tokens, max_new_tokens=NEW_TOKENS, **namespace)


def serve_exact(replica: Replica, *requests: Request) -> ServeReport:
    """Serve ``requests`` on ``replica``; every output must equal the uncached engine's."""
    report = replica.serve(*requests)
    assert report.outputs == uncached_outputs(replica.config, list(requests))
    return report


def assert_fetched_nothing(report: ServeReport) -> None:
    """No restore, and no object read at all: every key the request asked for was absent."""
    assert report.remote_hit_tokens == 0 and report.engine.get("restores", 0) == 0
    assert report.store.get("shared_bytes_read", 0) == 0
    assert set(report.misses) <= {"missing"}


# --- 1. cross-replica hit --------------------------------------------------------------------


def test_a_replica_restores_what_another_published(replica_cluster):
    a, b = replica_cluster.spawn("a", CONFIG), replica_cluster.spawn("b", CONFIG)
    (prefix,) = prompts(1, 1)
    served = serve_exact(a, request(prefix))
    assert served.remote_hit_tokens == 0 and served.engine["published_steps"] == DEEPEST // CHUNK

    hit = serve_exact(b, request(extended(prefix)))
    assert hit.remote_hit_tokens == DEEPEST and hit.cached_tokens == (DEEPEST,)
    assert hit.engine["restores"] == 1
    assert hit.engine["restored_bytes"]["shared"] == hit.store["shared_bytes_read"] > 0
    assert (hit.store["read_count_ck"], hit.store["read_count_kv"]) == (1, DEEPEST // CHUNK)
    assert hit.misses == {"missing": 1}  # step 224 only: A never reached it
    a.check_invariants()
    b.check_invariants()


# --- 2. publish last -------------------------------------------------------------------------


def test_a_writer_killed_between_its_chunk_puts_and_its_checkpoint_put_is_never_hit(redis_replica_cluster):
    cluster = redis_replica_cluster
    a = cluster.spawn("a", CONFIG, checkpoint_puts_before_exit=2)  # dies putting the checkpoint at 96
    b = cluster.spawn("b", CONFIG)
    (prefix,) = prompts(2, 1)
    keys = b.keys(request(prefix))
    with pytest.raises(WorkerDied) as died:
        a.serve(request(prefix))
    assert died.value.returncode == CHECKPOINT_EXIT_CODE
    # Chunk [64, 96) was stored for the checkpoint at 96, which never was.
    assert cluster.exists([*keys.chunks[:3], keys.checkpoints[32], keys.checkpoints[64]]) == [True] * 5
    assert cluster.exists([keys.checkpoints[96], keys.chunks[3]]) == [False, False]

    hit = serve_exact(b, request(extended(prefix)))
    assert hit.remote_hit_tokens == 64  # the earlier checkpoint serves; 96 and beyond never do
    assert hit.misses == {"missing": 5}  # 224, 192, 160, 128 and 96
    b.check_invariants()


# --- 3. eviction splits ----------------------------------------------------------------------


def test_one_part_of_an_entry_evicted_on_its_own_falls_back_to_a_complete_step(redis_replica_cluster):
    cluster = redis_replica_cluster
    a, b = cluster.spawn("a", CONFIG), cluster.spawn("b", CONFIG)
    state_gone, chunk_gone = prompts(3, 2)
    serve_exact(a, request(state_gone), request(chunk_gone))
    state_keys, chunk_keys = b.keys(request(state_gone)), b.keys(request(chunk_gone))
    # Each eviction strikes when B asks the store what it holds, as a store evicting between
    # A's publish and B's lookup would.
    b.add_fault(Fault.evict([state_keys.checkpoints[DEEPEST]], Operation.EXISTS))
    b.add_fault(Fault.evict([chunk_keys.chunks[3]], Operation.EXISTS))

    hit = serve_exact(b, request(extended(state_gone)))
    assert hit.remote_hit_tokens == 160  # its chunks are all there, the state at 192 is not
    assert hit.misses == {"missing": 2}
    assert (hit.store["read_count_ck"], hit.store["read_count_kv"]) == (1, 5)
    assert cluster.exists(list(state_keys.chunks)) == [True] * 6  # the chunks never left

    hit = serve_exact(b, request(extended(chunk_gone)))
    assert hit.remote_hit_tokens == 96  # the states at 128..192 are there, their chunk [96, 128) is not
    assert hit.misses == {"missing": 4}
    assert cluster.exists([chunk_keys.checkpoints[s] for s in (128, 160, DEEPEST)]) == [True] * 3
    b.check_invariants()


def test_real_memory_eviction_falls_back_or_recomputes_never_wrong(tmp_path):
    server = servers.start_redis(tmp_path, maxmemory="2mb")  # far less than what A publishes
    cluster = None
    try:
        cluster = ReplicaCluster(tmp_path, "redis", redis_url(server))
        a, b = cluster.spawn("a", CONFIG), cluster.spawn("b", CONFIG)
        prefixes = prompts(4, 6)
        for prefix in prefixes:
            serve_exact(a, request(prefix))
        assert evicted_keys(server) > 0
        for prefix in prefixes:
            whole = whole_steps(cluster, b.keys(request(prefix)))
            hit = serve_exact(b, request(extended(prefix)))
            assert hit.remote_hit_tokens <= max(whole, default=0)  # only a step the store still holds whole serves
        a.check_invariants()
        b.check_invariants()
    finally:
        if cluster is not None:
            cluster.close()
        server.stop()


def whole_steps(cluster: ReplicaCluster, keys) -> list[int]:
    """The steps whose checkpoint and every chunk below it the shared store holds now."""
    return [
        step for step, checkpoint in keys.checkpoints.items()
        if all(cluster.exists([checkpoint, *keys.chunks[: step // CHUNK]]))
    ]


# --- 4. corruption ---------------------------------------------------------------------------


def test_a_flipped_payload_byte_is_a_checksum_miss(replica_cluster):
    a, b = replica_cluster.spawn("a", CONFIG), replica_cluster.spawn("b", CONFIG)
    bad_state, bad_chunk = prompts(5, 2)
    serve_exact(a, request(bad_state), request(bad_chunk))
    state_keys, chunk_keys = b.keys(request(bad_state)), b.keys(request(bad_chunk))
    b.add_fault(Fault.corrupt([state_keys.checkpoints[DEEPEST]], offset=-1))  # the last byte is payload
    b.add_fault(Fault.corrupt([chunk_keys.chunks[2]], offset=-1))

    hit = serve_exact(b, request(extended(bad_state)))
    assert hit.remote_hit_tokens == 160
    assert hit.misses == {"missing": 1, "checksum_mismatch": 1}

    hit = serve_exact(b, request(extended(bad_chunk)))
    assert hit.remote_hit_tokens == 64  # chunk [64, 96) is refused, so every step above 64 is too
    assert hit.misses == {"missing": 4, "checksum_mismatch": 1}
    b.check_invariants()


# --- 5. poison -------------------------------------------------------------------------------


def twin(tokens: list[int], position: int) -> list[int]:
    """``tokens`` with one token changed: a prefix that shares everything before ``position``."""
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % VOCAB
    return changed


def test_another_prefix_object_under_the_requested_key_is_a_token_mismatch(redis_replica_cluster):
    cluster = redis_replica_cluster
    a, b = cluster.spawn("a", CONFIG), cluster.spawn("b", CONFIG)
    state_victim, chunk_victim = prompts(6, 2)
    state_twin, chunk_twin = twin(state_victim, 190), twin(chunk_victim, 150)
    serve_exact(a, *(request(tokens) for tokens in (state_victim, state_twin, chunk_victim, chunk_twin)))
    victim, impostor = b.keys(request(state_victim)), b.keys(request(state_twin))
    b.add_fault(Fault.substitute(victim.checkpoints[DEEPEST], impostor.checkpoints[DEEPEST]))
    victim, impostor = b.keys(request(chunk_victim)), b.keys(request(chunk_twin))
    b.add_fault(Fault.substitute(victim.chunks[4], impostor.chunks[4]))

    hit = serve_exact(b, request(extended(state_victim)))
    assert hit.remote_hit_tokens == 160
    assert hit.misses == {"missing": 1, "token_mismatch": 1}

    hit = serve_exact(b, request(extended(chunk_victim)))
    assert hit.remote_hit_tokens == 128  # chunk [128, 160) is the twin's
    assert hit.misses == {"missing": 2, "token_mismatch": 1}
    b.check_invariants()


# --- 6. isolation ----------------------------------------------------------------------------


def test_another_salt_adapter_model_or_chunk_size_never_hits(redis_replica_cluster):
    cluster = redis_replica_cluster
    config = replace(CONFIG, adapters=("a", "b"))
    publisher, same = cluster.spawn("publisher", config), cluster.spawn("same", config)
    other_weights = cluster.spawn("other-weights", replace(config, seed=1))
    other_chunks = cluster.spawn("other-chunks", replace(config, tier_chunk_size=2 * CHUNK))
    (prefix,) = prompts(7, 1)
    longer = extended(prefix)
    serve_exact(publisher, request(prefix), request(prefix, cache_salt="tenant-1"), request(prefix, adapter="a"))

    for namespace in ({"cache_salt": "tenant-2"}, {"adapter": "b"}):
        assert_fetched_nothing(serve_exact(same, request(longer, **namespace)))
    assert_fetched_nothing(serve_exact(other_weights, request(longer)))
    assert_fetched_nothing(serve_exact(other_chunks, request(longer)))
    # The same namespaces do hit: the misses above are the namespace's doing.
    for namespace in ({"cache_salt": "tenant-1"}, {"adapter": "a"}, {}):
        assert serve_exact(same, request(longer, **namespace)).remote_hit_tokens == DEEPEST
    for replica in (publisher, same, other_weights, other_chunks):
        replica.check_invariants()


# --- 7. restart ------------------------------------------------------------------------------


def test_restarted_engines_hit_the_shared_tier_unless_their_weights_changed(replica_cluster):
    cluster = replica_cluster
    a, b = cluster.spawn("a", CONFIG), cluster.spawn("b", CONFIG)
    first, second = prompts(8, 2)
    serve_exact(a, request(first))
    serve_exact(b, request(second))
    assert a.stop() == 0  # a clean shutdown
    assert b.kill() != 0  # a crash

    restarted = cluster.spawn("restarted", CONFIG)
    reweighted = cluster.spawn("reweighted", replace(CONFIG, seed=1))
    assert serve_exact(restarted, request(extended(first))).remote_hit_tokens == DEEPEST
    assert serve_exact(restarted, request(extended(second))).remote_hit_tokens == DEEPEST
    assert_fetched_nothing(serve_exact(reweighted, request(extended(first))))
    for replica in (restarted, reweighted):
        replica.check_invariants()


# --- 8. mixed sources ------------------------------------------------------------------------


def test_local_kv_below_a_remote_checkpoint_restores_exactly(redis_replica_cluster):
    cluster = redis_replica_cluster
    publisher, mixed = cluster.spawn("publisher", CONFIG), cluster.spawn("mixed", CONFIG)
    whole, gap = prompts(9, 2)
    # The mixed replica serves the first 70 tokens itself: its device then holds a checkpoint
    # at 70 and whole KV blocks of [0, 64), the rest comes from the publisher's [0, 192).
    local = 70
    for prefix in (whole, gap):
        serve_exact(mixed, request(prefix[:local]))
        serve_exact(publisher, request(prefix))

    keys = mixed.keys(request(whole))
    cluster.remove(list(keys.chunks[:2]))  # [0, 64): only the mixed replica's device holds it now
    hit = serve_exact(mixed, request(extended(whole)))
    assert hit.remote_hit_tokens == DEEPEST - local and hit.cached_tokens == (DEEPEST,)
    assert hit.store["read_count_kv"] == 4  # chunks [64, 192) only
    assert hit.misses == {"missing": 1}

    keys = mixed.keys(request(gap))
    cluster.remove([keys.chunks[3]])  # [96, 128): every step above 96 lacks it
    hit = serve_exact(mixed, request(extended(gap)))
    assert hit.remote_hit_tokens == 96 - local
    assert hit.misses == {"missing": 4}
    mixed.check_invariants()
    publisher.check_invariants()


# --- 9. soak ---------------------------------------------------------------------------------

SOAK_ROUNDS = 20
KILL_EVERY = 8  # rounds between crashes


def soak_faults() -> tuple[Fault, ...]:
    """Every kind of store misbehaviour, each on a small share of the calls."""
    return (
        Fault(FaultKind.CORRUPT, Operation.GET, times=None, probability=0.05),
        Fault(FaultKind.DROP, Operation.PUT, times=None, probability=0.05),  # acknowledged, never visible
        Fault(FaultKind.EVICT, Operation.GET, times=None, probability=0.03),
        Fault(FaultKind.FAIL, Operation.EXISTS, times=None, probability=0.02),
    )


def test_soak_across_replicas_with_kills_evictions_and_faults(tmp_path):
    server = servers.start_redis(tmp_path, maxmemory="2mb")  # real evictions too
    cluster = None
    try:
        cluster = ReplicaCluster(tmp_path, "redis", redis_url(server))
        run_soak(cluster, np.random.default_rng(2024))
        assert evicted_keys(server) > 0
        pids = list(cluster.pids.values())
    finally:
        if cluster is not None:
            cluster.close()
        server.stop()
    deadline = time.monotonic() + PROCESS_EXIT_DEADLINE_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)], "an engine process outlived its cluster"


def run_soak(cluster: ReplicaCluster, rng: np.random.Generator) -> None:
    bases = [rng.integers(0, VOCAB, int(length)).tolist() for length in rng.integers(96, 225, 4)]
    salts = (None, "tenant")
    names = (f"r{number}" for number in itertools.count())

    def spawn(checkpoint_puts_before_exit: int | None = None) -> Replica:
        return cluster.spawn(
            next(names), CONFIG, faults=soak_faults(), fault_seed=int(rng.integers(1 << 30)),
            checkpoint_puts_before_exit=checkpoint_puts_before_exit, measured_cost_model=True,
        )

    replicas = [spawn() for _ in range(3)]
    hits = crashes = 0
    for round_index in range(SOAK_ROUNDS):
        if round_index % KILL_EVERY == KILL_EVERY - 1:  # a crash between requests, then one while publishing
            victim = int(rng.integers(len(replicas)))
            replicas[victim].kill()
            replicas[victim] = spawn(checkpoint_puts_before_exit=int(rng.integers(1, 4)))
            fresh = rng.integers(0, VOCAB, 224).tolist()  # unpublished: every step is a checkpoint put
            try:
                serve_exact(replicas[victim], request(fresh))
            except WorkerDied as died:
                assert died.returncode == CHECKPOINT_EXIT_CODE
                crashes += 1
                replicas[victim] = spawn()
        index = int(rng.integers(len(replicas)))
        base = bases[int(rng.integers(len(bases)))]
        suffix = rng.integers(0, VOCAB, int(rng.integers(8, 49))).tolist()
        tokens = base[: int(rng.integers(len(base) // 2, len(base) + 1))] + suffix
        report = serve_exact(replicas[index], request(tokens, cache_salt=salts[int(rng.integers(2))]))
        hits += report.remote_hit_tokens
        replicas[index].check_invariants()
    assert hits > 0 and crashes == SOAK_ROUNDS // KILL_EVERY
    for replica in replicas:
        replica.check_invariants()
        at_start, cleared = replica.pools_after_clearing()
        assert cleared == at_start, f"{replica.name} leaked pool entries"


def evicted_keys(server: servers.Server) -> int:
    """How many keys the Redis server evicted for memory since it started."""
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        return admin.info("stats")["evicted_keys"]
    finally:
        admin.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
