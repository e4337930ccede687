"""The reference engine: schedule -> plans -> restore -> forward -> save -> publish -> unpin.

Owns: the model, the cache tensors, the pools, the trie, the scheduler, the queue of forwards
in flight and the finished results. ``async_depth=0`` runs each forward as soon as it is
queued; ``async_depth=1`` schedules the next forward while the previous one is still queued,
as a GPU engine overlapping host work with device work does. Checkpoints are published right
after their forward is queued and stay pinned (and unusable by matches) until its output is
in; restore pins are released once the forward carrying the copy is queued. Forwards execute
strictly in queue order, which is what makes releasing those pins early safe.

If a forward raises, nothing it would have produced stays matchable: its reserved or
published saves are dropped, the trie nodes it attached for blocks it did not write are
detached, and its sequences go back to recompute; the engine keeps serving.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridcache.engine.cache_tensors import CacheTensors
from hybridcache.engine.copy_plan import CopyPlan, build_copy_plan
from hybridcache.engine.model import ForwardChunk, TinyHybridConfig, TinyHybridModel
from hybridcache.engine.requests import Request, Result
from hybridcache.errors import InvalidConfigError, InvalidNamespaceError, InvalidTokenError, InvalidTypeError
from hybridcache.memory.block_pool import BlockPool
from hybridcache.memory.state_pool import StatePool
from hybridcache.prefix_cache.trie import BlockTrie
from hybridcache.scheduler.scheduler import ScheduledBatch, ScheduledChunk, Scheduler, SchedulerConfig, ServingSequence
from hybridcache.sequence import MultimodalSpan, Sequence

FAULT_STAGES = ("before_restore", "after_restore", "before_save", "after_save")


class InjectedFault(RuntimeError):
    """Raised inside a forward by ``Engine.inject_fault`` (tests only)."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 512
    num_state_slots: int = 24
    checkpoint_budget: int = 8
    prefix_caching: bool = True
    max_batch_tokens: int = 256
    max_running: int = 8
    prefill_chunk: int = 64
    decode_checkpoint_interval: int = 0
    checkpoint_chunk_ends: bool = True
    async_depth: int = 0
    seed: int = 0
    dtype: str = "float64"
    model: TinyHybridConfig = field(default_factory=TinyHybridConfig)
    adapters: tuple[str, ...] | None = None
    shared_write_guard: bool = True
    max_checkpoints_per_anchor: int = 4

    def __post_init__(self) -> None:
        if self.async_depth not in (0, 1):
            raise InvalidConfigError("async_depth must be 0 or 1")
        if not isinstance(self.model, TinyHybridConfig):
            raise InvalidConfigError("model must be a TinyHybridConfig")
        if self.block_size < 2 or self.block_size % 2:
            raise InvalidConfigError("block_size must be an even int >= 2")
        if self.num_state_slots < 2:
            raise InvalidConfigError("num_state_slots must be >= 2 (slot 0 is reserved)")
        if self.decode_checkpoint_interval % self.block_size:
            raise InvalidConfigError("decode_checkpoint_interval must be a multiple of block_size")
        self.scheduler_config()  # validates the batching limits now, not at Engine construction

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            prefill_chunk=self.prefill_chunk,
            decode_checkpoint_interval=self.decode_checkpoint_interval,
            checkpoint_chunk_ends=self.checkpoint_chunk_ends,
        )


