"""The replica hub: starts engine workers (:mod:`tiers.engine_worker`) and relays frames to them.

Run by :class:`tiers.replicas.ReplicaCluster` as
``python -m tiers.replica_hub WORKDIR redis URL KEY_PREFIX`` or, inside a private network
namespace (``unshare -n sh -c 'ip link set lo up; exec python -m tiers.replica_hub WORKDIR
mooncake'``, as Mooncake binds every interface), ``... WORKDIR mooncake``: it then starts
``mooncake_master`` and a segment holder there, and every worker it starts inherits the
namespace. Answers ``("ready", StoreSpec)``, then one frame per request on the original stdout.

Owns the workers (each stopped by pid), the Mooncake cluster when it started one, and an
admin client of the shared store through which the test inspects and removes objects behind
the workers' backs. Worker messages are relayed as opaque frames, so the hub never imports
the engine. On end of input or ``shutdown`` it stops every worker, then the cluster.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridcache.tiers import local_servers as servers

from .replica_wire import FrameTimeout, StoreSpec, read_frame, receive, send, write_frame

TESTS_DIR = Path(__file__).resolve().parents[1]
READY_DEADLINE_S = 60.0  # a worker imports torch and builds its engine first
CALL_DEADLINE_S = 60.0
STOP_DEADLINE_S = 10.0
ADMIN_OPERATIONS = ("exists", "get", "remove")


class WorkerProcess:
    def __init__(self, name: str, spec_frame: bytes, workdir: Path) -> None:
        self.name = name
        self.log = workdir / f"worker-{name}.log"
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tiers.engine_worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=TESTS_DIR, bufsize=0,
            )
        self.ready = False
        write_frame(self.process.stdin.fileno(), spec_frame)

    def call(self, frame: bytes) -> tuple:
        """Relay one command frame; the reply frame, or why none came."""
        if not self.ready:
            status = self._answer(time.monotonic() + READY_DEADLINE_S)
            if status[0] != "reply":
                return status
            ready = pickle.loads(status[1])
            if ready[0] != "ready":
                return ("error", ready[1][1])  # the worker's traceback of its failed start
            self.ready = True
        try:
            write_frame(self.process.stdin.fileno(), frame)
        except BrokenPipeError:
            return self._died()
        return self._answer(time.monotonic() + CALL_DEADLINE_S)

    def _answer(self, deadline: float) -> tuple:
        try:
            body = read_frame(self.process.stdout.fileno(), deadline)
        except FrameTimeout as error:
            self.kill()
            return ("error", f"worker {self.name} did not answer: {error}\n{self.log_tail()}")
        return self._died() if body is None else ("reply", body)

    def _died(self) -> tuple:
        return ("died", self._reap(), self.log_tail())

    def kill(self) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        return self._reap()

    def stop(self) -> int:
        """End of input asks the worker to close its store and exit; SIGKILL past the deadline."""
        self.ask_to_stop()
        return self._reap()

    def ask_to_stop(self) -> None:
        if not self.process.stdin.closed:
            self.process.stdin.close()

    def _reap(self) -> int:
        try:
            return self.process.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout=STOP_DEADLINE_S)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class Hub:
    def __init__(self, workdir: Path, store: StoreSpec) -> None:
        self.workdir = workdir
        self.admin = store.open()
        self.workers: dict[str, WorkerProcess] = {}

    def answer(self, request: tuple) -> tuple:
        operation, *args = request
        if operation == "spawn":
            name, spec_frame = args
            if name in self.workers and self.workers[name].process.poll() is None:
                return ("error", f"worker {name} is still running")
            self.workers[name] = WorkerProcess(name, spec_frame, self.workdir)
            return ("ok", self.workers[name].process.pid)
        if operation == "call":
            name, frame = args
            return self.workers[name].call(frame)
        if operation in ("kill", "stop"):
            return ("ok", getattr(self.workers[args[0]], operation)())
        if operation == "admin" and args[0] in ADMIN_OPERATIONS:
            return ("ok", getattr(self.admin, args[0])(*args[1:]))
        return ("error", f"unknown hub request {operation!r}")

    def close(self) -> None:
        try:
            for worker in self.workers.values():
                worker.ask_to_stop()  # all at once: they exit in parallel
            for worker in self.workers.values():
                worker.stop()
        finally:
            self.admin.close()


def main(workdir: Path, backend: str, address: str = "", key_prefix: str = "") -> None:
    replies = os.dup(1)
    os.dup2(2, 1)  # whatever the C++ side prints must not corrupt the reply stream
    cluster = servers.start_mooncake(workdir) if backend == "mooncake" else None
    try:
        if cluster is not None:
            store = StoreSpec("mooncake", cluster.master_address, metadata_server=cluster.metadata_server)
        else:
            store = StoreSpec(backend, address, key_prefix=key_prefix)
        hub = Hub(workdir, store)
        try:
            send(replies, ("ready", store))
            while (request := receive(0, None)) is not None and request[0] != "shutdown":
                try:
                    reply = hub.answer(request)
                except Exception as error:  # e.g. a store failure of an admin call: the test sees it
                    reply = ("error", f"{type(error).__name__}: {error}")
                send(replies, reply)
        finally:
            hub.close()
    finally:
        if cluster is not None:
            cluster.stop()
    send(replies, ("closed", None))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
