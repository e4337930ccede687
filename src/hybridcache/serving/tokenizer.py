"""Text to token ids and back, for the model being served.

Owns nothing mutable. ``ByteChatTokenizer`` is the tiny model's tokenizer, so a person can talk
to it: ids 0-255 are the UTF-8 bytes of the text, 256 begins a conversation, 257 ends a turn
(the model's end-of-sequence token) and 258-261 open a turn of a role. A conversation is

    <bos> ( <role> utf-8 bytes of the content <end> )*  <assistant>

so every turn of a chat is a prefix of the next one's prompt, which is what the prefix cache
reuses. Decoding keeps only the byte ids (the others print nothing). A checkpoint's own
tokenizer and chat template come through ``engine.hf.chat`` (transformers stays in ``engine``).
"""

from __future__ import annotations

from typing import Protocol

from hybridcache.errors import InvalidArgumentError

BYTE_IDS = 256
BOS, END_OF_TURN = 256, 257
ROLE_IDS = {"system": 258, "developer": 258, "user": 259, "assistant": 260, "tool": 261}
BYTE_VOCAB = 262  # the smallest vocabulary this tokenizer needs


class TextTokenizer(Protocol):
    has_chat_template: bool
    eos_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def text(self, ids: list[int]) -> str: ...


class ByteChatTokenizer:
    """The tiny model's byte-level tokenizer and chat template (see the module docstring)."""

    has_chat_template = True
    eos_ids = frozenset([END_OF_TURN])

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_VOCAB:
            raise InvalidArgumentError(f"the byte tokenizer needs a vocabulary of >= {BYTE_VOCAB}, got {vocab_size}")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = [BOS]
        for message in messages:
            ids.append(ROLE_IDS[message["role"]])
            ids.extend(message["content"].encode("utf-8"))
            ids.append(END_OF_TURN)
        ids.append(ROLE_IDS["assistant"])
        return ids

    def text(self, ids: list[int]) -> str:
        return bytes(token for token in ids if token < BYTE_IDS).decode("utf-8", errors="replace")


def load_text_tokenizer(model_dir: object, vocab_size: int) -> TextTokenizer | None:
    """The tokenizer for the served model: the byte tokenizer for the tiny model (``model_dir``
    None), the checkpoint's own otherwise (None when its directory ships none: prompts must
    then be token ids)."""
    if model_dir is None:
        return ByteChatTokenizer(vocab_size)
    from hybridcache.engine.hf.chat import load_tokenizer  # imports transformers

    return load_tokenizer(model_dir)
