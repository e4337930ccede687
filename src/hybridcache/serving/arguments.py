"""``hybridcache serve``'s command-line arguments (``ServeConfig.from_args`` reads them).

Owns nothing. Imports nothing heavy: the CLI builds its parser for every command, and only
``serve`` pays for the engine (torch) and the serve extra.
"""

from __future__ import annotations

import argparse

from hybridcache.policies import DEFAULT_POLICY

TINY_MODEL = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=TINY_MODEL, help="a local transformers checkpoint directory, or 'tiny'")
    parser.add_argument("--served-name", help="the model id clients send (default: 'tiny' or the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["float32", "float64"], help="float64 for tiny, float32 for a checkpoint")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="checkpoint policy (hybridcache.policies)")
    parser.add_argument("--adapters", help="comma-separated adapter names the model serves (clients name them in 'model')")
    parser.add_argument("--no-prefix-caching", action="store_true", help="serve without the prefix cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--num-state-slots", type=int, default=96)
    parser.add_argument("--checkpoint-budget", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond the running ones; more get 503")
    parser.add_argument("--host-bytes", default="0", help="host-memory tier size (e.g. 2GB; 0: none)")
    parser.add_argument("--disk-bytes", default="0", help="disk tier size (0: none)")
    parser.add_argument("--disk-root", help="disk tier directory (default: a temporary one)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
