"""CacheProtocol.take_changes: what an observer learns adds up to exactly the matchable trie
nodes and the published checkpoints, step after step, under eviction and failed forwards."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request
from hybridcache.prefix_cache.checkpoint_record import CheckpointState
from tests.engine.faults import arm


def _matchable(trie) -> set[tuple[int, int]]:
    nodes = trie.nodes
    return {
        (slot, int(nodes.generation[slot]))
        for slot in nodes.attached_slots().tolist()
        if not nodes.is_root[slot] and not nodes.pending[slot]
    }


def _published(trie) -> set[int]:
    return {r.record_id for r in trie.checkpoints.live_records() if r.state is CheckpointState.PUBLISHED}


@pytest.mark.parametrize("async_depth", [0, 1])
def test_changes_add_up_to_the_matchable_nodes_and_published_checkpoints(async_depth):
    engine = Engine(EngineConfig(block_size=8, num_kv_blocks=40, num_state_slots=8, checkpoint_budget=4,
                                 max_batch_tokens=48, max_running=3, prefill_chunk=24, async_depth=async_depth))
    cache, trie = engine.prefix_cache, engine.trie
    cache.record_changes()
    rng = np.random.default_rng(11)
    vocab = engine.model.layout.vocab_size
    systems = [rng.integers(0, vocab, 17) for _ in range(3)]
    nodes, checkpoints = set(), set()
    for step in range(90):
        if step % 3 == 0:
            prompt = np.concatenate([systems[int(rng.integers(3))], rng.integers(0, vocab, int(rng.integers(1, 30)))])
            engine.add_request(Request(prompt, max_new_tokens=int(rng.integers(1, 6)), cache_salt=["a", None][step % 2]))
        if step % 17 == 5:
            arm(engine, "after_restore")
        engine.step()
        changes = cache.take_changes()
        nodes -= set(changes.removed)
        nodes |= {block.node for block in changes.stored}
        checkpoints -= set(changes.released)
        checkpoints |= {record.checkpoint_id for record in changes.published}
        assert nodes == _matchable(trie)
        assert checkpoints == _published(trie)
        for block in changes.stored:
            assert block.parent is None or block.parent in nodes
            assert len(block.token_ids) == 8
        engine.check_invariants()
    assert engine.stats()["evicted_blocks"] > 0 and engine.stats()["failed_forwards"] > 0
