"""Families that clamp the SSM time step only in transformers' multi-token scan (NemotronH,
Zamba2): at a stress init (10x init range, time steps pushed below ``time_step_min``, slow
decay) the engine's decode equals transformers' full forward, and a state reached by decoding
equals the same prefix prefilled, so caching cannot change the function."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.engine.model_api import ForwardChunk
from tests.engine.hf.conftest import load_oracle
from tests.engine.hf.tiny_configs import VOCAB, tiny_config

BLOCK = 8
PROMPT = 24
DECODED = 12
TOLERANCE = 1e-6  # relative to the values' scale: the SSD scans keep their state in float32
UNCLAMPED_GAP = 30 * TOLERANCE  # the control: without the clamp, decode drifts by ~1e-4 (measured)


def _relative_gap(left, right) -> float:
    left, right = np.asarray(left), np.asarray(right)
    return float(np.abs(left - right).max() / (1.0 + np.abs(right).max()))


def _stressed_checkpoint(family: str, directory) -> str:
    config = tiny_config(family)
    config.initializer_range = 10 * config.initializer_range
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "time_step_limit") and hasattr(module, "dt_bias"):
                floor = config.time_step_min
                module.dt_bias.fill_(math.log(math.expm1(floor)))  # about half the steps fall below the floor
                module.A_log.fill_(math.log(0.05))  # slow decay: the state remembers those steps
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["nemotron_h", "zamba2"])
def stressed(request, tmp_path_factory):
    directory = _stressed_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return HFModel(HFModelConfig(directory, "float64")), load_oracle(directory)


def _decode(model: HFModel, tokens: list[int]):
    """Prefill ``tokens[:PROMPT]`` in one chunk, then feed the rest one token at a time, as the
    engine's decode does; returns the storage and the logits after each position from PROMPT-1."""
    storage = model.new_storage(num_blocks=8, block_size=BLOCK, num_state_slots=3)
    table = list(range(1, 6))
    logits = [model.forward([ForwardChunk(tokens[:PROMPT], 0, table, 1)], storage)[0].logits]
    for position in range(PROMPT, len(tokens)):
        logits.append(model.forward([ForwardChunk([tokens[position]], position, table, 1)], storage)[0].logits)
    return storage, np.stack(logits)


def _tokens() -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT + DECODED,), generator=torch.Generator().manual_seed(4)).tolist()


def test_decode_equals_the_full_forward(stressed):
    model, oracle = stressed
    tokens = _tokens()
    _, decoded = _decode(model, tokens)
    with torch.no_grad():
        full = oracle(input_ids=torch.tensor([tokens])).logits[0, PROMPT - 1 :].numpy()
    assert _relative_gap(decoded, full) <= TOLERANCE


def test_a_decoded_state_equals_the_prefilled_one(stressed):
    model, _ = stressed
    tokens = _tokens()
    decoded, _ = _decode(model, tokens)
    prefilled = model.new_storage(num_blocks=8, block_size=BLOCK, num_state_slots=3)
    model.forward([ForwardChunk(tokens, 0, list(range(1, 6)), 1)], prefilled)
    for key, state in decoded.states.items():
        assert _relative_gap(state[1].numpy(), prefilled.states[key][1].numpy()) <= TOLERANCE, key


def test_the_stress_init_needs_the_clamp(stressed):
    """Control: with the single-token clamp removed, decode drifts from the full forward."""
    model, oracle = stressed
    mixers = [m for m in model.transformers_model.modules() if hasattr(m, "time_step_limit")]
    hooks = [mixer.in_proj._forward_hooks for mixer in mixers]
    assert hooks and all(hooks)
    saved = [dict(hook) for hook in hooks]
    for hook in hooks:
        hook.clear()
    try:
        _, decoded = _decode(model, _tokens())
    finally:
        for hook, entries in zip(hooks, saved):
            hook.update(entries)
    with torch.no_grad():
        full = oracle(input_ids=torch.tensor([_tokens()])).logits[0, PROMPT - 1 :].numpy()
    assert _relative_gap(decoded, full) > UNCLAMPED_GAP
