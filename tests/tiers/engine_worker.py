"""One engine replica in its own process, driven over a pipe by :mod:`tiers.replica_hub`.

Run as ``python -m tiers.engine_worker`` (from ``tests/``): reads a :class:`WorkerSpec` frame on
stdin, builds ``Engine(config, tiers=TieredStore(shared=...))`` on the cluster's shared store,
answers ``("ready", pid)``, then answers one frame per command on the original stdout (the
Mooncake client's C++ logs go to stderr). On end of input it closes its store and exits.

Owns its engine, its tiers, the fault wrapper around its shared store and, when asked to die
while publishing, the wrapper that ends the process before a checkpoint put.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

from hybridcache.engine.engine import Engine
from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.requests import Request
from hybridcache.sequence import Sequence
from hybridcache.tiers import ObjectKey, ObjectKind
from hybridcache.tiers.backends import ObjectStore
from hybridcache.tiers.restore_cost import RestoreCost
from hybridcache.tiers.tiered import TieredStore

from .faults import Fault, FaultInjectingStore
from .replica_wire import StoreSpec, receive, send

CHECKPOINT_EXIT_CODE = 87  # what a worker killed before a checkpoint put exits with


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one replica. ``faults`` are added to the fault wrapper around the shared
    store (``fault_seed`` draws the probabilistic ones). ``checkpoint_puts_before_exit``: the
    process dies at the checkpoint put after that many. ``measured_cost_model``: let the
    measured cost model skip restores it judges slower than recompute (its verdict depends on
    timings, so tests asserting hit counts take every verified restore instead)."""

    config: EngineConfig
    store: StoreSpec
    faults: tuple[Fault, ...] = ()
    fault_seed: int = 0
    checkpoint_puts_before_exit: int | None = None
    measured_cost_model: bool = False


@dataclass(frozen=True)
class ServeReport:
    """What one ``serve`` call produced: each request's generated tokens, cached tokens and
    error (None when served), and how much each tier counter moved during the call."""

    outputs: tuple[tuple[int, ...], ...]
    cached_tokens: tuple[int, ...]
    errors: tuple[str | None, ...]
    engine: dict = field(default_factory=dict)  # the tier client's statistics (TierStats)
    store: dict[str, int] = field(default_factory=dict)  # TieredStore counters
    misses: dict[str, int] = field(default_factory=dict)  # TieredStore misses by reason

    @property
    def remote_hit_tokens(self) -> int:
        return self.engine.get("remote_hit_tokens", 0)


@dataclass(frozen=True)
class KeyNames:
    """The store keys of one request's complete chunks (by index) and checkpoints (by step)."""

    chunks: tuple[str, ...]
    checkpoints: dict[int, str]


class ExitBeforeCheckpointPut(ObjectStore):
    """Delegates to ``inner``, except that the process ends (``os._exit``: no cleanup, as a
    crash) when asked to put its checkpoint number ``allowed + 1``, before ``inner`` sees it.
    The chunks that checkpoint needs were put by the call before, so the writer dies exactly
    between its chunk puts and its checkpoint put."""

    def __init__(self, inner: ObjectStore, allowed: int) -> None:
        super().__init__(default_timeout=inner.default_timeout)
        self.inner = inner
        self._allowed = allowed

    def _exists(self, keys, timeout):
        return self.inner.exists(keys, timeout)

    def _put_if_absent(self, items, timeout):
        for key, _ in items:
            if ObjectKey.from_name(key).kind is ObjectKind.CHECKPOINT:
                if self._allowed == 0:
                    os._exit(CHECKPOINT_EXIT_CODE)
                self._allowed -= 1
        return self.inner.put_if_absent(items, timeout)

    def _get(self, keys, timeout):
        return self.inner.get(keys, timeout)

    def _remove(self, keys, timeout):
        return self.inner.remove(keys, timeout)

    def _close(self) -> None:
        self.inner.close()


