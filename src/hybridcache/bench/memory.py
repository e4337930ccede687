"""``memory``: host memory of a hybrid prefix cache holding many long checkpointed prefixes.

``batch`` distinct prompts of ``context`` tokens are prefilled one at a time, each publishing an
aligned checkpoint at its end. The process's resident memory is read before the cache exists
and after the last prompt was released; the growth divided by the cached tokens is the host
cost per cached token. ``metadata_bytes`` is what the implementation holds for exact matching
of its published checkpoints. Each implementation is measured in a fresh process so one's
freed memory cannot hide the other's growth.
"""

from __future__ import annotations

import gc
import multiprocessing
import os

import numpy as np

from hybridcache.bench.workload import VOCAB


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(impl_name: str, batch: int, context: int, block_size: int) -> dict:
    """Build the case with one implementation in this process and report its memory."""
    from hybridcache.bench.implementations import make_impl

    impl = make_impl(impl_name)
    impl.setup(num_blocks=16, num_checkpoints=1, block_size=block_size, hybrid=True)  # imports, untimed
    gc.collect()
    before = resident_bytes()
    impl.setup(num_blocks=batch * (context // block_size + 2), num_checkpoints=batch, block_size=block_size, hybrid=True)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        impl.prefill(rng.integers(0, VOCAB, size=context, dtype=np.int32), (context,))
    gc.collect()
    growth = resident_bytes() - before
    cached_tokens = batch * context
    return {
        "scenario": "memory",
        "impl": impl_name,
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "checkpoints": batch,
        "cached_tokens": cached_tokens,
        "metadata_bytes": impl.metadata_bytes(),
        "host_bytes": growth,
        "host_bytes_per_token": growth / cached_tokens,
    }


def measure_in_fresh_process(impl_name: str, batch: int, context: int, block_size: int) -> dict:
    context_ = multiprocessing.get_context("spawn")
    with context_.Pool(1) as worker:
        return worker.apply(measure, (impl_name, batch, context, block_size))
