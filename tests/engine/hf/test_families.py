"""The adapter against transformers itself, per family: chunked forwards over paged KV and
restored state slots equal the uncached full forward and ``generate``; zeroing the restored
state breaks that (so the comparison is sensitive); routed experts of a resumed chunk equal
the uncached run's, and replaying them reproduces it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers import AutoModel

from hybridcache.engine.hf import HFModel, HFModelConfig
from hybridcache.engine.hf.introspect import probe_model
from hybridcache.engine.model_api import TOKEN_BY_TOKEN_RESUME, ForwardChunk
from hybridcache.errors import UnsupportedModelError
from tests.engine.hf.conftest import load_oracle
from tests.engine.hf.tiny_configs import VOCAB

BLOCK = 8
PROMPT = 56
NEW_TOKENS = 8
SPLITS = (0, 5, 13, 16, 29, PROMPT)  # chunk ends at mid-block positions and at a block edge
RESTORE_AT = 13  # a mid-block checkpoint
# Families whose SSD / GDN / KDA scans keep their state in float32 even in a float64 model agree
# at float32 rounding of that state; the short-conv family agrees at float64 rounding.
FLOAT32_STATE_TOLERANCE = 1e-6
FLOAT64_TOLERANCE = 1e-12
FAMILY_TOLERANCE = {
    "qwen3_next": FLOAT32_STATE_TOLERANCE,  # measured 1.3e-7
    "granitemoehybrid": FLOAT64_TOLERANCE,  # at this init the SSD scan agrees at float64 rounding
    "lfm2": FLOAT64_TOLERANCE,
    "falcon_h1": FLOAT64_TOLERANCE,
    "kimi_linear": FLOAT32_STATE_TOLERANCE,  # measured 2.4e-7
    "jamba": FLOAT32_STATE_TOLERANCE,  # token-by-token resume; measured 2.3e-8
    "zaya": FLOAT64_TOLERANCE,  # attention + a short conv and the previous token's value; measured 2.2e-16
}
# A decode step takes the single-token path, whose SSD step agrees with the chunked scan of the
# full forward at float32 rounding only; the short-conv steps stay at float64 rounding.
DECODE_TOLERANCE = {family: max(tolerance, FLOAT32_STATE_TOLERANCE) for family, tolerance in FAMILY_TOLERANCE.items()}
DECODE_TOLERANCE["lfm2"] = FLOAT64_TOLERANCE
DECODE_TOLERANCE["zaya"] = FLOAT64_TOLERANCE  # measured 2.2e-16
# The zeroed-state control must miss by this many tolerances.
CONTROL_FACTOR = 1e3
MOE_FAMILIES = ("qwen3_next", "granitemoehybrid", "kimi_linear", "jamba")
# Families refused at load, with the start of the reason the error gives.
REFUSED = {
    "glm5_next": "architecture 'glm5_next_text' has no causal language-model class",
    "qwen4_exp_text": "layer 1 keeps a DynamicIndexedLayer cache: its sparse attention also keeps per-token indexer",
    "inkling2_text": "layer 0 keeps a LinearAttentionAndSlidingWindowAttentionLayer cache: its sliding-window",
    "inkling2_loop_text": "layer 0 keeps a LinearAttentionAndSlidingWindowAttentionLayer cache: its sliding-window",
}


def _prompt(seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (PROMPT,), generator=generator).tolist()


@pytest.fixture(scope="module")
def served(checkpoint):
    """``served(family)`` -> (adapter, oracle, oracle logits of the prompt)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = checkpoint(family)
            model, oracle = HFModel(HFModelConfig(directory, "float64")), load_oracle(directory)
            with torch.no_grad():
                logits = oracle(input_ids=torch.tensor([_prompt()])).logits[0].numpy()
            cache[family] = model, oracle, logits
        return cache[family]

    return get


def _run(model: HFModel, storage, tokens: list[int], bounds: tuple[int, ...], table: list[int], slot: int):
    return [model.forward([ForwardChunk(tokens[a:b], a, table, slot)], storage)[0] for a, b in zip(bounds, bounds[1:])]


def _restored_suffix(model: HFModel, tokens: list[int], zero_state: bool = False):
    """Request A computes [0, RESTORE_AT) and saves a checkpoint; request B restores it (state
    slot copy + partial-block copy, as the engine's copy plan does) and runs the rest."""
    storage = model.new_storage(num_blocks=24, block_size=BLOCK, num_state_slots=4)
    table_a, table_b = list(range(1, 9)), [1] + list(range(9, 16))  # B shares A's full block 1
    _run(model, storage, tokens, (0, RESTORE_AT), table_a, 1)
    storage.copy_states([1], [3])  # save: runtime slot -> checkpoint slot
    storage.copy_blocks([table_a[1]], [20])  # save: the partial block -> a frozen block
    storage.poison_state(1)  # A's runtime slot is gone; nothing may read it
    storage.copy_blocks([20], [table_b[1]])  # restore: frozen block -> B's private block
    storage.copy_states([3], [2])  # restore: checkpoint slot -> B's runtime slot
    if zero_state:
        storage.zero_state(2)
    return storage, table_b, _run(model, storage, tokens, (RESTORE_AT, PROMPT), table_b, 2)[0]


