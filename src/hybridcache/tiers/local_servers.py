"""Local store servers (Redis/Valkey, Mooncake Store) on free loopback ports, stopped by pid:
what ``hybridcache replay --shared-tier`` starts when no ``--store-url`` is given, and what the
tier tests start.

Owns the processes it starts (each ``Server`` its own). On Linux each is started with a
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a server never outlives the
thread that started it, even when that process is killed without running any cleanup. Every
wait is a bounded loop with a deadline; a server that does not come up raises ``ServerStartError`` with the tail of its log,
and so does a missing binary (``apt-get install redis-server libibverbs1``; the ``mooncake``
extra brings ``mooncake_master``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridcache.errors import ServerStartError

START_DEADLINE_S = 20.0
STOP_DEADLINE_S = 10.0
VENV_BIN = Path(sys.executable).parent
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def binary(name: str) -> str:
    """A server binary: the virtual environment's first (pip packages), then PATH."""
    local = VENV_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(f"{name} is not installed (CI installs it: see .ci/run)")
    return found


@dataclass
class Server:
    """One started process, its log and the loopback port it serves on."""

    name: str
    process: subprocess.Popen
    port: int
    log: Path

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_listening(self, deadline_s: float = START_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise ServerStartError(f"{self.name} did not listen on {self.port} within {deadline_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the deadline; always reaps the pid."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=STOP_DEADLINE_S)


def _parent_death_hook():
    """What the child runs before exec to be killed when its parent goes: ``prctl`` resolved
    here, in the parent (a forked child must not load libraries); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # the process already links libc
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def start(name: str, argv: list[str], port: int, log: Path, env: dict | None = None) -> Server:
    handle = log.open("wb")
    try:
        process = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=_parent_death_hook()
        )
    finally:
        handle.close()
    server = Server(name, process, port, log)
    server.wait_listening()
    return server


def start_redis(workdir: Path, maxmemory: str = "64mb") -> Server:
    port = free_port()
    argv = [
        binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(workdir), "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
    ]
    return start("redis-server", argv, port, workdir / f"redis-{port}.log")


@dataclass
class MooncakeCluster:
    """A master (with its HTTP metadata server) and one client process holding the segment."""

    master: Server
    metadata_port: int
    segment_holder: Server

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def stop(self) -> None:
        self.segment_holder.stop()
        self.master.stop()


def start_mooncake(workdir: Path, segment: str = "64MB") -> MooncakeCluster:
    """Start ``mooncake_master`` and a ``mooncake_client`` that mounts ``segment`` of memory.

    Mooncake binds every interface, so call this only inside a private network namespace.
    """
    rpc, metadata, metrics, holder = free_port(), free_port(), free_port(), free_port()
    master = start(
        "mooncake_master",
        [
            binary("mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={metadata}", f"--metrics_port={metrics}",
            "--metrics_host=127.0.0.1", "--enable_metric_reporting=false",
        ],
        rpc,
        workdir / "mooncake-master.log",
    )
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_FORCE_TCP="1")
    try:
        segment_holder = start(
            "mooncake_client",
            [
                binary("mooncake_client"), f"--global_segment_size={segment}", "--host=127.0.0.1",
                f"--port={holder}", f"--master_server_address=127.0.0.1:{rpc}",
                f"--metadata_server=http://127.0.0.1:{metadata}/metadata", "--protocol=tcp",
            ],
            holder,
            workdir / "mooncake-client.log",
            env=env,
        )
    except BaseException:
        master.stop()
        raise
    return MooncakeCluster(master, metadata, segment_holder)
