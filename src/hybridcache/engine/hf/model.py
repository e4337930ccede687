"""``HFModel``: a local transformers causal LM served over paged KV blocks and state slots.

Owns: the loaded transformers model (weights fixed after loading, with the single-token
time-step hooks of ``time_steps``), its ``ModelLayout`` read from a probe forward, and the
router hooks (``RouterHooks``) with their per-call buffers.
Every KV entry and recurrent state lives in the caller's ``PagedStorage``: per chunk a fresh
``DynamicCache`` is built from the chunk's blocks and slot, the model runs the chunk as one
multi-token call with explicit positions, and the new KV and final state are written back.

Mixers that clamp the SSM time step only in their multi-token scan (NemotronH, Zamba2) get the
same clamp in their single-token step (``time_steps``), so decoding equals the full forward.
Families whose multi-token path ignores a restored state (a Mamba1 scan, as in Jamba and Zamba)
are found at load time by ``_detect_resume`` and resume token by token after position 0.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np
import torch

from hybridcache.engine.hf.cache_bridge import build_cache, store_cache
from hybridcache.engine.hf.config import HFModelConfig
from hybridcache.engine.hf.introspect import probe_model
from hybridcache.engine.hf.loading import load_causal_lm
from hybridcache.engine.hf.routing import RouterHooks
from hybridcache.engine.hf.time_steps import clamp_single_token_time_steps
from hybridcache.engine.chunk_checks import (
    as_index,
    check_writable,
    validated_expert_rows,
    validated_replays,
    validated_table,
    validated_tokens,
)
from hybridcache.engine.model_identity import identity_digest, implementation_choices, library_versions
from hybridcache.engine.model_api import (
    CHUNK_RESUME,
    TOKEN_BY_TOKEN_RESUME,
    ChunkOutput,
    ForwardChunk,
    ModelLayout,
)
from hybridcache.engine.paged_storage import PagedStorage
from hybridcache.errors import InvalidArgumentError, InvalidTypeError, SharedWriteError

# Resume detection: a restored state of this size must move the logits of a resumed chunk by far
# more than float32 rounding, so a path that ignores it stands out.
_RESUME_PROBE_SPLIT = 3
_RESUME_PROBE_STATE_STD = 1.0
_RESUME_PROBE_RTOL = 1e-3
# Config keys that say where a checkpoint was read from or which version wrote it, not what it computes.
_LOCATION_KEYS = ("_name_or_path", "_commit_hash", "transformers_version")


@contextlib.contextmanager
def _intra_op_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _gap(left: np.ndarray, right: np.ndarray) -> float:
    return float(np.abs(left - right).max())


@dataclass(frozen=True)
class _Plan:
    tokens: list[int]
    start: int
    table: torch.Tensor  # int64 block ids covering [0, start + len)
    slot: int
    replay: np.ndarray | None


class HFModel:
    """A transformers checkpoint behind the ``PagedModel`` interface."""

    def __init__(self, config: HFModelConfig) -> None:
        if not isinstance(config, HFModelConfig):
            raise InvalidTypeError("config must be an HFModelConfig")
        self.config = config
        self._model = load_causal_lm(config)
        clamp_single_token_time_steps(self._model)  # decode must compute what the full forward does
        parameters = inspect.signature(self._model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._keeps_last_logits = "logits_to_keep" in parameters
        vocab_size = self._model.config.get_text_config(decoder=True).vocab_size
        with _intra_op_threads(config.num_threads):
            probe = probe_model(self._model, vocab_size)
            self._routers = RouterHooks(probe.routers, probe.router_outputs)
            self.layout = ModelLayout(probe.layers, vocab_size, self._routers.width, CHUNK_RESUME)
            self.layout = replace(self.layout, resume=self._detect_resume())

    def weights_identity(self) -> str:
        """The digest of everything this checkpoint computes with: its family and whole config
        (``rope_theta``, norm epsilons, embedding multipliers, experts per token, ...), every
        parameter and buffer (non-persistent ones such as a rotary ``inv_freq`` included), the
        dtype, thread count and attention/expert implementations it runs with, and the torch and
        transformers versions and optional kernels installed. The
        checkpoint's path is not part of it: a copy elsewhere is the same model."""
        import transformers

        config = {k: v for k, v in self._model.config.to_dict().items() if k not in _LOCATION_KEYS}
        described = {
            "config": config,
            "implementations": implementation_choices(self._model.config),
            "dtype": self.config.dtype,
            "num_threads": self.config.num_threads,
        }
        module = self._model
        tensors = itertools.chain(module.named_parameters(), (("buffer:" + n, b) for n, b in module.named_buffers()))
        return identity_digest(self._model.config.model_type, described, tensors, library_versions(transformers))

    @property
    def transformers_model(self) -> torch.nn.Module:
        """The underlying transformers model (read only: the adapter relies on its weights)."""
        return self._model

    def new_storage(self, *, num_blocks: int, block_size: int, num_state_slots: int) -> PagedStorage:
        return PagedStorage(self.layout, num_blocks=num_blocks, block_size=block_size, num_state_slots=num_state_slots)

    # --- public ------------------------------------------------------------------------------

    def forward(
        self,
        chunks: Sequence[ForwardChunk],
        storage: PagedStorage,
        *,
        replay_experts: Sequence[np.ndarray | None] | None = None,
    ) -> list[ChunkOutput]:
        """Run every chunk, writing its KV and final state into ``storage``.

        All chunks are validated before anything is written. Chunks run one after another and
        share nothing. ``replay_experts`` (one entry per chunk) forces recorded expert choices.
        """
        self._check_storage(storage)
        plans = self._validated_plans(chunks, storage, replay_experts)
        token_by_token = self.layout.resume == TOKEN_BY_TOKEN_RESUME
        with torch.no_grad(), _intra_op_threads(self.config.num_threads):
            return [self._run_chunk(plan, storage, token_by_token and plan.start > 0) for plan in plans]

    # --- one chunk ---------------------------------------------------------------------------

    def _run_chunk(self, plan: _Plan, storage: PagedStorage, token_by_token: bool) -> ChunkOutput:
        end = plan.start + len(plan.tokens)
        cache = build_cache(self._model.config, self.layout, storage, (plan.table, plan.start, plan.slot))
        pieces = [(p, p + 1) for p in range(plan.start, end)] if token_by_token else [(plan.start, end)]
        rows, logits = [], None
        for first, last in pieces:
            offsets = slice(first - plan.start, last - plan.start)
            replay = None if plan.replay is None else plan.replay[offsets]
            logits, experts = self._call(plan.tokens[offsets], first, cache, replay)
            rows.append(experts)
        store_cache(cache, self.layout, storage, (plan.table, plan.start, end, plan.slot))
        return ChunkOutput(int(torch.argmax(logits)), np.concatenate(rows), logits.numpy().copy())

    def _call(self, tokens: list[int], start: int, cache: object, replay: np.ndarray | None) -> tuple:
        """One model call over ``tokens`` at positions ``[start, start + len)``."""
        arguments = {
            "input_ids": torch.tensor([tokens], dtype=torch.int64),
            "position_ids": torch.arange(start, start + len(tokens)).unsqueeze(0),
            self._cache_argument: cache,
            "use_cache": True,
        }
        if self._keeps_last_logits:
            arguments["logits_to_keep"] = 1
        self._routers.begin(replay)
        outputs = self._model(**arguments)
        return outputs.logits[0, -1].detach().clone(), self._routers.finish(len(tokens))

    # --- resume detection --------------------------------------------------------------------

    def _detect_resume(self) -> str:
        """``token_by_token`` when a multi-token chunk mishandles a restored state.

        Two copies of a random state resume the same tokens, once as one multi-token call and
        once token by token: where the paths agree, chunks are safe. Where they disagree (a
        Mamba1 scan drops the initial state; some SSD paths clamp the time step only in one
        of them), the path closer to an uncached forward over the whole probe wins.
        """
        if not self.layout.is_hybrid:
            return CHUNK_RESUME
        split = _RESUME_PROBE_SPLIT
        tokens = [(7 * position + 3) % self.layout.vocab_size for position in range(2 * split)]
        storage = self.new_storage(num_blocks=5, block_size=split, num_state_slots=4)
        with torch.no_grad():
            self._run_chunk(_Plan(tokens[:split], 0, torch.tensor([0, 1]), 1, None), storage, False)
            full = self._run_chunk(_Plan(tokens, 0, torch.tensor([3, 4]), 3, None), storage, False).logits
            true_chunk, true_step = self._resume_both_ways(storage, tokens[split:])
            generator = torch.Generator().manual_seed(0)
            for tensor in storage.states.values():
                noise = torch.randn(tensor[1].shape, generator=generator, dtype=torch.float64)
                tensor[1] = (noise * _RESUME_PROBE_STATE_STD).to(tensor.dtype)
            random_chunk, random_step = self._resume_both_ways(storage, tokens[split:])
        if _gap(random_chunk, random_step) <= _RESUME_PROBE_RTOL * (1.0 + float(np.abs(random_step).max())):
            return CHUNK_RESUME
        return CHUNK_RESUME if _gap(true_chunk, full) <= _gap(true_step, full) else TOKEN_BY_TOKEN_RESUME

    def _resume_both_ways(self, storage: PagedStorage, suffix: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logits of ``suffix`` resumed from slot 1 as one call and token by token (via a copy)."""
        storage.copy_states([1], [2])
        start = _RESUME_PROBE_SPLIT
        chunked = self._run_chunk(_Plan(suffix, start, torch.tensor([0, 1]), 1, None), storage, False)
        stepped = self._run_chunk(_Plan(suffix, start, torch.tensor([0, 2]), 2, None), storage, True)
        return chunked.logits, stepped.logits

    # --- validation --------------------------------------------------------------------------

    def _check_storage(self, storage: object) -> None:
        if not isinstance(storage, PagedStorage):
            raise InvalidTypeError("storage must be a PagedStorage")
        if storage.layout.layers != self.layout.layers:
            raise InvalidArgumentError("storage was built for a different model layout")

    def _validated_plans(self, chunks: object, storage: PagedStorage, replay: object) -> list[_Plan]:
        if isinstance(chunks, ForwardChunk) or not isinstance(chunks, Iterable):
            raise InvalidTypeError("chunks must be a list of ForwardChunk")
        chunks = list(chunks)
        replays = validated_replays(replay, len(chunks))
        plans, slots, written = [], set(), set()
        for chunk, rows in zip(chunks, replays):
            plan, writes = self._validated_plan(chunk, storage, rows)
            if self.layout.is_hybrid and plan.slot in slots:
                raise InvalidArgumentError(f"state slot {plan.slot} used by two chunks")
            if writes & written:
                raise SharedWriteError(f"two chunks write KV into blocks {sorted(writes & written)}")
            slots.add(plan.slot)
            written |= writes
            plans.append(plan)
        return plans

    def _validated_plan(self, chunk: object, storage: PagedStorage, rows: object) -> tuple[_Plan, set[int]]:
        if not isinstance(chunk, ForwardChunk):
            raise InvalidTypeError(f"chunks must hold ForwardChunk, got {type(chunk).__name__}")
        if chunk.adapter is not None or len(chunk.multimodal):
            raise InvalidArgumentError("HFModel serves neither adapters nor multimodal spans")
        tokens = validated_tokens(chunk.token_ids, self.layout.vocab_size)
        start = as_index("start", chunk.start)
        if start < 0:
            raise InvalidArgumentError(f"start must be >= 0, got {start}")
        table = validated_table(chunk.block_table, start + len(tokens), storage)
        slot = as_index("state_slot", chunk.state_slot)
        storage.check_slot(slot)
        # Slot 0 is the pool's padding row; a sequence computing into it is an engine bug.
        if slot == 0 and self.layout.is_hybrid:
            raise InvalidArgumentError("state slot 0 is the reserved padding row")
        writes = set(table[start // storage.block_size :].tolist()) if self.layout.kv_layers else set()
        check_writable(writes, chunk.writable_blocks)
        replay = validated_expert_rows(rows, len(tokens), self.layout.routed_expert_width)
        return _Plan(tokens, start, torch.from_numpy(table), slot, replay), writes
