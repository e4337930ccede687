"""Two lmdeploy Schedulers driven by one schedule: one with lmdeploy's own BlockTrie, one with
hybridcache's adapter. After every step the adapter's invariants are checked and everything
the engine observes (steps, block tables, reference counts, free blocks and state rows, hit
statistics, restores, replayed experts) must be equal in both."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import MessageStatus, SamplingParam, SequenceMeta, UpdateTokenMode
from lmdeploy.pytorch.multimodal.data_type import MultiModalData
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

from hybridcache.integrations import lmdeploy as adapter

BLOCK = 16
EXPERT_ROW = (2, 1)  # per-token routed-expert row shape (layers, top-k)


def make_scheduler(*, hybridcache: bool, ssm: bool, num_gpu_blocks: int, max_batches: int = 4, state_budget: int = 4) -> Scheduler:
    states = dict(num_state_caches=max_batches + 1 + state_budget, prefix_cache_state_budget=state_budget, states_shapes=[((1,), torch.float32)]) if ssm else {}
    cache_config = CacheConfig(
        max_batches=max_batches, block_size=BLOCK, num_cpu_blocks=0, num_gpu_blocks=num_gpu_blocks, enable_prefix_caching=True, **states
    )
    scheduler_config = SchedulerConfig(max_batches=max_batches, max_session_len=4096, max_request_output_len=64, eviction_type="recompute")
    if hybridcache:
        adapter.install()
    try:
        return Scheduler(scheduler_config=scheduler_config, cache_config=cache_config, seq_meta=SequenceMeta(BLOCK, strategy=ARSequenceStrategy()))
    finally:
        adapter.uninstall()


def image(start: int, end: int, content: str) -> dict:
    data = torch.full((2, 2), float(len(content)), dtype=torch.float32)
    return dict(image=[MultiModalData(data=data, start=start, end=end, meta=dict(image_token_id=99), content_hash=content)])


def experts_for(tokens: int, offset: int) -> np.ndarray:
    return (np.arange(tokens * 2, dtype=np.uint16) + offset).reshape(tokens, *EXPERT_ROW)


class World:
    """One scheduler and the sequences the schedule named."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seqs: dict[str, object] = {}
        self.running: list[object] = []

    def add(self, name: str, session: int, tokens: list[int], *, multimodals=None, experts: bool = False, recompute_blocks: int = 0):
        sessions = self.scheduler.sessions
        owner = sessions[session] if session in sessions else self.scheduler.add_session(session)
        seq = owner.add_sequence(torch.tensor(tokens), multimodals=multimodals, sampling_param=SamplingParam(return_routed_experts=experts))
        seq.prefix_cache.recompute_overlap.recompute_blocks = recompute_blocks
        self.seqs[name] = seq

    def continue_turn(self, name: str, tokens: list[int]) -> None:
        """A new turn of a stopped sequence, as lmdeploy's engine adds one to a live session:
        the same sequence grows by the turn's tokens and waits again."""
        seq = self.seqs[name]
        seq.update_token_ids(torch.tensor(tokens), mode=UpdateTokenMode.INPUTS)
        seq.state.activate()

    def schedule(self) -> None:
        self.running = list(self.scheduler.schedule(is_prefill=True).running)

    def forward(self, token: int = 7) -> None:
        """What lmdeploy's inputs maker and engine loop do around one forward of the running
        sequences: save a checkpoint at the computed end (hybrid models), publish it with the
        producer pin, release the restore pins, record routed experts, append the sampled token,
        enrich the trie with the experts, release the producer pins; then end the turn."""
        checkpoints = self.scheduler.block_trie.state_checkpoints
        running = self.running
        if self.scheduler.is_ssm:
            for seq in running:
                checkpoints.reserve_save(seq)
            checkpoints.publish_saves(running, pin_saves=True)
            checkpoints.unpin_restores(running)
        for seq in running:
            if seq.return_routed_experts:
                seq.append_routed_experts(experts_for(seq.num_token_ids, offset=seq.num_history_ids))
            seq.update_token_ids(torch.tensor([token]), mode=UpdateTokenMode.DECODE)
        self.scheduler.block_trie.cache_routed_experts(running)
        if self.scheduler.is_ssm:
            checkpoints.unpin_saves(running)
        for seq in running:
            seq.state.stop()
        self.running = []

    def finish(self, name: str) -> None:
        seq = self.seqs.pop(name)
        seq.session.remove_sequence(seq)

    def observed(self) -> dict:
        scheduler = self.scheduler
        allocator = scheduler.block_manager.allocator
        seqs = {}
        for name, seq in self.seqs.items():
            blocks = seq.logical_blocks.get_real_blocks().astype(np.int64) if seq.num_blocks else np.empty(0, np.int64)
            experts = seq.all_routed_experts.get_real() if len(seq.all_routed_experts) else np.empty(0)
            seqs[name] = dict(
                status=seq.status.name,
                step=seq.num_history_ids,
                tokens=seq.num_token_ids,
                blocks=blocks.tolist(),
                refs=allocator.get_ref_count(blocks).tolist(),
                cached=seq.cached_tokens,
                restore=seq.prefix_cache.restore.slot,
                experts=np.asarray(experts).tolist(),
            )
        trie = scheduler.block_trie
        every_block = np.arange(scheduler.block_manager.num_gpu_blocks, dtype=np.int64)
        return dict(
            free_gpu=scheduler.block_manager.get_num_free_gpu_blocks(),
            block_refs=allocator.get_ref_count(every_block).tolist(),  # frozen copies included
            free_states=scheduler.state_manager.get_num_free(),
            runtime_states=scheduler.state_manager.get_num_runtime_states(),
            checkpoint_states=scheduler.state_manager.get_num_allocated_checkpoint_states(),
            hits=trie.stats.num_hit_tokens,
            queries=trie.stats.num_query_tokens,
            running=[name for name, seq in self.seqs.items() if seq in self.running],
            seqs=seqs,
        )


class Twins:
    """The same schedule on lmdeploy's trie (``reference``) and on hybridcache (``subject``)."""

    def __init__(self, *, ssm: bool, num_gpu_blocks: int, **config) -> None:
        self.reference = World(make_scheduler(hybridcache=False, ssm=ssm, num_gpu_blocks=num_gpu_blocks, **config))
        self.subject = World(make_scheduler(hybridcache=True, ssm=ssm, num_gpu_blocks=num_gpu_blocks, **config))
        assert isinstance(self.subject.scheduler.block_trie, adapter.LmdeployBlockTrie)
        assert not isinstance(self.reference.scheduler.block_trie, adapter.LmdeployBlockTrie)

    def step(self, action: Callable[[World], None]) -> dict:
        """Apply ``action`` to both worlds; returns what both observe (equal by then)."""
        reference, observed = self.step_both(action)
        assert observed == reference
        return observed

    def step_both(self, action: Callable[[World], None]) -> tuple[dict, dict]:
        """Apply ``action`` to both worlds; returns (reference, subject) observations, for the
        schedules where hybridcache deliberately keeps more than lmdeploy (see the tests)."""
        for world in (self.reference, self.subject):
            action(world)
        self.subject.scheduler.block_trie.check_invariants()
        return self.reference.observed(), self.subject.observed()

    def seq(self, name: str) -> object:
        return self.subject.seqs[name]


def waiting(observed: dict, name: str) -> bool:
    return observed["seqs"][name]["status"] == MessageStatus.WAITING.name
