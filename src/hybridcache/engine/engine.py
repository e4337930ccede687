"""The reference engine: schedule -> plans -> restore -> forward -> save -> publish -> unpin.

Owns: the model (built by ``model_factory`` from ``EngineConfig.model``), its cache storage,
the pools, the trie, the scheduler, the queue of forwards in flight, the finished results not
yet handed out, what each request's result will say (``outcomes.Outcomes``: logits kept, tier
miss reasons, the prompt heads served) and (``sampling.Sampler``) the seeded generators of
requests that sample. Requests are checked by ``request_checks``. ``async_depth=0`` runs each
forward as soon as it is queued; ``async_depth=1`` schedules the next forward while the previous one is still queued,
as a GPU engine overlapping host work with device work does. Checkpoints are published right
after their forward is queued and stay pinned (and unusable by matches) until its output is
in; restore pins are released once the forward carrying the copy is queued. Forwards execute
strictly in queue order, which is what makes releasing those pins early safe.

If a forward raises, nothing it would have produced stays matchable: its reserved or
published saves are dropped, the trie nodes it attached for blocks it did not write are
detached, and its sequences go back to recompute; the engine keeps serving. Nothing retries
forever: a request whose forward failed runs alone from then on, and one that has been in
``MAX_FORWARD_FAILURES`` failed forwards is finished with ``RequestFailedError`` on its
result. A request that could not fit even alone in empty pools is refused when it is added.

Given tiers (``hybridcache.tiers.TieredStore``), prefill chunks also end at multiples of
``tier_chunk_size``, each forward ending there publishes that step, and a request adopts the
deepest verified restore from the tiers before it is queued, both through one
``hybridcache.tiers.client.TierClient`` (its tensor reads and writes: ``engine.tiering``). The
tier side can only ever cost a miss or a failed publish (counted by reason): the client never
raises into the engine, so no request is stranded by a store or an object.

Results belong to whoever submitted the request: ``generate`` returns exactly its own, and
results of requests queued with ``add_request`` are handed out by ``step``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from hybridcache.cache import build_cache
from hybridcache.engine.copy_plan import CopyPlan, build_copy_plan
from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.model_api import ChunkOutput, ForwardChunk
from hybridcache.engine.model_factory import build_model
from hybridcache.engine.requests import Request, Result
from hybridcache.engine.outcomes import Outcomes
from hybridcache.engine.request_checks import validated_sequence
from hybridcache.engine.sampling import Sampler
from hybridcache.engine.tiering import engine_tier_client
from hybridcache.errors import HybridCacheError, InvalidTypeError, RequestFailedError, RequestTooLargeError
from hybridcache.policies import resolve_policy
from hybridcache.protocol import CacheProtocol
from hybridcache.scheduler.scheduler import ScheduledBatch, ScheduledChunk, Scheduler, ServingSequence
from hybridcache.sequence import Sequence
from hybridcache.tiers.client import ForwardEnd
from hybridcache.tiers.tiered import TieredStore
from hybridcache.types import as_int, as_ordered

MAX_FORWARD_FAILURES = 3  # the first failure isolates a request; two more alone end it


@dataclass
class _QueuedForward:
    batch: ScheduledBatch
    plan: CopyPlan
    inputs: list[ForwardChunk]


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, tiers: TieredStore | None = None) -> None:
        """``tiers``: host, disk and shared tiers to publish chunk-aligned prefixes to and
        restore them from (``hybridcache.tiers``); the caller owns and closes them."""
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise InvalidTypeError("config must be an EngineConfig")
        if tiers is not None and not isinstance(tiers, TieredStore):
            raise InvalidTypeError("tiers must be a TieredStore")
        self.config = config
        self.model = build_model(config.model, seed=config.seed, dtype=config.dtype)
        self.cache = self.model.new_storage(
            num_blocks=config.num_kv_blocks, block_size=config.block_size, num_state_slots=config.num_state_slots
        )
        eviction = resolve_policy(config.checkpoint_policy).eviction.new_state(None)
        built = build_cache(
            config.cache_config(hybrid=self.model.layout.is_hybrid), track_pending=True, eviction=eviction
        )
        self.pool, self.states, self.trie = built.pool, built.states, built.trie  # for inspection only
        self.prefix_cache = CacheProtocol(built)  # the scheduler and the engine drive the cache only through it
        self.tiers = None
        scheduler_config = replace(config.scheduler_config(), state_weight_tokens=self.model.layout.state_weight_tokens)
        if tiers is not None:
            self.tiers = engine_tier_client(tiers, self.model, self.cache, self.prefix_cache, config)
            scheduler_config = replace(scheduler_config, chunk_align=config.tier_chunk_size)
        self.scheduler = Scheduler(scheduler_config, self.prefix_cache)
        self._entries: dict[int, ServingSequence] = {}
        self._ids = itertools.count()
        self._queue: deque[_QueuedForward] = deque()
        self._undelivered: list[Result] = []
        self._outcomes = Outcomes(config.block_size, self.model.layout.vocab_size)
        self._sampler = Sampler()
        self._counters = {"forwards": 0, "failed_forwards": 0, "computed_tokens": 0, "cache_flushes": 0}
        self.events = self._open_events(config)

    def _open_events(self, config: EngineConfig):
        """The KV and checkpoint streams when ``config.kv_events`` enables them (imported only
        then: pyzmq and msgspec are the ``events`` extra)."""
        if not config.kv_events.active:
            return None
        from hybridcache.engine.kv_events import EngineEvents

        return EngineEvents(config.kv_events, self.prefix_cache, block_size=config.block_size,
                            state_bytes=self.model.layout.state_bytes or None, tiers=self.tiers)

    def close(self) -> None:
        """Close the event streams (the engine serves on without them)."""
        if self.events is not None:
            self.events.close()
            self.events = None

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Its result is handed out by ``step``. Invalid
        requests raise and change nothing, request ids included."""
        seq = self._validated(request)
        return self._enqueue(request, seq).request_id

    def _enqueue(self, request: Request, seq: Sequence) -> ServingSequence:
        tier_miss = None
        if self.tiers is not None:
            # An adoption writes blocks and slots now; forwards already queued must have run
            # first, as their copies may read a checkpoint slot the adoption's room reuses.
            while self._queue:
                self._undelivered.extend(self._execute(self._queue.popleft()))
            tier_miss = self.tiers.adopt_prefix(seq).miss_reason
        entry = ServingSequence(next(self._ids), seq, request.max_new_tokens, payload=request)
        self._entries[entry.request_id] = entry
        self._outcomes.queued(entry, tier_miss, self.prefix_cache.enabled)
        self.scheduler.add(entry)
        return entry

    def cancel(self, request_id: int) -> bool:
        """Drop an unfinished request (a forward in flight for it completes first and its
        output is discarded). Returns False when the id is unknown or already finished."""
        entry = self._entries.pop(as_int("request_id", request_id), None)
        if entry is None:
            return False
        self._outcomes.forget(entry.request_id)
        self._sampler.forget(entry.request_id)
        self.scheduler.cancel(entry)
        return True

    def progress(self, request_id: int) -> Result | None:
        """An unfinished request's result so far: the tokens generated up to now and its cached
        depth (no logits, no routed experts). None when the id is unknown or already finished."""
        entry = self._entries.get(as_int("request_id", request_id))
        return None if entry is None else self._outcomes.summary(entry)

    def _validated(self, request: Request) -> Sequence:
        """Check a request against this engine and build its sequence (nothing is queued)."""
        return validated_sequence(request, self.config, self.model.layout)

    def generate(self, requests: list[Request]) -> list[Result]:
        """Serve ``requests`` to completion; their results in request order. Requests queued
        earlier with ``add_request`` keep running, and their results wait for ``step``."""
        requests = as_ordered("requests", requests)
        sequences = [self._validated(request) for request in requests]  # all valid before any is queued
        ids = [self._enqueue(request, seq).request_id for request, seq in zip(requests, sequences)]
        mine, finished = set(ids), {}
        while len(finished) < len(ids):
            for result in self._advance():
                if result.request_id in mine:
                    finished[result.request_id] = result
                else:
                    self._undelivered.append(result)
        return [finished[i] for i in ids]

    # --- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Result]:
        """Schedule and queue one forward, and run what the async depth allows; returns the
        requests queued with ``add_request`` that finished (including any that finished while
        ``generate`` was serving other requests)."""
        finished, self._undelivered = self._undelivered, []
        finished.extend(self._advance())
        return finished

    def _advance(self) -> list[Result]:
        batch = self.scheduler.schedule()
        if batch.chunks:
            self._queue.append(self._prepare(batch))
            if self.events is not None:  # what the schedule evicted, announced before the forward runs
                self.events.publish_changes()
        finished: list[Result] = []
        executed = 0
        while self._queue and (len(self._queue) > self.config.async_depth or not batch.chunks):
            finished.extend(self._execute(self._queue.popleft()))
            executed += 1
        if not batch.chunks and not executed and self.scheduler.has_work:
            finished.extend(self._unstick())
        if self.events is not None:
            self.events.publish_changes()
        return finished

    def _unstick(self) -> list[Result]:
        """Nothing could be scheduled although requests wait: the cache holds the room they
        need. Drop every unpinned checkpoint and cached leaf before the next attempt; when
        that frees nothing and nothing runs, the request at the head can never be admitted,
        so it is ended with an error instead of blocking the queue."""
        self._counters["cache_flushes"] += 1
        if self.prefix_cache.clear() or self.scheduler.running:
            return []
        entry = self.scheduler.drop_waiting_head()
        self._entries.pop(entry.request_id, None)
        return [self._result(entry, RequestTooLargeError("the request cannot be admitted even into empty pools"))]

    def _prepare(self, batch: ScheduledBatch) -> _QueuedForward:
        config = self.config
        plan = build_copy_plan(batch.chunks, self.prefix_cache, config.shared_write_guard)
        inputs = [self._forward_input(chunk) for chunk in batch.chunks]
        for chunk in batch.chunks:
            self.prefix_cache.forward_queued(chunk.entry.seq)
        return _QueuedForward(batch, plan, inputs)

    def _forward_input(self, chunk: ScheduledChunk) -> ForwardChunk:
        seq, request = chunk.entry.seq, chunk.entry.payload
        multimodal = [(m.start, m.end, bytes(m.data)) for m in request.multimodal if m.start < chunk.end and m.end > chunk.start]
        writable = None
        if self.config.shared_write_guard:
            writable = self.prefix_cache.writable_blocks(seq, chunk.start, chunk.end)
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
            for slot in plan.zero_states:
                cache.zero_state(slot)
            cache.copy_blocks(*plan.restore_blocks)
            cache.copy_states(*plan.restore_states)
            began = time.perf_counter()
            outputs = self.model.forward(queued.inputs, cache)
            forward_s = time.perf_counter() - began
            cache.copy_blocks(*plan.save_blocks)
            cache.copy_states(*plan.save_states)
        except Exception as error:  # the model's or a copy's failure: recompute, never lose the engine
            self._counters["failed_forwards"] += 1
            return self._fail_forward(queued.batch, error)
        self._counters["forwards"] += 1
        self._counters["computed_tokens"] += queued.batch.num_tokens
        if self.tiers is not None:
            ends = [ForwardEnd(chunk.entry.seq, chunk.end, chunk.entry.runtime_slot) for chunk in queued.batch.chunks]
            self.tiers.after_forward(ends, queued.batch.num_tokens, forward_s)
        finished = []
        for chunk, output in zip(queued.batch.chunks, outputs):
            try:
                token = self._next_token(chunk, output)
            except Exception as error:  # this request's own draw failed: end it, not its batch or the engine
                finished.extend(self._fail_draw(chunk, error))
                continue
            rows = output.routed_experts if chunk.entry.seq.want_routed_experts else None
            generated = chunk.entry.generated
            done = self.scheduler.complete(chunk, token, rows)
            if chunk.entry.generated > generated:
                self._outcomes.keep_logits(chunk.entry, output)
            if done:
                self._entries.pop(chunk.entry.request_id, None)
                finished.append(self._result(chunk.entry))
        return finished

    def _next_token(self, chunk: ScheduledChunk, output: ChunkOutput) -> int:
        """The model's greedy token, or one drawn for a request that samples."""
        request = chunk.entry.payload
        if request.temperature == 0.0 or not chunk.produces_token:
            return output.next_token
        return self._sampler.choose(chunk.entry.request_id, output.logits, request.temperature, request.top_p, request.seed)

    def _fail_draw(self, chunk: ScheduledChunk, error: Exception) -> list[Result]:
        """The forward ran, the draw failed: the chunk dropped as a failed forward's, the request ended."""
        self.scheduler.abort(chunk, retry=False)  # a retry would draw the same way
        if self._entries.pop(chunk.entry.request_id, None) is None:  # cancelled while in flight
            return []
        failure = RequestFailedError(f"drawing request {chunk.entry.request_id}'s next token failed: {type(error).__name__}")
        failure.__cause__ = error
        return [self._result(chunk.entry, failure)]

    def _fail_forward(self, batch: ScheduledBatch, error: Exception) -> list[Result]:
        """Send each request of a failed forward back to recompute, alone from now on (so a
        failure tied to one request cannot starve the others); end the ones that have been in
        ``MAX_FORWARD_FAILURES`` failed forwards."""
        ended = []
        for chunk in batch.chunks:
            entry = chunk.entry
            entry.forward_failures += 1
            retry = entry.forward_failures < MAX_FORWARD_FAILURES
            self.scheduler.abort(chunk, retry=retry)
            if not retry and self._entries.pop(entry.request_id, None) is not None:
                failure = RequestFailedError(f"{entry.forward_failures} forwards carrying request {entry.request_id} failed")
                failure.__cause__ = error
                ended.append(self._result(entry, failure))
        return ended

    def _result(self, entry: ServingSequence, error: HybridCacheError | None = None) -> Result:
        self._sampler.forget(entry.request_id)
        return self._outcomes.result(entry, error)

    # --- introspection -------------------------------------------------------------------------

    def stats(self) -> dict:
        stats = self.prefix_cache.stats()
        stats.update(self._counters)
        if self.tiers is not None:
            stats["tiers"] = self.tiers.stats_dict()
        stats["preemptions"] = self.scheduler.preemptions
        return stats

    def check_invariants(self) -> None:
        """The cache's and scheduler's invariants, and that a request is in flight exactly
        when a queued forward carries it (none is stranded by a forward that never runs)."""
        carried = [id(chunk.entry) for queued in self._queue for chunk in queued.batch.chunks]
        assert len(set(carried)) == len(carried), "one request is in two queued forwards"
        for entry in (*self.scheduler.running, *self.scheduler.waiting):
            assert entry.in_flight == (id(entry) in set(carried)), "a request is in flight with no forward queued"
        assert self._sampler.request_ids() <= self._entries.keys(), "a finished request kept its generator"
        self._outcomes.check_invariants(set(self._entries))
        self.prefix_cache.check_invariants(self.scheduler.live_sequences())
        self.scheduler.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants()

    def clear_cache(self) -> int:
        """Release every cached block and checkpoint not in use; with no request in progress,
        every pool is full afterwards (the turn-end checkpoints the scheduler holds for a
        conversation's next turn are released first)."""
        self.scheduler.arrival_pins.release_holds()
        freed = self.prefix_cache.clear()
        if self.events is not None:
            self.events.publish_changes()
        return freed
