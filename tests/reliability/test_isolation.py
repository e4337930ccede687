"""Isolation: equal tokens under different adapters or cache salts never share a block or a
checkpoint, and equal placeholder tokens with different multimodal content never share either,
in the KV trie, in the hybrid trie and through the engine. Colliding keys change nothing."""

from __future__ import annotations

import itertools

import pytest

from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache import BlockKeyer, BlockTrie
from hybridcache.sequence import MultimodalSpan, Namespace, Sequence

from tests.keyers import ConstantKeyer
from tests.prefix_cache._helpers import admit, forward

B = 4
NAMESPACES = [Namespace(None, None), Namespace("a", None), Namespace(None, "x"), Namespace("a", "x"), Namespace("x", None)]
PROMPT = list(range(1, 4 * B + 2))  # four complete blocks and one more token
KEYERS = {
    "per-process": lambda: BlockKeyer(B),
    "deterministic": lambda: BlockKeyer.deterministic(B),
    "all-colliding": lambda: ConstantKeyer(B),
}


def make(keyer: str, hybrid: bool) -> BlockTrie:
    pool = BlockPool(128)
    states = StatePool(24, checkpoint_budget=20) if hybrid else None
    return BlockTrie(pool, B, keyer=KEYERS[keyer](), state_pool=states, max_checkpoints_per_anchor=8)


def run(trie: BlockTrie, seq: Sequence, saves=()) -> list:
    """Admit, run and free ``seq``, publishing checkpoints after each of ``saves`` tokens (one
    forward per save: chunked prefill). Returns the published records."""
    admit(trie, seq)
    records = []
    for step in saves:
        assert trie.checkpoints.reserve_save(seq, step) > 0
        seq.set_computed(max(step, seq.num_computed))
        trie.checkpoints.unpin_restore(seq)
        record = seq.prefix_state.checkpoints.pending_save
        assert trie.checkpoints.publish_save(seq)
        records.append(record)
    forward(trie, seq)
    trie.free_sequence(seq)
    return records


def blocks_by_root(trie: BlockTrie) -> dict[int, set[int]]:
    """Root slot -> blocks of the attached nodes below it."""
    nodes, found = trie.nodes, {}
    for slot in nodes.attached_slots().tolist():
        top = slot
        while not nodes.is_root[top]:
            top = int(nodes.parent[top])
        found.setdefault(top, set()).add(int(nodes.block[slot]))
    return found


def seq_in(namespace: Namespace, tokens=PROMPT, **kwargs) -> Sequence:
    return Sequence(tokens, adapter=namespace.adapter, cache_salt=namespace.cache_salt, **kwargs)


@pytest.mark.parametrize("keyer", list(KEYERS))
@pytest.mark.parametrize("hybrid", [False, True], ids=["kv", "hybrid"])
def test_equal_tokens_in_other_namespaces_share_nothing(keyer, hybrid):
    trie = make(keyer, hybrid)
    produced = NAMESPACES[:-1]
    records = {}
    for namespace in produced:
        records[namespace] = run(trie, seq_in(namespace), saves=(2 * B + 1, 4 * B) if hybrid else ())
    trie.check_invariants()
    # blocks: one root per namespace, four nodes each, no block under two roots
    by_root = blocks_by_root(trie)
    roots = {namespace: trie.nodes.find_root(namespace) for namespace in produced}
    assert len(set(roots.values())) == len(produced) and set(by_root) == set(roots.values())
    assert all(len(by_root[root]) == 4 for root in roots.values())
    for first, second in itertools.combinations(by_root.values(), 2):
        assert not first & second
    if hybrid:  # checkpoints: own namespace, own anchor path, own slot and frozen block
        live = trie.checkpoints.live_records()
        assert len(live) == 2 * len(produced)
        assert len({r.slot for r in live}) == len(live)
        frozen = [r.frozen_block for r in live if r.frozen_block >= 0]
        assert len(set(frozen)) == len(frozen) == len(produced)
        for namespace, own in records.items():
            for record in own:
                assert record.namespace == namespace and record.is_published
                top = record.anchor
                while not trie.nodes.is_root[top]:
                    top = int(trie.nodes.parent[top])
                assert top == roots[namespace]
    # every namespace hits only its own blocks and checkpoints; an unseen namespace hits nothing
    for namespace in NAMESPACES:
        seq = seq_in(namespace, PROMPT + [7])
        txn = trie.match(seq)
        if namespace not in roots:
            assert txn.hit_tokens == 0 and seq.num_blocks == 0
        else:
            assert txn.hit_tokens == 4 * B
            assert set(seq.block_table.tolist()) <= by_root[roots[namespace]]
            if hybrid:
                assert seq.prefix_state.checkpoints.restore in records[namespace]
        trie.rollback(txn)
    trie.check_invariants()


