"""These tests drive lmdeploy's real Scheduler; lmdeploy 0.16.0 must be importable (the
``.venv-lmdeploy`` environment that ``make test-lmdeploy`` builds). Without it collection fails
loudly instead of skipping: a missing engine must never read as a pass."""

import lmdeploy  # noqa: F401  (fails collection when the lmdeploy environment is missing)
import pytest

from hybridcache.integrations import lmdeploy as adapter


def pytest_configure(config):
    assert lmdeploy.__version__ == adapter.SUPPORTED_VERSION, f"lmdeploy {lmdeploy.__version__} is not {adapter.SUPPORTED_VERSION}"


@pytest.fixture(autouse=True)
def _lmdeploy_own_trie_by_default():
    """Every test starts and ends with lmdeploy's own BlockTrie installed."""
    adapter.uninstall()
    yield
    adapter.uninstall()
