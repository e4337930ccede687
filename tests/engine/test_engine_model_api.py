"""The engine over the model interface with the tiny model: the dtype rule, Result.logits, and
that a layout's hybrid-ness (not the config's) decides the cache."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.engine import Engine, EngineConfig, Request, TinyHybridConfig
from hybridcache.engine.hf import HFModelConfig
from hybridcache.errors import InvalidConfigError, InvalidTypeError

PROMPT = [5, 9, 300, 41, 41, 7, 120, 3, 88, 19, 250]


def test_dtype_none_means_the_models_own_and_a_conflicting_dtype_is_refused(tmp_path):
    assert EngineConfig().resolved_dtype == "float64"
    assert EngineConfig(dtype="float32").resolved_dtype == "float32"
    checkpoint = HFModelConfig(tmp_path, dtype="float64")  # validating never opens the directory
    assert EngineConfig(model=checkpoint).resolved_dtype == "float64"
    assert EngineConfig(model=checkpoint, dtype="float64").resolved_dtype == "float64"
    with pytest.raises(InvalidConfigError, match="conflicts"):
        EngineConfig(model=checkpoint, dtype="float32")
    with pytest.raises(InvalidConfigError):
        EngineConfig(dtype="float16")
    with pytest.raises(InvalidConfigError):
        EngineConfig(model="a path")


def test_the_layout_decides_hybrid():
    assert not Engine(EngineConfig(model=TinyHybridConfig(layer_pattern="AA"))).trie.is_hybrid
    assert Engine(EngineConfig()).trie.is_hybrid


def test_result_logits_are_the_rows_each_generated_token_was_chosen_from():
    engine = Engine(EngineConfig(block_size=4, prefill_chunk=5))
    asked, plain = engine.generate(
        [Request(PROMPT, max_new_tokens=6, return_logits=True), Request(PROMPT, max_new_tokens=6)]
    )
    assert plain.logits is None
    assert asked.logits.shape == (6, TinyHybridConfig().vocab_size) and asked.logits.dtype == np.float64
    assert asked.logits.argmax(axis=1).tolist() == asked.tokens
    # The tiny model is exact, so the rows equal a fresh uncached run's bit for bit.
    fresh = Engine(EngineConfig(prefix_caching=False)).generate([Request(PROMPT, max_new_tokens=6, return_logits=True)])
    assert np.array_equal(fresh[0].logits, asked.logits)


def test_return_logits_must_be_a_bool():
    with pytest.raises(InvalidTypeError):
        Request(PROMPT, return_logits=1)
    assert Request(PROMPT, return_logits=np.bool_(True)).return_logits is True
