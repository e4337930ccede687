"""``install`` swaps the two names lmdeploy's Scheduler builds its trie and its sequence
manager by, and only for the lmdeploy version the adapter targets."""

import lmdeploy
import lmdeploy.pytorch.paging.scheduler as scheduler_module
import pytest
from lmdeploy.pytorch.messages import SequenceManager as LmdeployOwnManager
from lmdeploy.pytorch.paging.block_trie import BlockTrie as LmdeployOwnTrie

from hybridcache.errors import InvalidConfigError, InvalidTypeError
from hybridcache.integrations import lmdeploy as adapter
from tests.integrations.lmdeploy.twins import make_scheduler


def test_install_swaps_the_schedulers_trie_and_uninstall_restores_it():
    assert adapter.install() is LmdeployOwnTrie
    assert scheduler_module.BlockTrie is adapter.LmdeployBlockTrie
    announcing = scheduler_module.SequenceManager
    assert issubclass(announcing, LmdeployOwnManager) and announcing is not LmdeployOwnManager
    assert adapter.install() is LmdeployOwnTrie  # installing twice still reports lmdeploy's class
    assert scheduler_module.SequenceManager is announcing  # and rebinds the same manager class
    adapter.uninstall()
    assert scheduler_module.BlockTrie is LmdeployOwnTrie
    assert scheduler_module.SequenceManager is LmdeployOwnManager


def test_a_scheduler_built_after_install_uses_hybridcache():
    assert isinstance(make_scheduler(hybridcache=True, ssm=True, num_gpu_blocks=8).block_trie, adapter.LmdeployBlockTrie)
    assert isinstance(make_scheduler(hybridcache=False, ssm=True, num_gpu_blocks=8).block_trie, LmdeployOwnTrie)


def test_another_lmdeploy_version_is_refused(monkeypatch):
    monkeypatch.setattr(lmdeploy, "__version__", "0.18.0")
    with pytest.raises(InvalidConfigError):
        adapter.install()
    assert scheduler_module.BlockTrie is LmdeployOwnTrie
    assert scheduler_module.SequenceManager is LmdeployOwnManager


def test_the_adapter_refuses_what_is_not_lmdeploys_allocator_or_state_manager():
    from lmdeploy.pytorch.paging.block_manager.base_block_manager import LogicalAllocator

    with pytest.raises(InvalidTypeError):
        adapter.LmdeployBlockTrie(allocator=object(), block_size=16, enabled=True)
    with pytest.raises(InvalidTypeError):
        adapter.LmdeployBlockTrie(allocator=LogicalAllocator(0, 4), block_size=16, enabled=True, checkpoint_state_manager=object())
