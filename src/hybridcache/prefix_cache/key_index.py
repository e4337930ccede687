"""Map from prefix key to attached node slots, lean enough for millions of nodes.

Owns: the key -> slot entries. Most entries live in two sorted NumPy arrays (8-byte key,
4-byte slot: 12 bytes an entry); recent insertions go to a small dict that is merged into the
arrays when it reaches a quarter of their size (amortized O(log n) per insertion). A removed
entry in the arrays is tombstoned (slot -1) and purged at the next merge. A key normally maps
to one slot; the rare extra slots of a key collision are kept in a side dict, so a collision
never prevents caching.

The children of namespace roots go to a dict of their own (never merged; one promoted from a
collision list when its key's first slot leaves goes the general way, which costs only speed): every
lookup from a root probes one of them (a request's first block), and a dict probe is one
cache miss where a binary search of the arrays is a dozen, after a long comparison has
evicted them (about 2 µs per request at 64K tokens). They are a small share of all nodes.
"""

from __future__ import annotations

import numpy as np

from hybridcache.errors import TopologyError

_TOMBSTONE = -1
_MIN_MERGE = 1024


class KeyIndex:
    def __init__(self) -> None:
        self._keys = np.empty(0, dtype=np.uint64)
        self._slots = np.empty(0, dtype=np.int32)
        self._live_in_arrays = 0
        self._recent: dict[int, int] = {}
        self._root_children: dict[int, int] = {}  # primary entries of nodes right below a root
        self._collisions: dict[int, list[int]] = {}

    def __len__(self) -> int:
        extra = sum(len(v) for v in self._collisions.values())
        return self._live_in_arrays + len(self._recent) + len(self._root_children) + extra

    @property
    def nbytes(self) -> int:
        """Approximate host bytes (arrays exactly, dict entries at ~100 bytes each)."""
        entries = len(self._recent) + len(self._root_children) + len(self._collisions)
        return self._keys.nbytes + self._slots.nbytes + 100 * entries

    def _array_position(self, key: int) -> int:
        """Position of the live entry for ``key`` in the arrays, or -1."""
        keys = self._keys
        position = int(keys.searchsorted(np.uint64(key)))  # the method: no dispatch wrapper
        while position < keys.size and int(keys[position]) == key:
            if self._slots[position] != _TOMBSTONE:
                return position
            position += 1
        return -1

    def first(self, key: int) -> int | None:
        """The primary slot of ``key``, or None. Probed on every lookup, so the arrays are
        searched here (Python integers read with ``item``: no NumPy scalar per entry)."""
        slot = self._root_children.get(key)
        if slot is not None:
            return slot
        slot = self._recent.get(key)
        if slot is not None:
            return slot
        keys, slots = self._keys, self._slots
        position = int(keys.searchsorted(np.uint64(key)))  # the method: no dispatch wrapper
        while position < keys.size and keys.item(position) == key:
            slot = slots.item(position)
            if slot != _TOMBSTONE:
                return slot
            position += 1
        return None

    def all(self, key: int) -> list[int]:
        """Every slot of ``key`` (more than one only after a collision)."""
        first = self.first(key)
        if first is None:
            return []
        return [first, *self._collisions.get(key, ())]

    def insert_many(self, keys: np.ndarray, slots: np.ndarray, root_child: bool = False) -> None:
        """File ``keys[i] -> slots[i]``; ``root_child``: the first entry is a namespace root's
        child (kept in its own dict when it is its key's primary entry)."""
        key_list = keys.tolist()
        if len(set(key_list)) == len(key_list) and not self._any_present(keys, key_list):
            self._recent.update(zip(key_list, slots.tolist()))
            if root_child and key_list:
                self._root_children[key_list[0]] = self._recent.pop(key_list[0])
        else:
            for position, (key, slot) in enumerate(zip(key_list, slots.tolist())):
                if self.first(key) is not None:
                    self._collisions.setdefault(key, []).append(slot)
                elif root_child and position == 0:
                    self._root_children[key] = slot
                else:
                    self._recent[key] = slot
        if len(self._recent) > max(_MIN_MERGE, self._live_in_arrays // 4):
            self._merge()

    def _any_present(self, keys: np.ndarray, key_list: list[int]) -> bool:
        if not self._recent.keys().isdisjoint(key_list) or not self._root_children.keys().isdisjoint(key_list):
            return True
        if self._keys.size == 0:
            return False
        positions = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
        return bool(np.any((self._keys[positions] == keys)))  # tombstones count: the slow path checks

    def remove(self, key: int, slot: int) -> None:
        """Drop the entry ``key -> slot`` (one that exists). Without a collision on the key
        (the rule) this is one dict look-up, or one binary search of the arrays."""
        extra = self._collisions.get(key)
        if extra is None:
            for entries in (self._root_children, self._recent):
                held = entries.get(key)
                if held is not None:
                    if held != slot:
                        raise TopologyError(f"key {key} does not map to slot {slot}")
                    del entries[key]
                    return
            position = self._array_position(key) if self._keys.size else -1
            if position < 0 or self._slots[position] != slot:
                raise TopologyError(f"key {key} does not map to slot {slot}")
            self._slots[position] = _TOMBSTONE
            self._live_in_arrays -= 1
            return
        if self.first(key) == slot:
            self._drop_primary(key)
            if extra:
                self._recent[key] = extra.pop(0)
        elif slot in extra:
            extra.remove(slot)
        else:
            raise TopologyError(f"key {key} does not map to slot {slot}")
        if not extra:
            del self._collisions[key]

    def _drop_primary(self, key: int) -> None:
        if self._root_children.pop(key, None) is not None or self._recent.pop(key, None) is not None:
            return
        position = self._array_position(key)
        self._slots[position] = _TOMBSTONE
        self._live_in_arrays -= 1

    def _merge(self) -> None:
        live = self._slots != _TOMBSTONE
        recent_keys = np.fromiter(self._recent.keys(), dtype=np.uint64, count=len(self._recent))
        recent_slots = np.fromiter(self._recent.values(), dtype=np.int32, count=len(self._recent))
        keys = np.concatenate([self._keys[live], recent_keys])
        slots = np.concatenate([self._slots[live], recent_slots])
        order = np.argsort(keys, kind="stable")
        self._keys, self._slots = keys[order], slots[order]
        self._live_in_arrays = int(keys.size)
        self._recent = {}

    def items(self) -> list[tuple[int, int]]:
        """Every live (key, slot) entry, collisions included (for invariant checks)."""
        live = self._slots != _TOMBSTONE
        entries = list(zip(self._keys[live].tolist(), self._slots[live].tolist()))
        entries += list(self._recent.items()) + list(self._root_children.items())
        entries += [(key, slot) for key, slots in self._collisions.items() for slot in slots]
        return entries

    def check_invariants(self) -> None:
        assert np.all(self._keys[:-1] <= self._keys[1:]), "key arrays not sorted"
        assert int(np.count_nonzero(self._slots != _TOMBSTONE)) == self._live_in_arrays
        assert all(self._collisions.values()), "empty collision list"
        assert all(self.first(key) is not None for key in self._collisions), "collision without a primary"
        live = self._keys[self._slots != _TOMBSTONE]
        assert np.unique(live).size == live.size, "a key has two primary entries"
        assert not set(live.tolist()) & set(self._recent), "a key is primary twice"
        assert not (set(live.tolist()) | set(self._recent)) & set(self._root_children), "a root child's key is primary twice"
