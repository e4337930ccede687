"""Policy names: ``--policy`` names an (admission, eviction) pair, ``--admission`` and
``--eviction`` override either part. Names take an optional argument after a colon
(``interval:32``, ``auto:1024``).

Owns no mutable state: the registries are constant and a ``Policy`` is frozen (the mutable
per-cache part of an eviction policy is made by ``Policy.eviction.new_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridcache.errors import InvalidArgumentError
from hybridcache.policies.admission import (
    AdmissionPolicy,
    AutoAdmission,
    IntervalAdmission,
    MarconiAdmission,
    ReferenceAdmission,
)
from hybridcache.policies.eviction import (
    AutoEviction,
    Eviction,
    LRUEviction,
    MarconiEviction,
)
from hybridcache.types import as_int


def _positive_int(kind: str, name: str, argument: str | None) -> int:
    if argument is None or not (argument.isascii() and argument.isdigit()) or int(argument) < 1:  # "٣٢", "²" are digits too
        raise InvalidArgumentError(f"{kind} {name!r} needs a positive int argument, e.g. {name}:32")
    return int(argument)


def _no_argument(kind: str, name: str, argument: str | None) -> None:
    if argument is not None:
        raise InvalidArgumentError(f"{kind} {name!r} takes no argument, got {argument!r}")


def _reference(argument: str | None, prefill_chunk: int) -> ReferenceAdmission:
    _no_argument("admission", "reference", argument)
    return ReferenceAdmission(prefill_chunk)


def _interval(argument: str | None, prefill_chunk: int) -> IntervalAdmission:
    return IntervalAdmission(_positive_int("admission", "interval", argument))


def _marconi_admission(argument: str | None, prefill_chunk: int) -> MarconiAdmission:
    _no_argument("admission", "marconi", argument)
    return MarconiAdmission()


def _auto_admission(argument: str | None, prefill_chunk: int) -> AutoAdmission:
    if argument is None:
        return AutoAdmission()
    return AutoAdmission(_positive_int("admission", "auto", argument), weighed=False)


def _lru(argument: str | None) -> LRUEviction:
    _no_argument("eviction", "lru", argument)
    return LRUEviction()


def _leaf_lru(argument: str | None) -> LRUEviction:
    _no_argument("eviction", "leaf-lru", argument)
    return LRUEviction("leaf-lru", states_with_leaves=True)


def _marconi_eviction(argument: str | None) -> MarconiEviction:
    if argument is None:
        return MarconiEviction()
    try:
        alpha = float(argument) if argument.isascii() else -1.0
    except ValueError:
        alpha = -1.0
    if not alpha >= 0:
        raise InvalidArgumentError(f"eviction 'marconi' takes a weight alpha >= 0, got {argument!r}")
    return MarconiEviction(alpha)


def _auto_eviction(argument: str | None) -> AutoEviction:
    """``auto:weighed``: KV pressure weighs the next leaf against the next mid-block state;
    ``auto:fixed``: mid-block states first; plain ``auto``: the default of ``AutoEviction``."""
    if argument is None:
        return AutoEviction()
    if argument not in SHORTFALL_ORDERS:
        raise InvalidArgumentError(f"eviction 'auto' takes one of {', '.join(SHORTFALL_ORDERS)}, got {argument!r}")
    return AutoEviction(f"auto:{argument}", SHORTFALL_ORDERS[argument])


SHORTFALL_ORDERS = {"weighed": True, "fixed": False}


ADMISSIONS: dict[str, Callable] = {
    "reference": _reference,
    "interval": _interval,
    "marconi": _marconi_admission,
    "auto": _auto_admission,
}
EVICTIONS: dict[str, Callable] = {
    "lru": _lru,
    "leaf-lru": _leaf_lru,
    "marconi": _marconi_eviction,
    "auto": _auto_eviction,
}
POLICIES: dict[str, tuple[str, str]] = {
    "reference": ("reference", "lru"),
    "interval": ("interval", "lru"),
    "marconi": ("marconi", "marconi"),
    "auto": ("auto", "auto"),
}
DEFAULT_POLICY = "auto"


@dataclass(frozen=True)
class Policy:
    name: str
    admission: AdmissionPolicy
    eviction: Eviction


def _split(text: str, kind: str, registry: dict) -> tuple[str, str | None]:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"the {kind} name must be a non-empty string")
    name, colon, argument = text.strip().partition(":")
    if name not in registry:
        raise InvalidArgumentError(f"unknown {kind} {name!r}; known: {', '.join(registry)}")
    return name, argument if colon else None


def resolve_policy(
    policy: str = DEFAULT_POLICY, admission: str | None = None, eviction: str | None = None, prefill_chunk: int = 2048
) -> Policy:
    """The policy ``policy`` names, with ``admission`` / ``eviction`` overriding its parts."""
    prefill_chunk = as_int("prefill_chunk", prefill_chunk, 1)
    name, argument = _split(policy, "policy", POLICIES)
    admission_text, eviction_text = POLICIES[name]
    if argument is not None:
        admission_text = f"{admission_text}:{argument}"
    admission_text = admission_text if admission is None else admission  # an empty override is refused, not ignored
    eviction_text = eviction_text if eviction is None else eviction
    admission_name, admission_argument = _split(admission_text, "admission", ADMISSIONS)
    eviction_name, eviction_argument = _split(eviction_text, "eviction", EVICTIONS)
    chosen = ADMISSIONS[admission_name](admission_argument, prefill_chunk)
    kept = EVICTIONS[eviction_name](eviction_argument)
    label = policy.strip() if admission is None and eviction is None else f"{chosen.name}+{kept.name}"
    return Policy(label, chosen, kept)
