"""A run's options are checked once, when its ``RunConfig`` is built; what it measured comes
back as one ``RunRecord``, whose JSON row keeps the fields (and their order) the command wrote."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.replay import Budget, RunConfig, TraceFacts, replay, resolve_policy
from hybridcache.replay.tiering import TierSetup
from hybridcache.tiers.backends import HostMemoryStore

from ._helpers import PROFILE, budget, request

POLICY = resolve_policy("reference")
ROOMY = budget(4096, 64)


@pytest.mark.parametrize("options, error, message", [
    ({"block_size": 7}, InvalidArgumentError, "even"),
    ({"block_size": 0}, InvalidArgumentError, "block_size"),
    ({"block_size": "32"}, InvalidTypeError, "block_size"),
    ({"prefill_chunk": 0}, InvalidArgumentError, "prefill_chunk"),
    ({"replicas": 0}, InvalidArgumentError, "replicas"),
    ({"replicas": 1.5}, InvalidTypeError, "replicas"),
    ({"routing": "random"}, InvalidArgumentError, "unknown routing"),
    ({"device_tflops": 0}, InvalidArgumentError, "device_tflops"),
    ({"device_tflops": "fast"}, InvalidArgumentError, "device_tflops"),
    ({"device_tflops": True}, InvalidArgumentError, "device_tflops"),
    ({"tiers": {"host_bytes": 10}}, InvalidTypeError, "TierSetup"),
    ({"tiers": TierSetup(chunk_size=100, host_bytes=10**12)}, InvalidArgumentError, "multiple of the block size"),
])
def test_each_option_is_refused_as_itself(options, error, message):
    with pytest.raises(error, match=message):
        RunConfig(PROFILE, POLICY, ROOMY, **options)


def test_the_budget_is_checked_with_the_config():
    with pytest.raises(InvalidArgumentError, match="budget too small"):
        RunConfig(PROFILE, POLICY, budget(0, 1))
    with pytest.raises(InvalidArgumentError, match="kv_bytes"):
        Budget(-1, 10)
    with pytest.raises(InvalidTypeError, match="state_bytes"):
        Budget(10, "lots")
    with pytest.raises(InvalidTypeError):
        RunConfig(PROFILE, "reference", ROOMY)


def test_checked_values_are_kept_normalized_and_the_pools_derived():
    config = RunConfig(PROFILE, POLICY, ROOMY, block_size=np.int64(32), replicas=np.int32(2), routing="kv-overlap")
    assert type(config.block_size) is int and type(config.replicas) is int and config.routing == "kv-overlap"
    assert (config.geometry.kv_blocks, config.geometry.checkpoint_slots) == (4096, 64)
    assert dataclasses.replace(config, replicas=1).geometry == config.geometry
    assert not config.tiered and config.shared_tier == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.replicas = 3


def _requests():
    """A conversation: each prompt is the previous turn (prompt and output) and a new message."""
    rng = np.random.default_rng(5)
    turns = [request(0, rng.integers(0, 50_000, 600), output_length=3)]
    for index in range(1, 4):
        turns.append(request(index, np.concatenate([turns[-1].tokens, rng.integers(0, 50_000, 100)]), output_length=3))
    return turns


FACTS = TraceFacts("t.jsonl", bound_token_hit_rate=0.5, bound_request_hit_rate=0.75, continuations=1, unique_tokens=1000)
ROW_FIELDS = [
    "trace", "policy", "admission", "eviction", "model", "cache_bytes", "kv_bytes", "state_bytes", "block_size",
    "kv_blocks", "checkpoint_slots", "requests", "dropped_requests", "prompt_tokens", "token_hit_rate",
    "request_hit_rate", "prefill_tokens_saved", "flops_saved", "flops_saved_fraction", "checkpoints_written",
    "checkpoint_bytes_written", "evictions", "misses", "shortened", "trie_hit_rate", "wall_s", "alpha",
]
ROW_TAIL = ["bound_token_hit_rate", "bound_request_hit_rate", "continuations", "device_tflops", "ttft_saved_s",
            "ttft_saved_ms_per_request", "bound_fraction"]


def test_a_record_row_keeps_the_command_s_fields_in_order():
    record = replay(_requests(), RunConfig(PROFILE, POLICY, ROOMY, device_tflops=100.0))
    row = record.row(FACTS)
    assert list(row) == ROW_FIELDS + ["replicas", "routing", "shared_tier", "remote_hit_tokens"] + ROW_TAIL
    assert list(row["evictions"]) == ["kv_blocks", "checkpoints_by_trie", "checkpoints_for_state_slots",
                                      "checkpoints_over_anchor_cap"]
    assert row["requests"] == 4 and row["prefill_tokens_saved"] == record.prefill_tokens_saved > 0
    assert row["ttft_saved_s"] == pytest.approx(record.flops_saved / 100e12)
    assert row["ttft_saved_ms_per_request"] == pytest.approx(1e3 * row["ttft_saved_s"] / 4)
    assert row["bound_fraction"] == pytest.approx(record.token_hit_rate / 0.5)


def test_a_fleet_row_has_its_replicas_and_tiers():
    tiers = TierSetup(shared=HostMemoryStore(1 << 30), shared_name="host")
    record = replay(_requests(), RunConfig(PROFILE, POLICY, ROOMY, replicas=2, tiers=tiers))
    row = record.row(FACTS)
    assert list(row) == ROW_FIELDS + ["per_replica", "replicas", "routing", "shared_tier", "remote_hit_tokens",
                                      "tiers"] + ROW_TAIL
    assert [replica["requests"] for replica in row["per_replica"]] == [2, 2]
    assert row["shared_tier"] == "host" and row["remote_hit_tokens"] == record.remote_hit_tokens
    stored = record.tiers["stored_bytes_nominal"]["shared"]
    assert list(row["tiers"])[-1] == "stored_bytes_per_unique_token"
    assert row["tiers"]["stored_bytes_per_unique_token"] == stored / 1000
    assert "stored_bytes_per_unique_token" not in record.tiers  # the row adds it; the record is unchanged
