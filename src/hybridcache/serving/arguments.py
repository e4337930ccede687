"""``hybridcache serve``'s command-line arguments and the ``ServeConfig`` they describe.

Owns nothing. Imports nothing heavy at module level: the CLI builds its parser for every
command, and only ``serve`` pays for the engine (torch) and the serve extra.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import TYPE_CHECKING

from hybridcache.policies import DEFAULT_POLICY
from hybridcache.profiles import parse_size

if TYPE_CHECKING:
    from hybridcache.serving.config import ServeConfig

TINY_MODEL = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=TINY_MODEL, help="a local transformers checkpoint directory, or 'tiny'")
    parser.add_argument("--served-name", help="the model id clients send (default: 'tiny' or the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["float32", "float64"], help="float64 for tiny, float32 for a checkpoint")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="checkpoint policy (hybridcache.policies)")
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


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` the arguments describe (a bad value raises a hybridcache error)."""
    from hybridcache.engine import EngineConfig, TinyHybridConfig
    from hybridcache.engine.hf.config import HFModelConfig
    from hybridcache.serving.config import ServeConfig

    tiny = args.model == TINY_MODEL
    model = TinyHybridConfig() if tiny else HFModelConfig(args.model, args.dtype or "float32")
    engine = EngineConfig(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, num_state_slots=args.num_state_slots,
        checkpoint_budget=args.checkpoint_budget, prefix_caching=not args.no_prefix_caching,
        max_batch_tokens=args.max_batch_tokens, max_running=args.max_running, prefill_chunk=args.prefill_chunk,
        dtype=args.dtype if tiny else None, model=model, checkpoint_policy=args.policy,
    )
    disk_bytes = _size(args.disk_bytes)
    disk_root = args.disk_root or (tempfile.mkdtemp(prefix="hybridcache-disk-") if disk_bytes else None)
    return ServeConfig(
        engine=engine, model_dir=None if tiny else args.model, served_name=args.served_name, host=args.host,
        port=args.port, max_waiting=args.max_waiting, host_bytes=_size(args.host_bytes), disk_bytes=disk_bytes,
        disk_root=disk_root,
    )


def _size(text: str) -> int:
    return 0 if text.strip() == "0" else parse_size(text)
