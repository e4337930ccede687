"""A server asked to hold more than the machine can (``--host-bytes 10PB``, pools that cannot be
allocated) refuses at startup with one line on stderr and exit status 2, never a traceback and
never a server that fails hours later."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridcache.cli import build_parser
from hybridcache.errors import InvalidConfigError, ResourceExhaustedError
from hybridcache.serving import runtime as runtime_module
from hybridcache.machine import host_memory_bytes
from hybridcache.serving.capacity import check_tier_sizes
from hybridcache.serving.config import ServeConfig
from tests.serving.conftest import SRC

STARTUP_S = 180  # a deadline for a loaded machine, never an assertion on speed


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hybridcache.cli", "serve", "--port", "0", *args],
                          env=env, capture_output=True, text=True, timeout=STARTUP_S)


@pytest.mark.parametrize("option, says", [("--host-bytes", "machine's memory"), ("--disk-bytes", "file system holds")])
def test_a_tier_larger_than_the_machine_is_refused_at_startup_in_one_line(tmp_path, option, says):
    done = _serve(option, "10PB", "--disk-root", str(tmp_path / "disk"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("hybridcache serve: error: InvalidConfigError") and option in line and says in line
    assert not (tmp_path / "disk").exists()


def test_tier_sizes_the_machine_can_hold_pass(tmp_path):
    memory = host_memory_bytes()
    assert memory > 0
    check_tier_sizes(memory, 1 << 20, tmp_path / "not" / "made" / "yet")  # all of RAM is still RAM
    with pytest.raises(InvalidConfigError):
        check_tier_sizes(memory + 1, 0, None)


def test_pools_that_cannot_be_allocated_are_one_resource_error(monkeypatch):
    config = ServeConfig.from_args(build_parser().parse_args(["serve", "--num-kv-blocks", "64"]))

    def refuse(*_, **__):
        raise ResourceExhaustedError("cannot allocate the KV pool (1,024 bytes): DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(runtime_module, "Engine", refuse)
    with pytest.raises(ResourceExhaustedError, match="lower --num-kv-blocks"):
        runtime_module.ServingRuntime(config)

