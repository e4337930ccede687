"""The operations every benchmarked implementation provides.

A scenario builds its workload with these calls and times exactly the ones its docstring
names. ``HybridcacheImpl`` drives this library; ``bench.lmdeploy_impl.LmdeployImpl`` drives
the reference implementation (installed with ``make compare-setup``) on the same prompts.
Requests are opaque to scenarios: each implementation returns its own objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from hybridcache.errors import BenchmarkSetupError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie, MatchTxn
from hybridcache.sequence import Sequence


class Impl(ABC):
    name: str

    @abstractmethod
    def setup(self, *, num_blocks: int, num_checkpoints: int, block_size: int, hybrid: bool) -> None:
        """Fresh cache: pools, trie; ``hybrid`` selects checkpoint matching."""

    @abstractmethod
    def prefill(self, prompt: np.ndarray, save_steps: tuple[int, ...] = ()) -> None:
        """Run ``prompt`` as a finished request whose complete blocks end up cached, publishing a
        checkpoint at each of ``save_steps`` (hybrid only)."""

    @abstractmethod
    def admit(self, prompt: np.ndarray):
        """Untimed: a request for ``prompt`` matched, given blocks, attached and computed (the
        state right after its prefill forward); release it with ``release``."""

    @abstractmethod
    def release(self, request) -> None:
        """Free a request: drop its block references (its cached blocks stay in the trie)."""

    @abstractmethod
    def new_requests(self, prompts: list[np.ndarray]) -> list:
        """Untimed: requests for these exact token arrays."""

    def ingest(self, requests: list) -> None:
        """Per-request identity work done when a request arrives (none by default)."""

    @abstractmethod
    def match(self, requests: list) -> list:
        """The scheduler-time match of every request; returns what ``rollback`` needs."""

    @abstractmethod
    def rollback(self, requests: list, handles: list) -> None:
        """Undo the matches exactly (a rejected admission)."""

    @abstractmethod
    def hit_tokens(self, request) -> int:
        """Tokens the last match of ``request`` served from the cache."""

    @abstractmethod
    def reserve_and_publish(self, request, step: int) -> None:
        """Reserve a checkpoint of ``request`` at ``step`` and publish it (request prefilled)."""

    @abstractmethod
    def evict_checkpoints(self, count: int) -> int: ...

    @abstractmethod
    def evict_blocks(self, count: int) -> int: ...

    @abstractmethod
    def metadata_bytes(self) -> int:
        """Exact-match metadata held by published checkpoints."""


class HybridcacheImpl(Impl):
    name = "hybridcache"

    def setup(self, *, num_blocks: int, num_checkpoints: int, block_size: int, hybrid: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.states = StatePool(num_checkpoints + 2, checkpoint_budget=num_checkpoints) if hybrid else None
        self.trie = BlockTrie(self.pool, block_size, state_pool=self.states)

    def prefill(self, prompt: np.ndarray, save_steps: tuple[int, ...] = ()) -> None:
        seq = self.admit(prompt)
        for step in save_steps:
            self.reserve_and_publish(seq, step)
        self.release(seq)

    def admit(self, prompt: np.ndarray) -> Sequence:
        seq = Sequence(prompt)
        txn = self.trie.match(seq)
        self.pool.grow_table(seq, seq.num_tokens, self.block_size)
        self.trie.allocate(seq)
        self.trie.commit(txn)
        seq.set_computed(seq.num_tokens)
        return seq

    def release(self, request: Sequence) -> None:
        self.trie.free_sequence(request)

    def new_requests(self, prompts: list[np.ndarray]) -> list[Sequence]:
        return [Sequence(prompt) for prompt in prompts]

    def ingest(self, requests: list[Sequence]) -> None:
        prepare = self.trie.prepare
        for seq in requests:
            prepare(seq)

    def match(self, requests: list[Sequence]) -> list[MatchTxn]:
        match = self.trie.match
        return [match(seq) for seq in requests]

    def rollback(self, requests: list[Sequence], handles: list[MatchTxn]) -> None:
        for txn in handles:
            self.trie.rollback(txn)

    def hit_tokens(self, request: Sequence) -> int:
        return request.num_computed

    def reserve_and_publish(self, request: Sequence, step: int) -> None:
        if self.trie.checkpoints.reserve_save(request, step) < 0 or not self.trie.checkpoints.publish_save(request):
            raise BenchmarkSetupError(f"could not publish a checkpoint at step {step}")

    def evict_checkpoints(self, count: int) -> int:
        return self.trie.free_state_slots(count)

    def evict_blocks(self, count: int) -> int:
        return self.trie.free_kv_blocks(count)

    def metadata_bytes(self) -> int:
        return self.trie.checkpoints.metadata_bytes if self.trie.checkpoints is not None else 0
