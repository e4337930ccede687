"""Small builders shared by the tier tests."""

from __future__ import annotations

import numpy as np

from hybridcache.tiers import KeyChain, NamespaceFingerprint

CHUNK = 32


def fingerprint(**changes) -> NamespaceFingerprint:
    fields = dict(
        model_id="tiny-hybrid", weights_revision="rev-1", dtype="float16", kv_layout="L=2,H=2,T,D=8",
        state_layout="L=2,S=4x4", block_size=16, chunk_size=CHUNK,
    )
    fields.update(changes)
    return NamespaceFingerprint(**fields)


def chain(tokens=None, multimodal=(), **changes) -> KeyChain:
    tokens = list(range(1, 3 * CHUNK + 5)) if tokens is None else tokens
    return KeyChain(fingerprint(**changes), tokens, multimodal)


def kv_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "k": rng.standard_normal((2, 2, CHUNK, 8)).astype(np.float16),
        "v": rng.standard_normal((2, 2, CHUNK, 8)).astype(np.float16),
    }


def state_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"state.0": rng.standard_normal((4, 4)).astype(np.float32), "state.1": rng.standard_normal((4, 4)).astype(np.float32)}
