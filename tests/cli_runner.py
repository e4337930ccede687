"""Driving the real command line in-process (``hybridcache.cli.main``) or as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridcache.cli import main


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main(argv)``; a parser error's SystemExit included."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def run_process(*args: str, cwd, columns: int = 160, timeout: float = 300,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m hybridcache.cli ARGS`` in ``cwd`` on a terminal of ``columns`` columns."""
    env = dict(os.environ, COLUMNS=str(columns), **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", "hybridcache.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
