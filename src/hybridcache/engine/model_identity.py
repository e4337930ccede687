"""A model's arithmetic identity: one digest over everything that changes what it computes.

Owns nothing: ``identity_digest`` is a pure function. Two models with equal digests compute the
same function bit for bit; the tiers use the digest as their namespace, so cached state only
ever crosses between such models. It covers the family, the whole config in canonical form,
every tensor the model computes with (parameters and buffers, persistent or not: a rotary
``inv_freq`` is derived from the config and not saved with the weights), and the versions of
the libraries whose kernels do the arithmetic.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

import numpy as np
import torch

import hybridcache

_PERSON = b"hc-model-ident"


def library_versions(*modules: object) -> dict[str, str]:
    """Versions of hybridcache, torch and NumPy, and of any further ``modules``."""
    versions = {"hybridcache": hybridcache.__version__, "torch": torch.__version__, "numpy": np.__version__}
    versions.update({module.__name__: str(module.__version__) for module in modules})
    return versions


def identity_digest(
    family: str, config: Mapping, tensors: Iterable[tuple[str, torch.Tensor]], versions: Mapping
) -> str:
    """BLAKE2b-128 hex over ``family``, ``config`` (canonical JSON: sorted keys, values without
    a JSON form by their ``repr``), ``versions`` and every named tensor's shape, dtype and bits."""
    hasher = hashlib.blake2b(digest_size=16, person=_PERSON)
    described = {"family": family, "config": config, "versions": dict(versions)}
    hasher.update(json.dumps(described, sort_keys=True, default=repr).encode())
    for name, tensor in tensors:
        hasher.update(f"\0{name}|{tuple(tensor.shape)}|{tensor.dtype}\0".encode())
        data = tensor.detach().contiguous().cpu()
        hasher.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return hasher.hexdigest()
