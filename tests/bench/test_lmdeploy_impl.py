"""The lmdeploy adapter agrees with our implementation on what a match serves.

With the reference installed (``make compare-setup``) both implementations run the same small
workloads (block size 16 and 64, prompts of a few hundred tokens) and must report the same hit
tokens for aligned checkpoint hits, mid-block hits, root-anchored hits, misses, plain KV block
hits, and step 0 after a rollback. Without it, setting the adapter up must fail with the setup
hint. The hint path is also checked with lmdeploy hidden, so it is covered either way.
"""

import sys

import numpy as np
import pytest

from hybridcache.bench import lmdeploy_impl
from hybridcache.bench.impl import HybridcacheImpl
from hybridcache.bench.lmdeploy_impl import LmdeployImpl
from hybridcache.errors import BenchmarkSetupError

VOCAB = 151_000


def _reference_available() -> bool:
    try:
        lmdeploy_impl.load_lmdeploy()
    except BenchmarkSetupError:
        return False
    return True


AVAILABLE = _reference_available()


def _setup_kwargs(block_size=16, hybrid=True):
    return dict(num_blocks=300, num_checkpoints=8, block_size=block_size, hybrid=hybrid)


def _workload(block_size: int):
    rng = np.random.default_rng(block_size)
    a, b, c = (rng.integers(0, VOCAB, 320, dtype=np.int32) for _ in range(3))

    def suffix(prompt):
        return np.concatenate([prompt, rng.integers(0, VOCAB, 16, dtype=np.int32)])

    early = a.copy()
    early[5] += 1  # differs before every checkpoint of ``a``
    late = a.copy()
    late[300] += 1  # differs after them
    aligned = 4 * block_size
    requests = [
        suffix(a), suffix(b), suffix(c), early, late,
        a[: aligned + 1].copy(), a[:aligned].copy(),  # the aligned step needs one token after it
        a[:204].copy(), a[:203].copy(),  # same for the mid-block step 203
        a[:11].copy(), a[:10].copy(),  # and for the root-anchored step 10
    ]
    saves = {"a": (aligned, 203, 10), "b": (256 - block_size // 2,)}
    return a, b, requests, saves


def _run(impl, block_size: int, hybrid: bool):
    a, b, requests, saves = _workload(block_size)
    impl.setup(**_setup_kwargs(block_size, hybrid))
    impl.prefill(a, saves["a"] if hybrid else ())
    impl.prefill(b[:300] if not hybrid else b, saves["b"] if hybrid else ())
    batch = impl.new_requests(requests)
    impl.ingest(batch)
    handles = impl.match(batch)
    hits = [impl.hit_tokens(request) for request in batch]
    impl.rollback(batch, handles)
    after_rollback = [impl.hit_tokens(request) for request in batch]
    handles = impl.match(batch)
    rematch = [impl.hit_tokens(request) for request in batch]
    impl.rollback(batch, handles)
    return hits, after_rollback, rematch


def _reference_impl():
    """A fresh adapter when the reference is installed; otherwise check that setting one up fails
    with the setup hint and return None (the test has then checked all it can)."""
    impl = LmdeployImpl()
    if AVAILABLE:
        return impl
    with pytest.raises(BenchmarkSetupError, match="run make compare-setup first"):
        impl.setup(**_setup_kwargs())
    return None


def test_hint_when_lmdeploy_is_hidden(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # any import of it now fails
    monkeypatch.setattr(lmdeploy_impl, "_api", None)
    with pytest.raises(BenchmarkSetupError, match="run make compare-setup first"):
        LmdeployImpl().setup(**_setup_kwargs())


def test_package_imports_without_touching_lmdeploy():
    import subprocess

    code = "import sys, hybridcache.bench.lmdeploy_impl; assert 'lmdeploy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("block_size", [16, 64])
def test_checkpoint_hits_agree(block_size):
    impl = _reference_impl()
    if impl is None:
        return
    ours = _run(HybridcacheImpl(), block_size, hybrid=True)
    reference = _run(impl, block_size, hybrid=True)
    assert ours == reference
    hits, after_rollback, rematch = reference
    aligned, mid_block = 4 * block_size, 256 - block_size // 2
    deepest_a = max(aligned, 203)
    assert hits == [deepest_a, mid_block, 0, 0, deepest_a, aligned, 203 if aligned > 203 else 10,
                    203, aligned if aligned < 203 else 10, 10, 0]
    assert after_rollback == [0] * len(hits)
    assert rematch == hits


@pytest.mark.parametrize("block_size", [16, 64])
def test_kv_block_hits_agree(block_size):
    impl = _reference_impl()
    if impl is None:
        return
    ours = _run(HybridcacheImpl(), block_size, hybrid=False)
    reference = _run(impl, block_size, hybrid=False)
    assert ours == reference
    hits, after_rollback, _ = reference
    assert hits[0] == 320 and hits[2] == 0 and hits[3] == 0  # every full block; a miss; first block differs
    assert after_rollback == [0] * len(hits)


def test_rollback_returns_blocks_and_statistics():
    impl = _reference_impl()
    if impl is None:
        return
    a, _, requests, saves = _workload(64)
    impl.setup(**_setup_kwargs(64))
    impl.prefill(a, saves["a"])
    free, stats = impl.block_manager.get_num_free_gpu_blocks(), impl.trie.stats.snapshot()
    batch = impl.new_requests(requests)
    handles = impl.match(batch)
    assert impl.block_manager.get_num_free_gpu_blocks() == free  # a hit shares the trie's blocks
    assert impl.trie.stats != stats
    impl.rollback(batch, handles)
    assert impl.block_manager.get_num_free_gpu_blocks() == free
    assert impl.trie.stats == stats
    assert all(seq.num_history_ids == 0 and seq.num_blocks == 0 for seq in batch)


def test_checkpoint_eviction_and_metadata():
    impl = _reference_impl()
    if impl is None:
        return
    a, _, requests, saves = _workload(64)
    impl.setup(**_setup_kwargs(64))
    impl.prefill(a, saves["a"])
    assert len(impl.published_checkpoints()) == 3
    token_bytes = sum(step * 8 for step in saves["a"])  # int64 token copies of each prefix
    assert impl.metadata_bytes() > token_bytes
    assert impl.evict_checkpoints(5) == 3
    assert impl.metadata_bytes() == 0
    batch = impl.new_requests(requests)
    handles = impl.match(batch)
    assert all(impl.hit_tokens(seq) == 0 for seq in batch)
    impl.rollback(batch, handles)
    assert impl.evict_blocks(1000) == 5  # the prompt's five full blocks were trie-owned leaves


def test_prefill_and_publish_lifecycle():
    impl = _reference_impl()
    if impl is None:
        return
    impl.setup(**_setup_kwargs(16))
    prompt = np.arange(100, dtype=np.int32)
    seq = impl.admit(prompt)
    impl.reserve_and_publish(seq, 40)  # mid-block: takes a frozen block
    impl.release(seq)
    assert impl.block_manager.get_num_free_gpu_blocks() == 300 - 6 - 1
    (request,) = impl.new_requests([prompt[:60].copy()])
    handles = impl.match([request])
    assert impl.hit_tokens(request) == 40
    impl.rollback([request], handles)
    with pytest.raises(BenchmarkSetupError, match="refused to reserve"):
        impl.reserve_and_publish(impl.admit(prompt[:30].copy()), 31)
