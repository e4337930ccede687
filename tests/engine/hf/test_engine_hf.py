"""The engine serving transformers checkpoints, per family, against itself and transformers.

Each family's tiny random model is saved with ``save_pretrained`` and served through
``EngineConfig(model=HFModelConfig(DIR, "float64"))``. The workload is multi-turn: three
conversations share a system prompt, every turn resends the conversation so far with the
previous reply and a new user message. Prefill chunks of 12 tokens over blocks of 8 put chunk
ends (and so checkpoints) mid-block; the small pool forces eviction and preemption.

- caching on (both async depths, roomy and small pools) == caching off: greedy tokens equal,
  logits within the family's split noise, routed experts (the hit's recorded rows plus the
  computed ones) equal;
- caching off == transformers: ``generate(do_sample=False)`` tokens, full-forward logits;
- zeroing every restored state slot (a broken restore) visibly breaks the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from hybridcache.engine import Engine, EngineConfig, MultimodalInput, Request, Result
from hybridcache.engine.hf import HFModelConfig
from hybridcache.errors import InvalidArgumentError, InvalidNamespaceError, InvalidSpanError
from tests.engine.hf.conftest import load_oracle
from tests.engine.hf.test_families import DECODE_TOLERANCE
from tests.engine.hf.tiny_configs import VOCAB

FAMILIES = ("qwen3_next", "granitemoehybrid", "lfm2", "falcon_h1", "kimi_linear")
MOE_FAMILIES = ("qwen3_next", "granitemoehybrid", "kimi_linear")
# Logits of the engine vs the engine or transformers: the float32 recurrent states of the
# SSD / GDN / KDA scans (and transformers' single-token SSD step) agree at 1e-7; the short-conv
# family at float64 rounding. These are the adapter's decode tolerances (1e-6 and 1e-12).
TOLERANCE = {family: DECODE_TOLERANCE[family] for family in FAMILIES}
# A zeroed restored state must move some logit by this many tolerances (or change a token).
CONTROL_FACTOR = 100.0

CONVERSATIONS, TURNS = 3, 3
SYSTEM_TOKENS = 20
USER_TOKENS = (5, 13)
REPLY_TOKENS = (3, 6)

BASE = EngineConfig(
    block_size=8,
    num_kv_blocks=64,
    num_state_slots=16,
    checkpoint_budget=8,
    max_batch_tokens=32,
    max_running=3,
    prefill_chunk=12,
    decode_checkpoint_interval=8,
)
# Room for one conversation's longest turn (63 tokens, 8 blocks) but not for all three at once.
SMALL_POOL = {"num_kv_blocks": 11, "num_state_slots": 6, "checkpoint_budget": 2}


@dataclass(frozen=True)
class Turn:
    users: tuple[tuple[int, ...], ...]  # per conversation, the new user tokens
    replies: tuple[int, ...]  # per conversation, max_new_tokens


def workload(seed: int) -> tuple[list[int], list[Turn]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, VOCAB, SYSTEM_TOKENS).tolist()
    turns = [
        Turn(
            tuple(tuple(rng.integers(3, VOCAB, int(rng.integers(*USER_TOKENS))).tolist()) for _ in range(CONVERSATIONS)),
            tuple(int(rng.integers(*REPLY_TOKENS)) for _ in range(CONVERSATIONS)),
        )
        for _ in range(TURNS)
    ]
    return system, turns


def serve(engine: Engine, seed: int, experts: bool) -> list[tuple[Request, Result]]:
    """Every turn of every conversation, each prompt built from the engine's own replies."""
    system, turns = workload(seed)
    histories = [list(system) for _ in range(CONVERSATIONS)]
    served = []
    for turn in turns:
        requests = [
            Request(history + list(user), max_new_tokens=new, return_logits=True, return_routed_experts=experts)
            for history, user, new in zip(histories, turn.users, turn.replies)
        ]
        for number, (request, result) in enumerate(zip(requests, engine.generate(requests))):
            assert result.error is None
            histories[number] = list(request.prompt) + result.tokens
            served.append((request, result))
        engine.check_invariants()
    return served


class RestoreSpy:
    """Counts (and optionally zeroes) restored state slots and blocks of an engine's storage.

    A copy whose destination the next forward's chunks then read is a restore: saves go to
    checkpoint slots and frozen blocks, which no running chunk reads.
    """

    def __init__(self, engine: Engine, *, zero: bool = False) -> None:
        self.zero, self.storage = zero, engine.cache
        self.pending_slots: set[int] = set()
        self.pending_blocks: set[int] = set()
        self.restored_slots = self.restored_blocks = 0
        self._copy_states, self._copy_blocks = engine.cache.copy_states, engine.cache.copy_blocks
        self._forward = engine.model.forward
        engine.cache.copy_states, engine.cache.copy_blocks = self.copy_states, self.copy_blocks
        engine.model.forward = self.forward

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        self._copy_states(src, dst)
        self.pending_slots.update(int(slot) for slot in dst)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._copy_blocks(src, dst)
        self.pending_blocks.update(int(block) for block in dst)

    def forward(self, chunks, storage, **options):
        resumed = {chunk.state_slot for chunk in chunks if chunk.start > 0}
        tables = {int(block) for chunk in chunks for block in chunk.block_table}
        restored = self.pending_slots & resumed
        for slot in restored if self.zero else ():
            storage.zero_state(slot)
        self.restored_slots += len(restored)
        self.restored_blocks += len(self.pending_blocks & tables)
        self.pending_slots, self.pending_blocks = set(), set()
        return self._forward(chunks, storage, **options)


