"""What a replica's HTTP server says about itself: its event streams and its load.

Owns nothing. ``GET /kv_events`` describes the streams (``{"block_size", "instance_id", "kv":
{"endpoint", "replay_endpoint", "topic"}, "state": {...} | null, "adapters": [...]}``, as
``Engine.events.describe`` gives it, ``instance_id`` naming this run of the streams, and
``hybridcache serve`` adds the adapter names and ``next_seq``, each stream's seq once what it
queued is sent); an endpoint bound on every interface (``*``, ``0.0.0.0``, ``::``) is reached
at the replica's host. ``GET /metrics`` gives the load: ``vllm:num_requests_running`` plus
``vllm:num_requests_waiting``. Every call is bounded by ``timeout_s`` and raises
``EventStreamError`` (description) or returns None (load) when the replica does not answer.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from hybridcache.errors import EventStreamError
from hybridcache.router.feed import StreamInfo

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class ReplicaStreams:
    block_size: int
    kv: StreamInfo
    state: StreamInfo | None
    adapters: frozenset[str] = frozenset()  # model ids whose blocks carry their name as lora_name
    instance_id: str | None = None  # this run of the streams (None: a replica that does not say)


@dataclass(frozen=True)
class Continuity:
    """What tells one run of a replica's streams from the next: its id and each stream's next_seq."""

    instance_id: str | None
    next_seqs: tuple[int | None, int | None]


def read_streams(url: str, timeout_s: float) -> ReplicaStreams:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/kv_events", timeout=timeout_s) as response:
            described = json.loads(response.read())
        host = urlsplit(url).hostname or "127.0.0.1"
        kv = _stream(described["kv"], host)
        state = None if described.get("state") is None else _stream(described["state"], host)
        block_size = int(described["block_size"])
        adapters = frozenset(str(name) for name in described.get("adapters") or ())
        instance_id = _instance_id(described)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise EventStreamError(f"{url}/kv_events gave no stream description: {error}") from None
    return ReplicaStreams(block_size, kv, state, adapters, instance_id)


def read_continuity(url: str, timeout_s: float) -> Continuity | None:
    """The replica's instance id and next_seqs from ``/kv_events``, or None when it does not say."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/kv_events", timeout=timeout_s) as response:
            described = json.loads(response.read())
        seqs = next_seqs_from(described["next_seq"])
        instance_id = _instance_id(described)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None if seqs is None else Continuity(instance_id, seqs)


def _instance_id(described: dict) -> str | None:
    instance_id = described.get("instance_id")
    if instance_id is not None and not isinstance(instance_id, str):
        raise ValueError(f"instance_id must be a string, got {instance_id!r}")
    return instance_id


def read_next_seqs(url: str, timeout_s: float) -> tuple[int | None, int | None] | None:
    """The KV and checkpoint streams' ``next_seq`` (None for a stream the replica lacks), or
    None when the replica does not say."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/kv_events", timeout=timeout_s) as response:
            return next_seqs_from(json.loads(response.read())["next_seq"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def next_seqs_from(described: object) -> tuple[int | None, int | None] | None:
    """``{"kv": int | None, "state": int | None}`` (as ``/kv_events``, an answer's
    ``hybridcache.next_seq`` and its ``x-hybridcache-next-seq`` header give it) as a pair, or
    None when it is not that shape."""
    if not isinstance(described, dict) or "kv" not in described:
        return None
    kv, state = described.get("kv"), described.get("state")
    if not all(seq is None or (isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0) for seq in (kv, state)):
        return None
    return kv, state


def answer_next_seqs(header: str | None, answer: bytes | None) -> tuple[int | None, int | None] | None:
    """The ``next_seq`` a replica's answer carries: its header, else its body's (or last usage
    event's) ``hybridcache.next_seq``; None when it carries neither."""
    for source in (header, answer):
        if not source:
            continue
        try:
            described = json.loads(source)
        except ValueError:
            continue
        if source is answer:
            described = described.get("hybridcache", {}).get("next_seq") if isinstance(described, dict) else None
            described = described if isinstance(described, dict) else None
        seqs = next_seqs_from(described)
        if seqs is not None:
            return seqs
    return None


def _stream(described: dict, host: str) -> StreamInfo:
    replay = described.get("replay_endpoint")
    return StreamInfo(_reachable(described["endpoint"], host), None if replay is None else _reachable(replay, host),
                      str(described.get("topic", "")))


def _reachable(endpoint: str, host: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    bound, _, port = rest.rpartition(":")
    return f"tcp://{host}:{port}" if bound in _WILDCARD_HOSTS else endpoint


def read_load(url: str, timeout_s: float) -> float | None:
    """Running plus waiting requests, or None when the replica does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    load = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _LOAD_METRICS:
            try:
                load += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return load
