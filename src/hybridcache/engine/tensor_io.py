"""Cache tensors to and from NumPy arrays, bit for bit, for the host, disk and shared tiers.

Owns no state. A dtype NumPy cannot hold (bfloat16) travels as the unsigned integer of its
width; the receiving tensor reinterprets it, so nothing is ever rounded.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridcache.errors import InvalidArgumentError, InvalidTypeError

_CARRIERS = {torch.bfloat16: torch.uint16}


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """A private NumPy copy of ``tensor``'s bits."""
    carrier = _CARRIERS.get(tensor.dtype)
    data = tensor.detach().contiguous()
    return (data.view(carrier) if carrier is not None else data).numpy().copy()


def write_into(target: torch.Tensor, array: object, what: str) -> None:
    """Overwrite ``target`` (a view into a cache tensor) with ``array``'s bits; refuses any
    other shape or element type than what ``to_array`` of ``target`` would give."""
    if not isinstance(array, np.ndarray):
        raise InvalidTypeError(f"{what} must be a NumPy array")
    carrier = _CARRIERS.get(target.dtype, target.dtype)
    expected = torch.empty(0, dtype=carrier).numpy().dtype
    if tuple(array.shape) != tuple(target.shape) or array.dtype != expected:
        raise InvalidArgumentError(
            f"{what}: {array.dtype}{tuple(array.shape)} does not fit {expected}{tuple(target.shape)}"
        )
    source = torch.from_numpy(np.require(array, requirements=("C", "W")))
    target.copy_(source.view(target.dtype) if carrier is not target.dtype else source)


def checked_names(arrays: object, names: list[str], what: str) -> None:
    if not hasattr(arrays, "keys") or sorted(arrays.keys()) != sorted(names):
        raise InvalidArgumentError(f"{what} must name exactly {sorted(names)}")