@pytest.mark.parametrize("family", list(FAMILY_TOLERANCE))
def test_chunked_forward_matches_the_uncached_full_forward(served, family):
    model, _, expected = served(family)
    tokens = _prompt()
    storage = model.new_storage(num_blocks=16, block_size=BLOCK, num_state_slots=2)
    outputs = _run(model, storage, tokens, SPLITS, list(range(1, 9)), 1)
    gaps = [np.abs(out.logits - expected[end - 1]).max() for out, end in zip(outputs, SPLITS[1:])]
    assert max(gaps) <= FAMILY_TOLERANCE[family], gaps
    assert [out.next_token for out in outputs] == [int(expected[end - 1].argmax()) for end in SPLITS[1:]]


@pytest.mark.parametrize("family", list(FAMILY_TOLERANCE))
def test_restored_checkpoint_then_decode_matches_generate(served, family):
    model, oracle, expected = served(family)
    tokens = _prompt()
    storage, table, output = _restored_suffix(model, tokens)
    assert np.abs(output.logits - expected[-1]).max() <= FAMILY_TOLERANCE[family]
    with torch.no_grad():
        reference = oracle.generate(
            torch.tensor([tokens]), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    generated, logits = [output.next_token], [output.logits]
    for position in range(PROMPT, PROMPT + NEW_TOKENS - 1):
        step = model.forward([ForwardChunk([generated[-1]], position, table, 2)], storage)[0]
        generated.append(step.next_token)
        logits.append(step.logits)
    assert generated == reference.sequences[0, PROMPT:].tolist()
    # generate() hands out float32 logits, so the float64 oracle for them is a full forward.
    with torch.no_grad():
        full = oracle(input_ids=torch.tensor([tokens + generated[:-1]])).logits[0, PROMPT - 1 :].numpy()
    assert np.abs(np.stack(logits) - full).max() <= DECODE_TOLERANCE[family]


@pytest.mark.parametrize("family", list(FAMILY_TOLERANCE))
def test_zeroing_the_restored_state_breaks_the_comparison(served, family):
    model, _, expected = served(family)
    _, _, output = _restored_suffix(model, _prompt(), zero_state=True)
    assert np.abs(output.logits - expected[-1]).max() > CONTROL_FACTOR * FAMILY_TOLERANCE[family]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_of_a_resumed_chunk_equal_the_uncached_run(served, family):
    model, _, _ = served(family)
    tokens = _prompt()
    storage = model.new_storage(num_blocks=16, block_size=BLOCK, num_state_slots=2)
    uncached = _run(model, storage, tokens, (0, PROMPT), list(range(1, 9)), 1)[0].routed_experts
    assert uncached.shape == (PROMPT, model.layout.routed_expert_width) and model.layout.routed_expert_width > 0
    _, _, resumed = _restored_suffix(model, tokens)
    np.testing.assert_array_equal(resumed.routed_experts, uncached[RESTORE_AT:])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_recorded_experts_reproduces_the_run_and_other_experts_change_it(served, family):
    model, _, _ = served(family)
    tokens = _prompt()[:24]
    table = list(range(1, 4))
    storage = model.new_storage(num_blocks=8, block_size=BLOCK, num_state_slots=2)
    recorded = model.forward([ForwardChunk(tokens, 0, table, 1)], storage)[0]
    replayed = model.forward([ForwardChunk(tokens, 0, table, 1)], storage, replay_experts=[recorded.routed_experts])[0]
    np.testing.assert_array_equal(replayed.routed_experts, recorded.routed_experts)
    np.testing.assert_array_equal(replayed.logits, recorded.logits)
    router = model._routers._calls[0]
    others = (recorded.routed_experts.astype(np.int64) + 1) % router.num_experts
    others = np.sort(others.reshape(len(tokens), -1, router.top_k), axis=2).reshape(len(tokens), -1)
    changed = model.forward([ForwardChunk(tokens, 0, table, 1)], storage, replay_experts=[others])[0]
    np.testing.assert_array_equal(changed.routed_experts, others)
    assert np.abs(changed.logits - recorded.logits).max() > 1e-3


def test_a_mamba1_family_resumes_token_by_token(served):
    model, _, _ = served("jamba")
    assert model.layout.resume == TOKEN_BY_TOKEN_RESUME


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_the_adapter_cannot_page_is_refused_at_load_with_the_reason(checkpoint, family):
    with pytest.raises(UnsupportedModelError, match=re.escape(REFUSED[family])):
        HFModel(HFModelConfig(checkpoint(family), "float64"))


def test_glm5_next_would_be_refused_for_its_indexed_attention_even_with_a_language_model_head(checkpoint):
    model = AutoModel.from_pretrained(checkpoint("glm5_next"), local_files_only=True, experts_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="layer 1 keeps a DynamicIndexedLayer cache"):
        probe_model(model.eval(), VOCAB)
