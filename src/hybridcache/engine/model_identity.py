"""A model's arithmetic identity: one digest over everything that changes what it computes.

Owns nothing: ``identity_digest`` is a pure function. Two models with equal digests compute the
same function bit for bit; the tiers use the digest as their namespace, so cached state only
ever crosses between such models. It covers the family, the whole config in canonical form,
every tensor the model computes with (parameters and buffers, persistent or not: a rotary
``inv_freq`` is derived from the config and not saved with the weights), and the versions of
the libraries whose kernels do the arithmetic: the required ones, and the optional kernel
packages that transformers switches to when they are installed (a Mamba scan, a causal conv1d,
flash attention), so an engine with them never shares state with one without.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from collections.abc import Iterable, Mapping

import numpy as np
import torch

import hybridcache

_PERSON = b"hc-model-ident"

# Distributions whose mere presence changes the kernels transformers picks, hence the numerics.
OPTIONAL_KERNELS = ("causal-conv1d", "mamba-ssm", "flash-attn", "flash-linear-attention", "kernels", "triton")
# The implementation choices a checkpoint is loaded with; they live outside ``to_dict()``.
IMPLEMENTATION_CHOICES = ("_attn_implementation", "_experts_implementation")


def library_versions(*modules: object) -> dict[str, str]:
    """Versions of hybridcache, torch and NumPy, and of any further ``modules``."""
    versions = {"hybridcache": hybridcache.__version__, "torch": torch.__version__, "numpy": np.__version__}
    versions.update({module.__name__: str(module.__version__) for module in modules})
    versions.update(installed_kernel_versions())
    return versions


def installed_kernel_versions() -> dict[str, str]:
    """Version of each ``OPTIONAL_KERNELS`` distribution installed here (absent ones omitted)."""
    installed = {}
    for name in OPTIONAL_KERNELS:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return installed


def implementation_choices(config: object) -> dict[str, str]:
    """The attention and expert implementations ``config`` (and every sub-config) was loaded
    with, by dotted path: eager and SDPA attention, eager and grouped experts round differently."""
    chosen: dict[str, str] = {}
    pending = [("", config)]
    while pending:
        path, current = pending.pop()
        for name in IMPLEMENTATION_CHOICES:
            value = getattr(current, name, None)
            if value is not None:
                chosen[path + name] = str(value)
        for key in sorted(getattr(current, "sub_configs", None) or {}):
            child = getattr(current, key, None)
            if child is not None and child is not current:
                pending.append((f"{path}{key}.", child))
    return chosen


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
