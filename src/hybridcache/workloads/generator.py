"""Multi-turn traces of a chosen shape, written in the Mooncake JSONL format the readers take.

Owns, during one ``generate`` call, the random generator and each open session's history (its
block ids so far); returns immutable lines and keeps nothing.

A trace is a set of sessions. A session starts at a Poisson arrival, opens with one of a few
system prompts shared across sessions (chosen Zipf-like, so some are far more common), and runs
a number of turns drawn from the shape's distribution. Each turn's prompt is the whole history
(the previous prompt, its output) plus a new message; between turns the user thinks (an
exponential pause) after the output is generated. Histories grow until the shape's context cap
ends the session. Lines are emitted in arrival order.

In hash-id terms (512-token blocks): a turn repeats the previous turn's full blocks and gets
fresh ids for the rest, so the readers' continuation rule recovers the conversation exactly
(the previous prompt has exactly those full blocks, the new message is at most 4,096 tokens);
system prompts are whole blocks, shared by id. The first message of a session fills at least
one block of its own, so no turn could be mistaken for another session's continuation.

Shapes (``SHAPES``):
* ``conversation``: chat with long histories: 2-3K-token system prompts, 6 turns on average
  (up to 30), messages of a few hundred tokens, outputs of ~300, pauses of ~30 s, 64K context.
* ``tool-agent``: an agent loop: long shared tool descriptions (8-16K tokens, 4 of them), 12
  short turns on average (tool results and calls of 50-800 tokens, outputs of ~100), pauses of ~2 s.
* ``long-context``: the held-out production trace of issue 24: long one-off prompts (a 1-2K-token
  system prompt of 8, then a first message of 2.5-21.5K tokens: ~13.7K a request) and few,
  late returns (1.19 turns a session on average, so ~130 continuations per 1,000 requests,
  after pauses of ~10 min: some 150 sessions arrive in between), 128K context. Most of its
  infinite-cache bound (~22-25 %) is the histories of the few sessions that return; the rest
  is the system prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridcache.errors import InvalidArgumentError, InvalidTypeError
from hybridcache.types import as_ordered

BLOCK = 512  # Mooncake's hash-id block
MAX_MESSAGE = 4096  # the readers' continuation window: a turn adds at most this much


@dataclass(frozen=True)
class Shape:
    """One trace shape's distributions (token counts, seconds)."""

    system_prompts: int
    system_blocks: tuple[int, int]  # each shared system prompt: blocks, uniform in [low, high]
    mean_turns: float  # geometric, at least 1
    max_turns: int
    first_message: tuple[int, int]  # tokens, uniform (the first fills at least one block)
    message_median: int  # log-normal, capped at MAX_MESSAGE
    output_median: int  # log-normal
    think_s: float  # exponential mean between a turn's output and the next turn
    session_gap_s: float  # exponential mean between session starts
    context: int  # a session ends before its prompt would pass this


SHAPES = {
    "conversation": Shape(8, (4, 6), 6.0, 30, (512, 3000), 300, 300, 30.0, 6.0, 65_536),
    "tool-agent": Shape(4, (16, 32), 12.0, 40, (512, 1500), 250, 100, 2.0, 8.0, 65_536),
    # Fitted to issue 24's production trace (first 1,000 requests: ~13,700 prompt tokens a
    # request, 144 continuations, bound 22.2 %): one-off long prompts dominate, and the long
    # pauses put a returning turn far behind its history, as the trace's budgets suggest.
    "long-context": Shape(8, (2, 4), 1.19, 8, (2500, 21500), 300, 300, 600.0, 4.0, 131_072),
}
DEFAULT_SESSIONS = 200
_DECODE_S_PER_TOKEN = 0.03  # the output's generation time, before the user's pause


def _lognormal(rng: np.random.Generator, median: int, cap: int) -> int:
    return int(min(cap, max(1, round(median * rng.lognormal(0.0, 0.8)))))


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, count: int) -> list[int]:
        ids = list(range(self.next, self.next + count))
        self.next += count
        return ids


def _session(rng: np.random.Generator, shape: Shape, start_s: float, system: list[int], ids: _Ids) -> list[dict]:
    turns = min(shape.max_turns, int(rng.geometric(1.0 / shape.mean_turns)))
    history_ids, history_tokens, full = list(system), len(system) * BLOCK, len(system)
    message = int(rng.integers(shape.first_message[0], shape.first_message[1] + 1))
    lines, now = [], start_s
    for _ in range(turns):
        prompt = history_tokens + message
        if prompt > shape.context:
            break
        output = _lognormal(rng, shape.output_median, shape.context)
        hash_ids = history_ids[:full] + ids.fresh(-(-prompt // BLOCK) - full)
        lines.append({"timestamp": int(now * 1000), "input_length": prompt, "output_length": output,
                      "hash_ids": hash_ids})
        history_ids, history_tokens, full = hash_ids, prompt + output, prompt // BLOCK
        message = _lognormal(rng, shape.message_median, MAX_MESSAGE)
        now += output * _DECODE_S_PER_TOKEN + rng.exponential(shape.think_s)
    return lines


def generate(kind: str, seed: int = 0, sessions: int = DEFAULT_SESSIONS) -> list[dict]:
    """The lines of a ``kind`` trace (``SHAPES``) of ``sessions`` sessions, in arrival order."""
    if not isinstance(kind, str) or kind not in SHAPES:
        raise InvalidArgumentError(f"unknown trace shape {kind!r}; known: {', '.join(SHAPES)}")
    for name, value, minimum in (("seed", seed, 0), ("sessions", sessions, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    shape, rng, ids = SHAPES[kind], np.random.default_rng(seed), _Ids()
    systems = [ids.fresh(int(rng.integers(shape.system_blocks[0], shape.system_blocks[1] + 1)))
               for _ in range(shape.system_prompts)]
    popularity = 1.0 / np.arange(1, shape.system_prompts + 1)
    popularity /= popularity.sum()
    lines, start = [], 0.0
    for _ in range(sessions):
        start += rng.exponential(shape.session_gap_s)
        system = systems[int(rng.choice(shape.system_prompts, p=popularity))]
        lines += _session(rng, shape, start, system, ids)
    lines.sort(key=lambda line: line["timestamp"])  # stable: a session's turns keep their order
    return lines


def write_trace(lines: list[dict], path: str | Path) -> None:
    """Write ``lines`` (JSON objects) as JSONL, one object per line; nothing is written when one
    of them is not JSON (a set, NaN, a cycle)."""
    if not isinstance(path, (str, Path)):
        raise InvalidTypeError(f"path must be a str or a Path, got {type(path).__name__}")
    lines = as_ordered("lines", lines)
    if not all(isinstance(line, dict) for line in lines):
        raise InvalidTypeError("every line must be a dict (a JSON object)")
    try:
        text = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidArgumentError(f"a line cannot be written as JSON ({error})") from None
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise InvalidArgumentError(f"cannot write {path}: {error.strerror}") from None
    except ValueError as error:  # a NUL byte, or text the file system cannot encode
        raise InvalidArgumentError(f"cannot write {str(path)!r}: {error}") from None
