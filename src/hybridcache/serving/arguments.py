"""``hybridcache serve``'s command-line arguments (``ServeConfig.from_args`` reads them).

Owns nothing. Imports nothing heavy: the CLI builds its parser for every command, and only
``serve`` pays for the engine (torch) and the serve extra.
"""

from __future__ import annotations

import argparse

from hybridcache import cli_args
from hybridcache.policies import DEFAULT_POLICY
from hybridcache.tiers.shared_setup import SHARED_TIERS

TINY_MODEL = "tiny"
CLIENT_TIMEOUT_S = 60.0  # how long a connection may wait on a silent client (serving.connection)
MAX_CONNECTIONS = 1024  # connections held at once by default (serving.connection)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option is checked as it is parsed (``hybridcache.cli_args``)."""
    count = cli_args.int_in(1, 2**24)
    parser.add_argument("--model", default=TINY_MODEL, help="a local transformers checkpoint directory, or 'tiny'")
    parser.add_argument("--served-name", help="the model id clients send (default: 'tiny' or the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=cli_args.int_in(0, 65535), default=8000)
    parser.add_argument("--dtype", choices=["float32", "float64"], help="float64 for tiny, float32 for a checkpoint")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="checkpoint policy (hybridcache.policies)")
    parser.add_argument("--adapters", help="comma-separated adapter names the model serves (clients name them in 'model')")
    parser.add_argument("--no-prefix-caching", action="store_true", help="serve without the prefix cache")
    parser.add_argument("--block-size", type=cli_args.int_in(2, 2**16, even=True), default=16)
    parser.add_argument("--num-kv-blocks", type=count, default=2048)
    parser.add_argument("--num-state-slots", type=count, default=96)
    parser.add_argument("--checkpoint-budget", type=cli_args.int_in(0, 2**24), default=64)
    parser.add_argument("--max-running", type=count, default=16)
    parser.add_argument("--max-batch-tokens", type=count, default=2048)
    parser.add_argument("--prefill-chunk", type=count, default=2048)
    parser.add_argument("--max-waiting", type=cli_args.int_in(0, 2**20), default=64,
                        help="queued requests beyond the running ones; more get 503")
    parser.add_argument("--host-bytes", type=cli_args.size, help="host-memory tier size (e.g. 2GB; default: none)")
    parser.add_argument("--disk-bytes", type=cli_args.size, help="disk tier size (default: none)")
    parser.add_argument("--disk-root", help="disk tier directory (default: a temporary one)")
    parser.add_argument("--shared-tier", default="none", choices=SHARED_TIERS,
                        help="a store shared by servers (default: none)")
    parser.add_argument("--store-url", help="the shared store: redis://HOST:PORT/DB or "
                        "mooncake://HOST:PORT?metadata=URL (default: a local server serve starts and stops)")
    parser.add_argument("--kv-events-config", metavar="JSON",
                        help="vLLM's KVEventsConfig as JSON, plus state_endpoint / state_replay_endpoint (docs/events.md)")
    parser.add_argument("--client-timeout", type=cli_args.positive_float, default=CLIENT_TIMEOUT_S, metavar="S",
                        help="seconds a connection may wait on a silent client (a request never finished, a stream "
                             "no longer read) before it is closed")
    parser.add_argument("--max-connections", type=cli_args.int_in(1, 2**20), metavar="N",
                        help=f"connections held at once; one more is answered 503 and closed (default: "
                             f"{MAX_CONNECTIONS}, or what the file descriptor limit allows)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
