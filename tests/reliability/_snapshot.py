"""A generic deep snapshot of object graphs, for "a failed call changes nothing" checks.

``snapshot(*objects)`` returns a hashable, comparable image of everything reachable from the
objects: instance ``__dict__`` and ``__slots__`` values, dataclasses, NumPy arrays (dtype, shape
and bytes), torch tensors (the same), lists, tuples, deques, dicts, sets, enums, counters and
random generators (their state). Shared objects are recorded once and referred to by visit
order afterwards, so aliasing changes show up too. Unknown types raise instead of being skipped
silently.

Skipped on purpose (documented caches of derived data, never state a caller can observe):

* ``TinyHybridModel._adapters``: the memo of low-rank adapter weights derived from an adapter
  name the first time it is used (pure function of the model seed and the name).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import types

import numpy as np

try:  # the engine extra
    import torch
except ImportError:  # pragma: no cover
    torch = None

SKIPPED_ATTRIBUTES = {
    "TinyHybridModel": {"_adapters"},
}

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type)


def snapshot(*objects) -> tuple:
    memo: dict[int, int] = {}
    keep_alive: list = []  # ids stay unique while the walk runs
    return tuple(_freeze(obj, memo, keep_alive) for obj in objects)


def _freeze(obj, memo: dict[int, int], keep_alive: list):
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, enum.Enum):
        return ("enum", type(obj).__qualname__, _freeze(obj.value, memo, keep_alive))
    if isinstance(obj, np.generic):
        return ("np", obj.dtype.str, obj.item())
    if isinstance(obj, np.dtype):
        return ("dtype", obj.str)
    if isinstance(obj, _CALLABLES):
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__qualname__", repr(obj))
        if isinstance(obj, types.MethodType) and owner is not None:
            return ("method", name, _freeze(owner, memo, keep_alive))
        return ("callable", getattr(obj, "__module__", None), name)
    if isinstance(obj, itertools.count):
        return ("count", repr(obj))
    if torch is not None and isinstance(obj, (torch.dtype, torch.device)):
        return ("torch", str(obj))
    key = id(obj)
    if key in memo:
        return ("ref", memo[key])
    memo[key] = len(memo)
    keep_alive.append(obj)
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if torch is not None and isinstance(obj, torch.Tensor):
        array = obj.detach().cpu().contiguous()
        return ("tensor", str(array.dtype), tuple(array.shape), array.numpy().tobytes())
    if torch is not None and isinstance(obj, torch.Generator):
        return ("torch-generator", obj.get_state().numpy().tobytes())
    if isinstance(obj, np.random.Generator):
        return ("generator", repr(obj.bit_generator.state))
    if isinstance(obj, dict):  # dict, Counter, defaultdict, OrderedDict
        items = [(_freeze(k, memo, keep_alive), _freeze(v, memo, keep_alive)) for k, v in obj.items()]
        return ("dict", type(obj).__qualname__, tuple(sorted(items, key=repr)))
    if isinstance(obj, (list, tuple, collections.deque)):
        return (type(obj).__qualname__, tuple(_freeze(v, memo, keep_alive) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted((_freeze(v, memo, keep_alive) for v in obj), key=repr)))
    state = _attributes(obj)
    if state is None:
        raise TypeError(f"snapshot does not know how to capture {type(obj).__qualname__}")
    skipped = SKIPPED_ATTRIBUTES.get(type(obj).__name__, set())
    items = tuple((name, _freeze(value, memo, keep_alive)) for name, value in state if name not in skipped)
    return ("object", type(obj).__module__, type(obj).__qualname__, items)


def _attributes(obj) -> list[tuple[str, object]] | None:
    """(name, value) of every attribute an instance holds, in a stable order."""
    found: dict[str, object] = {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found[name] = getattr(obj, name)
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                found[f.name] = getattr(obj, f.name)
    if hasattr(obj, "__dict__"):
        found.update(vars(obj))
    elif not found and not hasattr(type(obj), "__slots__"):
        return None
    return sorted(found.items())
