"""CacheConfig: validated at construction, frozen afterwards."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridcache import CacheConfig
from hybridcache.errors import HybridCacheError, InvalidConfigError

INT_FIELDS = ("block_size", "num_kv_blocks", "num_state_slots", "checkpoint_budget", "decode_checkpoint_interval")
BOOL_FIELDS = ("prefix_caching", "deterministic_keys")
WRONG_TYPES_FOR_INT = (1.0, 16.0, "16", None, True, False, [16])


def test_defaults_are_valid():
    config = CacheConfig()
    assert config.block_size == 64
    assert config.num_kv_blocks == 1024
    assert config.num_state_slots == 1
    assert config.checkpoint_budget == 0
    assert config.prefix_caching is True
    assert config.decode_checkpoint_interval == 0
    assert config.deterministic_keys is False


def test_valid_values_are_stored():
    config = CacheConfig(
        block_size=16,
        num_kv_blocks=0,
        num_state_slots=9,
        checkpoint_budget=4,
        prefix_caching=False,
        decode_checkpoint_interval=48,
        deterministic_keys=True,
    )
    assert (config.block_size, config.num_kv_blocks, config.num_state_slots) == (16, 0, 9)
    assert (config.checkpoint_budget, config.decode_checkpoint_interval) == (4, 48)
    assert config.prefix_caching is False
    assert config.deterministic_keys is True


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", WRONG_TYPES_FOR_INT, ids=repr)
def test_int_fields_reject_wrong_types_including_bool(field, value):
    with pytest.raises(InvalidConfigError, match=field):
        CacheConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", -2),
        ("block_size", 0),
        ("num_kv_blocks", -1),
        ("num_state_slots", 0),
        ("num_state_slots", -1),
        ("checkpoint_budget", -1),
        ("decode_checkpoint_interval", -64),
    ],
)
def test_int_fields_reject_values_below_their_minimum(field, value):
    with pytest.raises(InvalidConfigError, match=field):
        CacheConfig(**{field: value})


@pytest.mark.parametrize("block_size", [1, 3, 17, 63])
def test_block_size_must_be_even(block_size):
    with pytest.raises(InvalidConfigError, match="block_size"):
        CacheConfig(block_size=block_size)


@pytest.mark.parametrize("block_size", [2, 4, 16, 64, 256])
def test_even_block_sizes_are_accepted(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("interval", [8, 24, 17, 65])
def test_decode_interval_must_be_a_multiple_of_block_size(interval):
    with pytest.raises(InvalidConfigError, match="decode_checkpoint_interval"):
        CacheConfig(block_size=16, decode_checkpoint_interval=interval)


@pytest.mark.parametrize("interval", [0, 16, 48, 1600])
def test_decode_interval_multiples_of_block_size_are_accepted(interval):
    assert CacheConfig(block_size=16, decode_checkpoint_interval=interval).decode_checkpoint_interval == interval


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", [0, 1, "yes", None, 1.0], ids=repr)
def test_bool_fields_reject_non_bools(field, value):
    with pytest.raises(InvalidConfigError, match=field):
        CacheConfig(**{field: value})


def test_config_errors_are_value_errors_and_hybridcache_errors():
    with pytest.raises(ValueError):
        CacheConfig(block_size=3)
    with pytest.raises(HybridCacheError):
        CacheConfig(num_kv_blocks=-1)


def test_wrong_type_is_reported_as_config_error_not_type_error():
    # Config errors form one family (ValueError) even for a wrong type.
    with pytest.raises(InvalidConfigError) as info:
        CacheConfig(block_size="64")
    assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("slots", "budget", "expected"),
    [(1, 0, 0), (2, 0, 1), (4, 0, 3), (6, 3, 2), (5, 4, 0), (2, 5, 0), (1, 7, 0)],
)
def test_num_runtime_state_slots(slots, budget, expected):
    assert CacheConfig(num_state_slots=slots, checkpoint_budget=budget).num_runtime_state_slots == expected


def test_config_is_frozen():
    config = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]
    assert config.block_size == 64


def test_replace_revalidates():
    config = CacheConfig(block_size=16)
    assert dataclasses.replace(config, block_size=32).block_size == 32
    with pytest.raises(InvalidConfigError):
        dataclasses.replace(config, block_size=15)


def test_equal_configs_compare_and_hash_equal():
    a = CacheConfig(block_size=16, num_state_slots=4)
    b = CacheConfig(block_size=16, num_state_slots=4)
    assert a == b
    assert hash(a) == hash(b)
    assert a != CacheConfig(block_size=16, num_state_slots=5)


@given(
    half_block=st.integers(1, 512),
    blocks=st.integers(0, 10_000),
    slots=st.integers(1, 1000),
    budget=st.integers(0, 1000),
    interval_multiple=st.integers(0, 50),
)
def test_any_valid_combination_constructs(half_block, blocks, slots, budget, interval_multiple):
    block_size = 2 * half_block
    config = CacheConfig(
        block_size=block_size,
        num_kv_blocks=blocks,
        num_state_slots=slots,
        checkpoint_budget=budget,
        decode_checkpoint_interval=interval_multiple * block_size,
    )
    assert config.num_runtime_state_slots == max(0, slots - 1 - budget)
    assert 0 <= config.num_runtime_state_slots <= slots - 1