@pytest.mark.parametrize("keyer", list(KEYERS))
@pytest.mark.parametrize("hybrid", [False, True], ids=["kv", "hybrid"])
def test_equal_placeholders_with_other_content_share_nothing(keyer, hybrid):
    trie = make(keyer, hybrid)
    placeholders = [0] * (2 * B) + list(range(1, 2 * B + 2))  # the image fills blocks 0-1

    def image(content: str):
        return [MultimodalSpan(1, 2 * B - 1, "image", content)]

    saves = (B + 2, 2 * B, 4 * B) if hybrid else ()  # inside the span is refused; after it works
    if hybrid:
        seq = Sequence(placeholders, multimodal=image("cat"))
        admit(trie, seq)
        assert trie.checkpoints.reserve_save(seq, B + 2) < 0  # mid-span: never a checkpoint
        seq.set_computed(seq.num_tokens)
        trie.free_sequence(seq)
        saves = (2 * B, 4 * B)
    cat = run(trie, Sequence(placeholders, multimodal=image("cat")), saves)
    dog = run(trie, Sequence(placeholders, multimodal=image("dog")), saves)
    plain = run(trie, Sequence(placeholders), saves)  # no image at all: the same tokens as text
    by_root = blocks_by_root(trie)
    (blocks,) = by_root.values()  # one namespace
    nodes = trie.nodes
    depth1 = [s for s in nodes.attached_slots().tolist() if nodes.depth[s] == 1]
    assert len(depth1) == 3, "each content must get its own first block"
    assert len(blocks) == 3 * 4
    if hybrid:
        for first, second in itertools.combinations((cat, dog, plain), 2):
            assert not {r.record_id for r in first} & {r.record_id for r in second}
            assert not {r.slot for r in first} & {r.slot for r in second}
    for content, records in (("cat", cat), ("dog", dog), (None, plain), ("bird", None)):
        seq = Sequence(placeholders + [9], multimodal=image(content) if content else ())
        txn = trie.match(seq)
        if records is None:
            assert txn.hit_tokens == 0
        else:
            assert txn.hit_tokens == 4 * B
            slots = {s for s in nodes.attached_slots().tolist() if int(nodes.block[s]) in set(seq.block_table.tolist())}
            for slot in slots:
                assert nodes.extra_identity.get(slot) == (
                    seq.spans_overlapping((int(nodes.depth[slot]) - 1) * B, int(nodes.depth[slot]) * B) or None
                )
            if hybrid:
                assert seq.prefix_state.checkpoints.restore in records
        trie.rollback(txn)
    trie.check_invariants()


# --- through the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_classes():
    engine = pytest.importorskip("hybridcache.engine")
    return engine


def tiny_engine(engine_classes):
    model = engine_classes.TinyHybridConfig(
        vocab_size=64, hidden_size=8, layer_pattern="RA", num_attention_heads=1, attention_head_dim=4,
        num_ssm_heads=1, ssm_head_dim=4, ssm_state_size=2, conv_kernel=2, num_experts=2,
        experts_per_token=1, expert_hidden_size=8, adapter_rank=1,
    )
    config = engine_classes.EngineConfig(
        block_size=B, num_kv_blocks=128, num_state_slots=48, checkpoint_budget=40, max_batch_tokens=64,
        prefill_chunk=8, model=model, adapters=("a",),
    )
    return engine_classes.Engine(config)


def test_engine_requests_never_reuse_another_namespaces_cache(engine_classes):
    Request = engine_classes.Request
    engine = tiny_engine(engine_classes)
    prompt = [(7 * i + 3) % 64 for i in range(21)]
    (first,) = engine.generate([Request(prompt, max_new_tokens=2)])
    assert first.cached_tokens == 0
    follow_up = prompt + [5, 6, 7]
    for adapter, salt in (("a", None), (None, "x"), ("a", "x")):
        (result,) = engine.generate([Request(follow_up, max_new_tokens=2, adapter=adapter, cache_salt=salt)])
        assert result.cached_tokens == 0, (adapter, salt)
        engine.check_invariants()
    # the control: the same follow-up in the producer's namespace does reuse its cache
    (same,) = engine.generate([Request(follow_up, max_new_tokens=2)])
    assert same.cached_tokens >= 16
    # and each namespace reuses its own cache afterwards
    (again,) = engine.generate([Request(follow_up + [9], max_new_tokens=1, adapter="a", cache_salt="x")])
    assert again.cached_tokens >= 16
    engine.check_invariants()


def test_engine_requests_never_reuse_other_multimodal_content(engine_classes):
    Request, Image = engine_classes.Request, engine_classes.MultimodalInput
    engine = tiny_engine(engine_classes)
    prompt = [0] * 8 + [(5 * i + 1) % 64 for i in range(13)]
    engine.generate([Request(prompt, max_new_tokens=2, multimodal=[Image(1, 7, b"cat")])])
    (dog,) = engine.generate([Request(prompt + [3, 4], max_new_tokens=1, multimodal=[Image(1, 7, b"dog")])])
    assert dog.cached_tokens == 0
    (text,) = engine.generate([Request(prompt + [3, 4], max_new_tokens=1)])
    assert text.cached_tokens == 0
    (cat,) = engine.generate([Request(prompt + [3, 4], max_new_tokens=1, multimodal=[Image(1, 7, b"cat")])])
    assert cat.cached_tokens >= 16  # the control: equal content is reused
    engine.check_invariants()
