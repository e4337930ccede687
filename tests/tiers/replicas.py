"""The test's side of a replica cluster: a hub process and the engine workers it starts.

:class:`ReplicaCluster` starts :mod:`tiers.replica_hub` (inside ``unshare -n`` with loopback up
for Mooncake, the mechanism :mod:`tiers.remote` uses) and hands out :class:`Replica` handles,
one per engine process. Every wait on the hub is bounded by a deadline. ``uncached_outputs``
is what each replica's output is compared with: the same engine with prefix caching off, run
in the test process.
"""

from __future__ import annotations

import pickle
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from hybridcache.engine.engine import Engine
from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.requests import Request

from .engine_worker import KeyNames, ServeReport, WorkerSpec
from .faults import Fault
from .replica_hub import CALL_DEADLINE_S, READY_DEADLINE_S, STOP_DEADLINE_S
from .replica_wire import receive, send

TESTS_DIR = Path(__file__).resolve().parents[1]
HUB_START_DEADLINE_S = 60.0
HUB_REPLY_DEADLINE_S = READY_DEADLINE_S + CALL_DEADLINE_S + 2 * STOP_DEADLINE_S


class WorkerDied(Exception):
    """A worker process ended while serving a command."""

    def __init__(self, name: str, returncode: int, log_tail: str) -> None:
        super().__init__(f"worker {name} exited with {returncode}:\n{log_tail}")
        self.returncode = returncode


class WorkerError(Exception):
    """A command raised inside a worker (its traceback is the message)."""


def uncached_outputs(config: EngineConfig, requests: list[Request]) -> tuple[tuple[int, ...], ...]:
    engine = Engine(replace(config, prefix_caching=False))
    return tuple(tuple(result.tokens) for result in engine.generate(requests))


class ReplicaCluster:
    """One shared store (a Redis key prefix, or a Mooncake cluster of its own) and the engine
    processes using it."""

    def __init__(self, workdir: Path, backend: str, address: str = "", key_prefix: str = "") -> None:
        argv = [sys.executable, "-m", "tiers.replica_hub", str(workdir), backend, address, key_prefix]
        if backend == "mooncake":
            argv = ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {shlex.join(argv)}"]
        self._log_path = workdir / "hub.log"
        with self._log_path.open("ab") as log:
            self._hub = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=TESTS_DIR, bufsize=0
            )
        self.workdir = workdir
        self.backend = backend
        self.pids: dict[str, int] = {}  # every worker started, by name (the latest of each name)
        status = receive(self._hub.stdout.fileno(), time.monotonic() + HUB_START_DEADLINE_S)
        if status is None or status[0] != "ready":
            self.close()
            raise RuntimeError(f"replica hub did not start:\n{self.log_tail()}")
        self.store = status[1]

    def log_tail(self, chars: int = 4000) -> str:
        return self._log_path.read_text(errors="replace")[-chars:]

    def request(self, *message: object) -> tuple:
        send(self._hub.stdin.fileno(), message)
        reply = receive(self._hub.stdout.fileno(), time.monotonic() + HUB_REPLY_DEADLINE_S)
        if reply is None:
            raise RuntimeError(f"replica hub died:\n{self.log_tail()}")
        return reply

    def value(self, *message: object) -> object:
        status, value = self.request(*message)
        if status != "ok":
            raise WorkerError(value)
        return value

    def spawn(
        self,
        name: str,
        config: EngineConfig,
        *,
        faults: tuple[Fault, ...] = (),
        fault_seed: int = 0,
        checkpoint_puts_before_exit: int | None = None,
        measured_cost_model: bool = False,
    ) -> Replica:
        """Start an engine process; it builds its engine while the test goes on (the first
        command waits for it), so replicas spawned together start in parallel."""
        spec = WorkerSpec(config, self.store, faults, fault_seed, checkpoint_puts_before_exit, measured_cost_model)
        self.pids[name] = self.value("spawn", name, pickle.dumps(spec))
        return Replica(self, name, config)

    def exists(self, names: list[str]) -> list[bool]:
        """Which objects the shared store holds, asked by the hub's own client."""
        return self.value("admin", "exists", list(names))

    def remove(self, names: list[str]) -> list[bool]:
        return self.value("admin", "remove", list(names))

    def close(self) -> None:
        """Stop every worker and the hub (and with it a Mooncake cluster) by pid."""
        if self._hub.poll() is None:
            try:
                send(self._hub.stdin.fileno(), ("shutdown",))
                receive(self._hub.stdout.fileno(), time.monotonic() + HUB_REPLY_DEADLINE_S)
            except (OSError, TimeoutError):
                pass  # the hub is gone or stuck: it is killed below
            try:
                self._hub.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self._hub.kill()
                self._hub.wait(timeout=STOP_DEADLINE_S)
        self._hub.stdin.close()
        self._hub.stdout.close()


class Replica:
    """One engine process of a cluster."""

    def __init__(self, cluster: ReplicaCluster, name: str, config: EngineConfig) -> None:
        self.cluster, self.name, self.config = cluster, name, config

    def _call(self, command: str, *args: object) -> object:
        reply = self.cluster.request("call", self.name, pickle.dumps((command, args)))
        if reply[0] == "died":
            raise WorkerDied(self.name, reply[1], reply[2])
        if reply[0] == "error":
            raise WorkerError(reply[1])
        status, value = pickle.loads(reply[1])
        if status == "ok":
            return value
        is_assertion, trace = value
        raise (AssertionError if is_assertion else WorkerError)(f"in worker {self.name}:\n{trace}")

    def serve(self, *requests: Request) -> ServeReport:
        report = self._call("serve", list(requests))
        assert report.errors == (None,) * len(requests), report.errors
        return report

    def stats(self) -> dict:
        return self._call("stats")

    def check_invariants(self) -> None:
        self._call("check_invariants")

    def pools_after_clearing(self) -> tuple[dict, dict]:
        return self._call("pools_after_clearing")

    def keys(self, request: Request) -> KeyNames:
        return self._call("keys", request)

    def add_fault(self, fault: Fault) -> None:
        self._call("add_fault", fault)

    def kill(self) -> int:
        """SIGKILL by pid (a crash); the exit status."""
        return self.cluster.value("kill", self.name)

    def stop(self) -> int:
        """A clean shutdown: the worker closes its store and exits."""
        return self.cluster.value("stop", self.name)
