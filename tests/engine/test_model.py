"""TinyHybridModel: cached, chunked and batched generation equal plain generation bit for bit."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.model import ForwardChunk, TinyHybridConfig, TinyHybridModel
from hybridcache.engine.model_api import ATTENTION, RECURRENT, PagedModel
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidConfigError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidTokenError,
    InvalidTypeError,
    SharedWriteError,
)
from hybridcache.sequence import MultimodalSpan

CONFIG = TinyHybridConfig()
B = 4  # small blocks, so short sequences span several blocks and end mid-block
NUM_BLOCKS = 64
NUM_SLOTS = 10
PROMPT = [17, 301, 5, 88, 88, 402, 9, 250, 133, 7, 61, 499, 12, 300]  # 14 tokens: 3 blocks + 2
OTHER_PROMPT = [44, 45, 46, 200, 201, 3, 3, 3, 511, 0]
NEW_TOKENS = 8


# --- a tiny scheduler --------------------------------------------------------------------------


@dataclass
class Request:
    """One sequence driven like an engine drives it: chunked prefill, then one token per step."""

    prompt: list[int]
    table: list[int]
    slot: int
    chunk_size: int = 10**6
    max_new: int = NEW_TOKENS
    adapter: str | None = None
    multimodal: tuple = ()
    writable: frozenset[int] | None = None
    computed: int = 0  # positions already in the cache (a restored prefix)
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.table = list(self.table)

    def next_chunk(self) -> ForwardChunk | None:
        if len(self.generated) >= self.max_new:
            return None
        ids = self.tokens[self.computed : self.computed + self.chunk_size]
        return ForwardChunk(
            ids, self.computed, self.table, self.slot, self.adapter, self.multimodal, self.writable
        )

    def absorb(self, chunk: ForwardChunk, output) -> None:
        self.computed += len(chunk.token_ids)
        self.routed.append(output.routed_experts)
        if self.computed == len(self.tokens):  # only the last known token's output is a sample
            self.generated.append(output.next_token)
            self.tokens.append(output.next_token)
            self.logits.append(output.logits)

    @property
    def routed_rows(self) -> np.ndarray:
        return np.concatenate(self.routed)


def run(model: TinyHybridModel, cache: CacheTensors, *requests: Request) -> None:
    """Step every unfinished request in the same forward call until all are done."""
    while True:
        pending = [(request, chunk) for request in requests if (chunk := request.next_chunk()) is not None]
        if not pending:
            return
        outputs = model.forward([chunk for _, chunk in pending], cache)
        for (request, chunk), output in zip(pending, outputs):
            request.absorb(chunk, output)


def make_cache(config: TinyHybridConfig = CONFIG, dtype: str = "float64") -> CacheTensors:
    return CacheTensors(config, num_blocks=NUM_BLOCKS, block_size=B, num_state_slots=NUM_SLOTS, dtype=dtype)


def blocks(first: int, count: int = 6) -> list[int]:
    return list(range(first, first + count))


def assert_same_run(actual: Request, expected: Request, from_position: int = 0) -> None:
    assert actual.generated == expected.generated
    assert np.array_equal(actual.routed_rows, expected.routed_rows[from_position:])
    for got, want in zip(actual.logits, expected.logits, strict=True):
        assert np.array_equal(got, want)  # bitwise: no tolerance


def solo(model: TinyHybridModel, **kwargs) -> Request:
    request = Request(**kwargs)
    run(model, make_cache(model.config, model.dtype_name), request)
    return request


@functools.lru_cache(maxsize=None)
def model(seed: int = 0, config: TinyHybridConfig = CONFIG, dtype: str = "float64") -> TinyHybridModel:
    return TinyHybridModel(config, seed=seed, dtype=dtype)


@functools.lru_cache(maxsize=None)
def reference(seed: int = 0) -> Request:
    """PROMPT in one chunk, then greedy decoding: the run every other path must reproduce."""
    return solo(model(seed), prompt=PROMPT, table=blocks(0), slot=1)


# --- the reference run is worth comparing against ------------------------------------------------


def test_greedy_run_is_not_degenerate():
    # A model that always repeats one token would make every equality below vacuous.
    run_ = reference()
    assert len(set(run_.generated)) >= NEW_TOKENS // 2
    assert run_.routed_rows.shape == (len(PROMPT) + NEW_TOKENS - 1, CONFIG.routed_expert_width)
    assert run_.routed_rows.dtype == np.int16
    assert len({tuple(row) for row in run_.routed_rows}) > 3
    assert all(np.isfinite(logits).all() for logits in run_.logits)


def test_routed_experts_are_valid_ids_ascending_within_each_layer():
    rows = reference().routed_rows.reshape(-1, len(CONFIG.layer_pattern), CONFIG.experts_per_token)
    assert rows.min() >= 0 and rows.max() < CONFIG.num_experts
    assert (np.diff(rows, axis=-1) > 0).all()


def test_next_token_is_the_argmax_of_the_returned_logits():
    run_ = reference()
    assert [int(np.argmax(logits)) for logits in run_.logits] == run_.generated
    assert run_.logits[0].shape == (CONFIG.vocab_size,)


# --- chunking and batching --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 16])
def test_chunk_size_does_not_change_a_bit(chunk_size):
    chunked = solo(model(), prompt=PROMPT, table=blocks(0), slot=1, chunk_size=chunk_size)
    assert_same_run(chunked, reference())


@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=len(PROMPT)))
@settings(max_examples=20, deadline=None)
def test_any_split_of_the_prompt_gives_the_same_first_token_and_experts(sizes):
    cache, position, outputs = make_cache(), 0, []
    sizes = iter(sizes * len(PROMPT))
    while position < len(PROMPT):
        ids = PROMPT[position : position + next(sizes)]
        outputs += model().forward([ForwardChunk(ids, position, blocks(0), 1)], cache)
        position += len(ids)
    routed = np.concatenate([output.routed_experts for output in outputs])
    assert np.array_equal(routed, reference().routed_rows[: len(PROMPT)])
    assert np.array_equal(outputs[-1].logits, reference().logits[0])


def test_batching_with_unrelated_sequences_does_not_change_a_bit():
    tiny = model()
    mine = Request(PROMPT, blocks(0), slot=1, chunk_size=3)
    others = [
        Request(OTHER_PROMPT, blocks(10), slot=2, chunk_size=1, max_new=12),
        Request(OTHER_PROMPT[::-1], blocks(20), slot=3, chunk_size=7, adapter="tenant-a", max_new=4),
        Request(PROMPT, blocks(30), slot=4, chunk_size=5, multimodal=((2, 5, b"image"),)),
    ]
    run(tiny, make_cache(), others[0], mine, *others[1:])
    assert_same_run(mine, reference())
    for other in others:
        alone = solo(tiny, prompt=other.prompt, table=other.table, slot=other.slot, max_new=other.max_new,
                     adapter=other.adapter, multimodal=other.multimodal)
        assert_same_run(other, alone)


def test_block_and_slot_ids_do_not_matter():
    moved = solo(model(), prompt=PROMPT, table=[40, 3, 57, 11, 22, 9], slot=7, chunk_size=5)
    assert_same_run(moved, reference())


# --- prefix caching: restoring copied state and blocks ----------------------------------------------


@pytest.mark.parametrize("k", [8, 10, 13])  # block boundary, mid-block, full hit minus one
def test_continuing_from_copied_state_and_blocks_equals_the_original(k):
    tiny, cache = model(), make_cache()
    full, partial = divmod(k, B)
    donor_table, checkpoint_slot, checkpoint_block = blocks(10), 6, 30
    # Compute the first k tokens elsewhere and checkpoint them as a prefix cache would.
    tiny.forward([ForwardChunk(PROMPT[:k], 0, donor_table, 2)], cache)
    cache.copy_states([2], [checkpoint_slot])
    if partial:
        cache.copy_blocks([donor_table[full]], [checkpoint_block])
    # The donor moves on with other tokens, rewriting its slot and its partial block.
    tiny.forward([ForwardChunk(OTHER_PROMPT, k, donor_table, 2)], cache)

    # Restore into a fresh runtime slot and fresh blocks; full blocks are shared read-only.
    restored_slot, fresh = 3, blocks(40)
    for block in fresh:
        cache.poison_block(block)
    cache.poison_state(restored_slot)
    cache.copy_states([checkpoint_slot], [restored_slot])
    if partial:
        cache.copy_blocks([checkpoint_block], [fresh[0]])
    table = donor_table[:full] + fresh[: 6 - full]
    restored = Request(PROMPT, table, restored_slot, computed=k, chunk_size=2, writable=frozenset(table[full:]))
    run(tiny, cache, restored)
    assert_same_run(restored, reference(), from_position=k)


def test_a_decode_time_checkpoint_restores_exactly():
    tiny, cache = model(), make_cache()
    original = Request(PROMPT, blocks(0), slot=1, max_new=3)
    run(tiny, cache, original)
    # After 3 samples, 16 positions are computed: the state covers PROMPT + 2 generated tokens.
    computed = original.computed
    cache.copy_states([1], [5])
    cache.copy_blocks(blocks(0, computed // B), blocks(20, computed // B))
    restored = Request(original.tokens, blocks(20), slot=4, computed=computed, max_new=NEW_TOKENS - 3)
    cache.copy_states([5], [4])
    run(tiny, cache, restored)
    assert original.generated + restored.generated == reference().generated


# --- the shared-write guard ---------------------------------------------------------------------------


def test_writing_into_a_block_outside_writable_blocks_raises_and_changes_nothing():
    tiny, cache = model(), make_cache()
    tiny.forward([ForwardChunk(PROMPT[:6], 0, blocks(0), 1)], cache)
    before = (cache.kv.clone(), cache.conv_states.clone(), cache.ssm_states.clone())
    # Positions 6..9 land in blocks 1 and 2; block 1 is not writable.
    chunk = ForwardChunk(PROMPT[6:10], 6, blocks(0), 1, writable_blocks=frozenset({2, 3}))
    with pytest.raises(SharedWriteError):
        tiny.forward([ForwardChunk(OTHER_PROMPT, 0, blocks(20), 2), chunk], cache)
    assert all(a.equal(b) for a, b in zip(before, (cache.kv, cache.conv_states, cache.ssm_states)))
    # Reading a block that is not writable (block 0) is fine while the writes stay in owned blocks.
    owned = ForwardChunk(PROMPT[6:], 6, blocks(0), 1, writable_blocks=frozenset({1, 2, 3}))
    (output,) = tiny.forward([owned], cache)
    assert np.array_equal(output.logits, reference().logits[0])


@pytest.mark.parametrize("guarded", [(True, True), (True, False), (False, True)])
def test_two_guarded_chunks_writing_one_block_raise(guarded):
    # PROMPT writes blocks 0..3, OTHER_PROMPT writes blocks 3..5: block 3 is written twice.
    tables = (blocks(0), blocks(3))
    chunks = [
        ForwardChunk(prompt, 0, table, slot, writable_blocks=frozenset(table) if guard else None)
        for prompt, table, slot, guard in zip((PROMPT, OTHER_PROMPT), tables, (1, 2), guarded)
    ]
    with pytest.raises(SharedWriteError):
        model().forward(chunks, make_cache())


def test_without_the_guard_two_chunks_may_write_one_block():
    # With writable_blocks None the engine has switched the guard off; the model then trusts it.
    chunks = [ForwardChunk(PROMPT, 0, blocks(0), 1), ForwardChunk(OTHER_PROMPT, 0, blocks(3), 2)]
    assert len(model().forward(chunks, make_cache())) == 2


# --- poisoned blocks and slots ------------------------------------------------------------------------


def test_poisoned_blocks_and_slots_off_the_table_never_affect_outputs():
    tiny, cache = model(), make_cache()
    table = [5, 9, 13, 17, 21, 25]
    for block in range(NUM_BLOCKS):
        cache.poison_block(block)  # the table's blocks too: every position is written before it is read
    for slot in range(NUM_SLOTS):
        cache.poison_state(slot)  # a fresh sequence (start 0) never reads its slot
    request = Request(PROMPT, table, slot=8, chunk_size=6)
    run(tiny, cache, request)
    assert_same_run(request, reference())
    others = [block for block in range(NUM_BLOCKS) if block not in table]
    assert np.isnan(cache.kv[:, others].numpy()).all()


def test_poisoning_a_computed_block_on_the_table_shows_up():
    # The control for the test above: a poisoned block that is read does reach the logits.
    tiny, cache = model(), make_cache()
    tiny.forward([ForwardChunk(PROMPT[:8], 0, blocks(0), 1)], cache)
    cache.poison_block(1)
    (output,) = tiny.forward([ForwardChunk(PROMPT[8:], 8, blocks(0), 1)], cache)
    assert np.isnan(output.logits).all()


def test_poisoned_state_is_read_when_continuing():
    tiny, cache = model(), make_cache()
    tiny.forward([ForwardChunk(PROMPT[:8], 0, blocks(0), 1)], cache)
    cache.poison_state(1)
    (output,) = tiny.forward([ForwardChunk(PROMPT[8:], 8, blocks(0), 1)], cache)
    assert np.isnan(output.logits).all()


# --- adapters, seeds, multimodal content ---------------------------------------------------------------


def _first_logits(tiny: TinyHybridModel, **chunk) -> np.ndarray:
    cache = make_cache(tiny.config, tiny.dtype_name)
    (output,) = tiny.forward([ForwardChunk(PROMPT, 0, blocks(0), 1, **chunk)], cache)
    return output.logits


def test_adapters_change_outputs_and_the_same_name_reproduces_them():
    base = solo(model(), prompt=PROMPT, table=blocks(0), slot=1)
    alpha = solo(model(), prompt=PROMPT, table=blocks(0), slot=1, adapter="alpha")
    beta = solo(model(), prompt=PROMPT, table=blocks(0), slot=1, adapter="beta")
    assert alpha.generated != base.generated and beta.generated != alpha.generated
    assert not np.array_equal(alpha.routed_rows, base.routed_rows)
    # A fresh model deriving the adapters in the other order gives the very same bits.
    fresh = TinyHybridModel(CONFIG, seed=0)
    assert np.array_equal(_first_logits(fresh, adapter="beta"), beta.logits[0])
    assert np.array_equal(_first_logits(fresh, adapter="alpha"), alpha.logits[0])
    assert_same_run(solo(model(), prompt=PROMPT, table=blocks(0), slot=1, adapter="alpha", chunk_size=3), alpha)


def test_same_seed_same_model_different_seed_different_model():
    again = TinyHybridModel(CONFIG, seed=0)
    assert np.array_equal(_first_logits(again), reference().logits[0])
    assert np.array_equal(_first_logits(again), _first_logits(model(0)))
    other = solo(model(1), prompt=PROMPT, table=blocks(0), slot=1)
    assert other.generated != reference().generated
    assert not np.array_equal(other.logits[0], reference().logits[0])


def test_multimodal_content_not_placeholder_tokens_decides_the_embedding():
    span = (3, 8)
    cat = _first_logits(model(), multimodal=[(*span, b"cat")])
    dog = _first_logits(model(), multimodal=[(*span, b"dog")])
    assert not np.array_equal(cat, dog)
    assert not np.array_equal(cat, _first_logits(model()))
    assert np.array_equal(cat, _first_logits(TinyHybridModel(CONFIG, seed=0), multimodal=[(*span, b"cat")]))
    # A str content id hashes as its UTF-8 bytes; MultimodalSpan is accepted as well.
    assert np.array_equal(cat, _first_logits(model(), multimodal=[(*span, "cat")]))
    assert np.array_equal(cat, _first_logits(model(), multimodal=[MultimodalSpan(*span, "image", "cat")]))


def test_a_span_split_across_chunks_matches_one_chunk():
    spans = ((2, 9, b"picture"), (11, 13, b"clip"))
    whole = solo(model(), prompt=PROMPT, table=blocks(0), slot=1, multimodal=spans)
    split = solo(model(), prompt=PROMPT, table=blocks(0), slot=1, multimodal=spans, chunk_size=3)
    assert_same_run(split, whole)
    assert whole.generated != reference().generated


# --- other shapes and dtypes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "dtype"), [("RARA", "float32"), ("AA", "float64"), ("RR", "float64"), ("ARRA", "float64")]
)
def test_other_patterns_and_float32_are_chunk_invariant(pattern, dtype):
    tiny = model(2, TinyHybridConfig(layer_pattern=pattern, conv_kernel=2), dtype)
    whole = solo(tiny, prompt=PROMPT, table=blocks(0), slot=1, max_new=4)
    split = solo(tiny, prompt=PROMPT, table=blocks(0), slot=1, max_new=4, chunk_size=4)
    assert_same_run(split, whole)
    assert whole.logits[0].dtype == np.dtype(dtype)


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk", "error"),
    [
        (ForwardChunk([512], 0, [0], 1), InvalidTokenError),
        (ForwardChunk([-1], 0, [0], 1), InvalidTokenError),
        (ForwardChunk([1.5], 0, [0], 1), InvalidTypeError),
        (ForwardChunk([], 0, [0], 1), InvalidArgumentError),
        (ForwardChunk([1], -1, [0], 1), InvalidArgumentError),
        (ForwardChunk([1] * 5, 0, [0], 1), InvalidArgumentError),  # table covers 4 positions
        (ForwardChunk([1], 0, [NUM_BLOCKS], 1), InvalidBlockIdError),
        (ForwardChunk([1], 0, [0], NUM_SLOTS), InvalidBlockIdError),
        (ForwardChunk([1], 0, [0], 0), InvalidArgumentError),  # the reserved padding row
        (ForwardChunk([1], 0, [0], 1, adapter=""), InvalidNamespaceError),
        (ForwardChunk([1], 0, [0], 1, adapter=3), InvalidTypeError),
        (ForwardChunk([1], 0, [0], 1, multimodal=[(0, 0, b"x")]), InvalidSpanError),
        (ForwardChunk([1], 0, [0], 1, multimodal=[(0, 3, b"x"), (2, 4, b"y")]), InvalidSpanError),
        (ForwardChunk([1], 0, [0], 1, multimodal=[(0, 3, 7)]), InvalidTypeError),
    ],
)
def test_invalid_chunks_raise_before_anything_is_written(chunk, error):
    cache = make_cache()
    valid = ForwardChunk(PROMPT, 0, blocks(10), 2)
    with pytest.raises(error):
        model().forward([valid, chunk], cache)
    assert not cache.kv.any() and not cache.ssm_states.any()


def test_a_state_slot_used_twice_in_one_forward_raises():
    with pytest.raises(InvalidArgumentError):
        model().forward([ForwardChunk([1], 0, [0], 1), ForwardChunk([2], 0, [1], 1)], make_cache())


def test_the_cache_must_match_the_model():
    with pytest.raises(InvalidArgumentError):
        model().forward([ForwardChunk([1], 0, [0], 1)], make_cache(TinyHybridConfig(vocab_size=64)))
    with pytest.raises(InvalidArgumentError):
        model().forward([ForwardChunk([1], 0, [0], 1)], make_cache(dtype="float32"))
    with pytest.raises(InvalidTypeError):
        model().forward([ForwardChunk([1], 0, [0], 1)], object())


@pytest.mark.parametrize(
    "overrides",
    [
        {"vocab_size": 1},
        {"hidden_size": 0},
        {"hidden_size": 8.0},
        {"num_experts": True},
        {"layer_pattern": ""},
        {"layer_pattern": "RXA"},
        {"attention_head_dim": 15},
        {"experts_per_token": 5},
        {"conv_kernel": 0},
        {"adapter_rank": 0},
    ],
)
def test_invalid_configs_raise(overrides):
    with pytest.raises(InvalidConfigError):
        TinyHybridConfig(**overrides)


def test_config_counts_layers_and_expert_width():
    config = TinyHybridConfig(layer_pattern="RRAR", experts_per_token=3)
    assert (config.num_recurrent_layers, config.num_attention_layers, config.routed_expert_width) == (3, 1, 12)


def test_model_rejects_unknown_dtype():
    with pytest.raises(InvalidArgumentError):
        TinyHybridModel(CONFIG, dtype="float16")


def test_the_callers_torch_thread_setting_neither_matters_nor_changes():
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert np.array_equal(_first_logits(model()), reference().logits[0])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


# --- the model interface (PagedModel) ---------------------------------------------------------


def test_the_tiny_model_is_a_paged_model_whose_layout_describes_its_cache_tensors():
    pattern_config = TinyHybridConfig(layer_pattern="RAAR")
    tiny = TinyHybridModel(pattern_config)
    assert isinstance(tiny, PagedModel)
    layout = tiny.layout
    assert [layer.kind for layer in layout.layers] == [RECURRENT, ATTENTION, ATTENTION, RECURRENT]
    assert layout.is_hybrid and layout.vocab_size == pattern_config.vocab_size
    assert layout.routed_expert_width == pattern_config.routed_expert_width
    cache = tiny.new_storage(num_blocks=3, block_size=B, num_state_slots=2)
    assert isinstance(cache, CacheTensors) and cache.dtype == tiny.dtype
    keys, values = layout.kv_layers[0].kv
    assert cache.kv.shape == (2, 3, B, 2, *keys.shape) and keys.shape == values.shape
    conv, ssm = layout.state_layers[0].state
    assert cache.conv_states.shape == (2, 2, *conv.shape) and cache.ssm_states.shape == (2, 2, *ssm.shape)
    assert not TinyHybridModel(TinyHybridConfig(layer_pattern="AA")).layout.is_hybrid


def _replayed(rows: np.ndarray, tokens: list[int] = PROMPT):
    return model().forward([ForwardChunk(tokens, 0, blocks(0), 1)], make_cache(), replay_experts=[rows])[0]


def test_replaying_the_recorded_experts_reproduces_the_run_bit_for_bit():
    recorded = model().forward([ForwardChunk(PROMPT, 0, blocks(0), 1)], make_cache())[0]
    replayed = _replayed(recorded.routed_experts)
    assert np.array_equal(replayed.routed_experts, recorded.routed_experts)
    assert np.array_equal(replayed.logits, recorded.logits)


def test_replaying_other_experts_uses_them_and_changes_the_logits():
    recorded = model().forward([ForwardChunk(PROMPT, 0, blocks(0), 1)], make_cache())[0]
    width = CONFIG.experts_per_token
    others = (recorded.routed_experts.astype(np.int64) + width) % CONFIG.num_experts
    others = np.sort(others.reshape(len(PROMPT), -1, width), axis=2).reshape(len(PROMPT), -1)
    replayed = _replayed(others)
    assert np.array_equal(replayed.routed_experts, others)
    assert np.abs(replayed.logits - recorded.logits).max() > 1e-3


@pytest.mark.parametrize(
    "rows, error",
    [
        (np.zeros((len(PROMPT), 3), dtype=np.int64), InvalidArgumentError),  # wrong width
        (np.full((len(PROMPT), CONFIG.routed_expert_width), 0.5), InvalidArgumentError),  # not ints
        (np.full((len(PROMPT), CONFIG.routed_expert_width), CONFIG.num_experts), InvalidArgumentError),
        (np.zeros((len(PROMPT), CONFIG.routed_expert_width), dtype=np.int64), InvalidArgumentError),  # repeats
    ],
)
def test_invalid_replayed_experts_raise_before_anything_is_written(rows, error):
    cache = make_cache()
    with pytest.raises(error):
        model().forward([ForwardChunk(PROMPT, 0, blocks(0), 1)], cache, replay_experts=[rows])
    assert not cache.kv.any() and not cache.ssm_states.any()


def test_replay_needs_one_entry_per_chunk():
    with pytest.raises(InvalidArgumentError):
        model().forward([ForwardChunk(PROMPT, 0, blocks(0), 1)], make_cache(), replay_experts=[None, None])
    with pytest.raises(InvalidTypeError):
        model().forward([ForwardChunk(PROMPT, 0, blocks(0), 1)], make_cache(), replay_experts=np.zeros(3))