def engine_for(directory: str, **overrides) -> Engine:
    return Engine(replace(BASE, model=HFModelConfig(directory, "float64"), **overrides))


@pytest.fixture(scope="module")
def uncached(checkpoint):
    """``uncached(family)`` -> the workload served with prefix caching off (seed 0)."""
    runs = {}

    def get(family: str):
        if family not in runs:
            engine = engine_for(checkpoint(family), prefix_caching=False)
            runs[family] = serve(engine, 0, family in MOE_FAMILIES)
        return runs[family]

    return get


def logit_gap(left: list[tuple[Request, Result]], right: list[tuple[Request, Result]]) -> float:
    """The largest logit difference, after checking both runs generated the same tokens."""
    assert [result.tokens for _, result in left] == [result.tokens for _, result in right]
    return max(float(np.abs(a.logits - b.logits).max()) for (_, a), (_, b) in zip(left, right))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_depth", [0, 1])
@pytest.mark.parametrize("pool", ["roomy", "small"])
def test_caching_on_equals_caching_off(checkpoint, uncached, family, async_depth, pool):
    engine = engine_for(checkpoint(family), async_depth=async_depth, **(SMALL_POOL if pool == "small" else {}))
    spy = RestoreSpy(engine)
    cached = serve(engine, 0, family in MOE_FAMILIES)
    reference = uncached(family)
    assert logit_gap(cached, reference) <= TOLERANCE[family]
    for (_, hit), (_, plain) in zip(cached, reference):
        if family in MOE_FAMILIES:  # a hit's rows come from the cache, the rest are computed
            np.testing.assert_array_equal(hit.routed_experts, plain.routed_experts)
        assert plain.cached_tokens == 0
    assert sum(result.cached_tokens for _, result in cached) > 0
    # Hits restored states and mid-block checkpoints' partial blocks.
    assert spy.restored_slots > 0 and spy.restored_blocks > 0
    if pool == "small":
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["evicted_blocks"] + stats["evicted_checkpoints"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_caching_off_equals_transformers_generate_and_full_forward(checkpoint, uncached, family):
    oracle = load_oracle(checkpoint(family))
    for request, result in uncached(family):
        prompt = torch.tensor([request.prompt.tolist()])
        # Replies may hold the pad id; without a mask generate() would mask those positions out.
        mask = torch.ones_like(prompt)
        with torch.no_grad():
            generated = oracle.generate(
                prompt, attention_mask=mask, max_new_tokens=len(result.tokens), do_sample=False, pad_token_id=0
            )
            assert generated[0, prompt.shape[1] :].tolist() == result.tokens
            # generate() hands out float32 logits; the float64 reference is a full forward.
            full = oracle(input_ids=generated[:, :-1]).logits[0, prompt.shape[1] - 1 :].numpy()
        assert np.abs(result.logits - full).max() <= TOLERANCE[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_zeroing_the_restored_state_breaks_the_comparison(checkpoint, uncached, family):
    engine = engine_for(checkpoint(family))
    spy = RestoreSpy(engine, zero=True)
    broken = serve(engine, 0, False)
    assert spy.restored_slots > 0
    reference = uncached(family)
    for (_, zeroed), (_, plain) in zip(broken, reference):
        if zeroed.tokens != plain.tokens:
            return  # a changed token breaks it (and the later prompts differ from here on)
        if np.abs(zeroed.logits - plain.logits).max() > CONTROL_FACTOR * TOLERANCE[family]:
            return
    pytest.fail("zeroing every restored state left all outputs within tolerance")


def test_a_checkpoint_refuses_what_its_model_does_not_serve(checkpoint):
    engine = engine_for(checkpoint("lfm2"))
    with pytest.raises(InvalidNamespaceError):
        engine.generate([Request([5, 6, 7], adapter="style")])
    with pytest.raises(InvalidSpanError):
        engine.generate([Request([5, 6, 7], multimodal=[MultimodalInput(0, 2, b"image")])])
    with pytest.raises(InvalidArgumentError, match="no experts"):
        engine.generate([Request([5, 6, 7], return_routed_experts=True)])
    with pytest.raises(InvalidArgumentError):
        engine.generate([Request([5, VOCAB])])
    assert engine.stats()["forwards"] == 0
