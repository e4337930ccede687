"""Paged KV blocks and recurrent-state slots for any ``ModelLayout``.

Owns: per attention layer and KV tensor a ``[num_blocks, block_size, *per_token_shape]`` tensor,
and per recurrent layer and state tensor a ``[num_state_slots, *shape]`` tensor, each in its
spec's dtype (recurrent states may be float32 inside a float64 model). Block and slot ids are
the ids handed out by ``BlockPool`` and ``StatePool``; this class does not know who holds them.

The management calls (``zero_state``, ``copy_states``, ``copy_blocks``, ``poison_*``) validate
every id before touching a tensor. The ``gather_kv`` / ``scatter_kv`` / ``read_state`` /
``write_state`` calls are a model's hot path and trust ids the model has already validated.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridcache.engine.cache_tensors import _as_id_list, _require_count
from hybridcache.engine.model_api import ModelLayout
from hybridcache.engine.storage_alloc import zeros_within_memory
from hybridcache.engine.tensor_io import checked_names, to_array, write_into
from hybridcache.errors import InvalidArgumentError, InvalidBlockIdError, InvalidTypeError

TensorKey = tuple[int, str]  # (layer index, tensor name)


def _write_all_or_nothing(tensors: dict, index: object, arrays: object, what: str) -> None:
    """Write ``arrays`` (by ``"layer.name"``) at ``index`` of every tensor, or raise before any."""
    checked_names(arrays, [_name(key) for key in tensors], what)
    staged = {key: tensor[index].clone() for key, tensor in tensors.items()}
    for key, target in staged.items():
        write_into(target, arrays[_name(key)], _name(key))
    for key, target in staged.items():
        tensors[key][index] = target


def _copy_rows(tensors: object, src: list[int], dst: list[int]) -> None:
    """``tensor[dst[i]] = tensor[src[i]]`` for every tensor, row by row: the copies of a step are
    a few rows, and one ``copy_`` per row costs microseconds where an advanced-index assignment
    goes through torch's parallel ``index_put_`` (measured at 4-40 ms per call for one row on a
    loaded 2-core machine). Sources and destinations never overlap (validated), so order is free."""
    for tensor in tensors:
        for source, destination in zip(src, dst):
            tensor[destination].copy_(tensor[source])


def _name(key: TensorKey) -> str:
    return f"{key[0]}.{key[1]}"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class PagedStorage:
    """Cache tensors laid out as a model's ``ModelLayout`` describes."""

    def __init__(self, layout: ModelLayout, *, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        if not isinstance(layout, ModelLayout):
            raise InvalidTypeError("layout must be a ModelLayout")
        self.layout = layout
        self.num_blocks = _require_count("num_blocks", num_blocks, 0)
        self.block_size = _require_count("block_size", block_size, 1)
        self.num_state_slots = _require_count("num_state_slots", num_state_slots, 1)
        kv_keys = [(layer.index, spec) for layer in layout.kv_layers for spec in layer.kv]
        state_keys = [(layer.index, spec) for layer in layout.state_layers for spec in layer.state]
        tensors = zeros_within_memory(
            [((num_blocks, block_size, *spec.shape), _dtype(spec.dtype)) for _, spec in kv_keys]
            + [((num_state_slots, *spec.shape), _dtype(spec.dtype)) for _, spec in state_keys],
            "the KV blocks and state slots",
        )
        self.kv: dict[TensorKey, torch.Tensor] = {
            (index, spec.name): tensor for (index, spec), tensor in zip(kv_keys, tensors[: len(kv_keys)])
        }
        self.states: dict[TensorKey, torch.Tensor] = {
            (index, spec.name): tensor for (index, spec), tensor in zip(state_keys, tensors[len(kv_keys) :])
        }

    @property
    def nbytes(self) -> int:
        """Bytes held by every KV and state tensor."""
        tensors = [*self.kv.values(), *self.states.values()]
        return sum(t.element_size() * t.numel() for t in tensors)

    # --- validation ----------------------------------------------------------------------------

    def check_block(self, block: int) -> None:
        """Raise ``InvalidBlockIdError`` unless ``block`` names a KV block."""
        if not 0 <= block < self.num_blocks:
            raise InvalidBlockIdError(f"block {block} outside [0, {self.num_blocks})")

    def check_slot(self, slot: int) -> None:
        """Raise ``InvalidBlockIdError`` unless ``slot`` names a state slot."""
        if not 0 <= slot < self.num_state_slots:
            raise InvalidBlockIdError(f"state slot {slot} outside [0, {self.num_state_slots})")

    def _validated_pairs(self, kind: str, src: object, dst: object) -> tuple[list[int], list[int]]:
        check = self.check_block if kind == "block" else self.check_slot
        src_ids, dst_ids = _as_id_list(f"source {kind}s", src), _as_id_list(f"destination {kind}s", dst)
        if len(src_ids) != len(dst_ids):
            raise InvalidArgumentError(f"{len(src_ids)} source {kind}s but {len(dst_ids)} destinations")
        for item in src_ids + dst_ids:
            check(item)
        if len(set(dst_ids)) != len(dst_ids):
            raise InvalidArgumentError(f"duplicate destination {kind}s in {dst_ids}")
        # A copy whose source is also a destination would depend on the copy order.
        if set(src_ids) & set(dst_ids):
            raise InvalidArgumentError(f"source and destination {kind}s overlap")
        return src_ids, dst_ids

    def _one_id(self, kind: str, value: object) -> int:
        item = _as_id_list(kind, [value])[0]
        (self.check_block if kind == "block" else self.check_slot)(item)
        return item

    # --- management ----------------------------------------------------------------------------

    def zero_state(self, slot: int) -> None:
        """Reset one slot's state tensors in every recurrent layer."""
        slot = self._one_id("slot", slot)
        for tensor in self.states.values():
            tensor[slot] = 0

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy whole slots ``src_slots[i] -> dst_slots[i]`` in every recurrent layer."""
        src, dst = self._validated_pairs("slot", src_slots, dst_slots)
        _copy_rows(self.states.values(), src, dst)

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy whole KV blocks ``src_blocks[i] -> dst_blocks[i]`` in every attention layer."""
        src, dst = self._validated_pairs("block", src_blocks, dst_blocks)
        _copy_rows(self.kv.values(), src, dst)

    def poison_block(self, block: int) -> None:
        """Fill one block with NaN so any read of it shows up in the outputs."""
        block = self._one_id("block", block)
        for tensor in self.kv.values():
            tensor[block] = float("nan")

    def poison_state(self, slot: int) -> None:
        """Fill one slot with NaN so any read of it shows up in the outputs."""
        slot = self._one_id("slot", slot)
        for tensor in self.states.values():
            tensor[slot] = float("nan")

    # --- transfer to and from the tiers (ids validated) -------------------------------------------

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        """The KV of whole ``blocks``: per ``"layer.name"`` an array ``(blocks, block_size, *shape)``."""
        ids = self._ids("block", blocks)
        return {_name(key): to_array(tensor[ids]) for key, tensor in self.kv.items()}

    def write_blocks(self, blocks: list[int], arrays: dict[str, np.ndarray]) -> None:
        """Overwrite whole ``blocks`` with arrays shaped as ``read_blocks`` gives them; checks
        every array before writing any."""
        _write_all_or_nothing(self.kv, self._ids("block", blocks), arrays, "block arrays")

    def read_slot(self, slot: int) -> dict[str, np.ndarray]:
        """One slot's state: per ``"layer.name"`` its array."""
        slot = self._one_id("slot", slot)
        return {_name(key): to_array(tensor[slot]) for key, tensor in self.states.items()}

    def write_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        _write_all_or_nothing(self.states, self._one_id("slot", slot), arrays, "state arrays")

    def _ids(self, kind: str, ids: object) -> list[int]:
        items = _as_id_list(f"{kind}s", ids)
        for item in items:
            (self.check_block if kind == "block" else self.check_slot)(item)
        return items

    # --- a model's hot path (ids already validated) ----------------------------------------------

    def gather_kv(self, key: TensorKey, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """Entries of positions ``[0, length)`` as ``[length, *per_token_shape]``.

        ``blocks`` is the int64 block-table prefix covering those positions; whole blocks are
        gathered and then cut, so unwritten (possibly NaN) tail rows never reach the model.
        """
        tensor = self.kv[key]
        return tensor.index_select(0, blocks).flatten(0, 1)[:length]

    def scatter_kv(self, key: TensorKey, blocks: torch.Tensor, start: int, entries: torch.Tensor) -> None:
        """Store ``entries`` (``[n, *per_token_shape]``) at positions ``[start, start + n)``."""
        positions = torch.arange(start, start + entries.shape[0])
        tensor = self.kv[key]
        tensor[blocks[positions // self.block_size], positions % self.block_size] = entries.to(tensor.dtype)

    def read_state(self, key: TensorKey, slot: int) -> torch.Tensor:
        """A private copy of one slot's state tensor."""
        return self.states[key][slot].clone()

    def write_state(self, key: TensorKey, slot: int, value: torch.Tensor) -> None:
        """Overwrite one slot's state tensor."""
        self.states[key][slot] = value
