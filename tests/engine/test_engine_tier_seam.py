"""The engine/tier seam (issue 19): the tier side can only ever cost a miss or a failed publish,
counted by reason. A store that raises at any stage, with any error, a malformed object with a
valid header, a request with names longer than a header field, or a model that differs only in
its config never costs a request its exact output, strands it, or leaks a block or slot."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest

from hybridcache.engine import Engine, Request
from hybridcache.engine.requests import MultimodalInput
from hybridcache.errors import InvalidConfigError, StoreTimeoutError
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.backends.base import ObjectStore
from hybridcache.tiers.keys import KeyChain
from hybridcache.tiers.objects import encode_checkpoint, encode_kv_chunk
from hybridcache.tiers.tiered import TieredStore
from tests.engine.test_engine_tiers import CHUNK, MODEL, config, prompt, uncached

STAGES = ("exists", "get", "put_if_absent")
ERRORS = (StoreTimeoutError("paused"), RuntimeError("a backend bug"), struct.error("bad length"), KeyError("x"))


class RaisingStore(ObjectStore):
    """``inner``, except that every call of ``stage`` raises ``error``."""

    def __init__(self, inner: ObjectStore, stage: str, error: Exception) -> None:
        super().__init__()
        self.inner, self.stage, self.error = inner, stage, error

    def _call(self, stage: str, *args):
        if stage == self.stage:
            raise self.error
        return getattr(self.inner, stage)(*args)

    def _exists(self, keys, timeout):
        return self._call("exists", keys, timeout)

    def _put_if_absent(self, items, timeout):
        return self._call("put_if_absent", items, timeout)

    def _get(self, keys, timeout):
        return self._call("get", keys, timeout)

    def _remove(self, keys, timeout):
        return self.inner.remove(keys, timeout)

    def _close(self) -> None:
        self.inner.close()


def _published(base: list[int], **overrides) -> HostMemoryStore:
    shared = HostMemoryStore(1 << 26)
    Engine(config(**overrides), tiers=TieredStore(shared=shared)).generate([Request(base, max_new_tokens=2)])
    return shared


def _assert_nothing_held(engine: Engine) -> None:
    engine.check_invariants()
    engine.clear_cache()
    stats = engine.stats()
    assert stats["free_blocks"] == engine.config.num_kv_blocks
    assert stats["free_state_slots"] == engine.config.num_state_slots - 1


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_store_raising_at_any_stage_costs_only_misses_and_publishes(stage, error):
    base = prompt(100, 31)
    shared = RaisingStore(_published(base), stage, error)
    engine = Engine(config(), tiers=TieredStore(shared=shared))
    requests = [Request(base + prompt(9, 32), max_new_tokens=4), Request(prompt(70, 33), max_new_tokens=3)]
    results = engine.generate(requests)
    assert [r.tokens for r in results] == uncached(requests) and all(r.error is None for r in results)
    engine.add_request(Request(base + prompt(40, 34), max_new_tokens=2))
    stepped = []
    for _ in range(100):
        stepped += engine.step()
        engine.check_invariants()
        if stepped:
            break
    assert stepped and stepped[0].error is None
    counters = engine.stats()["tiers"]
    failed = sum(counters["publish_failed"].values()) + sum(counters["restore_failed"].values())
    store = counters["store"]
    by_store = sum(n for name, n in store["counters"].items() if "failed" in name) + sum(store["misses"].values())
    assert failed + by_store > 0  # counted, by reason
    _assert_nothing_held(engine)


def test_a_publish_that_raises_strands_no_request_of_its_batch():
    class Broken(TieredStore):
        def store_prefix(self, *args, **kwargs):
            raise IndexError("a bug in the write path")

    engine = Engine(config(async_depth=1), tiers=Broken(shared=HostMemoryStore(1 << 26)))
    requests = [Request(prompt(80, 35 + i), max_new_tokens=3) for i in range(3)]
    assert [r.tokens for r in engine.generate(requests)] == uncached(requests, async_depth=1)
    counters = engine.stats()["tiers"]
    assert list(counters["publish_failed"]) == ["IndexError"] and counters["publish_failed"]["IndexError"] >= 3
    _assert_nothing_held(engine)


# --- item 1: the namespace covers everything that changes the arithmetic -------------------------


@pytest.mark.parametrize(
    "model",
    [replace(MODEL, experts_per_token=1), replace(MODEL, adapter_rank=2)],
    ids=["experts_per_token", "adapter_rank"],
)
def test_a_model_differing_only_in_its_config_never_restores_anothers_state(model):
    base = prompt(100, 41)
    shared = HostMemoryStore(1 << 26)
    adapter = "lora-a"
    Engine(config(), tiers=TieredStore(shared=shared)).generate(
        [Request(base, max_new_tokens=2), Request(base, max_new_tokens=2, adapter=adapter)]
    )
    engine = Engine(config(model=model), tiers=TieredStore(shared=shared))
    follow = [Request(base + prompt(7, 42), max_new_tokens=4),
              Request(base + prompt(7, 42), max_new_tokens=4, adapter=adapter)]
    results = engine.generate(follow)
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 0
    assert [r.tokens for r in results] == uncached(follow, model=model)


def test_weights_identity_covers_the_config_seed_and_dtype():
    identities = {
        Engine(config(**change)).model.weights_identity()
        for change in ({}, {"seed": 1}, {"dtype": "float32"}, {"model": replace(MODEL, experts_per_token=1)},
                       {"model": replace(MODEL, adapter_rank=2)})
    }
    assert len(identities) == 5
    assert Engine(config()).model.weights_identity() == Engine(config()).model.weights_identity()


# --- item 2: names longer than a header field are served exactly ---------------------------------


LONG = "s" * 1500


@pytest.mark.parametrize(
    "field",
    [dict(cache_salt=LONG), dict(adapter=LONG), dict(cache_salt="~blake2b:" + "0" * 64)],
    ids=["long salt", "long adapter", "salt in digest form"],
)
def test_long_names_are_served_exactly_and_never_hurt_a_batch(field):
    base = prompt(100, 51)
    shared = HostMemoryStore(1 << 26)
    good, bad = Request(base, max_new_tokens=3), Request(base, max_new_tokens=3, **field)
    producer = Engine(config(), tiers=TieredStore(shared=shared))
    results = producer.generate([good, bad])
    assert [r.tokens for r in results] == uncached([good, bad]) and all(r.error is None for r in results)
    assert producer.stats()["tiers"]["publish_failed"] == {}
    consumer = Engine(config(), tiers=TieredStore(shared=shared))
    follow = Request(base + prompt(5, 52), max_new_tokens=3, **field)
    (result,) = consumer.generate([follow])
    assert result.tokens == uncached([follow])[0]
    assert consumer.stats()["tiers"]["remote_hit_tokens"] == 96  # restored from its own namespace
    other = {name: value[:-1] + "t" for name, value in field.items()}  # another long name, same 1024-byte head
    consumer.generate([Request(base + prompt(5, 52), max_new_tokens=3, **other)])
    assert consumer.stats()["tiers"]["remote_hit_tokens"] == 96
    _assert_nothing_held(consumer)


def test_a_modality_longer_than_a_header_field_is_served_exactly():
    base = prompt(100, 53)
    image = MultimodalInput(10, 20, b"pixels", modality="m" * 70_000)
    shared = HostMemoryStore(1 << 26)
    good, bad = Request(base, max_new_tokens=3), Request(base, max_new_tokens=3, multimodal=(image,))
    results = Engine(config(), tiers=TieredStore(shared=shared)).generate([good, bad])
    assert [r.tokens for r in results] == uncached([good, bad])
    consumer = Engine(config(), tiers=TieredStore(shared=shared))
    follow = Request(base + prompt(5, 54), max_new_tokens=3, multimodal=(image,))
    assert consumer.generate([follow])[0].tokens == uncached([follow])[0]
    assert consumer.stats()["tiers"]["remote_hit_tokens"] == 96


# --- item 3: a malformed object with a valid header is a counted miss -----------------------------


def _replace_objects(shared: HostMemoryStore, engine: Engine, base: list[int], kv=None, state=None) -> None:
    """Re-encode every chunk (``kv(arrays)``) or checkpoint (``state(arrays)``) of ``base``'s
    published steps, with valid headers and checksums."""
    chain = KeyChain(engine.tiers.fingerprint, base[: (len(base) // CHUNK) * CHUNK])
    names, values = [], []
    for index in range(chain.num_chunks):
        if kv is not None:
            arrays = engine.cache.read_blocks(list(range(CHUNK // engine.config.block_size)))
            names.append(chain.chunk_key(index).name)
            values.append(encode_kv_chunk(chain, index, kv(arrays)))
        if state is not None:
            step = (index + 1) * CHUNK
            names.append(chain.checkpoint_key(step).name)
            values.append(encode_checkpoint(chain, step, state(engine.cache.read_slot(1))))
    shared.remove(names)
    shared.put_if_absent(list(zip(names, values)))


MALFORMED_KV = {
    "fewer rows": lambda arrays: {name: a[:1] for name, a in arrays.items()},
    "0-d": lambda arrays: {name: np.array(1.0) for name in arrays},
    "other dtype": lambda arrays: {name: a.astype(np.float32) for name, a in arrays.items()},
    "other name": lambda arrays: {"other": a for a in arrays.values()},
}
MALFORMED_STATE = {
    "fewer rows": lambda arrays: {name: a[:1] for name, a in arrays.items()},
    "0-d": lambda arrays: {name: np.array(1.0) for name in arrays},
    "extra array": lambda arrays: {**arrays, "routed_experts_x": np.zeros(3)},
}


@pytest.mark.parametrize("kind,malform", [*(("kv", f) for f in MALFORMED_KV), *(("state", f) for f in MALFORMED_STATE)])
def test_a_malformed_object_with_a_valid_header_is_a_counted_miss_and_leaks_nothing(kind, malform):
    base = prompt(100, 61)
    shared = _published(base)
    engine = Engine(config(), tiers=TieredStore(shared=shared))
    changes = {"kv": MALFORMED_KV, "state": MALFORMED_STATE}[kind][malform]
    _replace_objects(shared, engine, base, **{kind: changes})
    follows = [Request(base + prompt(5 + i, 62 + i), max_new_tokens=3) for i in range(5)]
    for follow in follows:  # more such objects than the engine has spare slots
        assert engine.generate([follow])[0].tokens == uncached([follow])[0]
        engine.clear_cache()
        engine.check_invariants()
    assert engine.stats()["tiers"]["write_refusals"]["layout_mismatch"] >= len(follows)
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 0
    _assert_nothing_held(engine)


# --- items 16 and 20 -----------------------------------------------------------------------------


def test_an_attention_only_model_with_tiers_is_refused_at_construction():
    with pytest.raises(InvalidConfigError, match="attention-only"):
        Engine(config(model=replace(MODEL, layer_pattern="AA")), tiers=TieredStore(shared=HostMemoryStore(1 << 20)))


def test_requests_asking_for_routed_experts_skip_the_restore():
    base = prompt(100, 71)
    shared = _published(base)
    engine = Engine(config(), tiers=TieredStore(shared=shared))
    follow = Request(base + prompt(5, 72), max_new_tokens=3, return_routed_experts=True)
    (result,) = engine.generate([follow])
    assert result.tokens == uncached([follow])[0]
    stats = engine.stats()["tiers"]
    assert stats["restores_skipped"] == {"routed_experts": 1}
    assert "restore_lookups" not in stats["store"]["counters"]  # nothing was fetched
