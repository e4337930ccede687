"""A transformers checkpoint with its own tokenizer and chat template, served over HTTP: the
prompt is the template's rendering, later turns restore cached tokens, and the tokens equal the
engine called directly."""

from __future__ import annotations

import pytest

from tests.serving.conftest import running_server

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":", "hello", "there", "how", "are", "you", "cache", "me"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def save_word_tokenizer(directory) -> None:
    """A whitespace word-level tokenizer of the first ids of the vocabulary, with a chat template."""
    model = tokenizers.models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from tests.engine.hf.conftest import save_tiny_model

    directory = save_tiny_model("bamba", tmp_path_factory.mktemp("bamba-chat"))
    save_word_tokenizer(directory)
    return directory


def test_a_checkpoint_chat_uses_its_template_and_restores_later_turns(checkpoint_dir):
    from hybridcache.cli import build_parser
    from hybridcache.engine import Engine, Request
    from hybridcache.engine.hf.chat import load_tokenizer
    from hybridcache.serving.config import ServeConfig

    args = ("--model", checkpoint_dir, "--num-kv-blocks", "128", "--num-state-slots", "24", "--checkpoint-budget", "12")
    with running_server(*args) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "hello there how are you"}]
        options = dict(temperature=0, max_tokens=4, extra_body={"ignore_eos": True, "return_token_ids": True})
        first = client.chat.completions.create(model=name, messages=messages, **options)
        messages += [{"role": "assistant", "content": "cache me"}, {"role": "user", "content": "how are you"}]
        second = client.chat.completions.create(model=name, messages=messages, **options)
    tokenizer = load_tokenizer(checkpoint_dir)
    assert first.model_extra["prompt_token_ids"] == tokenizer.prompt_ids(messages[:1])
    assert second.model_extra["prompt_token_ids"] == tokenizer.prompt_ids(messages)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    engine = Engine(ServeConfig.from_args(build_parser().parse_args(["serve", *args])).engine)  # the server's own config
    for reply in (first, second):
        expected = engine.generate([Request(reply.model_extra["prompt_token_ids"], max_new_tokens=4)])[0].tokens
        assert reply.choices[0].model_extra["token_ids"] == expected
