"""``HFModel.weights_identity`` names the function a checkpoint computes, not its weight files:
equal for a copy elsewhere, different for the same weights under another rope theta (a
non-persistent ``inv_freq``), norm epsilon, embedding multiplier or experts per token. Through a
shared tier, an engine on the changed config never restores the original's state."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from hybridcache.engine import Engine, Request
from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.tiers import TieredStore
from hybridcache.tiers.backends import HostMemoryStore
from tests.engine.hf.test_engine_hf import BASE
from tests.engine.hf.tiny_configs import VOCAB

FAMILY = "granitemoehybrid"  # rotary embedding, an embedding multiplier and routed experts
CHANGES = {
    "rope_theta": lambda config: config["rope_parameters"].update(rope_theta=500.0),
    "rms_norm_eps": lambda config: config.update(rms_norm_eps=1e-2),
    "embedding_multiplier": lambda config: config.update(embedding_multiplier=3.0),
    "num_experts_per_tok": lambda config: config.update(num_experts_per_tok=1),
}


def _copy(source: str, target, change=None) -> str:
    shutil.copytree(source, target)
    if change is not None:
        path = target / "config.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def original(checkpoint):
    return checkpoint(FAMILY)


def test_a_copy_elsewhere_has_the_same_identity(original, tmp_path):
    copy = _copy(original, tmp_path / "copy")
    assert HFModel(HFModelConfig(copy, "float64")).weights_identity() == HFModel(
        HFModelConfig(original, "float64")
    ).weights_identity()
    assert HFModel(HFModelConfig(copy, "float32")).weights_identity() != HFModel(
        HFModelConfig(copy, "float64")
    ).weights_identity()


@pytest.mark.parametrize("field", list(CHANGES))
def test_the_same_weights_under_another_config_never_share_tier_state(original, tmp_path, field):
    changed = _copy(original, tmp_path / field, CHANGES[field])
    base_config = replace(BASE, model=HFModelConfig(original, "float64"), tier_chunk_size=16)
    changed_config = replace(base_config, model=HFModelConfig(changed, "float64"))
    rng = np.random.default_rng(11)
    prompt = rng.integers(2, VOCAB, 40).tolist()
    shared = HostMemoryStore(1 << 26)
    Engine(base_config, tiers=TieredStore(shared=shared)).generate([Request(prompt, max_new_tokens=2)])
    engine = Engine(changed_config, tiers=TieredStore(shared=shared))
    assert engine.model.weights_identity() != HFModel(HFModelConfig(original, "float64")).weights_identity()
    follow = Request(prompt + rng.integers(2, VOCAB, 6).tolist(), max_new_tokens=3)
    (result,) = engine.generate([follow])
    (reference,) = Engine(replace(changed_config, prefix_caching=False)).generate([follow])
    assert engine.stats()["tiers"]["remote_hit_tokens"] == 0
    assert result.tokens == reference.tokens
    engine.check_invariants()


def test_another_attention_implementation_is_another_identity(original, tmp_path):
    """Eager attention softmaxes in float32, SDPA does not: same weights, other numerics."""
    eager = _copy(original, tmp_path / "eager", lambda config: config.update(attn_implementation="eager"))
    default = HFModel(HFModelConfig(original, "float64"))
    changed = HFModel(HFModelConfig(eager, "float64"))
    assert changed.transformers_model.config._attn_implementation == "eager"
    assert default.transformers_model.config._attn_implementation != "eager"
    assert changed.weights_identity() != default.weights_identity()
