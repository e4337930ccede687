"""``ServeConfig`` from the command line: what a name option may be."""

from __future__ import annotations

import pytest

from hybridcache.cli import build_parser
from hybridcache.errors import InvalidConfigError
from hybridcache.serving.config import ServeConfig


def _config(*args: str) -> ServeConfig:
    return ServeConfig.from_args(build_parser().parse_args(["serve", *args]))


@pytest.mark.parametrize("args, says", [
    (("--adapters", ",,"), "--adapters"),
    (("--adapters", "support-bot,"), "--adapters"),
    (("--adapters", ""), "--adapters"),
    (("--served-name", ""), "served_name"),
])
def test_an_empty_name_is_refused_not_dropped(args, says):
    with pytest.raises(InvalidConfigError, match=says):
        _config(*args)


def test_names_given_are_kept_as_given():
    config = _config("--adapters", "support-bot,coder", "--served-name", "hybrid-tiny")
    assert config.engine.adapters == ("support-bot", "coder") and config.served_name == "hybrid-tiny"
    assert _config().served_name == "tiny" and _config().engine.adapters is None
