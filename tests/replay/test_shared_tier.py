"""The replay's local shared-tier server never outlives the command: SIGTERM and SIGHUP stop it
as Ctrl-C does, and a command killed outright takes it down through the parent-death signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import signal, sys, time
from pathlib import Path
from hybridcache.tiers import local_servers
from hybridcache.replay.shared_tier import open_shared_tier

workdir, pidfile = Path(sys.argv[1]), Path(sys.argv[2])
start_redis = local_servers.start_redis

def recording(*args, **kwargs):
    server = start_redis(*args, **kwargs)
    pidfile.write_text(str(server.process.pid))
    return server

local_servers.start_redis = recording
# A runner started under nohup, or in the background by a shell, hands its children SIGHUP or
# SIGINT ignored, which the command rightly keeps ignoring; the command under test is one a
# terminal started.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
with open_shared_tier("redis", None, workdir):
    print("ready", flush=True)
    time.sleep(600)
"""
DEADLINE_S = 30.0


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, waiting for a reaper that is not ours)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _assert_gone(pid: int, message: str) -> None:
    if not _wait_gone(pid):
        os.kill(pid, signal.SIGKILL)  # never leave it behind, then fail
        pytest.fail(message)


def _start_command(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    pidfile = tmp_path / "redis.pid"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(pidfile)],
        stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert child.stdout.readline().strip() == b"ready"
    return child, int(pidfile.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_terminating_signal_stops_the_local_server(tmp_path, signum):
    child, server_pid = _start_command(tmp_path)
    assert not _gone(server_pid)
    os.kill(child.pid, signum)
    assert child.wait(timeout=DEADLINE_S) != 0
    _assert_gone(server_pid, "redis-server outlived the command")


def test_a_command_killed_outright_takes_its_server_down(tmp_path):
    child, server_pid = _start_command(tmp_path)
    os.kill(child.pid, signal.SIGKILL)  # no cleanup runs in the command
    child.wait(timeout=DEADLINE_S)
    _assert_gone(server_pid, "redis-server outlived a killed command")