class RestoreEveryVerifiedStep(RestoreCost):
    def worth_restoring(self, bytes_by_tier, tokens) -> bool:
        return True


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.faults = FaultInjectingStore(spec.store.open(), seed=spec.fault_seed)
        for fault in spec.faults:
            self.faults.add(fault)
        shared: ObjectStore = self.faults
        if spec.checkpoint_puts_before_exit is not None:
            shared = ExitBeforeCheckpointPut(self.faults, spec.checkpoint_puts_before_exit)
        cost = None if spec.measured_cost_model else RestoreEveryVerifiedStep()
        self.tiers = TieredStore(shared=shared, cost=cost)
        self.engine = Engine(spec.config, tiers=self.tiers)
        self.empty_pools = self._free_pools()

    def serve(self, requests: list[Request]) -> ServeReport:
        before = self._counters()
        results = self.engine.generate(list(requests))
        after = self._counters()
        deltas = [_delta(old, new) for old, new in zip(before, after)]
        return ServeReport(
            outputs=tuple(tuple(result.tokens) for result in results),
            cached_tokens=tuple(result.cached_tokens for result in results),
            errors=tuple(None if result.error is None else repr(result.error) for result in results),
            engine=deltas[0],
            store=deltas[1],
            misses=deltas[2],
        )

    def _counters(self) -> tuple[dict, dict, dict]:
        tiers = self.engine.stats()["tiers"]
        engine = {name: value for name, value in tiers.items() if name != "store"}
        return engine, tiers["store"]["counters"], tiers["store"]["misses"]

    def stats(self) -> dict:
        return self.engine.stats()

    def check_invariants(self) -> None:
        self.engine.check_invariants()
        self.tiers.check_invariants()

    def pools_after_clearing(self) -> tuple[dict, dict]:
        """The free pool sizes when the engine was built and after dropping every cached
        block and checkpoint: equal unless something leaked."""
        self.engine.clear_cache()
        return self.empty_pools, self._free_pools()

    def _free_pools(self) -> dict:
        stats = self.engine.stats()
        return {"free_blocks": stats["free_blocks"], "free_state_slots": stats["free_state_slots"]}

    def keys(self, request: Request) -> KeyNames:
        seq = Sequence(request.prompt, adapter=request.adapter, cache_salt=request.cache_salt)
        chain = self.engine.tiers.chain(seq, seq.num_tokens)
        chunks = tuple(chain.chunk_key(index).name for index in range(chain.num_chunks))
        return KeyNames(chunks, {step: chain.checkpoint_key(step).name for step in chain.checkpoint_steps()})

    def add_fault(self, fault: Fault) -> None:
        self.faults.add(fault)

    def close(self) -> None:
        self.tiers.close()
        self.faults.inner.close()  # the fault wrapper borrows the store it wraps


COMMANDS = ("serve", "stats", "check_invariants", "pools_after_clearing", "keys", "add_fault")


def _delta(before: dict, after: dict) -> dict:
    """How each count moved (counts by tier, reason or error class as dicts of their own)."""
    moved = {}
    for name, value in after.items():
        change = _delta(before.get(name, {}), value) if isinstance(value, dict) else value - before.get(name, 0)
        if change:
            moved[name] = change
    return moved


def _failure(error: Exception) -> tuple[str, tuple[bool, str]]:
    """An error reply: whether it is an assertion (an invariant broke) and its traceback."""
    return "error", (isinstance(error, AssertionError), traceback.format_exc())


def main() -> None:
    replies = os.dup(1)
    os.dup2(2, 1)  # whatever the C++ side prints must not corrupt the reply stream
    try:
        worker = Worker(receive(0, None))
    except Exception as error:
        send(replies, _failure(error))
        raise SystemExit(1)
    send(replies, ("ready", os.getpid()))
    while (command := receive(0, None)) is not None:
        name, args = command
        if name not in COMMANDS:
            send(replies, ("error", (False, f"no command {name!r}")))
            continue
        try:
            reply = ("ok", getattr(worker, name)(*args))
        except Exception as error:
            reply = _failure(error)
        send(replies, reply)
    worker.close()


if __name__ == "__main__":
    # Run the module under its package name, so what it pickles unpickles in the test.
    from tiers.engine_worker import main as package_main

    package_main()
