"""transformers checkpoints through the tiers: engine A publishes a prompt's chunk-aligned
prefixes, a fresh engine B adopts them for a longer prompt, and B's output equals an engine with
caching off (greedy tokens equal, logits within the family's split noise)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hybridcache.engine import Engine, Request
from hybridcache.engine.hf import HFModelConfig
from hybridcache.tiers import TieredStore
from hybridcache.tiers.backends import HostMemoryStore
from tests.engine.hf.test_engine_hf import BASE, FAMILIES, TOLERANCE
from tests.engine.hf.tiny_configs import VOCAB

CHUNK = 16


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fresh_engine_restores_a_published_prefix_exactly(family, checkpoint):
    config = replace(BASE, model=HFModelConfig(checkpoint(family), "float64"), tier_chunk_size=CHUNK)
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, VOCAB, 50).tolist()
    follow = Request(prompt + rng.integers(2, VOCAB, 9).tolist(), max_new_tokens=4, return_logits=True)
    shared = HostMemoryStore(1 << 26)
    Engine(config, tiers=TieredStore(shared=shared)).generate([Request(prompt, max_new_tokens=2)])
    restored_engine = Engine(config, tiers=TieredStore(shared=shared))
    (restored,) = restored_engine.generate([follow])
    (reference,) = Engine(replace(config, prefix_caching=False)).generate([follow])
    assert restored_engine.stats()["tiers"]["remote_hit_tokens"] == 48
    assert restored.tokens == reference.tokens
    assert np.max(np.abs(restored.logits - reference.logits)) <= TOLERANCE[family]
    restored_engine.check_invariants()
