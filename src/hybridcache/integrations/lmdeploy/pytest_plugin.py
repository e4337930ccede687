"""pytest plugin: run lmdeploy's own tests against hybridcache.

``pytest -p hybridcache.integrations.lmdeploy.pytest_plugin <lmdeploy test files>`` installs
``LmdeployBlockTrie`` before collection, so every Scheduler those tests build uses it. Owns
nothing beyond that swap, undone when the session ends.
"""

from __future__ import annotations

from hybridcache.integrations import lmdeploy as adapter


def pytest_configure(config) -> None:
    adapter.install()
    config.addinivalue_line("markers", "hybridcache_adapter: run against hybridcache's LmdeployBlockTrie")


def pytest_report_header(config) -> str:
    return f"hybridcache: lmdeploy's BlockTrie replaced by LmdeployBlockTrie (lmdeploy {adapter.SUPPORTED_VERSION})"


def pytest_unconfigure(config) -> None:
    adapter.uninstall()
