"""What a replica's HTTP server says about itself: its event streams and its load.

Owns nothing. ``GET /kv_events`` describes the streams (``{"block_size", "instance_id", "kv":
{"endpoint", "replay_endpoint", "topic"}, "state": {...} | null, "adapters": [...]}``, as
``Engine.events.describe`` gives it, ``instance_id`` naming this run of the streams, and
``hybridcache serve`` adds the adapter names and ``next_seq``, each stream's seq once what it
queued is sent); an endpoint bound on every interface (``*``, ``0.0.0.0``, ``::``) is reached
at the replica's host. ``GET /metrics`` gives the load: ``vllm:num_requests_running`` plus
``vllm:num_requests_waiting``. Every call is bounded by ``timeout_s`` and by ``MAX_ANSWER``
bytes, and raises ``EventStreamError`` (description) or returns None (load, seqs) when the
replica does not answer, or answers what cannot be read: a description whose ``block_size``
is not an int in ``[1, MAX_BLOCK_SIZE]``, whose endpoints are not ``tcp://``, ``ipc://`` or
``inproc://`` strings, whose topic is not a string or whose adapters are not a list of
strings describes no streams (the replica is routed by load).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from hybridcache.errors import EventStreamError
from hybridcache.router.feed import StreamInfo

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SCHEMES = ("tcp", "ipc", "inproc")
MAX_BLOCK_SIZE = 1 << 16  # tokens; far above any engine's block, far below a hash chain's overflow
MAX_ANSWER = 16 * 1024 * 1024  # bytes of one /kv_events or /metrics answer
# What reading a replica's answer may raise: the connection's failures, and what its bytes make
# the parsers raise (deep JSON: RecursionError).
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, http.client.HTTPException)


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


def _read(url: str, path: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as response:
        data = response.read(MAX_ANSWER + 1)
    if len(data) > MAX_ANSWER:
        raise ValueError(f"{path} answered more than {MAX_ANSWER:,} bytes")
    return data


def read_streams(url: str, timeout_s: float) -> ReplicaStreams:
    try:
        described = json.loads(_read(url, "/kv_events", timeout_s))
        host = urlsplit(url).hostname or "127.0.0.1"
        kv = _stream(described["kv"], host)
        state = None if described.get("state") is None else _stream(described["state"], host)
        block_size = _block_size(described["block_size"])
        adapters = _adapters(described.get("adapters"))
        instance_id = _instance_id(described)
    except _UNREADABLE as error:
        raise EventStreamError(f"{url}/kv_events gave no stream description: {error}") from None
    return ReplicaStreams(block_size, kv, state, adapters, instance_id)


def _block_size(described: object) -> int:
    if isinstance(described, bool) or not isinstance(described, int) or not 1 <= described <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {described!r}")
    return described


def _adapters(described: object) -> frozenset[str]:
    if described is None:
        return frozenset()
    if not isinstance(described, list) or not all(isinstance(name, str) for name in described):
        raise ValueError(f"adapters must be a list of names, got {described!r}")
    return frozenset(described)


def read_continuity(url: str, timeout_s: float) -> Continuity | None:
    """The replica's instance id and next_seqs from ``/kv_events``, or None when it does not say."""
    try:
        described = json.loads(_read(url, "/kv_events", timeout_s))
        seqs = next_seqs_from(described["next_seq"])
        instance_id = _instance_id(described)
    except _UNREADABLE:
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
        return next_seqs_from(json.loads(_read(url, "/kv_events", timeout_s))["next_seq"])
    except _UNREADABLE:
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
        except (ValueError, RecursionError):
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
    topic = described.get("topic", "")
    if not isinstance(topic, str):
        raise ValueError(f"topic must be a string, got {topic!r}")
    return StreamInfo(_reachable(described["endpoint"], host), None if replay is None else _reachable(replay, host), topic)


def _reachable(endpoint: object, host: str) -> str:
    if not isinstance(endpoint, str) or endpoint.partition("://")[0] not in _SCHEMES:
        raise ValueError(f"an endpoint must be a tcp://, ipc:// or inproc:// string, got {endpoint!r}")
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    bound, _, port = rest.rpartition(":")
    return f"tcp://{host}:{port}" if bound in _WILDCARD_HOSTS else endpoint


def read_load(url: str, timeout_s: float) -> float | None:
    """Running plus waiting requests, or None when the replica does not answer."""
    try:
        text = _read(url, "/metrics", timeout_s).decode("utf-8", "replace")
    except _UNREADABLE:
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
