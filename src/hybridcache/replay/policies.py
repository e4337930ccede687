"""Checkpoint admission and eviction policies of the replay, selected by name from registries.

Owns no mutable state: a policy is a frozen description. An admission policy says where a
turn's virtual chunks end and which of those ends get a checkpoint; an eviction policy says
what the cache keeps. ``--policy`` names an (admission, eviction) pair; ``--admission`` and
``--eviction`` override either part. Names take an optional argument after a colon
(``interval:32``). New policies (``marconi``, ``auto``) register a factory here.

A turn is processed up to ``final_end``: its prompt, then its output but the last token (the
engine never runs the forward of the token it emits last). Decode is one virtual chunk from the
prompt end to ``final_end`` unless the admission policy ends chunks inside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hybridcache.errors import InvalidArgumentError

Boundary = tuple[int, bool]  # (chunk end, save a checkpoint there)


@dataclass(frozen=True)
class ReferenceAdmission:
    """Today's scheduler rule: a checkpoint at every prefill chunk end (chunks of
    ``prefill_chunk`` tokens from the resume point), at the prompt end and at the end of the
    forward that emits the last token; no decode interval."""

    prefill_chunk: int
    name: str = "reference"

    def first_chunk_tokens(self) -> int:
        return self.prefill_chunk

    def plan(self, start: int, prompt_length: int, final_end: int) -> list[Boundary]:
        ends = list(range(start + self.prefill_chunk, prompt_length, self.prefill_chunk))
        ends.append(prompt_length)
        if final_end > prompt_length:
            ends.append(final_end)
        return [(end, True) for end in ends]

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return mean_prompt / (math.ceil(mean_prompt / self.prefill_chunk) + 1)


@dataclass(frozen=True)
class IntervalAdmission:
    """A checkpoint at every multiple of ``interval`` tokens, in the prompt and in the output
    (as vLLM-style engines keep one state per aligned block); nothing at unaligned ends."""

    interval: int

    @property
    def name(self) -> str:
        return f"interval:{self.interval}"

    def first_chunk_tokens(self) -> int:
        # every checkpoint is aligned, so a hit resumes on a multiple and this ends on the next
        return self.interval

    def plan(self, start: int, prompt_length: int, final_end: int) -> list[Boundary]:
        first = (start // self.interval + 1) * self.interval
        aligned = range(first, final_end + 1, self.interval)
        ends = {end: True for end in aligned}
        ends.setdefault(prompt_length, False)  # the output is appended at the prompt end
        ends.setdefault(final_end, False)
        return sorted(ends.items())

    def checkpoint_spacing(self, mean_prompt: float) -> float:
        return float(self.interval)


@dataclass(frozen=True)
class LRUEviction:
    """The library's own order: least recently used checkpoints and trie leaves first."""

    name: str = "lru"


def _positive_int(kind: str, name: str, argument: str | None) -> int:
    if argument is None or not argument.isdigit() or int(argument) < 1:
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


def _lru(argument: str | None) -> LRUEviction:
    _no_argument("eviction", "lru", argument)
    return LRUEviction()


ADMISSIONS: dict[str, Callable] = {"reference": _reference, "interval": _interval}
EVICTIONS: dict[str, Callable] = {"lru": _lru}
POLICIES: dict[str, tuple[str, str]] = {"reference": ("reference", "lru"), "interval": ("interval", "lru")}
PLANNED = ("marconi", "auto")  # named by issue 13, not built yet


@dataclass(frozen=True)
class Policy:
    name: str
    admission: ReferenceAdmission | IntervalAdmission
    eviction: LRUEviction


def _split(text: str, kind: str, registry: dict) -> tuple[str, str | None]:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"a {kind} name must be a non-empty string")
    name, _, argument = text.strip().partition(":")
    if name not in registry:
        later = f" ({name} is not implemented yet)" if name in PLANNED else ""
        raise InvalidArgumentError(f"unknown {kind} {name!r}{later}; known: {', '.join(registry)}")
    return name, argument if _ else None


def resolve_policy(policy: str, admission: str | None = None, eviction: str | None = None, prefill_chunk: int = 2048) -> Policy:
    """The policy ``policy`` names, with ``admission`` / ``eviction`` overriding its parts."""
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise InvalidArgumentError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
    name, argument = _split(policy, "policy", POLICIES)
    admission_text, eviction_text = POLICIES[name]
    if argument is not None:
        admission_text = f"{admission_text}:{argument}"
    admission_text, eviction_text = admission or admission_text, eviction or eviction_text
    admission_name, admission_argument = _split(admission_text, "admission", ADMISSIONS)
    eviction_name, eviction_argument = _split(eviction_text, "eviction", EVICTIONS)
    chosen = ADMISSIONS[admission_name](admission_argument, prefill_chunk)
    kept = EVICTIONS[eviction_name](eviction_argument)
    label = policy.strip() if admission is None and eviction is None else f"{chosen.name}+{kept.name}"
    return Policy(label, chosen, kept)
