"""Bad model directories, unsupported layer kinds and bad chunks give specific hybridcache
errors, never a stack trace from inside transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.engine.model_api import ForwardChunk
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidConfigError,
    InvalidTokenError,
    InvalidTypeError,
    ModelLoadError,
    ModelWeightsError,
    SharedWriteError,
    UnsupportedModelError,
)
from tests.engine.hf.conftest import save_tiny_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def lfm2_dir(checkpoint):
    return checkpoint("lfm2")


def _copy_with_weights(source: str, target, edit) -> str:
    shutil.copytree(source, target)
    weights = load_file(f"{source}/{WEIGHTS}")
    edit(weights)
    save_file(weights, f"{target}/{WEIGHTS}", metadata={"format": "pt"})
    return str(target)


def test_a_missing_directory_or_config_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot read"):
        HFModel(HFModelConfig(tmp_path / "absent"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        HFModel(HFModelConfig(tmp_path))


def test_an_unknown_architecture_is_unsupported(lfm2_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(lfm2_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "no_such_architecture"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no architecture"):
        HFModel(HFModelConfig(target))


def test_no_weights_file_is_a_load_error(lfm2_dir, tmp_path):
    (tmp_path / "config.json").write_text((open(f"{lfm2_dir}/config.json")).read())
    with pytest.raises(ModelLoadError, match="no loadable weights"):
        HFModel(HFModelConfig(tmp_path))


def test_a_missing_weight_is_a_weights_error(lfm2_dir, tmp_path):
    directory = _copy_with_weights(lfm2_dir, tmp_path / "m", lambda w: w.pop("model.layers.0.ffn_norm.weight"))
    with pytest.raises(ModelWeightsError, match="missing_keys"):
        HFModel(HFModelConfig(directory))


def test_a_mismatched_weight_is_a_weights_error(lfm2_dir, tmp_path):
    def shrink(weights):
        weights["model.layers.0.ffn_norm.weight"] = torch.zeros(3)

    with pytest.raises(ModelWeightsError, match="mismatched_keys"):
        HFModel(HFModelConfig(_copy_with_weights(lfm2_dir, tmp_path / "m", shrink)))


def test_an_unexpected_weight_is_a_weights_error(lfm2_dir, tmp_path):
    def add(weights):
        weights["model.extra.weight"] = torch.zeros(3)

    with pytest.raises(ModelWeightsError, match="unexpected_keys"):
        HFModel(HFModelConfig(_copy_with_weights(lfm2_dir, tmp_path / "m", add)))


def test_sliding_window_attention_layers_are_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="DynamicSlidingWindowLayer"):
        HFModel(HFModelConfig(save_tiny_model("lara_mini", tmp_path / "m")))


def test_a_model_specific_cache_class_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="MiniMaxCache"):
        HFModel(HFModelConfig(save_tiny_model("minimax", tmp_path / "m")))


def test_bad_configs_are_refused():
    for bad in ({"path": ""}, {"path": 3}, {"path": "x", "dtype": "int8"}, {"path": "x", "num_threads": 0}):
        with pytest.raises(InvalidConfigError):
            HFModelConfig(**bad)


@pytest.fixture(scope="module")
def lfm2(lfm2_dir):
    return HFModel(HFModelConfig(lfm2_dir, "float64"))


@pytest.mark.parametrize(
    ("chunk", "error"),
    [
        (ForwardChunk([1000], 0, [1], 1), InvalidTokenError),
        (ForwardChunk([], 0, [1], 1), InvalidArgumentError),
        (ForwardChunk([5] * 9, 0, [1], 1), InvalidArgumentError),  # table too short
        (ForwardChunk([5], 0, [99], 1), InvalidBlockIdError),
        (ForwardChunk([5], 0, [1], 0), InvalidArgumentError),  # the padding slot
        (ForwardChunk([5], 0, [1], 9), InvalidBlockIdError),
        (ForwardChunk([5], 0, [1], 1, adapter="lora"), InvalidArgumentError),
        (ForwardChunk([5], 0, [1], 1, writable_blocks=frozenset({2})), SharedWriteError),
        (ForwardChunk([5.0], 0, [1], 1), InvalidTypeError),
    ],
)
def test_bad_chunks_are_refused_before_anything_is_written(lfm2, chunk, error):
    storage = lfm2.new_storage(num_blocks=4, block_size=8, num_state_slots=2)
    storage.poison_block(1)
    with pytest.raises(error):
        lfm2.forward([chunk], storage)
    assert torch.isnan(storage.kv[(1, "keys")][1]).all()


def test_two_chunks_may_not_share_a_slot_or_write_one_block(lfm2):
    storage = lfm2.new_storage(num_blocks=4, block_size=8, num_state_slots=3)
    with pytest.raises(InvalidArgumentError, match="slot 1"):
        lfm2.forward([ForwardChunk([5], 0, [1], 1), ForwardChunk([6], 0, [2], 1)], storage)
    with pytest.raises(SharedWriteError):
        lfm2.forward([ForwardChunk([5], 0, [1], 1), ForwardChunk([6], 0, [1], 2)], storage)


def test_storage_of_another_layout_and_bad_replays_are_refused(lfm2, checkpoint):
    other = HFModel(HFModelConfig(checkpoint("falcon_h1"), "float64"))
    with pytest.raises(InvalidArgumentError, match="layout"):
        lfm2.forward([ForwardChunk([5], 0, [1], 1)], other.new_storage(num_blocks=2, block_size=8, num_state_slots=2))
    storage = lfm2.new_storage(num_blocks=2, block_size=8, num_state_slots=2)
    with pytest.raises(InvalidArgumentError, match="replay"):
        lfm2.forward([ForwardChunk([5], 0, [1], 1)], storage, replay_experts=[None, None])
    with pytest.raises(InvalidTypeError):
        lfm2.forward([ForwardChunk([5], 0, [1], 1)], [])
