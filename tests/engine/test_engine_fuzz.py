"""Any combination of request fields, however wrong their types or extreme their values (a
temperature down to the smallest float), is served or refused with a ``HybridCacheError``;
the engine's invariants hold after each and it serves on."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, TinyHybridConfig
from hybridcache.errors import HybridCacheError

VOCAB = TinyHybridConfig().vocab_size
ENGINE = Engine(EngineConfig(block_size=8, num_kv_blocks=64, num_state_slots=8, checkpoint_budget=4,
                             max_batch_tokens=64, max_running=4, prefill_chunk=32))
ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4),
                st.binary(max_size=4), st.lists(st.integers(-5, 600), max_size=40), st.just(np.array([1.5])),
                st.just(np.zeros((2, 2), dtype=int)))
MULTIMODAL = st.lists(st.tuples(st.integers(-2, 30), st.integers(-2, 40), st.binary(max_size=3)), max_size=2)


def _mostly(plausible):
    """``plausible`` nine times in ten, else anything: most requests are served, so the draw
    and the paths behind validation are reached too."""
    return st.integers(0, 9).flatmap(lambda pick: ANY if pick == 0 else plausible)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_mostly(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)), max_new=_mostly(st.integers(1, 6)),
       temperature=_mostly(st.sampled_from([5e-324, 1e-300, 1e-12]) | st.floats(0, 100)),
       top_p=_mostly(st.floats(1e-300, 1)), seed=_mostly(st.none() | st.integers(0, 2**64)),
       adapter=_mostly(st.none()), salt=_mostly(st.none() | st.text(max_size=5)), spans=_mostly(MULTIMODAL))
def test_any_request_is_served_or_refused_and_the_engine_stays_whole(prompt, max_new, temperature, top_p, seed, adapter,
                                                                     salt, spans):
    try:
        multimodal = spans
        if isinstance(spans, list):  # a span drawn as (start, end, data) is built; anything else handed in as it is
            multimodal = tuple(MultimodalInput(*span) if isinstance(span, tuple) else span for span in spans)
        request = Request(prompt, max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=seed,
                          adapter=adapter, cache_salt=salt, multimodal=multimodal)
        result = ENGINE.generate([request])[0]
        assert result.error is None or isinstance(result.error, HybridCacheError)
    except HybridCacheError:
        pass
    ENGINE.check_invariants()