@dataclass
class _QueuedForward:
    batch: ScheduledBatch
    plan: CopyPlan
    inputs: list[ForwardChunk]


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise InvalidTypeError("config must be an EngineConfig")
        self.config = config
        self.model = TinyHybridModel(config.model, seed=config.seed, dtype=config.dtype)
        self.cache = CacheTensors(
            config.model,
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            num_state_slots=config.num_state_slots,
            dtype=config.dtype,
        )
        self.pool = BlockPool(config.num_kv_blocks)
        self.states = StatePool(config.num_state_slots, checkpoint_budget=config.checkpoint_budget)
        hybrid = config.model.num_recurrent_layers > 0
        self.trie = BlockTrie(
            self.pool,
            config.block_size,
            enabled=config.prefix_caching,
            state_pool=self.states if hybrid else None,
            max_checkpoints_per_anchor=config.max_checkpoints_per_anchor,
            track_pending=True,
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.pool, self.states, self.trie)
        self._entries: dict[int, ServingSequence] = {}
        self._ids = itertools.count()
        self._queue: deque[_QueuedForward] = deque()
        self._faults: deque[str] = deque()
        self._counters = {"forwards": 0, "failed_forwards": 0, "computed_tokens": 0, "cache_flushes": 0}

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Invalid requests raise and change nothing."""
        entry = self._entry_for(request)
        self._queue_entry(entry)
        return entry.request_id

    def _queue_entry(self, entry: ServingSequence) -> None:
        self._entries[entry.request_id] = entry
        self.scheduler.add(entry)

    def cancel(self, request_id: int) -> bool:
        """Drop an unfinished request (a forward in flight for it completes first and its
        output is discarded). Returns False when the id is unknown or already finished."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self.scheduler.cancel(entry)
        return True

    def _entry_for(self, request: Request) -> ServingSequence:
        """Validate a request and build its serving state (nothing is queued yet)."""
        if not isinstance(request, Request):
            raise InvalidTypeError("expected a Request")
        config = self.config
        if isinstance(request.prompt, (str, bytes)) or not isinstance(request.prompt, Iterable):
            raise InvalidTypeError("prompt must be a sequence of token ids")
        prompt = list(request.prompt)
        if not prompt:
            raise InvalidTokenError("a prompt needs at least one token")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
            raise InvalidTypeError("prompt token ids must be ints")
        if min(prompt) < 0 or max(prompt) >= config.model.vocab_size:
            raise InvalidTokenError(f"prompt token ids must lie in [0, {config.model.vocab_size})")
        if config.adapters is not None and request.adapter is not None and request.adapter not in config.adapters:
            raise InvalidNamespaceError(f"unknown adapter {request.adapter!r}")
        spans = [MultimodalSpan(m.start, m.end, m.modality, m.content_id) for m in request.multimodal]
        seq = Sequence(
            prompt,
            adapter=request.adapter,
            cache_salt=request.cache_salt,
            multimodal=spans,
            want_routed_experts=request.return_routed_experts,
        )
        return ServingSequence(next(self._ids), seq, request.max_new_tokens, payload=request)

    def generate(self, requests: list[Request]) -> list[Result]:
        """Serve ``requests`` to completion; results in request order."""
        entries = [self._entry_for(request) for request in requests]  # all valid before any is queued
        for entry in entries:
            self._queue_entry(entry)
        ids = [entry.request_id for entry in entries]
        finished: dict[int, Result] = {}
        while len(finished) < len(ids):
            for result in self.step():
                finished[result.request_id] = result
        return [finished[i] for i in ids]

    # --- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Result]:
        """Schedule and queue one forward, and run what the async depth allows; returns the
        requests that finished."""
        batch = self.scheduler.schedule()
        if batch.chunks:
            self._queue.append(self._prepare(batch))
        finished: list[Result] = []
        executed = 0
        while self._queue and (len(self._queue) > self.config.async_depth or not batch.chunks):
            finished.extend(self._execute(self._queue.popleft()))
            executed += 1
        if not batch.chunks and not executed and self.scheduler.has_work:
            self._unstick()
        return finished

    def _unstick(self) -> None:
        """Nothing could be scheduled although requests wait: the cache holds the room they
        need. Drop every unpinned checkpoint and cached leaf before the next attempt."""
        self._counters["cache_flushes"] += 1
        freed = self.trie.clear()
        if freed == 0 and not self.scheduler.running:
            raise RuntimeError("a waiting request can never fit: pools are too small for it")

    def _prepare(self, batch: ScheduledBatch) -> _QueuedForward:
        config = self.config
        plan = build_copy_plan(batch.chunks, self.trie, config.shared_write_guard)
        inputs = [self._forward_input(chunk) for chunk in batch.chunks]
        checkpoints = self.trie.checkpoints
        for chunk in batch.chunks:
            if checkpoints is not None:
                checkpoints.publish_save(chunk.entry.seq, pin=True, in_flight=True)
                checkpoints.unpin_restore(chunk.entry.seq)
        return _QueuedForward(batch, plan, inputs)

    def _forward_input(self, chunk: ScheduledChunk) -> ForwardChunk:
        seq, request = chunk.entry.seq, chunk.entry.payload
        multimodal = [(m.start, m.end, bytes(m.data)) for m in request.multimodal if m.start < chunk.end and m.end > chunk.start]
        writable = None
        if self.config.shared_write_guard:
            writable = self.trie.exclusive_blocks(seq, chunk.start, chunk.end)
        return ForwardChunk(
            token_ids=seq.token_view(chunk.start, chunk.end).tolist(),
            start=chunk.start,
            block_table=np.array(seq.block_table),
            state_slot=chunk.entry.runtime_slot,
            adapter=request.adapter,
            multimodal=multimodal,
            writable_blocks=writable,
        )

    def _execute(self, queued: _QueuedForward) -> list[Result]:
        plan, cache = queued.plan, self.cache
        try:
            self._fault_point("before_restore")
            for slot in plan.zero_states:
                cache.zero_state(slot)
            cache.copy_blocks(*plan.restore_blocks)
            cache.copy_states(*plan.restore_states)
            self._fault_point("after_restore")
            outputs = self.model.forward(queued.inputs, cache)
            self._fault_point("before_save")
            cache.copy_blocks(*plan.save_blocks)
            cache.copy_states(*plan.save_states)
            self._fault_point("after_save")
        except Exception:
            self._counters["failed_forwards"] += 1
            for chunk in queued.batch.chunks:
                self.scheduler.abort(chunk)
            return []
        self._counters["forwards"] += 1
        self._counters["computed_tokens"] += queued.batch.num_tokens
        finished = []
        for chunk, output in zip(queued.batch.chunks, outputs):
            if self.trie.checkpoints is not None:
                self.trie.checkpoints.unpin_save(chunk.entry.seq)
            rows = output.routed_experts if chunk.entry.seq.want_routed_experts else None
            if self.scheduler.complete(chunk, output.next_token, rows):
                self._entries.pop(chunk.entry.request_id, None)
                finished.append(self._result(chunk.entry))
        return finished

    def _result(self, entry: ServingSequence) -> Result:
        seq = entry.seq
        prompt_tokens = len(entry.payload.prompt)
        return Result(
            request_id=entry.request_id,
            prompt_tokens=prompt_tokens,
            tokens=seq.tokens[prompt_tokens:].tolist(),
            cached_tokens=entry.cached_tokens,
            routed_experts=entry.final_routed_experts,
        )

    # --- fault injection (tests) ---------------------------------------------------------------

    def inject_fault(self, stage: str) -> None:
        """Make the next executed forward raise at ``stage`` (one of ``FAULT_STAGES``)."""
        if stage not in FAULT_STAGES:
            raise InvalidConfigError(f"unknown fault stage {stage!r}")
        self._faults.append(stage)

    def _fault_point(self, stage: str) -> None:
        if self._faults and self._faults[0] == stage:
            self._faults.popleft()
            raise InjectedFault(stage)

    # --- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        stats = self.trie.stats.as_dict()
        stats.update(self._counters)
        stats["preemptions"] = self.scheduler.preemptions
        stats["free_blocks"] = self.pool.num_free
        stats["free_state_slots"] = self.states.num_free
        return stats

    def check_invariants(self) -> None:
        self.trie.check_invariants(self.scheduler.live_sequences())
        self.scheduler.check_invariants()
        self.states.check_invariants()

    def clear_cache(self) -> int:
        """Release every cached block and checkpoint not in use; with no request in progress,
        every pool is full afterwards."""
        return self.trie.clear()
