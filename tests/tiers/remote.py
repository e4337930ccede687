"""A proxy ObjectStore whose calls run in a Mooncake worker inside a network namespace.

The contract suite drives it like any local store; each call is one pickled request to
:mod:`tiers.mooncake_worker`, and a hybridcache error raised there is raised here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hybridcache.tiers.backends.base import ObjectStore
from .mooncake_worker import read_message, write_message

TESTS_DIR = Path(__file__).resolve().parents[1]  # the worker runs as tiers.mooncake_worker, like pytest names it
REPLY_DEADLINE_S = 60.0


class RemoteStore(ObjectStore):
    """Forwards every operation to a MooncakeStore living in a private network namespace."""

    def __init__(self, workdir: Path, segment: str = "64MB") -> None:
        super().__init__(default_timeout=5.0)
        inner = f"ip link set lo up && exec {sys.executable} -m tiers.mooncake_worker {workdir} {segment}"
        self._log = (workdir / "worker.log").open("wb")
        self._process = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", inner],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=TESTS_DIR,
        )
        self.workdir = workdir
        status = read_message(self._process.stdout)
        if status != ("ready", None):
            self._stop()
            raise RuntimeError(f"mooncake worker did not start:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return (self.workdir / "worker.log").read_text(errors="replace")[-chars:]

    def control(self, operation: str, *args: object, **kwargs: object) -> object:
        write_message(self._process.stdin, (operation, args, kwargs))
        reply = read_message(self._process.stdout)
        if reply is None:
            raise RuntimeError(f"mooncake worker died:\n{self.log_tail()}")
        status, value = reply
        if status == "error":
            error_type, message = value
            raise error_type(message)
        return value

    def _exists(self, keys, timeout):
        return self.control("exists", keys, timeout)

    def _put_if_absent(self, items, timeout):
        return self.control("put_if_absent", items, timeout)

    def _get(self, keys, timeout):
        return self.control("get", keys, timeout)

    def _get_into(self, keys, buffers, timeout):
        # Buffers cannot cross the process boundary: fetch, then fill them here.
        return super()._get_into(keys, buffers, timeout)

    def _remove(self, keys, timeout):
        return self.control("remove", keys, timeout)

    def _close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._process.poll() is None:
            try:
                write_message(self._process.stdin, ("shutdown", (), {}))
                self._process.stdin.close()
            except OSError:
                pass  # already gone: the wait below reaps it
            try:
                self._process.wait(timeout=REPLY_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=REPLY_DEADLINE_S)
        self._log.close()
