"""The typed request bodies of the OpenAI endpoints, and the one place a raw body becomes one.

Owns nothing mutable: pydantic models (frozen) and pure parsing. ``parse_body`` refuses, with a
``hybridcache.errors`` exception whose ``param`` names the offending field: bytes that are not
UTF-8, not JSON (``NaN``, integers longer than Python reads), not a JSON object or holding a
lone UTF-16 surrogate (``MalformedRequestError``), fields of the wrong type or missing
(``InvalidTypeError``), values out of range (``InvalidArgumentError``). Unknown fields are
ignored, as OpenAI-compatible servers do; known options this server does not implement with a
non-default value (``n`` > 1, penalties, ``logit_bias``, ``logprobs``, ``tools``, ... in
``UNIMPLEMENTED``) are refused with a message naming the field, rather than ignored.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridcache.errors import HybridCacheError, InvalidArgumentError, InvalidTypeError, MalformedRequestError
from hybridcache.serving.api_errors import rejected

MAX_STOP_STRINGS = 4
MAX_STOP_CHARACTERS = 1024  # each stop string's length: every step compares the text's end with it
MAX_SEED = 2**63 - 1
# Options this server does not implement, with the values that mean "off" (JSON's spelling in
# the message); any other value is refused. None (the field omitted or null) is always off.
UNIMPLEMENTED = (
    ("n", (1,)), ("best_of", (1,)), ("logprobs", (False, 0)), ("top_logprobs", (0,)), ("echo", (False,)),
    ("presence_penalty", (0.0,)), ("frequency_penalty", (0.0,)), ("logit_bias", ({},)), ("suffix", ("",)),
    ("repetition_penalty", (1.0,)), ("top_k", (-1, 0)), ("min_p", (0.0,)), ("min_tokens", (0,)),
    ("stop_token_ids", ([],)), ("use_beam_search", (False,)), ("tools", ([],)),
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    def refuse_unimplemented(self) -> None:
        """Raise if the body asks for an option this server would otherwise ignore."""


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints. ``cache_salt`` isolates a tenant's cached prefixes (vLLM's
    name); ``adapter`` names an adapter when ``model`` is the base model (``model`` may also name
    the adapter directly)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    adapter: str | None = Field(default=None, min_length=1)
    user: str | None = None
    logprobs: bool | int | None = None  # chat: a flag; completions: how many (0 = none)
    top_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(default=None, ge=1)
    # vLLM's sampling extensions, at their "off" values
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    top_k: int | None = None
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the completion's token ids

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(stop) <= MAX_STOP_CHARACTERS for stop in stops):
            raise rejected(InvalidArgumentError, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most "
                                                 f"{MAX_STOP_CHARACTERS:,} characters", "stop")
        return tuple(stops)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unimplemented(self) -> None:
        """A client that sends a penalty, a bias or several candidates expects them applied;
        ignoring them would answer something else than asked, silently."""
        for field, off in UNIMPLEMENTED:
            value = getattr(self, field, None)
            if value is not None and not any(value == plain and type(value) is type(plain) for plain in off):
                shown = " or ".join(json.dumps(plain) for plain in off)
                raise rejected(InvalidArgumentError,
                               f"{field} is not implemented by this server; omit it or send {shown}", field)


class CompletionRequest(_Sampling):
    """``prompt``: a string, or one prompt as token ids (a list of several prompts is refused)."""

    prompt: str | list[int] = Field(min_length=1)
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Literal["text"]] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize`` body: a prompt (text or ids) or chat messages, not both."""

    model: str = Field(min_length=1)
    prompt: str | list[int] | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)


Body = TypeVar("Body", bound=_Body)


def parse_body(raw: bytes, schema: type[Body]) -> Body:
    """``raw`` as a ``schema`` instance, or the specific error saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise rejected(MalformedRequestError, f"the body is not valid UTF-8 (byte {error.start})", None) from None
    data = _json_object(text)
    _refuse_lone_surrogates(data)
    try:
        body = schema.model_validate(data)
    except ValidationError as error:
        raise _validation_error(error) from None
    body.refuse_unimplemented()
    return body


def _json_object(text: str) -> dict:
    """``text`` as a JSON object. Python's reader also takes ``NaN`` / ``Infinity`` (not JSON)
    and stops at integers longer than ``sys.get_int_max_str_digits()`` with a bare ValueError:
    both are a malformed body here, not a value to validate or a 500."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise rejected(MalformedRequestError, f"the body is not valid JSON: {error}", None) from None
    except RecursionError:
        raise rejected(MalformedRequestError, "the body is not valid JSON: nested too deeply", None) from None
    except MalformedRequestError:
        raise
    except ValueError:  # only the integer-length limit is left: JSONDecodeError was caught above
        limit = sys.get_int_max_str_digits()
        raise rejected(MalformedRequestError,
                       f"the body holds an integer longer than the {limit} digits the server reads", None) from None
    if not isinstance(data, dict):
        raise rejected(MalformedRequestError, "the body must be a JSON object", None)
    return data


def _refuse_constant(name: str) -> float:
    raise rejected(MalformedRequestError, f"the body is not valid JSON: {name} is not a JSON number", None)


def _refuse_lone_surrogates(data: dict) -> None:
    """JSON's ``\\ud800`` escapes can spell half of a UTF-16 pair, which is no Unicode text:
    it cannot be encoded, tokenized or hashed into a cache key, so the body is malformed. The
    walk is iterative because the reader accepts nesting deeper than this stack leaves room for."""
    for field, value in data.items():
        pending = [field, value]
        while pending:
            item = pending.pop()
            if isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
            elif isinstance(item, str) and not _is_unicode(item):
                param = field if _is_unicode(field) else None  # the message must encode itself
                raise rejected(MalformedRequestError,
                               f"{param or 'a field name'} holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                               "which is not Unicode text", param)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validation_error(error: ValidationError) -> HybridCacheError:
    """The first problem pydantic found, as a type error (wrong kind, missing) or a value error."""
    first: dict[str, Any] = error.errors()[0]
    param = str(first["loc"][0]) if first["loc"] else None  # the top-level field, as OpenAI names it
    kind = first["type"]
    value_kinds = ("greater_than", "less_than", "too_short", "too_long", "literal_error", "string_too_short")
    cls = InvalidArgumentError if kind.startswith(value_kinds) else InvalidTypeError
    if kind == "missing":
        return rejected(InvalidTypeError, f"{param} is required", param)
    return rejected(cls, f"{param}: {first['msg']}", param)
