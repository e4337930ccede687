"""A checkpoint directory's tokenizer and chat template, for text workloads (the demo).

Owns: the loaded transformers tokenizer (read only after loading). Nothing is downloaded: the
tokenizer is opened with ``local_files_only=True``.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer

from hybridcache.errors import ModelLoadError

# Any of these in the directory means it ships a tokenizer (fast, SentencePiece or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ChatTokenizer:
    """Conversations (lists of ``{"role", "content"}`` messages) to prompt ids, text to ids and
    ids to text. ``has_chat_template``: whether ``prompt_ids`` can render a conversation."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset() if eos is None else frozenset([int(eos)])

    def encode(self, text: str) -> list[int]:
        """``text`` as the model reads a plain prompt (with the tokenizer's special tokens)."""
        try:
            ids = self._tokenizer(text)["input_ids"]
        except Exception as error:  # tokenizers raise builtin errors of several kinds
            raise ModelLoadError(f"the tokenizer cannot encode this text: {error}") from error
        return [int(token) for token in ids]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the chat template, ending with the assistant's turn opener."""
        try:
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:  # a template can fail in jinja with any builtin error
            raise ModelLoadError(f"the chat template cannot render this conversation: {error}") from error
        return [int(token) for token in ids]

    def text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(directory: str | os.PathLike) -> ChatTokenizer | None:
    """The directory's tokenizer (with or without a chat template), or None when it holds none."""
    path = Path(directory)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers raises builtin errors of many kinds for bad files
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {error}") from error
    return ChatTokenizer(tokenizer)


def load_chat_tokenizer(directory: str | os.PathLike) -> ChatTokenizer | None:
    """The directory's tokenizer, or None when it holds none or it has no chat template."""
    tokenizer = load_tokenizer(directory)
    return tokenizer if tokenizer is not None and tokenizer.has_chat_template else None
