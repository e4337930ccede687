"""``hybridcache router`` in front of real ``hybridcache serve`` replicas, through the official
``openai`` client: predicted restorable depths equal the reported ``cached_tokens``, streaming
is relayed, adapters are routed under their own names, a killed replica loses no request, a
restarted, empty one is served again, and a restarted router rebuilds its indexes from replay."""

from __future__ import annotations

import signal

import pytest

from tests.router.cluster import replica, router, router_metrics, wait_settled, wait_subscribed

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

SYSTEMS = ("You are a terse assistant for a hardware store.", "You answer questions about trains, briefly.")
GREEDY = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True})


def _start(count: int, **router_options):
    replicas = [replica(f"r{i}") for i in range(count)]
    front = None
    try:
        for process in replicas:
            process.wait_healthy()
        front = router([r.url for r in replicas], **router_options)
        front.wait_healthy()
        wait_subscribed(front.url, count)
    except BaseException:
        _stop(front, replicas)
        raise
    return front, replicas


def _stop(front, replicas) -> None:
    for process in [front, *replicas]:
        if process is not None:
            process.stop()


@pytest.fixture(scope="module")
def cluster():
    front, replicas = _start(2)
    yield front, replicas
    _stop(front, replicas)


def _client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)


def _conversation_turns(front, client, model: str, system: str, users: tuple[str, ...]) -> list:
    messages, usages = [{"role": "system", "content": system}], []
    for text in users:
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model=model, messages=messages, **GREEDY)
        usages.append(reply.usage)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        wait_settled(front.url)
    return usages


def _settle_reads(front) -> float:
    """Settles that had to GET the replica's /kv_events: its answer lacked ``next_seq``."""
    return router_metrics(front.url)["hybridcache_router_settles_read_total"]


def _counters(front) -> tuple[float, float, float]:
    samples = router_metrics(front.url)
    return tuple(samples[f"hybridcache_router_{name}_total"] for name in ("predictions_checked", "predictions_exact",
                                                                          "reported_cached_tokens"))


def test_chat_turns_are_predicted_exactly_and_later_turns_hit(cluster):
    front, _ = cluster
    client = _client(front)
    checked, exact, reported = _counters(front)
    reads = _settle_reads(front)
    usages = []
    for index, model in enumerate(("tiny", "tiny", "support-bot")):  # the adapter's blocks carry its name
        usages += _conversation_turns(front, client, model, SYSTEMS[index % 2], (f"Question {index}?", "Why?", "Thanks."))
    now_checked, now_exact, now_reported = _counters(front)
    assert now_checked - checked == len(usages) == 9
    assert (now_exact - exact) / (now_checked - checked) >= 0.99
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert now_reported - reported == cached > 0
    assert _settle_reads(front) == reads  # every answer carried its replica's next_seq


def test_token_id_prompts_and_streaming_are_relayed(cluster):
    front, _ = cluster
    client = _client(front)
    checked, exact, _ = _counters(front)
    reads = _settle_reads(front)
    prompt = list(range(1, 60))
    first = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=4,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    wait_settled(front.url)
    follow_up = prompt + first.choices[0].model_extra["token_ids"] + [7, 8, 9]
    chunks = list(client.completions.create(model="tiny", prompt=follow_up, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert len([c for c in chunks if c.choices]) >= 1 and chunks[-1].usage.prompt_tokens == len(follow_up)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    now_checked, now_exact, _ = _counters(front)
    assert (now_checked - checked, now_exact - exact) == (2, 2)
    assert _settle_reads(front) == reads  # the JSON answer's header and the usage event's next_seq


def test_a_killed_replica_loses_no_request_and_a_restarted_empty_one_serves_again():
    front, replicas = _start(2, health_interval_s=2.0)  # slow health checks: the dead replica is met by requests
    try:
        client = _client(front)
        replicas[0].stop(signal.SIGKILL)
        for number in range(4):  # one of the first two is routed to the dead replica: retried on the other
            reply = client.completions.create(model="tiny", prompt=[number + 1] * 40, **GREEDY)
            assert reply.usage.prompt_tokens == 40
        samples = router_metrics(front.url)
        assert samples[f'hybridcache_router_replica_healthy{{replica="{replicas[0].url}"}}'] == 0
        assert samples["hybridcache_router_retries_total"] >= 1
        replicas[0] = replica("r0", port=replicas[0].port)  # the same URL, an empty cache, streams from seq 0
        replicas[0].wait_healthy()
        wait_subscribed(front.url, 2)
        checked, exact, _ = _counters(front)
        for number in range(4):  # round robin among equal costs reaches the restarted replica
            client.completions.create(model="tiny", prompt=[number + 50] * 40, **GREEDY)
            wait_settled(front.url)
            client.completions.create(model="tiny", prompt=[number + 50] * 40 + [3, 4], **GREEDY)
        now_checked, now_exact, _ = _counters(front)
        assert now_checked - checked == 8 and now_exact - exact == 8
        restarted = router_metrics(front.url)
        assert any(replicas[0].url in key and value > 0 for key, value in restarted.items()
                   if key.startswith("hybridcache_router_decisions_total"))
    finally:
        _stop(front, replicas)


def test_a_restarted_router_rebuilds_its_indexes_from_the_replay_sockets(cluster):
    front, replicas = cluster
    prompt = [9, 8, 7, 6] * 12
    first = _client(front).completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=4,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    follow_up = prompt + first.choices[0].model_extra["token_ids"] + [1, 2]
    fresh = router([r.url for r in replicas])  # knows nothing but the replicas' URLs
    try:
        fresh.wait_healthy()
        wait_subscribed(fresh.url, len(replicas))
        wait_settled(fresh.url)
        reply = _client(fresh).completions.create(model="tiny", prompt=follow_up, **GREEDY)
        checked, exact, reported = _counters(fresh)
        assert (checked, exact) == (1, 1) and reported == reply.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        fresh.stop()
