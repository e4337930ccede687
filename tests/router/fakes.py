"""A fake replica for the router's hostile tests: an HTTP server (``/metrics``, ``/kv_events``,
``/tokenize``, completions) and a KV stream (a ZMQ PUB and a replay ROUTER) on free loopback
ports, each answer replaceable by the test."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from hybridcache.events.publisher import END_SEQ, seq_frame
from hybridcache.events.schema import KVEventBatch, encode_batch

TOPIC = b"kv@fake@tiny"
ANSWER = {"choices": [{"text": "fake"}], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}


class FakeReplica:
    """``describe(d)`` may change the ``/kv_events`` description; ``answer(handler, path, body)``
    may answer a POST itself (True once it did); ``replay(identity)`` answers a replay request
    (default: nothing buffered); ``metrics_ok`` False makes ``/metrics`` answer 500."""

    def __init__(self, describe=None, answer=None, replay=None) -> None:
        self.describe, self.answer = describe, answer
        self.metrics_ok = True
        self.replay_requests = 0
        self._context = zmq.Context()
        self.pub, self.replay_socket = self._context.socket(zmq.PUB), self._context.socket(zmq.ROUTER)
        for socket in (self.pub, self.replay_socket):
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind("tcp://127.0.0.1:*")
        self._replay = replay or self.end_replay
        self._stop = threading.Event()
        self._replayer = threading.Thread(target=self._serve_replays, daemon=True)
        self._replayer.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def description(self) -> dict:
        described = {"block_size": 4, "instance_id": "fake", "state": None, "adapters": [], "next_seq": {"kv": 0, "state": None},
                     "kv": {"endpoint": self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                            "replay_endpoint": self.replay_socket.getsockopt_string(zmq.LAST_ENDPOINT), "topic": TOPIC.decode()}}
        if self.describe is not None:
            self.describe(described)
        return described

    def publish(self, seq: int) -> None:
        self.pub.send_multipart([TOPIC, seq_frame(seq), encode_batch(KVEventBatch(float(seq), []))])

    def end_replay(self, identity: bytes) -> None:
        self.replay_socket.send_multipart([identity, b"", b"", END_SEQ, b""])

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if self.replay_socket.poll(20):
                identity = self.replay_socket.recv_multipart()[0]
                self.replay_requests += 1
                self._replay(identity)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._stop.set()
        self._replayer.join(30)
        self.pub.close()
        self.replay_socket.close()
        self._context.term()


def _handler(fake: FakeReplica) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):
            return

        def send(self, status: int, body: bytes | dict, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                if not fake.metrics_ok:
                    return self.send(500, b"down", "text/plain")
                return self.send(200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n", "text/plain")
            if self.path == "/kv_events":
                return self.send(200, fake.description())
            return self.send(200, {"object": "list", "data": []})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if fake.answer is not None and fake.answer(self, self.path, body):
                return
            if self.path == "/tokenize":
                return self.send(200, {"tokens": [1, 2, 3, 4, 5]})
            return self.send(200, ANSWER)

    return Handler
