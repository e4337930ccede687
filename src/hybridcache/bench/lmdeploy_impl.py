"""The reference implementation behind the benchmark interface: lmdeploy's prefix cache.

``LmdeployImpl`` drives the CPU-side prefix cache of ``lmdeploy==0.18.0`` (its ``BlockTrie`` with
the sparse checkpoint index and checkpoint lifecycle, its logical block allocator and state
manager, and its scheduler sequences) through the same :class:`~hybridcache.bench.impl.Impl`
operations as ``HybridcacheImpl``, so a scenario times both on the same prompts. It is an
adapter only: every cache decision is lmdeploy's own code, called through its modules.

Installing: ``make compare-setup`` puts lmdeploy into the project venv with ``--no-deps`` (so pip
never replaces our CPU torch) plus the few pure-host packages its scheduler modules import.
Nothing here imports lmdeploy until :meth:`LmdeployImpl.setup` runs, so ``hybridcache`` imports
without it; a missing or broken install raises ``RuntimeError("run make compare-setup first")``.

How each object is built (all on the CPU; no CUDA device, kernel or model is touched):

* One real ``lmdeploy.pytorch.paging.scheduler.Scheduler`` per :meth:`setup`, from a
  ``CacheConfig(block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0,
  enable_prefix_caching=True, device_type="cpu")`` and a ``SequenceMeta`` carrying its
  autoregressive sequence strategy. The scheduler builds the pieces we use: the block manager
  (its ``LogicalAllocator``), the state manager, the ``BlockTrie`` and the sequence lifecycle.
  Hybrid mode gives the config one dummy entry in ``states_shapes`` (only its presence is read:
  it switches the trie to checkpoint matching with the state manager as checkpoint owner) and
  sizes the state pool like ours: ``num_checkpoints + 2`` rows, row 0 reserved,
  ``prefix_cache_state_budget = num_checkpoints``. Plain mode passes no state shapes, so the
  trie runs its block-by-block KV matcher.
* Requests are that scheduler's own ``SchedulerSequence`` objects made by
  ``SchedulerSession.add_sequence(tokens)``. :meth:`new_requests` detaches each one from the
  session registry right away (``remove_sequence``: it owns nothing yet), so a batch the
  scenario drops is garbage collected; the detached sequence keeps its lifecycle state object,
  which is what rollback uses to free it.
* :meth:`admit` / :meth:`prefill` follow the scheduler's admission and the engine's prefill:
  ``block_trie.match`` (a prefill may reuse an earlier checkpoint or blocks),
  ``block_manager.allocate``, ``block_trie.allocate`` (attaches the prompt's complete blocks),
  ``finalize_match``, then the prompt is marked computed with ``set_step``. Checkpoints are
  published the way lmdeploy's engine loop does it, ``state_checkpoints.reserve_save(seq, step)``
  then ``state_checkpoints.publish_save(seq)``; a mid-block step makes a partial checkpoint with a
  frozen block. No runtime state slot is taken (``HybridcacheImpl`` takes none either, and the
  trie never reads it). :meth:`release` is ``SchedulerSession.remove_sequence``: its blocks are
  freed while the trie keeps its own references.
* :meth:`match` is the scheduler-time match: per request the prefill scheduler's tentative match
  object (``_TentativePrefixMatch``: a statistics snapshot, then ``BlockTrie.match(seq)``).
  :meth:`rollback` calls that object's ``rollback`` in reverse order (stacked snapshots), which
  restores the statistics and releases the sequence's blocks, back to step 0.
* :meth:`evict_checkpoints` is ``state_checkpoints.evict(k)``; :meth:`evict_blocks` is
  ``block_trie.evict(n)`` (frozen partial blocks first, then LRU trie leaves).
* :meth:`metadata_bytes` sums, over published checkpoints (found through the trie's sparse
  index), the ``nbytes`` of their exact-match arrays (``token_ids``, ``block_ids``) plus the same
  rough fixed size per record our records count (16 words, 64 bytes per multimodal span).

Import notes: lmdeploy's package ``__init__`` loads its serving stack (transformers, pydantic,
...), and its sequence strategy module imports the engine's model agent (pyzmq, xgrammar); all of
it imports on a CPU-only torch and no stub is needed. The import takes a few seconds and is done
once per process. Warnings raised while importing (e.g. requests' missing charset detector) are
silenced.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np

from hybridcache.bench.impl import Impl
from hybridcache.errors import BenchmarkSetupError

REFERENCE_VERSION = "0.18.0"
SETUP_HINT = "run make compare-setup first"
_FIXED_RECORD_BYTES = 16 * 8
_SPAN_BYTES = 64

_api: SimpleNamespace | None = None


def load_lmdeploy() -> SimpleNamespace:
    """Import the lmdeploy pieces the adapter uses (once), or raise the setup hint."""
    global _api
    if _api is not None:
        return _api
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import lmdeploy
            from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
            from lmdeploy.pytorch.messages import SequenceMeta
            from lmdeploy.pytorch.paging.prefill_scheduler import _TentativePrefixMatch
            from lmdeploy.pytorch.paging.scheduler import Scheduler
            from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy
    except Exception as exc:  # ImportError, or a dependency that fails while importing
        raise BenchmarkSetupError(f"lmdeploy is not importable ({type(exc).__name__}: {exc}); {SETUP_HINT}") from exc
    version = getattr(lmdeploy, "__version__", "?")
    if version != REFERENCE_VERSION:
        raise BenchmarkSetupError(f"lmdeploy {version} is installed, the benchmarks use {REFERENCE_VERSION}; {SETUP_HINT}")
    _api = SimpleNamespace(
        version=version,
        CacheConfig=CacheConfig,
        SchedulerConfig=SchedulerConfig,
        SequenceMeta=SequenceMeta,
        Scheduler=Scheduler,
        ARSequenceStrategy=ARSequenceStrategy,
        TentativePrefixMatch=_TentativePrefixMatch,
    )
    return _api


class LmdeployImpl(Impl):
    name = "lmdeploy"

    def setup(self, *, num_blocks: int, num_checkpoints: int, block_size: int, hybrid: bool) -> None:
        lm = load_lmdeploy()
        self.block_size = block_size
        self.hybrid = hybrid
        cache_config = lm.CacheConfig(
            max_batches=1,
            block_size=block_size,
            num_cpu_blocks=0,
            num_gpu_blocks=num_blocks,
            enable_prefix_caching=True,
            device_type="cpu",
            num_state_caches=num_checkpoints + 2 if hybrid else None,
            prefix_cache_state_budget=num_checkpoints if hybrid else 0,
            states_shapes=[((1,), np.float32)] if hybrid else [],
        )
        scheduler_config = lm.SchedulerConfig(max_batches=1, max_session_len=1 << 40)
        meta = lm.SequenceMeta(block_size, strategy=lm.ARSequenceStrategy())
        self.scheduler = lm.Scheduler(scheduler_config, cache_config, seq_meta=meta)
        assert self.scheduler.is_ssm == hybrid
        self.trie = self.scheduler.block_trie
        self.block_manager = self.scheduler.block_manager
        self.state_manager = self.scheduler.state_manager
        self.checkpoints = self.trie.state_checkpoints
        self.session = self.scheduler.add_session(0)
        self._tentative = lm.TentativePrefixMatch

    # --- requests ------------------------------------------------------------------------

    def _sequence(self, prompt: np.ndarray):
        return self.session.add_sequence(np.asarray(prompt))

    def admit(self, prompt: np.ndarray):
        """Admit ``prompt`` as the scheduler does and mark the whole prompt computed."""
        seq = self._sequence(prompt)
        self.trie.match(seq)
        self.block_manager.allocate(seq)
        self.trie.allocate(seq)
        self.trie.finalize_match(seq)
        seq.set_step(seq.num_all_ids)
        return seq

    def release(self, request) -> None:
        """The request ends: its blocks go back, the trie keeps its own references."""
        self.session.remove_sequence(request)

    def prefill(self, prompt: np.ndarray, save_steps: tuple[int, ...] = ()) -> None:
        seq = self.admit(prompt)
        if self.hybrid:
            for step in save_steps:
                self.reserve_and_publish(seq, step)
        self.release(seq)

    def new_requests(self, prompts: list[np.ndarray]) -> list:
        requests = [self._sequence(prompt) for prompt in prompts]
        for seq in requests:
            self.session.remove_sequence(seq)  # owns nothing yet; lets a dropped batch be collected
        return requests

    # --- matching ------------------------------------------------------------------------

    def match(self, requests: list) -> list:
        tentative, trie, block_manager, is_ssm = self._tentative, self.trie, self.block_manager, self.hybrid
        handles = []
        for seq in requests:
            txn = tentative(seq, trie, block_manager, is_ssm=is_ssm, preserve_existing_state=False)
            txn.match()
            handles.append(txn)
        return handles

    def rollback(self, requests: list, handles: list) -> None:
        for txn in reversed(handles):
            txn.rollback("benchmark rollback")

    def hit_tokens(self, request) -> int:
        return int(request.num_history_ids)

    # --- checkpoint lifecycle ------------------------------------------------------------

    def reserve_and_publish(self, request, step: int) -> None:
        slot = self.checkpoints.reserve_save(request, step)
        if slot < 0:
            raise BenchmarkSetupError(f"lmdeploy refused to reserve a checkpoint at step {step}")
        if not self.checkpoints.publish_save(request):
            raise BenchmarkSetupError(f"lmdeploy refused to publish the checkpoint at step {step}")

    def evict_checkpoints(self, count: int) -> int:
        return int(self.checkpoints.evict(count))

    def evict_blocks(self, count: int) -> int:
        return int(self.trie.evict(count))

    def published_checkpoints(self) -> list:
        """The checkpoint records currently matchable (via the trie's sparse index)."""
        records = []
        for node in self.trie._checkpoint_index.unique_nodes():
            record = node.state_checkpoint
            if record is not None and record.published and record.exact_match_data is not None:
                records.append(record)
        return records

    def metadata_bytes(self) -> int:
        total = 0
        for record in self.published_checkpoints():
            data = record.exact_match_data
            total += data.token_ids.nbytes + data.block_ids.nbytes
            total += _FIXED_RECORD_BYTES + _SPAN_BYTES * len(data.extra_identity)
        return total

    @property
    def hit_rate(self) -> float:
        return float(self.trie.stats.hit_rate())
