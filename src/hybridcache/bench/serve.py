"""``hybridcache bench serve``: concurrent multi-turn chat clients over HTTP against a real
``hybridcache serve``, caching on and then off: TTFT p50/p99, throughput, token hit rate.

Owns, during a run: the server processes it starts (one per setting, stopped by pid), the
scratch directory holding the random checkpoint it saves, and the client threads. Each client
holds a conversation as token ids: a system prompt every client shares (sent once before the
clients start, as a deployment's first request would), its own opening message, then per turn
the model's reply and a new user message; every request streams with ``return_token_ids`` so
the first token's arrival is seen even where the model has no tokenizer. ``duration_s`` > 0
keeps the clients going (conversations restart after ``turns``) for that long instead: the soak.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hybridcache.errors import BenchmarkSetupError
from hybridcache.tiers.local_servers import free_port

STARTUP_S = 600  # loading a checkpoint on a loaded machine; a deadline, not a measurement


@dataclass(frozen=True)
class ServeBench:
    clients: int = 4
    turns: int = 3
    system_tokens: int = 3840
    opening_tokens: int = 256
    user_tokens: int = 64
    reply_tokens: int = 16
    hidden_size: int = 512
    num_layers: int = 4
    model: str | None = None  # a checkpoint directory or "tiny"; None saves a random Bamba checkpoint
    duration_s: float = 0.0
    server_args: tuple[str, ...] = ()


@dataclass
class _Turn:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class _Tally:
    turns: list[_Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def server_process(*args: str, env: dict | None = None, startup_s: float = STARTUP_S, output=None):
    """``hybridcache serve ARGS`` on a free loopback port: yields ``(base URL, process)`` once
    ``/health`` answers; SIGTERM by pid at the end unless it already exited (SIGKILL if it
    does not stop). ``output``: a binary file taking what it prints (None: a temporary one)."""
    port = free_port()
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    with serving_process(command, port, startup_s, output, env) as running:
        yield running


@contextmanager
def serving_process(command: list[str], port: int, startup_s: float, output=None, env: dict | None = None):
    """``command``, which serves HTTP on ``port`` of the loopback: yields ``(base URL,
    process)`` once ``/health`` answers, and stops it by its pid at the end. Its output goes
    to ``output`` (None: a temporary file), never to a pipe: nobody reads one while it serves,
    and a full pipe would block the process at its next log line."""
    with ExitStack() as owned:
        output = owned.enter_context(tempfile.TemporaryFile()) if output is None else output
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(base, process, startup_s, output)
            yield base, process
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def _wait_healthy(base: str, process: subprocess.Popen, startup_s: float, output) -> None:
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output.seek(0)
            raise BenchmarkSetupError(f"the server exited: {output.read().decode(errors='replace')}")
        try:
            if _get(base, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise BenchmarkSetupError("the server did not become healthy")


def _connection(base: str) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=3600)


def _get(base: str, path: str) -> tuple[int, bytes]:
    connection = _connection(base)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[_Turn, list[int]]:
    """One streamed completion: its timing and usage, and the generated token ids."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True})
    connection, began, first, tokens, usage = _connection(base), time.perf_counter(), None, [], None
    try:
        connection.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise BenchmarkSetupError(f"status {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchmarkSetupError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    tokens.extend(choice["token_ids"])
            usage = chunk.get("usage") or usage
    finally:
        connection.close()
    ended = time.perf_counter()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return _Turn((first or ended) - began, ended - began, usage["prompt_tokens"], cached, usage["completion_tokens"]), tokens


@dataclass(frozen=True)
class _Job:
    """What every client of one setting talks to, and until when."""

    base: str
    model: str
    bench: ServeBench
    system: list[int]
    deadline: float


def _client(job: _Job, index: int, tally: _Tally) -> None:
    base, model, bench, system = job.base, job.model, job.bench, job.system
    rng = np.random.default_rng(1000 + index)
    vocab = _vocab(bench)
    while True:
        history = system + rng.integers(2, vocab, bench.opening_tokens).tolist()
        for _ in range(bench.turns):
            try:
                turn, reply = stream_completion(base, model, history, bench.reply_tokens)
            except (OSError, RuntimeError, KeyError, ValueError) as error:
                with tally.lock:
                    tally.errors.append(f"client {index}: {error}")
                return
            with tally.lock:
                tally.turns.append(turn)
            history = history + reply + rng.integers(2, vocab, bench.user_tokens).tolist()
            if time.monotonic() >= job.deadline:
                return
        if not bench.duration_s:
            return


def _vocab(bench: ServeBench) -> int:
    return 256 if bench.model == "tiny" else 2048


def _rss_bytes(pid: int) -> int:
    """The server's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_setting(bench: ServeBench, model_args: tuple[str, ...], model: str, caching: bool) -> dict:
    """Serve one setting (caching on or off) and drive the clients against it."""
    args = (*model_args, *bench.server_args, *(() if caching else ("--no-prefix-caching",)))
    with tempfile.TemporaryFile() as output:
        with server_process(*args, output=output) as (base, process):
            measured = _drive(bench, base, model, process.pid, caching)
        return {**measured, "server_audit": _audit_line(output)}


def _drive(bench: ServeBench, base: str, model: str, pid: int, caching: bool) -> dict:
    """The clients' run against the server at ``base`` (process ``pid``), summarized."""
    system = np.random.default_rng(7).integers(2, _vocab(bench), bench.system_tokens).tolist()
    stream_completion(base, model, system, 1)  # the deployment's first request: the system prompt
    tally, rss_before, began = _Tally(), _rss_bytes(pid), time.perf_counter()
    job = _Job(base, model, bench, system, time.monotonic() + (bench.duration_s or float("inf")))
    threads = [threading.Thread(target=_client, args=(job, i, tally)) for i in range(bench.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    return _summary(caching, tally, wall, rss_before, _rss_bytes(pid))


def _audit_line(output) -> str:
    """The stopped server's last word on its cache accounting (``serving.runtime.audit``), from
    what it printed into ``output``."""
    output.seek(0)
    said = output.read().decode(errors="replace").splitlines()
    return next((line for line in reversed(said) if "cache accounting" in line), "no accounting line")


def _summary(caching: bool, tally: _Tally, wall: float, rss_before: int, rss_after: int) -> dict:
    turns = tally.turns
    ttft = [turn.ttft_s for turn in turns]
    prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
    return {
        "caching": caching, "requests": len(turns), "errors": len(tally.errors), "first_errors": tally.errors[:3],
        "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
        "e2e_p50_s": _percentile([t.e2e_s for t in turns], 50), "wall_s": wall,
        "generated_tokens_per_s": sum(t.completion_tokens for t in turns) / wall if wall else 0.0,
        "prompt_tokens_per_s": prompt / wall if wall else 0.0,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "server_rss_before_mb": rss_before / 2**20, "server_rss_after_mb": rss_after / 2**20,
    }


def run_serve_bench(bench: ServeBench, settings: tuple[bool, ...] = (True, False)) -> list[dict]:
    """One record per setting, with the caching-on TTFT p50 over caching-off's when both ran."""
    with tempfile.TemporaryDirectory(prefix="hybridcache-bench-serve-") as scratch:
        model_dir = bench.model
        if model_dir is None:
            from hybridcache.engine.hf.random_checkpoint import save_random_checkpoint  # imports transformers

            model_dir = save_random_checkpoint(Path(scratch) / "bamba", hidden_size=bench.hidden_size,
                                               num_layers=bench.num_layers)
        model = "tiny" if model_dir == "tiny" else Path(model_dir).name
        records = [run_setting(bench, ("--model", model_dir), model, caching) for caching in settings]
    if len(records) == 2 and records[1]["ttft_p50_s"] > 0:
        records[0]["ttft_p50_vs_off"] = records[0]["ttft_p50_s"] / records[1]["ttft_p50_s"]
    for record in records:
        record["config"] = {key: value for key, value in asdict(bench).items()}
    return records
