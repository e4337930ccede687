"""CacheTensors: whole-row state copies, whole-block KV copies, poisoning, validation before mutation."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.model import ForwardChunk, TinyHybridConfig, TinyHybridModel
from hybridcache.errors import InvalidArgumentError, InvalidBlockIdError, InvalidTypeError

CONFIG = TinyHybridConfig()
NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS = 8, 4, 6


def make_cache(**overrides) -> CacheTensors:
    arguments = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "num_state_slots": NUM_SLOTS}
    return CacheTensors(CONFIG, **(arguments | overrides))


def filled_cache() -> CacheTensors:
    """Every row and block holds distinct values, so a copy to the wrong place shows."""
    cache = make_cache()
    generator = torch.Generator().manual_seed(0)
    for tensor in (cache.kv, cache.conv_states, cache.ssm_states):
        tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
    return cache


def snapshot(cache: CacheTensors) -> tuple[torch.Tensor, ...]:
    return cache.kv.clone(), cache.conv_states.clone(), cache.ssm_states.clone()


def assert_unchanged(cache: CacheTensors, before: tuple[torch.Tensor, ...]) -> None:
    # equal() is False for NaN, so compare with NaNs treated as equal.
    for now, then in zip((cache.kv, cache.conv_states, cache.ssm_states), before):
        assert torch.allclose(now, then, rtol=0, atol=0, equal_nan=True)


# --- layout ----------------------------------------------------------------------------------------


def test_shapes_follow_the_config_and_start_zeroed():
    cache = make_cache()
    assert cache.kv.shape == (2, NUM_BLOCKS, BLOCK_SIZE, 2, 2, 16)
    assert cache.conv_states.shape == (2, NUM_SLOTS, CONFIG.conv_kernel - 1, 16 * 2 + 2 * 8)
    assert cache.ssm_states.shape == (2, NUM_SLOTS, 2, 16, 8)
    assert not cache.kv.any() and not cache.conv_states.any() and not cache.ssm_states.any()


@pytest.mark.parametrize(("dtype", "element_size"), [("float64", 8), ("float32", 4)])
def test_nbytes_counts_every_element(dtype, element_size):
    cache = make_cache(dtype=dtype)
    elements = cache.kv.numel() + cache.conv_states.numel() + cache.ssm_states.numel()
    assert cache.nbytes == elements * element_size
    assert cache.kv.dtype == getattr(torch, dtype)


def test_a_pattern_without_attention_or_recurrence_has_empty_tensors():
    cache = CacheTensors(TinyHybridConfig(layer_pattern="RR"), num_blocks=4, block_size=2, num_state_slots=2)
    assert cache.kv.numel() == 0 and cache.ssm_states.shape[0] == 2
    cache.copy_blocks([0], [1])
    cache.poison_block(3)


# --- state slots -----------------------------------------------------------------------------------


def test_zero_state_clears_one_slot_in_every_recurrent_layer():
    cache = filled_cache()
    before = snapshot(cache)
    cache.zero_state(3)
    assert not cache.conv_states[:, 3].any() and not cache.ssm_states[:, 3].any()
    others = [slot for slot in range(NUM_SLOTS) if slot != 3]
    assert cache.ssm_states[:, others].equal(before[2][:, others])
    assert cache.conv_states[:, others].equal(before[1][:, others])


def test_copy_states_copies_whole_rows_and_nothing_else():
    cache = filled_cache()
    before = snapshot(cache)
    cache.copy_states([1, 4], [5, 2])
    for src, dst in ((1, 5), (4, 2)):
        assert cache.conv_states[:, dst].equal(before[1][:, src])
        assert cache.ssm_states[:, dst].equal(before[2][:, src])
    untouched = [0, 1, 3, 4]
    assert cache.ssm_states[:, untouched].equal(before[2][:, untouched])
    assert cache.kv.equal(before[0])


def test_a_swap_through_a_spare_row_is_exact():
    cache = filled_cache()
    before = snapshot(cache)
    cache.copy_states([1], [5])
    cache.copy_states([2], [1])
    cache.copy_states([5], [2])
    assert cache.ssm_states[:, 1].equal(before[2][:, 2]) and cache.ssm_states[:, 2].equal(before[2][:, 1])


# --- KV blocks ---------------------------------------------------------------------------------------


def test_copy_blocks_copies_whole_blocks_in_every_attention_layer():
    cache = filled_cache()
    before = snapshot(cache)
    cache.copy_blocks([0, 6], [7, 3])
    assert cache.kv[:, 7].equal(before[0][:, 0]) and cache.kv[:, 3].equal(before[0][:, 6])
    untouched = [0, 1, 2, 4, 5, 6]
    assert cache.kv[:, untouched].equal(before[0][:, untouched])
    assert cache.ssm_states.equal(before[2])


def test_poison_block_fills_one_block_with_nan():
    cache = filled_cache()
    cache.poison_block(2)
    assert torch.isnan(cache.kv[:, 2]).all()
    assert not torch.isnan(cache.kv[:, [0, 1, 3, 4, 5, 6, 7]]).any()


def test_poison_state_fills_one_slot_with_nan():
    cache = filled_cache()
    cache.poison_state(4)
    assert torch.isnan(cache.ssm_states[:, 4]).all() and torch.isnan(cache.conv_states[:, 4]).all()
    assert not torch.isnan(cache.ssm_states[:, :4]).any()


def test_empty_copies_change_nothing():
    cache = filled_cache()
    before = snapshot(cache)
    cache.copy_blocks([], [])
    cache.copy_states([], [])
    assert_unchanged(cache, before)


# --- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "error"),
    [
        ([1, 2], [3], InvalidArgumentError),  # lengths differ
        ([1, 2], [3, 3], InvalidArgumentError),  # duplicate destination
        ([1, 2], [2, 3], InvalidArgumentError),  # a source is also a destination
        ([1], [1], InvalidArgumentError),
        ([1], [-1], InvalidBlockIdError),
        ([99], [1], InvalidBlockIdError),
        ([1.0], [2], InvalidTypeError),
        ([True], [2], InvalidTypeError),
        (1, [2], InvalidTypeError),
    ],
)
@pytest.mark.parametrize("method", ["copy_states", "copy_blocks"])
def test_invalid_copies_raise_and_change_nothing(method, src, dst, error):
    cache = filled_cache()
    before = snapshot(cache)
    with pytest.raises(error):
        getattr(cache, method)(src, dst)
    assert_unchanged(cache, before)


def test_destination_range_is_checked_per_kind():
    cache = make_cache()
    cache.copy_blocks([0], [NUM_BLOCKS - 1])  # a block id that is not a slot id
    with pytest.raises(InvalidBlockIdError):
        cache.copy_states([0], [NUM_BLOCKS - 1])


@pytest.mark.parametrize("call", ["zero_state", "poison_state", "poison_block"])
def test_single_id_calls_check_their_range(call):
    cache = filled_cache()
    before = snapshot(cache)
    with pytest.raises(InvalidBlockIdError):
        getattr(cache, call)(NUM_BLOCKS)
    with pytest.raises(InvalidTypeError):
        getattr(cache, call)("1")
    assert_unchanged(cache, before)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"num_blocks": -1}, InvalidArgumentError),
        ({"block_size": 0}, InvalidArgumentError),
        ({"num_state_slots": 0}, InvalidArgumentError),
        ({"num_blocks": 2.0}, InvalidTypeError),
        ({"dtype": "bfloat16"}, InvalidArgumentError),
    ],
)
def test_invalid_construction_raises(overrides, error):
    with pytest.raises(error):
        make_cache(**overrides)


def test_config_must_be_a_tiny_hybrid_config():
    with pytest.raises(InvalidTypeError):
        CacheTensors(object(), num_blocks=1, block_size=2, num_state_slots=1)


# --- what a forward touches ------------------------------------------------------------------


def test_a_forward_writes_only_its_slot_and_the_positions_it_computes():
    model = TinyHybridModel(CONFIG, seed=0)
    cache = make_cache()
    for block in range(NUM_BLOCKS):
        cache.poison_block(block)
    before = snapshot(cache)
    model.forward([ForwardChunk(list(range(6)), 0, [5, 2], 3)], cache)
    # Positions 0..5: all of block 5 and the first two rows of block 2.
    assert not torch.isnan(cache.kv[:, 5]).any() and not torch.isnan(cache.kv[:, 2, :2]).any()
    assert torch.isnan(cache.kv[:, 2, 2:]).all()
    others = [block for block in range(NUM_BLOCKS) if block not in (2, 5)]
    assert torch.isnan(cache.kv[:, others]).all()
    # The slot holds a real state after the chunk; other slots are untouched.
    assert cache.conv_states[:, 3].abs().sum() > 0 and cache.ssm_states[:, 3].abs().sum() > 0
    untouched = [slot for slot in range(NUM_SLOTS) if slot != 3]
    assert cache.ssm_states[:, untouched].equal(before[2][:, untouched])
    assert cache.conv_states[:, untouched].equal(before[1][:, untouched])
