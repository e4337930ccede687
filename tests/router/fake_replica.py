"""A minimal OpenAI-style replica for the router tests: the real engine (tiny model) with its
event streams on loopback, behind a standard-library HTTP server.

``python -m tests.router.fake_replica [KV_PORT STATE_PORT]`` prints ``PORT <n>`` once serving;
it serves ``/kv_events``, ``/metrics`` (vLLM's load gauges), ``/health``, ``/tokenize``
(a prompt of token ids, or text and messages as bytes modulo the vocabulary) and
``/v1/completions`` / ``/v1/chat/completions`` with ``usage.prompt_tokens_details.cached_tokens``,
streamed as server-sent events when asked. Ports given reuse a restarted replica's streams.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from tests.router.replicas import engine

LOCK = threading.Lock()


def _endpoint(port: str | None) -> str:
    return "tcp://127.0.0.1:*" if port is None else f"tcp://127.0.0.1:{port}"


class Replica(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine = None

    def log_message(self, *args) -> None:
        return

    def do_GET(self) -> None:
        if self.path == "/kv_events":
            return self._json(self.engine.events.describe())
        if self.path == "/health":
            return self._json({"ok": True})
        if self.path == "/metrics":
            text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            return self._send(200, text.encode(), "text/plain")
        if self.path == "/v1/models":
            return self._json({"data": [{"id": "tiny"}]})
        self._send(404, b"{}", "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        tokens = self._tokens(body)
        if self.path == "/tokenize":
            return self._json({"tokens": tokens, "count": len(tokens)})
        from hybridcache.engine import Request

        with LOCK:
            result = self.engine.generate([Request(np.array(tokens), max_new_tokens=int(body.get("max_tokens", 4)))])[0]
            self.engine.events.flush()
        usage = {"prompt_tokens": len(tokens), "completion_tokens": len(result.tokens),
                 "total_tokens": len(tokens) + len(result.tokens),
                 "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
        if not body.get("stream"):
            return self._json({"object": "text_completion", "choices": [{"text": " ".join(map(str, result.tokens))}],
                               "usage": usage, "token_ids": result.tokens})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": str(t)}], "usage": None} for t in result.tokens]
        events.append({"choices": [], "usage": usage})
        for event in events:
            self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _tokens(self, body: dict) -> list[int]:
        vocab = self.engine.model.layout.vocab_size
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in body.get("messages", []))
        return [b % vocab for b in text.encode()]

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str]) -> None:
    ports = argv + [None] * (4 - len(argv))
    Replica.engine = engine(*(_endpoint(port) for port in ports), num_kv_blocks=96)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
