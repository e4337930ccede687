"""The server's running parts, opened together and closed together.

Owns: the engine loop (and through it the engine), the tokenizer, the metrics and the tiers it
opened (``tier_setup``: stores closed and servers stopped on shutdown with the engine's event
sockets, after the loop has stopped using them). ``resolve_model`` turns a request's
``model`` / ``adapter`` fields into the adapter to serve, or refuses.
"""

from __future__ import annotations

import sys

from hybridcache.engine import Engine
from hybridcache.errors import InvalidArgumentError, ResourceExhaustedError, UnknownModelError
from hybridcache.serving.api_errors import rejected
from hybridcache.serving.config import ServeConfig
from hybridcache.serving.loop import EngineLoop
from hybridcache.serving.metrics import ServingMetrics
from hybridcache.serving.tier_setup import open_tiers
from hybridcache.serving.tokenizer import TextTokenizer, load_text_tokenizer


class ServingRuntime:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.tiers = open_tiers(config)
        try:
            self.engine = Engine(config.engine, tiers=self.tiers.store)
        except BaseException as error:
            self.tiers.close()  # stop the servers started for a tier the engine refused
            if isinstance(error, ResourceExhaustedError):
                raise ResourceExhaustedError(f"{error}; lower --num-kv-blocks / --num-state-slots") from None
            raise
        self.vocab_size = self.engine.model.layout.vocab_size
        # read before the loop owns the engine: the streams' sockets are fixed once bound
        self.events_description = None if self.engine.events is None else self.engine.events.describe()
        self.tokenizer: TextTokenizer | None = load_text_tokenizer(config.model_dir, self.vocab_size)
        self.metrics = ServingMetrics(config.served_name, config.engine, config.miss_log_interval_s)
        self.loop = EngineLoop(self.engine, capacity=config.max_in_server, observe=self.metrics.observe_engine)
        self.loop.start()

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.config.engine.adapters or ()

    def resolve_model(self, model: str, adapter: str | None) -> str | None:
        """The adapter a request names through ``model`` (an adapter's id) or ``adapter``
        (with ``model`` the base id); None for the base model."""
        if model in self.adapters and adapter is None:
            return model
        if model != self.config.served_name:
            raise rejected(UnknownModelError, f"the model {model!r} is not served here (GET /v1/models lists them)", "model")
        if adapter is not None and adapter not in self.adapters:
            raise rejected(InvalidArgumentError, f"unknown adapter {adapter!r}", "adapter")
        return adapter

    def close(self, drain_s: float) -> None:
        """Finish or cancel the requests in the server, say on stderr whether the cache's
        accounting holds, then close the event sockets and the tier stores and stop the tier
        servers it started."""
        self.loop.stop(drain_s)
        print(f"hybridcache serve: {audit(self.engine)}", file=sys.stderr, flush=True)
        self.engine.close()
        self.tiers.close()


def audit(engine: Engine) -> str:
    """The engine's invariants once its loop has stopped (refcounts equal their owners, no
    stranded request, no leaked slot), as one line for the server's last words."""
    try:
        engine.check_invariants()
    except AssertionError as violation:
        return f"cache accounting VIOLATED after shutdown: {violation}"
    return "cache accounting holds after shutdown (check_invariants)"
