"""The routes a router reads: ``GET /kv_events`` names the event streams a real server binds
(and a subscriber receives its blocks), ``POST /tokenize`` gives exactly the ids generation
computes, ``--kv-events-config`` is vLLM's JSON, and closing the runtime closes the sockets."""

from __future__ import annotations

import json
import socket

import pytest

from tests.serving.conftest import ENGINE_ARGS, request, running_server

zmq = pytest.importorskip("zmq")

LOOPBACK = "tcp://127.0.0.1:*"
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": LOOPBACK, "replay_endpoint": LOOPBACK, "bind": True,
                     "topic": "kv@pod@tiny", "state_endpoint": LOOPBACK, "state_topic": "hcstate@pod@tiny"})


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_kv_events_describes_the_bound_streams():
    with running_server(*ENGINE_ARGS, "--adapters", "support-bot", "--kv-events-config", EVENTS) as (base, _):
        status, _, data = request(base, "GET", "/kv_events")
        described = json.loads(data)
        assert status == 200 and described["block_size"] == 16 and described["adapters"] == ["support-bot"]
        assert described["kv"]["topic"] == "kv@pod@tiny" and described["state"]["topic"] == "hcstate@pod@tiny"
        assert described["state"]["replay_endpoint"] is None
        assert isinstance(described["instance_id"], str) and len(described["instance_id"]) == 16  # this run's id
        context = zmq.Context()
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.connect(described["kv"]["endpoint"])
        try:
            frames = None
            for _ in range(20):  # a late subscriber misses messages: send until one arrives (bounded)
                request(base, "POST", "/v1/completions", {"model": "tiny", "prompt": list(range(1, 40)), "max_tokens": 1})
                if subscriber.poll(500):
                    frames = subscriber.recv_multipart()
                    break
            assert frames is not None and frames[0] == b"kv@pod@tiny" and len(frames) == 3
            next_seq = json.loads(request(base, "GET", "/kv_events")[2])["next_seq"]
            assert next_seq["kv"] > int.from_bytes(frames[1], "big") and next_seq["state"] >= 1
        finally:
            subscriber.close()
            context.term()


def test_closing_the_runtime_closes_the_event_sockets():
    from hybridcache.cli import build_parser
    from hybridcache.serving.config import ServeConfig
    from hybridcache.serving.runtime import ServingRuntime

    runtime = ServingRuntime(ServeConfig.from_args(build_parser().parse_args(["serve", *ENGINE_ARGS, "--kv-events-config", EVENTS])))
    described = runtime.events_description
    ports = [_port(described[name]["endpoint"]) for name in ("kv", "state")] + [_port(described["kv"]["replay_endpoint"])]
    assert not any(_port_is_free(port) for port in ports)
    runtime.close(1.0)
    assert runtime.engine.events is None and all(_port_is_free(port) for port in ports)


def test_kv_events_is_not_found_without_events(server):
    status, _, data = request(server, "GET", "/kv_events")
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"


def test_tokenize_gives_the_ids_generation_computes(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, tokenizer!"}]
    for path, field, value in (("/v1/chat/completions", "messages", messages), ("/v1/completions", "prompt", "Once upon")):
        status, _, data = request(server, "POST", "/tokenize", {"model": "tiny", field: value})
        assert status == 200
        tokens = json.loads(data)
        body = {"model": "tiny", field: value, "max_tokens": 1, "return_token_ids": True}
        _, _, answer = request(server, "POST", path, body)
        assert tokens["tokens"] == json.loads(answer)["prompt_token_ids"] and tokens["count"] == len(tokens["tokens"])
    _, _, data = request(server, "POST", "/tokenize", {"model": "support-bot", "prompt": [5, 6, 7]})
    assert json.loads(data)["tokens"] == [5, 6, 7]


@pytest.mark.parametrize("body, status", [
    ({"model": "tiny"}, 400),
    ({"model": "tiny", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
    ({"model": "elsewhere", "prompt": "a"}, 404),
    ({"model": "tiny", "prompt": 5}, 422),
])
def test_tokenize_refuses_bad_bodies(server, body, status):
    got, _, data = request(server, "POST", "/tokenize", body)
    assert got == status and "message" in json.loads(data)["error"]


@pytest.mark.parametrize("ids", [[100_000], [2**40], [-5], [1, 2, 2**63 - 1]])
def test_tokenize_refuses_the_ids_generation_refuses(server, ids):
    answers = [request(server, "POST", path, {"model": "tiny", "prompt": ids, "max_tokens": 1})
               for path in ("/tokenize", "/v1/completions")]
    for status, _, data in answers:
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("value", ["{not json", '{"endpoint": "udp://x"}', '{"no_such_field": 1}', "[" * 100_000])
def test_a_bad_kv_events_config_is_refused(value):
    from hybridcache.cli import build_parser
    from hybridcache.errors import InvalidConfigError
    from hybridcache.serving.config import ServeConfig

    with pytest.raises(InvalidConfigError):
        ServeConfig.from_args(build_parser().parse_args(["serve", "--kv-events-config", value]))


def test_the_kv_events_config_reaches_the_engine():
    from hybridcache.cli import build_parser
    from hybridcache.serving.config import ServeConfig

    config = ServeConfig.from_args(build_parser().parse_args(["serve", "--kv-events-config", EVENTS]))
    assert config.engine.kv_events.active and config.engine.kv_events.topic == "kv@pod@tiny"
