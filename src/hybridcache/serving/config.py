"""``ServeConfig``: what ``hybridcache serve`` serves and the limits it enforces.

Owns nothing mutable (a frozen value, validated when built). It carries the engine's own
``EngineConfig`` plus the HTTP side: the served model id, the bounded queue, the body size
limit, token limits and the miss-log interval. Later server features (KV events, a router
descriptor) add fields here and read them in ``runtime.ServingRuntime``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridcache.engine import EngineConfig, TinyHybridConfig
from hybridcache.engine.hf.config import HFModelConfig
from hybridcache.errors import InvalidConfigError
from hybridcache.events.config import KVEventsConfig
from hybridcache.machine import connection_bound
from hybridcache.serving.arguments import CLIENT_TIMEOUT_S, MAX_CONNECTIONS, TINY_MODEL
from hybridcache.serving.capacity import check_tier_sizes
from hybridcache.tiers.shared_setup import check_shared_tier
from hybridcache.types import as_int, as_name, is_positive_finite


@dataclass(frozen=True)
class ServeConfig:
    """``model_dir`` None serves the tiny model (byte-level tokenizer, ``serving.tokenizer``);
    else the transformers checkpoint in that directory, whose tokenizer and chat template are
    used. ``served_name``: the id clients put in ``model`` (default ``tiny`` or the directory's
    name). At most ``max_running + max_waiting`` requests are in the server at once; one more
    gets 503. ``default_max_tokens`` applies when a request names none. ``shared_tier``
(``none``, ``redis``, ``mooncake``): a store at ``store_url``, or (None) a local server the
runtime starts and stops. ``client_timeout_s``: how long a connection may wait on its client;
``max_connections``: connections held at once, one more answered 503 (None: ``MAX_CONNECTIONS``,
or what the descriptor limit allows; ``serving.connection``)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    model_dir: str | os.PathLike | None = None
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 64
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    miss_log_interval_s: float = 60.0
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_root: str | os.PathLike | None = None
    shared_tier: str = "none"
    store_url: str | None = None
    client_timeout_s: float = CLIENT_TIMEOUT_S
    max_connections: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise InvalidConfigError("engine must be an EngineConfig")
        for name, minimum in (("port", 0), ("max_waiting", 0), ("max_body_bytes", 1024), ("default_max_tokens", 1),
                              ("host_bytes", 0), ("disk_bytes", 0)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum, error=InvalidConfigError))
        if self.port > 65535:
            raise InvalidConfigError(f"port must be <= 65535, got {self.port}")
        for name in ("miss_log_interval_s", "client_timeout_s"):
            value = getattr(self, name)
            if not is_positive_finite(value):
                raise InvalidConfigError(f"{name} must be a finite number > 0, got {value!r}")
        object.__setattr__(self, "max_connections", connection_bound(self.max_connections, MAX_CONNECTIONS, 1,
                                                                      InvalidConfigError))
        if self.disk_bytes and self.disk_root is None:
            raise InvalidConfigError("disk_bytes needs a disk_root directory")
        check_shared_tier(self.shared_tier, self.store_url)
        name = self.served_name
        if name is None:
            name = TINY_MODEL if self.model_dir is None else Path(self.model_dir).name
        object.__setattr__(self, "served_name", as_name("served_name", name, InvalidConfigError))
        object.__setattr__(self, "host", as_name("host", self.host, InvalidConfigError))

    @property
    def max_in_server(self) -> int:
        """Requests the server holds at once (running plus waiting); one more is refused."""
        return self.engine.max_running + self.max_waiting

    @property
    def max_context_tokens(self) -> int:
        """The most prompt plus generated tokens one request can hold (the whole KV pool)."""
        return self.engine.num_kv_blocks * self.engine.block_size

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """The config ``serving.arguments`` describe (a bad value raises a hybridcache error)."""
        tiny = args.model == TINY_MODEL
        model = TinyHybridConfig() if tiny else HFModelConfig(args.model, args.dtype or "float32")
        engine = EngineConfig(
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, num_state_slots=args.num_state_slots,
            checkpoint_budget=args.checkpoint_budget, prefix_caching=not args.no_prefix_caching,
            max_batch_tokens=args.max_batch_tokens, max_running=args.max_running, prefill_chunk=args.prefill_chunk,
            dtype=args.dtype if tiny else None, model=model, checkpoint_policy=args.policy,
            adapters=None if args.adapters is None else _adapter_names(args.adapters),
            kv_events=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else KVEventsConfig(),
        )
        disk_bytes = args.disk_bytes or 0
        # before a temporary disk root is made, so a refused size leaves nothing behind
        check_tier_sizes(args.host_bytes or 0, disk_bytes, args.disk_root or tempfile.gettempdir())
        disk_root = args.disk_root or (tempfile.mkdtemp(prefix="hybridcache-disk-") if disk_bytes else None)
        return cls(
            engine=engine, model_dir=None if tiny else args.model, served_name=args.served_name, host=args.host,
            port=args.port, max_waiting=args.max_waiting, host_bytes=args.host_bytes or 0, disk_bytes=disk_bytes,
            disk_root=disk_root, shared_tier=args.shared_tier, store_url=args.store_url,
            client_timeout_s=args.client_timeout, max_connections=args.max_connections,
        )



def _adapter_names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    if not all(names):
        raise InvalidConfigError(f"--adapters takes comma-separated names, none of them empty; got {text!r}")
    return names
