"""PagedStorage: one tensor per layer and cached tensor, validated management calls."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.model_api import (
    ATTENTION,
    ATTENTION_AND_RECURRENT,
    NO_CACHE,
    RECURRENT,
    LayerLayout,
    ModelLayout,
    TensorSpec,
)
from hybridcache.engine.paged_storage import PagedStorage
from hybridcache.errors import InvalidArgumentError, InvalidBlockIdError, InvalidConfigError, InvalidTypeError

LAYOUT = ModelLayout(
    layers=(
        LayerLayout(0, RECURRENT, state=(TensorSpec("conv_states.0", (6, 4), "float64"),
                                         TensorSpec("recurrent_states.0", (2, 3, 5), "float32"))),
        LayerLayout(1, ATTENTION, kv=(TensorSpec("keys", (1, 16), "float64"), TensorSpec("values", (1, 8), "float64"))),
        LayerLayout(2, NO_CACHE),
        LayerLayout(3, ATTENTION_AND_RECURRENT, kv=(TensorSpec("keys", (2, 4), "float64"),
                                                    TensorSpec("values", (2, 4), "float64")),
                    state=(TensorSpec("conv_states.0", (6, 4), "float64"),)),
    ),
    vocab_size=10,
)


@pytest.fixture
def storage():
    return PagedStorage(LAYOUT, num_blocks=4, block_size=3, num_state_slots=3)


def test_shapes_and_dtypes_follow_the_layout(storage):
    assert storage.kv[(1, "keys")].shape == (4, 3, 1, 16)
    assert storage.kv[(3, "values")].shape == (4, 3, 2, 4)
    assert storage.states[(0, "recurrent_states.0")].dtype == torch.float32
    assert storage.states[(3, "conv_states.0")].shape == (3, 6, 4)
    assert set(storage.kv) == {(1, "keys"), (1, "values"), (3, "keys"), (3, "values")}
    assert storage.nbytes == sum(t.numel() * t.element_size() for t in [*storage.kv.values(), *storage.states.values()])


def test_scatter_then_gather_round_trips_across_blocks(storage):
    entries = torch.randn(5, 1, 16, dtype=torch.float64)
    table = torch.tensor([2, 0, 3])
    storage.scatter_kv((1, "keys"), table, 2, entries)
    assert torch.equal(storage.gather_kv((1, "keys"), table, 7)[2:], entries)


def test_copies_and_zeroing_touch_only_their_ids(storage):
    storage.states[(0, "recurrent_states.0")][1] = 1.0
    storage.kv[(3, "keys")][0] = 2.0
    storage.copy_states([1], [2])
    storage.copy_blocks([0], [3])
    assert (storage.states[(0, "recurrent_states.0")][2] == 1).all()
    assert (storage.kv[(3, "keys")][3] == 2).all() and (storage.kv[(3, "keys")][1] == 0).all()
    storage.zero_state(1)
    assert (storage.states[(0, "recurrent_states.0")][1] == 0).all()
    assert (storage.states[(0, "recurrent_states.0")][2] == 1).all()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.copy_blocks([0], [4]), InvalidBlockIdError),
        (lambda s: s.copy_blocks([0, 1], [2]), InvalidArgumentError),
        (lambda s: s.copy_blocks([0, 1], [2, 2]), InvalidArgumentError),
        (lambda s: s.copy_blocks([0, 1], [1, 2]), InvalidArgumentError),
        (lambda s: s.copy_states([True], [1]), InvalidTypeError),
        (lambda s: s.zero_state(3), InvalidBlockIdError),
        (lambda s: s.poison_block(-1), InvalidBlockIdError),
    ],
)
def test_bad_ids_are_refused_before_any_copy(storage, call, error):
    before = {key: tensor.clone() for key, tensor in storage.kv.items()}
    with pytest.raises(error):
        call(storage)
    assert all(torch.equal(before[key], storage.kv[key]) for key in before)


def test_layouts_are_validated():
    with pytest.raises(InvalidConfigError):
        LayerLayout(0, ATTENTION)  # an attention layer without KV
    with pytest.raises(InvalidConfigError):
        TensorSpec("keys", (0,), "float64")
    with pytest.raises(InvalidConfigError):
        ModelLayout(layers=(LayerLayout(1, NO_CACHE),), vocab_size=4)
    with pytest.raises(InvalidTypeError):
        PagedStorage("layout", num_blocks=1, block_size=1, num_state_slots=1)
