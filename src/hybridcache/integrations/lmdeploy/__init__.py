"""hybridcache behind lmdeploy's PyTorch-engine Scheduler (lmdeploy 0.16.0).

Owns nothing itself: ``install`` rebinds the name ``BlockTrie`` in
``lmdeploy.pytorch.paging.scheduler`` (the one lmdeploy's ``Scheduler`` builds its trie by) to
``LmdeployBlockTrie``, and ``uninstall`` puts lmdeploy's class back. lmdeploy is imported only
when one of them runs::

    from hybridcache.integrations import lmdeploy as hybridcache_lmdeploy
    hybridcache_lmdeploy.install()        # every Scheduler built from now on uses hybridcache
"""

from __future__ import annotations

import importlib

from hybridcache.errors import InvalidConfigError
from hybridcache.integrations.lmdeploy.trie import LmdeployBlockTrie

SUPPORTED_VERSION = "0.16.0"
_SCHEDULER_MODULE = "lmdeploy.pytorch.paging.scheduler"

__all__ = ["LmdeployBlockTrie", "SUPPORTED_VERSION", "install", "uninstall"]


def _scheduler_module():
    try:
        module = importlib.import_module(_SCHEDULER_MODULE)
        version = importlib.import_module("lmdeploy").__version__
    except ImportError as error:
        raise InvalidConfigError(f"lmdeploy is not importable ({error}); install hybridcache[lmdeploy]") from None
    if version != SUPPORTED_VERSION:
        raise InvalidConfigError(f"lmdeploy {version} installed; the adapter targets {SUPPORTED_VERSION}")
    return module


def install() -> type:
    """Make lmdeploy's Scheduler build ``LmdeployBlockTrie``; returns the class it replaced."""
    module = _scheduler_module()
    previous = module.BlockTrie
    module.BlockTrie = LmdeployBlockTrie
    return lmdeploy_trie_class() if previous is LmdeployBlockTrie else previous


def uninstall() -> None:
    """Give lmdeploy's Scheduler its own BlockTrie back."""
    _scheduler_module().BlockTrie = lmdeploy_trie_class()


def lmdeploy_trie_class() -> type:
    """lmdeploy's own ``BlockTrie`` (the reference the adapter is compared with)."""
    _scheduler_module()
    return importlib.import_module("lmdeploy.pytorch.paging.block_trie").BlockTrie
