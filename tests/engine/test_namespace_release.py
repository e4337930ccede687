"""A namespace root released under a save that anchors on it: with one KV block per request's
worth of room and every checkpoint slot taken, the slot eviction a first-block save makes can
free the empty root of the saving request's own namespace. The save is then refused, never
anchored on the freed slot (whose remembered path would later pass for the node that reuses
it: "kept path drifted"). Found by a hostile schedule: two adapters, a salt, ``clear_cache``
every fourth step; the invariants hold after every step and the outputs equal an uncached
engine's."""

from __future__ import annotations

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig

FIRST = [3, 26, 54, 40, 10, 38, 19, 35, 13, 17, 39, 35, 45, 54, 8, 61, 35, 4, 19, 8, 14, 17, 45, 28, 58, 59, 14, 49, 60,
         32, 58]
SECOND = [33, 17, 24, 58, 17, 42, 45, 60, 57, 6, 59, 22, 25, 5, 42, 27, 35, 17, 19, 52, 5, 35]
CONFIG = dict(block_size=8, num_kv_blocks=5, num_state_slots=13, checkpoint_budget=9, max_batch_tokens=5, max_running=1,
              prefill_chunk=17, async_depth=0, checkpoint_policy="marconi", adapters=("a", "b"),
              model=TinyHybridConfig(vocab_size=64))
REQUESTS = (dict(prompt=FIRST, max_new_tokens=5, adapter="a"), dict(prompt=SECOND, max_new_tokens=16, adapter="b", cache_salt="s"))
MAX_STEPS = 400  # the schedule ends in about 60 steps; a bound, not a measurement


def test_a_save_on_a_root_its_own_eviction_released_is_refused_and_the_paths_stay_true():
    engine = Engine(EngineConfig(**CONFIG))
    ids = [engine.add_request(Request(**fields)) for fields in REQUESTS]
    done = {}
    for step in range(1, MAX_STEPS + 1):
        done.update((result.request_id, result) for result in engine.step())
        if step % 4 == 0:
            engine.clear_cache()
        engine.check_invariants()
        if len(done) == len(ids):
            break
    assert len(done) == len(ids)
    uncached = Engine(EngineConfig(**{**CONFIG, "prefix_caching": False, "num_kv_blocks": 64}))
    expected = uncached.generate([Request(**fields) for fields in REQUESTS])
    assert [done[i].tokens for i in ids] == [result.tokens for result in expected]
    follow_up = SECOND + done[ids[1]].tokens
    for length in (33, 34, 36, 37):  # prefixes of the second conversation, through the same namespace
        request = dict(prompt=follow_up[:length], max_new_tokens=2, adapter="b", cache_salt="s")
        assert engine.generate([Request(**request)])[0].tokens == uncached.generate([Request(**request)])[0].tokens
        engine.check_invariants()
