"""hybridcache behind lmdeploy's PyTorch-engine Scheduler (lmdeploy 0.16.0).

Owns nothing itself: ``install`` rebinds two names in ``lmdeploy.pytorch.paging.scheduler``,
the ones lmdeploy's ``Scheduler`` builds its trie and its sequence manager by: ``BlockTrie`` to
``LmdeployBlockTrie`` and ``SequenceManager`` to lmdeploy's manager announcing waiting
sequences to the trie (``arrivals``: shadows are built at arrival, outside the scheduler
step). ``uninstall`` puts lmdeploy's classes back. lmdeploy is imported only when one of them
runs::

    from hybridcache.integrations import lmdeploy as hybridcache_lmdeploy
    hybridcache_lmdeploy.install()        # every Scheduler built from now on uses hybridcache
"""

from __future__ import annotations

import importlib

from hybridcache.errors import InvalidConfigError
from hybridcache.integrations.lmdeploy.arrivals import announcing_manager
from hybridcache.integrations.lmdeploy.trie import LmdeployBlockTrie

SUPPORTED_VERSION = "0.16.0"
_SCHEDULER_MODULE = "lmdeploy.pytorch.paging.scheduler"
_MESSAGES_MODULE = "lmdeploy.pytorch.messages"

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
    module.SequenceManager = announcing_manager(importlib.import_module(_MESSAGES_MODULE).SequenceManager)
    return lmdeploy_trie_class() if previous is LmdeployBlockTrie else previous


def uninstall() -> None:
    """Give lmdeploy's Scheduler its own BlockTrie and SequenceManager back."""
    module = _scheduler_module()
    module.BlockTrie = lmdeploy_trie_class()
    module.SequenceManager = importlib.import_module(_MESSAGES_MODULE).SequenceManager


def lmdeploy_trie_class() -> type:
    """lmdeploy's own ``BlockTrie`` (the reference the adapter is compared with)."""
    _scheduler_module()
    return importlib.import_module("lmdeploy.pytorch.paging.block_trie").BlockTrie
