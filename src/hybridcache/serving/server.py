"""``hybridcache serve``: running the app under uvicorn.

Owns nothing between calls; during ``serve`` the uvicorn server (SIGINT/SIGTERM stop it
gracefully: no new connections, requests in the server finish for up to ``app.DRAIN_S``, the
engine loop stops, the tier stores close).
"""

from __future__ import annotations

import uvicorn

from hybridcache.serving.app import DRAIN_S, create_app
from hybridcache.serving.config import ServeConfig


def serve(config: ServeConfig, log_level: str = "info") -> None:
    """Serve until SIGINT or SIGTERM."""
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), host=config.host, port=config.port, log_level=log_level,
        timeout_graceful_shutdown=int(DRAIN_S), access_log=False,
    ))
    server.run()
