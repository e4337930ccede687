"""The official ``openai`` client against a real server: every endpoint, streaming and not;
later chat turns restore cached tokens; greedy outputs equal the engine called directly and
equal with caching on and off; seeded sampling, stop strings and cache salts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import SERVER_ARGS

openai = pytest.importorskip("openai")

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True, "return_token_ids": True})
USER_TURNS = ("Tell me about prefix caching in hybrid models, please.", "And the recurrent state?", "Thanks!")


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def chat(base: str, **options) -> list:
    """Three turns of one conversation; the replies are fed back as the assistant's turns."""
    messages, replies = [], []
    for text in USER_TURNS:
        messages.append({"role": "user", "content": text})
        reply = client(base).chat.completions.create(model="tiny", messages=messages, **options)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return replies


def direct_engine():
    from hybridcache.cli import build_parser
    from hybridcache.engine import Engine
    from hybridcache.serving.config import ServeConfig

    return Engine(ServeConfig.from_args(build_parser().parse_args(["serve", *SERVER_ARGS])).engine)


def test_models_lists_the_served_model_and_its_adapters(server):
    models = client(server).models.list()
    assert [model.id for model in models.data] == ["tiny", "support-bot", "legal-bot"]


def test_an_adapter_named_in_model_or_in_adapter_is_its_own_cache_namespace(server):
    prompt = "The same words, served by two adapters, share no cached prefix at all."

    def cached(model: str, **extra) -> int:
        reply = client(server).completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("support-bot") == 0
    assert cached("support-bot") > 0
    assert cached("tiny", adapter="support-bot") > 0  # the same namespace, named the other way
    assert cached("legal-bot") == 0
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="other-bot", prompt=prompt, max_tokens=2)


def test_later_chat_turns_restore_cached_tokens_and_equal_the_engine_and_caching_off(server, server_uncached):
    from hybridcache.engine import Request

    cached, uncached = chat(server, **GREEDY), chat(server_uncached, **GREEDY)
    assert cached[0].usage.prompt_tokens_details.cached_tokens == 0
    assert all(reply.usage.prompt_tokens_details.cached_tokens > 0 for reply in cached[1:])
    assert all(reply.model_extra["hybridcache"]["cached_tokens"] == reply.usage.prompt_tokens_details.cached_tokens
               for reply in cached)
    assert all(reply.usage.prompt_tokens_details.cached_tokens == 0 for reply in uncached)
    engine = direct_engine()
    for on, off in zip(cached, uncached):
        prompt, tokens = on.model_extra["prompt_token_ids"], on.choices[0].model_extra["token_ids"]
        assert prompt == off.model_extra["prompt_token_ids"]
        assert tokens == off.choices[0].model_extra["token_ids"]
        assert engine.generate([Request(prompt, max_new_tokens=8)])[0].tokens == tokens
        assert on.choices[0].message.content == off.choices[0].message.content
        assert on.usage.completion_tokens == 8 and on.choices[0].finish_reason == "length"


def test_a_streamed_chat_has_one_id_a_usage_chunk_last_and_the_same_text(server):
    messages = [{"role": "user", "content": "Streaming, with usage at the end of the stream."}]
    whole = client(server).chat.completions.create(model="tiny", messages=messages, **GREEDY)
    stream = client(server).chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt came just before
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content


def test_completions_stream_the_text_they_return_whole(server):
    prompt = "The quick brown fox jumps over the lazy dog, again and again."
    whole = client(server).completions.create(model="tiny", prompt=prompt, **GREEDY)
    chunks = list(client(server).completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY))
    assert len({chunk.id for chunk in chunks}) == 1
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 8
    ids = client(server).completions.create(model="tiny", prompt=whole.model_extra["prompt_token_ids"], **GREEDY)
    assert ids.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]


def test_a_seed_reproduces_a_sample_with_caching_on_and_off(server, server_uncached):
    options = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True})
    runs = [chat(base, **options) for base in (server, server, server_uncached)]
    ids = [[reply.choices[0].model_extra["token_ids"] for reply in run] for run in runs]
    assert ids[0] == ids[1] == ids[2]
    other = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": USER_TURNS[0]}],
                                                   **{**options, "seed": 4321})
    assert other.choices[0].model_extra["token_ids"] != ids[0][0]


def test_a_stop_string_ends_the_text_before_it(server):
    prompt = "Stop strings end the completion early."
    options = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    text = client(server).completions.create(model="tiny", prompt=prompt, **options).choices[0].text
    stop = text[len(text) // 2:][:2]
    assert len(stop) == 2
    stopped = client(server).completions.create(model="tiny", prompt=prompt, stop=[stop], **options)
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client(server).completions.create(model="tiny", prompt=prompt, stop=stop, stream=True, **options))
    assert "".join(chunk.choices[0].text for chunk in streamed) == text[: text.find(stop)]


def test_a_cache_salt_isolates_cached_prefixes(server):
    prompt = "A tenant's system prompt that nobody else may reuse, long enough for blocks."
    options = dict(temperature=0, max_tokens=2)

    def cached(salt: str) -> tuple[int, str | None]:
        reply = client(server).completions.create(model="tiny", prompt=prompt, extra_body={"cache_salt": salt}, **options)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.model_extra["hybridcache"]["miss_reason"]

    assert cached("tenant-a")[0] == 0
    assert cached("tenant-a")[0] > 0
    assert cached("tenant-b") == (0, "no_cached_prefix")


def test_concurrent_clients_get_the_answers_they_get_alone(server):
    prompts = [f"Client number {i} asks its own question about caches." for i in range(8)]
    alone = [client(server).completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in prompts]

    def ask(prompt: str) -> str:
        chunks = client(server).completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
        return "".join(chunk.choices[0].text for chunk in chunks)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == alone
