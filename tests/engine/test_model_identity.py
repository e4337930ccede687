"""``model_identity``: the implementations a model was loaded with and the optional kernels
installed are part of its identity."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import torch

from hybridcache.engine import model_identity
from hybridcache.engine.model_identity import identity_digest, implementation_choices, library_versions


def _digest(config: dict, versions: dict) -> str:
    return identity_digest("tiny", config, [("w", torch.ones(2))], versions)


def test_an_installed_optional_kernel_changes_the_versions_and_the_digest(monkeypatch):
    without = library_versions()
    real_version = metadata.version

    def with_mamba(name: str) -> str:
        return "2.2.4" if name == "mamba-ssm" else real_version(name)

    monkeypatch.setattr(model_identity.metadata, "version", with_mamba)
    installed = library_versions()
    assert installed["mamba-ssm"] == "2.2.4"
    assert "mamba-ssm" not in without or without["mamba-ssm"] == "2.2.4"
    if "mamba-ssm" not in without:
        assert _digest({}, installed) != _digest({}, without)


def test_implementation_choices_cover_sub_configs():
    text = SimpleNamespace(_attn_implementation="eager", sub_configs={})
    config = SimpleNamespace(
        _attn_implementation="sdpa", _experts_implementation="eager", sub_configs={"text_config": None}, text_config=text
    )
    assert implementation_choices(config) == {
        "_attn_implementation": "sdpa",
        "_experts_implementation": "eager",
        "text_config._attn_implementation": "eager",
    }
    assert implementation_choices(SimpleNamespace()) == {}
