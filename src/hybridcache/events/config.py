"""The event streams' configuration (a frozen value, validated in full when built).

The KV fields and their defaults are vLLM's ``KVEventsConfig`` (so ``--kv-events-config``
takes the same JSON); ``state_endpoint`` and ``state_replay_endpoint`` are the checkpoint
stream's sockets, ``state_topic`` its topic (``hcstate@<pod>@<model>`` by convention), and
``bind`` overrides vLLM's rule for whether the PUB sockets bind or connect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from hybridcache.errors import InvalidConfigError
from hybridcache.types import as_bool, as_int

_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    state_endpoint: str | None = None  # None: no checkpoint stream
    state_replay_endpoint: str | None = None
    state_topic: str = "hcstate"
    bind: bool | None = None  # None: vLLM's rule (bind on "*", "::", ipc:// and inproc://)
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "enable_kv_cache_events", as_bool("enable_kv_cache_events", self.enable_kv_cache_events, error=InvalidConfigError)
        )
        for name, minimum in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1), ("data_parallel_rank", 0)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum, error=InvalidConfigError))
        if self.publisher not in (None, "zmq", "null"):
            raise InvalidConfigError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if self.bind is not None:
            object.__setattr__(self, "bind", as_bool("bind", self.bind, error=InvalidConfigError))
        _check_endpoint("endpoint", self.endpoint, required=True)
        for name in ("replay_endpoint", "state_endpoint", "state_replay_endpoint"):
            _check_endpoint(name, getattr(self, name), required=False)
        if self.state_replay_endpoint is not None and self.state_endpoint is None:
            raise InvalidConfigError("state_replay_endpoint needs a state_endpoint")
        for name in ("topic", "state_topic"):
            if not isinstance(getattr(self, name), str):
                raise InvalidConfigError(f"{name} must be a str")

    @property
    def active(self) -> bool:
        """Whether events are published at all."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def binds(self, endpoint: str) -> bool:
        """Whether a PUB socket at ``endpoint`` binds (else it connects to a bound subscriber)."""
        if self.bind is not None:
            return self.bind
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config`` JSON; unknown keys are refused."""
        try:
            values = json.loads(text)
        except (TypeError, ValueError, RecursionError) as error:  # RecursionError: nesting past the parser's depth
            raise InvalidConfigError(f"--kv-events-config is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise InvalidConfigError("--kv-events-config must be a JSON object")
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidConfigError(f"unknown kv-events-config keys: {sorted(unknown)}")
        return cls(**values)


def _check_endpoint(name: str, value: object, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or len(value) <= len("tcp://"):
        raise InvalidConfigError(f"{name} must be a tcp://, ipc:// or inproc:// endpoint, got {value!r}")
