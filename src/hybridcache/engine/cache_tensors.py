"""The tensors behind the paged KV cache and the recurrent-state slots of the tiny model.

Owns: the KV tensor ``kv`` shaped ``(attention layers, blocks, block_size, 2, heads, head_dim)``
(index 0 of the fifth axis is the key, 1 the value; keys are stored after the rotary embedding),
the conv-state tensor ``(recurrent layers, slots, conv_kernel - 1, conv channels)`` and the
SSM-state tensor ``(recurrent layers, slots, ssm heads, ssm head_dim, ssm state size)``.
Block ids and slot ids are the ids handed out by ``BlockPool`` and ``StatePool``; this class
does not know who holds them. Slot 0 is the pool's reserved padding row.

The public management calls (``zero_state``, ``copy_states``, ``copy_blocks``, ``poison_*``)
validate every id before touching a tensor. The ``read_*`` / ``write_*`` calls are the model's
hot path and trust ids that ``TinyHybridModel.forward`` has already validated.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from hybridcache.engine.storage_alloc import zeros_within_memory
from hybridcache.engine.tensor_io import checked_names, to_array, write_into
from hybridcache.engine.tiny_config import TinyHybridConfig, torch_dtype
from hybridcache.errors import InvalidArgumentError, InvalidBlockIdError, InvalidTypeError


def _require_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def _as_id_list(name: str, ids: object) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidTypeError(f"{name} must be a sequence of ints")
    items = list(ids)
    for item in items:
        # numpy integers arrive from block tables; bools are ints to Python but never ids.
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise InvalidTypeError(f"{name} must contain ints, got {type(item).__name__}")
    return [item.__index__() for item in items]


class CacheTensors:
    """Paged KV blocks for attention layers and state rows for recurrent layers."""

    def __init__(
        self,
        config: TinyHybridConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        dtype: str = "float64",
    ) -> None:
        if not isinstance(config, TinyHybridConfig):
            raise InvalidTypeError("config must be a TinyHybridConfig")
        self.config = config
        self.num_blocks = _require_count("num_blocks", num_blocks, 0)
        self.block_size = _require_count("block_size", block_size, 1)
        self.num_state_slots = _require_count("num_state_slots", num_state_slots, 1)
        self.dtype_name = dtype
        self.dtype = torch_dtype(dtype)
        kv_shape = (
            config.num_attention_layers,
            num_blocks,
            block_size,
            2,
            config.num_attention_heads,
            config.attention_head_dim,
        )
        recurrent, slots = config.num_recurrent_layers, num_state_slots
        conv_shape = (recurrent, slots, config.conv_kernel - 1, config.conv_channels)
        ssm_shape = (recurrent, slots, config.num_ssm_heads, config.ssm_head_dim, config.ssm_state_size)
        self.kv, self.conv_states, self.ssm_states = zeros_within_memory(
            [(kv_shape, self.dtype), (conv_shape, self.dtype), (ssm_shape, self.dtype)], "the KV blocks and state slots"
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by the KV, conv-state and SSM-state tensors."""
        tensors = (self.kv, self.conv_states, self.ssm_states)
        return sum(t.element_size() * t.numel() for t in tensors)

    # --- validation ----------------------------------------------------------------------------

    def check_block(self, block: int) -> None:
        """Raise ``InvalidBlockIdError`` unless ``block`` names a KV block."""
        if not 0 <= block < self.num_blocks:
            raise InvalidBlockIdError(f"block {block} outside [0, {self.num_blocks})")

    def check_slot(self, slot: int) -> None:
        """Raise ``InvalidBlockIdError`` unless ``slot`` names a state row."""
        if not 0 <= slot < self.num_state_slots:
            raise InvalidBlockIdError(f"state slot {slot} outside [0, {self.num_state_slots})")

    def _validated_pairs(self, kind: str, src: object, dst: object, check) -> tuple[list[int], list[int]]:
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

    # --- management ----------------------------------------------------------------------------

    def zero_state(self, slot: int) -> None:
        """Reset one slot's conv and SSM state in every recurrent layer."""
        slot = _as_id_list("slot", [slot])[0]
        self.check_slot(slot)
        self.conv_states[:, slot] = 0
        self.ssm_states[:, slot] = 0

    def copy_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy whole state rows ``src_slots[i] -> dst_slots[i]`` in every recurrent layer."""
        src, dst = self._validated_pairs("slot", src_slots, dst_slots, self.check_slot)
        for source, destination in zip(src, dst):  # one copy_ per row: see paged_storage._copy_rows
            self.conv_states[:, destination].copy_(self.conv_states[:, source])
            self.ssm_states[:, destination].copy_(self.ssm_states[:, source])

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy whole KV blocks ``src_blocks[i] -> dst_blocks[i]`` in every attention layer."""
        src, dst = self._validated_pairs("block", src_blocks, dst_blocks, self.check_block)
        for source, destination in zip(src, dst):
            self.kv[:, destination].copy_(self.kv[:, source])

    def poison_block(self, block: int) -> None:
        """Fill one block with NaN so any read of it shows up in the outputs."""
        block = _as_id_list("block", [block])[0]
        self.check_block(block)
        self.kv[:, block] = float("nan")

    def poison_state(self, slot: int) -> None:
        """Fill one state row with NaN so any read of it shows up in the outputs."""
        slot = _as_id_list("slot", [slot])[0]
        self.check_slot(slot)
        self.conv_states[:, slot] = float("nan")
        self.ssm_states[:, slot] = float("nan")

    # --- transfer to and from the tiers (ids validated) -----------------------------------------

    def read_blocks(self, blocks: list[int]) -> dict[str, np.ndarray]:
        """The KV of whole ``blocks``, block axis first: ``kv`` is ``(blocks, layers, block_size, 2, heads, head_dim)``."""
        ids = self._checked_ids("block", blocks)
        return {"kv": to_array(self.kv[:, ids].transpose(0, 1))}

    def write_blocks(self, blocks: list[int], arrays: dict[str, np.ndarray]) -> None:
        """Overwrite whole ``blocks`` with arrays shaped as ``read_blocks`` gives them."""
        ids = self._checked_ids("block", blocks)
        checked_names(arrays, ["kv"], "block arrays")
        staged = self.kv[:, ids].transpose(0, 1).clone()
        write_into(staged, arrays["kv"], "kv")
        self.kv[:, ids] = staged.transpose(0, 1)

    def read_slot(self, slot: int) -> dict[str, np.ndarray]:
        """One slot's state in every recurrent layer: ``conv`` and ``ssm``, layer axis first."""
        slot = self._one_id("slot", slot)
        return {"conv": to_array(self.conv_states[:, slot]), "ssm": to_array(self.ssm_states[:, slot])}

    def write_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        slot = self._one_id("slot", slot)
        checked_names(arrays, ["conv", "ssm"], "state arrays")
        conv, ssm = self.conv_states[:, slot].clone(), self.ssm_states[:, slot].clone()
        write_into(conv, arrays["conv"], "conv")
        write_into(ssm, arrays["ssm"], "ssm")
        self.conv_states[:, slot], self.ssm_states[:, slot] = conv, ssm

    def _checked_ids(self, kind: str, ids: object) -> list[int]:
        items = _as_id_list(f"{kind}s", ids)
        for item in items:
            (self.check_block if kind == "block" else self.check_slot)(item)
        return items

    def _one_id(self, kind: str, value: object) -> int:
        return self._checked_ids(kind, [value])[0]

    # --- the model's hot path (ids already validated) -------------------------------------------

    def write_kv(self, layer: int, block: int, offset: int, entry: torch.Tensor) -> None:
        """Store one position's ``(2, heads, head_dim)`` key and value of attention layer ``layer``."""
        self.kv[layer, block, offset] = entry

    def read_kv(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, length)``, each ``(length, heads, head_dim)``.

        ``blocks`` is the int64 block table prefix covering those positions. Whole blocks are
        gathered and then cut to ``length``, so unwritten (possibly NaN) tail rows never reach
        the arithmetic.
        """
        entries = self.kv[layer].index_select(0, blocks).view(-1, *self.kv.shape[-3:])[:length]
        return entries[:, 0], entries[:, 1]

    def read_state(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Private copies of one slot's conv state and SSM state in recurrent layer ``layer``."""
        return self.conv_states[layer, slot].clone(), self.ssm_states[layer, slot].clone()

    def write_state(self, layer: int, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Overwrite one slot's conv state and SSM state in recurrent layer ``layer``."""
        self.conv_states[layer, slot] = conv
        self.ssm_states[layer, slot] = ssm
