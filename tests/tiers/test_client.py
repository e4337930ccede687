"""The one tier client of the engine and the replay: its restore limit and key chains, restore
then adopt, publishes, and a seam that costs at most a miss or a publish, counted by kind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridcache import MultimodalSpan, Sequence
from hybridcache.errors import InvalidTypeError, LifecycleError
from hybridcache.tiers import KeyChain, RestoreCost, TieredStore
from hybridcache.tiers.backends import HostMemoryStore
from hybridcache.tiers.client import TIER_ERROR, TIER_REJECTED, ForwardEnd, TierClient, TierRestore
from hybridcache.tiers.device import DeviceAdoption

from .helpers import CHUNK, fingerprint, kv_arrays, state_arrays

TOKENS = list(range(1, 3 * CHUNK + 9))  # three whole chunks and a tail


class _Arrays:
    def chunk(self, index: int) -> dict[str, np.ndarray]:
        return kv_arrays(index)

    def state(self) -> dict[str, np.ndarray]:
        return state_arrays(0)


class FakeDevice:
    """A device cache holding ``held`` (None: caching nothing) that takes every restore, or
    refuses it (with ``refused`` as its reason)."""

    def __init__(self, held: tuple[int, int] | None = (0, 0), accept: bool = True, refused: str | None = None) -> None:
        self.held, self.accept, self.refused = held, accept, refused
        self.adopted: list[Sequence] = []
        self.slots: list[int] = []

    def cached_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        return self.held

    def adopt(self, prefix, restore) -> DeviceAdoption:
        self.adopted.append(prefix)
        return DeviceAdoption(restore.step - self.held[0] if self.accept else 0, self.refused)

    def payloads(self, seq: Sequence, slot: int) -> _Arrays:
        self.slots.append(slot)
        return _Arrays()


def _client(device: FakeDevice | None = None, store: TieredStore | None = None) -> TierClient:
    store = TieredStore(host=HostMemoryStore(1 << 24)) if store is None else store
    return TierClient(store, fingerprint(), FakeDevice() if device is None else device)


def _published(client: TierClient, tokens=TOKENS) -> TierClient:
    client.store_prefix(Sequence(tokens), [CHUNK, 2 * CHUNK, 3 * CHUNK], slot=5)
    return client


def test_the_restore_limit_is_the_deepest_whole_chunk_before_the_last_token_outside_any_span():
    client = _client()
    assert client.restore_limit(Sequence(TOKENS)) == 3 * CHUNK
    assert client.restore_limit(Sequence(TOKENS[: 3 * CHUNK])) == 2 * CHUNK  # the last token is computed
    image = MultimodalSpan(3 * CHUNK - 4, 3 * CHUNK + 4, "image", "sha256:aa")
    assert client.restore_limit(Sequence(TOKENS, multimodal=[image])) == 2 * CHUNK
    assert client.restore_chain(Sequence(TOKENS[:CHUNK])) is None


def test_every_chain_is_the_sequence_chain_in_its_own_namespace():
    client = _client()
    seq = Sequence(TOKENS, adapter="lora-a", cache_salt="tenant")
    chain = client.restore_chain(seq)
    expected = KeyChain(fingerprint().in_namespace("lora-a", "tenant"), TOKENS[: 3 * CHUNK])
    assert [chain.chunk_key(i) for i in range(3)] == [expected.chunk_key(i) for i in range(3)]
    assert client.chain(seq, 3 * CHUNK).checkpoint_key(3 * CHUNK) == expected.checkpoint_key(3 * CHUNK)


def test_a_published_prefix_is_restored_adopted_and_counted_by_tier():
    device = FakeDevice(held=(CHUNK, CHUNK))
    client = _published(_client(device))
    assert client.stats.published_steps == 3 and client.stats.published_bytes > 0 and device.slots == [5]
    outcome = client.adopt_prefix(Sequence(TOKENS + [7, 7]))
    assert outcome.gained == 2 * CHUNK and outcome.miss_reason is None and outcome.restore.step == 3 * CHUNK
    assert [prefix.num_tokens for prefix in device.adopted] == [3 * CHUNK]
    stats = client.stats
    assert (stats.restores, stats.remote_hit_tokens) == (1, 2 * CHUNK)
    assert stats.restored_tokens == {"host": 2 * CHUNK} and stats.restores_using == {"host": 1}
    assert stats.restored_bytes["host"] == outcome.restore.nbytes > 0
    client.check_invariants()
    assert json.loads(json.dumps(client.stats_dict()))["restored_tokens"] == {"host": 2 * CHUNK}


def test_a_chain_made_once_for_a_turn_serves_its_publish_and_its_restore():
    turn = TOKENS + list(range(500, 500 + 2 * CHUNK))  # the prompt, then an output of two more chunks
    writer = _client()
    made = writer.chain(Sequence(turn), len(turn))
    published = writer.store_prefix(Sequence(turn), [CHUNK, 4 * CHUNK], slot=5, made=made)
    assert published is made and writer.stats.published_steps == 2
    reader = _client(FakeDevice(held=(0, 0)), store=writer.store)
    assert reader.restore_chain(Sequence(TOKENS), made).chunk_names == reader.restore_chain(Sequence(TOKENS)).chunk_names
    outcome = reader.adopt_prefix(Sequence(TOKENS), made)
    assert outcome.restore.step == CHUNK  # 3 * CHUNK was not published; 4 * CHUNK lies beyond the prompt's limit
    short = writer.chain(Sequence(TOKENS), CHUNK)
    assert reader.adopt_prefix(Sequence(TOKENS), short).miss_reason == TIER_ERROR  # too short to cut: counted, never raised
    assert reader.stats.restore_failed == {"InvalidArgumentError": 1}


def test_nothing_is_looked_up_beyond_what_the_device_holds_or_when_it_caches_nothing():
    for device in (FakeDevice(held=(3 * CHUNK, 3 * CHUNK)), FakeDevice(held=None)):
        client = _published(_client(device))
        assert client.adopt_prefix(Sequence(TOKENS)) == TierRestore()
        assert client.store.counters["restore_lookups"] == 0 and not device.adopted


def test_a_request_asking_for_routed_experts_skips_the_lookup():
    client = _published(_client())
    assert client.adopt_prefix(Sequence(TOKENS, want_routed_experts=True)) == TierRestore()
    assert client.stats.restores_skipped == {"routed_experts": 1}
    assert client.store.counters["restore_lookups"] == 0


def test_a_refused_adoption_is_a_rejected_miss_with_the_device_reason():
    client = _published(_client(FakeDevice(accept=False, refused="layout_mismatch")))
    outcome = client.adopt_prefix(Sequence(TOKENS))
    assert (outcome.gained, outcome.miss_reason) == (0, TIER_REJECTED)
    stats = client.stats
    assert stats.adoptions_refused == 1 and stats.write_refusals == {"layout_mismatch": 1}
    assert stats.misses == {TIER_REJECTED: 1} and stats.restores == stats.remote_hit_tokens == 0


def test_only_steps_on_a_chunk_boundary_outside_spans_are_published():
    client = _client()
    image = MultimodalSpan(2 * CHUNK - 2, 2 * CHUNK + 2, "image", "sha256:aa")
    chain = client.store_prefix(Sequence(TOKENS, multimodal=[image]), [0, CHUNK + 1, 2 * CHUNK, 3 * CHUNK])
    assert client.stats.published_steps == 1 and chain.num_chunks == 3
    assert client.store_prefix(Sequence(TOKENS), [CHUNK - 1]) is None and client.stats.published_steps == 1


def test_whatever_the_tier_side_raises_costs_a_miss_or_a_publish_counted_by_class():
    class Broken(TieredStore):
        def lookup_prefix(self, *args, **kwargs):
            raise RuntimeError("a bug in the read path")

        def store_prefix(self, *args, **kwargs):
            raise KeyError("a bug in the write path")

    class BrokenCost(RestoreCost):
        def observe_recompute(self, tokens, seconds):
            raise ZeroDivisionError("a bug in the cost model")

    client = _client(store=Broken(host=HostMemoryStore(1 << 20), cost=BrokenCost()))
    assert client.adopt_prefix(Sequence(TOKENS)) == TierRestore(0, TIER_ERROR)
    assert client.store_prefix(Sequence(TOKENS), [CHUNK]) is None
    client.after_forward([ForwardEnd(Sequence(TOKENS), 2 * CHUNK, 3)], 2 * CHUNK, 0.5)
    stats = client.stats
    assert stats.restore_failed == {"RuntimeError": 1} and stats.misses == {TIER_ERROR: 1}
    assert stats.publish_failed == {"KeyError": 2, "ZeroDivisionError": 1}
    client.check_invariants()


def test_the_client_takes_only_a_tiered_store_and_a_fingerprint():
    for store, base in ((HostMemoryStore(1 << 20), fingerprint()), (TieredStore(host=HostMemoryStore(1 << 20)), "fp")):
        with pytest.raises(InvalidTypeError):
            TierClient(store, base, FakeDevice())


def test_one_listener_hears_every_publish_and_what_it_raises_is_a_failed_publish():
    heard = []
    client = _client()
    client.listen_publishes(lambda seq, step, chain, report: heard.append((step, report.checkpoint_stored)))
    with pytest.raises(LifecycleError):
        client.listen_publishes(lambda *args: None)
    with pytest.raises(InvalidTypeError):
        _client().listen_publishes("not callable")
    _published(client)
    assert heard == [(step, {"host": True}) for step in (CHUNK, 2 * CHUNK, 3 * CHUNK)]

    def broken(*args):
        raise ValueError("a listener's bug")

    other = _client()
    other.listen_publishes(broken)
    assert other.store_prefix(Sequence(TOKENS), [CHUNK]) is None and other.stats.publish_failed == {"ValueError": 1}


def test_a_router_asks_the_shared_tier_once_and_each_replica_how_deep_a_restore_reaches():
    shared = HostMemoryStore(1 << 24)
    writer = _published(_client(store=TieredStore(shared=shared)))
    chain = writer.restore_chain(Sequence(TOKENS))
    reader = _client(store=TieredStore(host=HostMemoryStore(1 << 24), shared=shared))
    located = reader.shared_presence(chain)
    assert set(located) == {chain.checkpoint_key(CHUNK).name, chain.checkpoint_key(2 * CHUNK).name,
                            chain.checkpoint_key(3 * CHUNK).name} | {chain.chunk_key(i).name for i in range(3)}
    assert all(where == ["shared"] for where in located.values())
    assert reader.reachable_step(chain, (0, 0), located) == 3 * CHUNK
    assert reader.reachable_step(chain, (3 * CHUNK, 3 * CHUNK), located) == 3 * CHUNK  # nothing beyond
    assert reader.store.counters["shared_read_count_kv"] == 0  # existence only: nothing was read
    assert _client().shared_presence(chain) is None  # no shared tier
    assert _client().reachable_step(chain, (CHUNK, CHUNK)) == CHUNK


def test_a_chain_made_for_other_tokens_or_another_namespace_is_never_used():
    turn = TOKENS + list(range(500, 500 + 2 * CHUNK))
    writer = _client()
    other = writer.chain(Sequence([9] + turn[1:]), len(turn))
    adapted = writer.chain(Sequence(turn, adapter="lora-a"), len(turn))
    for made in (other, adapted):
        assert writer.store_prefix(Sequence(turn), [CHUNK], slot=5, made=made) is None
    assert writer.stats.publish_failed == {"InvalidArgumentError": 2} and writer.stats.published_steps == 0
    writer.store_prefix(Sequence(turn), [CHUNK], slot=5)
    device = FakeDevice(held=(0, 0))
    reader = _client(device, store=writer.store)
    for made in (other, adapted):
        assert reader.adopt_prefix(Sequence(TOKENS), made).miss_reason == TIER_ERROR
    assert reader.stats.restore_failed == {"InvalidArgumentError": 2} and not device.adopted
    with pytest.raises(InvalidTypeError):
        reader.restore_chain(Sequence(TOKENS), "a chain")
