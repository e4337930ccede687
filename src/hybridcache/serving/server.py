"""``hybridcache serve``: running the app under uvicorn.

Owns nothing between calls; during ``serve`` the uvicorn server (SIGINT/SIGTERM stop it
gracefully: no new connections, requests in the server finish for up to ``app.DRAIN_S``, the
engine loop stops, the tier stores close).
"""

from __future__ import annotations

import uvicorn

from hybridcache.serving.app import DRAIN_S, create_app
from hybridcache.serving.config import ServeConfig
from hybridcache.serving.connection import connection_protocol
from hybridcache.serving.runtime import ServingRuntime


def serve(config: ServeConfig, log_level: str = "info") -> None:
    """Serve until SIGINT or SIGTERM. The runtime opens first, so a server that cannot start
    raises (a ``HybridCacheError``) before uvicorn runs; if uvicorn itself never starts (its
    port taken), the runtime is closed all the same."""
    runtime = ServingRuntime(config)
    server = uvicorn.Server(uvicorn.Config(
        create_app(runtime), host=config.host, port=config.port, log_level=log_level,
        timeout_graceful_shutdown=int(DRAIN_S), access_log=False,
        http=connection_protocol(config.client_timeout_s, config.max_connections),
    ))
    try:
        server.run()
    finally:
        if not server.started:
            runtime.close(DRAIN_S)

