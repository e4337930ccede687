"""The demo's workload, smaller: every later turn is served from the cache at least up to the
previous turn's prompt plus its reply, minus the one sampled token that was never fed; and
``demo --model DIR`` on a tiny checkpoint, with a chat tokenizer built offline and without."""

import shutil

import numpy as np
import pytest

from hybridcache import cli, demo
from hybridcache.engine import Engine, Request


def test_later_turns_hit_up_to_the_previous_prompt_and_reply(monkeypatch):
    monkeypatch.setattr(demo, "CONVERSATIONS", 3)
    monkeypatch.setattr(demo, "TURNS", 3)
    engine = Engine(demo.engine_config(prefix_caching=True))
    reference = Engine(demo.engine_config(prefix_caching=False))
    rng = np.random.default_rng(5)
    system = rng.integers(0, 512, demo.SYSTEM_PROMPT_TOKENS).tolist()
    histories = [list(system) for _ in range(3)]
    previous_lengths = [None] * 3
    for turn in range(3):
        requests = [Request(prompt=h + rng.integers(0, 512, 10).tolist(), max_new_tokens=demo.REPLY_TOKENS) for h in histories]
        results = engine.generate(requests)
        assert [r.tokens for r in results] == [r.tokens for r in reference.generate(requests)]
        for c, (request, result) in enumerate(zip(requests, results)):
            if previous_lengths[c] is not None:
                assert result.cached_tokens >= previous_lengths[c] - 1
            histories[c] = list(request.prompt) + result.tokens
            previous_lengths[c] = len(histories[c])
        engine.check_invariants()


# --- hybridcache demo --model DIR -------------------------------------------------------------

SPECIALS = ["[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_chat_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer built offline over the demo's own words (the rest are [UNK]),
    exactly ``vocab_size`` entries so every id the model generates decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([demo.SYSTEM_TEXT, *demo.TOPICS, *demo.QUESTIONS])
    words = list(dict.fromkeys(text.split()))[: vocab_size - len(SPECIALS)]
    words += [f"filler{i}" for i in range(vocab_size - len(SPECIALS) - len(words))]
    model = models.WordLevel({word: i for i, word in enumerate(SPECIALS + words)}, unk_token="[UNK]")
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", additional_special_tokens=SPECIALS[1:])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


@pytest.fixture
def small_demo(monkeypatch):
    monkeypatch.setattr(demo, "CONVERSATIONS", 3)
    monkeypatch.setattr(demo, "TURNS", 3)


@pytest.fixture(scope="module")
def lfm2_checkpoint(tmp_path_factory):
    from tests.engine.hf.conftest import save_tiny_model
    from tests.engine.hf.tiny_configs import VOCAB

    directory = tmp_path_factory.mktemp("lfm2")
    save_tiny_model("lfm2", directory)
    return directory, VOCAB


def test_demo_on_a_checkpoint_with_a_chat_template_serves_text_turns(small_demo, lfm2_checkpoint, tmp_path, capsys):
    source, vocab = lfm2_checkpoint
    directory = tmp_path / "chat"
    shutil.copytree(source, directory)
    save_chat_tokenizer(directory, vocab)
    assert cli.main(["demo", "--model", str(directory), "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "text through the checkpoint's chat template" in out
    assert "sample reply (conversation 1, turn 3)" in out and "assistant:" in out
    assert "identical" in out and "DIFFERENT" not in out
    later_rate = float(out.split("hit rate for turns 2-3: ")[1].split("%")[0])
    assert later_rate > 50  # each turn resends the previous one, re-rendered through the template


def test_demo_on_a_checkpoint_without_a_tokenizer_serves_token_turns(small_demo, lfm2_checkpoint, capsys):
    directory, _ = lfm2_checkpoint
    assert cli.main(["demo", "--model", str(directory), "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "turns: random token ids" in out and "identical" in out


def test_demo_on_a_directory_that_is_no_checkpoint_says_why_on_stderr(tmp_path, capsys):
    assert cli.main(["demo", "--model", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "ModelLoadError" in err and "config.json" in err and out == ""


@pytest.mark.parametrize("kind", ["fifo", "link to a device"])
def test_demo_refuses_a_config_that_is_no_regular_file(tmp_path, capsys, kind):
    import os

    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)  # reading it would block forever
    else:
        config.symlink_to("/dev/zero")  # reading it would never end
    assert cli.main(["demo", "--model", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "not a regular file" in err and out == ""
