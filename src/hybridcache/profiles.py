"""Model profiles: what caching a token or a state costs in bytes, and what recomputing it costs
in FLOPs, for hybrid attention / state-space models.

Owns no mutable state: profiles are frozen and the built-in configs are read-only mappings.

A profile is computed from a model config in the transformers ``config.json`` schema (a path,
or one of the built-in configs below, which are the published models' values). Formulas (per
token unless noted; ``b`` = bytes of the cache dtype; FLOPs count a multiply-add as 2):

* KV bytes per token = sum over attention layers of ``2 * kv_heads * head_dim * b``; zero for a
  model without attention (Mamba, Mamba2, RWKV).
* State bytes per checkpoint = sum over recurrent layers of the recurrent state plus the
  convolution window the next token needs (``d_conv - 1`` columns):
  Mamba2 ``heads * head_dim * d_state * b_ssm + (d_inner + 2 * groups * d_state) * (d_conv - 1) * b``;
  Mamba1 ``d_inner * d_state * b_ssm + d_inner * (d_conv - 1) * b``;
  Gated DeltaNet ``v_heads * k_dim * v_dim * b + (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1) * b``.
* Linear FLOPs = 2 * (weights a token multiplies): attention projections, MLP or the active
  experts (top-k routed + shared + router), recurrent in/out projections, convolutions.
  The LM head is left out: a prefill computes logits for its last token only.
* Attention FLOPs of a token at position ``t`` (0-based) = ``4 * heads * head_dim * (t + 1)``
  per attention layer (QK^T and AV over ``t + 1`` keys): prefilling ``[a, b)`` costs the
  coefficient times ``(b (b + 1) - a (a + 1)) / 2``.
* Recurrent FLOPs: Mamba scan ``5 * d_inner * d_state`` (decay, input outer product, readout);
  Gated DeltaNet ``7 * v_heads * k_dim * v_dim`` (decay, delta correction, rank-1 update, readout).

The layers are summed in ``profile_layers`` (one function per kind of layer, the checked
config fields) and ``profile_architectures`` (one function per ``model_type``); this module
turns their totals into a ``ModelProfile``. The file sits at the package top rather than under ``workloads`` because the checkpoint
policies (FLOPs saved per byte) are library components that need profiles, and the library
core must not depend on the trace readers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError
from hybridcache.files import MAX_CONFIG_BYTES, read_bounded
from hybridcache.profile_architectures import ARCHITECTURES
from hybridcache.profile_configs import BUILTIN_CONFIGS
from hybridcache.profile_indexed import FLAT_TEXT_CONFIGS
from hybridcache.profile_layers import Fields, Totals, shown
from hybridcache.profile_recurrent import PURE_RECURRENT, REFUSED


@dataclass(frozen=True)
class ModelProfile:
    name: str
    kv_bytes_per_token: int
    state_bytes: int  # one checkpoint of every recurrent layer's state
    linear_flops_per_token: float
    recurrent_flops_per_token: float
    attention_flops_coefficient: float  # a token at position t costs coefficient * (t + 1)
    attention_layers: int
    recurrent_layers: int

    def __post_init__(self) -> None:
        """A checkpoint costs at least a byte; KV costs nothing exactly when no layer attends
        (a pure recurrent model: the replay then gives the whole budget to checkpoints). FLOPs
        must be finite and non-negative."""
        for field in ("kv_bytes_per_token", "state_bytes", "attention_layers", "recurrent_layers"):
            value, minimum = getattr(self, field), 1 if field == "state_bytes" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InvalidConfigError(f"ModelProfile.{field} must be an int >= {minimum}, got {value!r}")
        if (self.kv_bytes_per_token == 0) != (self.attention_layers == 0):
            raise InvalidConfigError(
                f"ModelProfile: {self.attention_layers} attention layers cannot cost "
                f"{self.kv_bytes_per_token} KV bytes per token (zero exactly when there are none)"
            )
        for field in ("linear_flops_per_token", "recurrent_flops_per_token", "attention_flops_coefficient"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise InvalidConfigError(f"ModelProfile.{field} must be a finite number >= 0, got {value!r}")

    @property
    def pure_recurrent(self) -> bool:
        """No attention layer: KV is free, and the prefix's blocks only name it."""
        return self.attention_layers == 0

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill positions ``[start, end)`` with ``[0, start)`` already cached."""
        if isinstance(start, bool) or isinstance(end, bool) or not 0 <= start <= end:
            raise InvalidArgumentError(f"need 0 <= start <= end, got [{start}, {end})")
        tokens = end - start
        quadratic = (end * (end + 1) - start * (start + 1)) / 2
        per_token = self.linear_flops_per_token + self.recurrent_flops_per_token
        return tokens * per_token + self.attention_flops_coefficient * quadratic

    @property
    def state_tokens_equivalent(self) -> float:
        """How many tokens of KV one checkpoint weighs (infinitely many when KV is free)."""
        return math.inf if self.pure_recurrent else self.state_bytes / self.kv_bytes_per_token


PROFILE_NAMES = tuple(BUILTIN_CONFIGS)


def _supported(model_type: object) -> bool:
    return isinstance(model_type, str) and model_type in ARCHITECTURES


def profile_from_config(config: dict, name: str | None = None) -> ModelProfile:
    """A profile from a config mapping in the transformers ``config.json`` schema. Every field
    a formula reads is checked (``profile_layers.Fields``); the model must have recurrent
    layers (a checkpoint must cost something) and attention layers, unless it is one of the
    pure recurrent families (``profile_recurrent.PURE_RECURRENT``), whose KV costs nothing."""
    if not isinstance(config, Mapping):
        raise InvalidConfigError("a model config must be a mapping")
    config = _language_model(dict(config))  # a copy: the caller's mapping may change
    model_type = config.get("model_type")
    if not _supported(model_type):
        profiled = (name for name in ARCHITECTURES if name not in REFUSED)
        raise InvalidConfigError(f"unsupported model_type {shown(model_type)}; supported: {', '.join(profiled)}")
    totals = ARCHITECTURES[model_type](Fields(dict(config), model_type))
    # a hybrid family's config without attention is more likely a slip than a pure recurrent model
    if totals.state_bytes < 1 or (totals.kv_bytes < 1 and model_type not in PURE_RECURRENT):
        raise InvalidConfigError(
            f"{model_type} config is not a hybrid model: {totals.attention_layers} attention layers "
            f"({totals.kv_bytes} KV bytes per token), {totals.recurrent_layers} recurrent layers "
            f"({totals.state_bytes} state bytes); both must be at least one (none without attention "
            f"but the pure recurrent {', '.join(sorted(PURE_RECURRENT))})"
        )
    return _profile_of(totals, name or str(config.get("_name_or_path") or model_type))


# Where multimodal checkpoints keep their language model (Nemotron-H Omni's checkpoints: llm_config)
_TEXT_CONFIG_KEYS = ("text_config", "llm_config")


def _language_model(config: Mapping) -> Mapping:
    """A multimodal checkpoint's language model (Qwen3.5, LFM2-VL, Nemotron-H Omni, GLM-5-Next,
    Qwen4-Exp, Inkling-2), in the outer dtype unless it names one; a text-only checkpoint saved
    under its wrapper's model type with the text fields at the top level (GLM-5-Next) as its
    language model; any other config as it is."""
    model_type = config.get("model_type")
    if _supported(model_type):
        return config
    for key in _TEXT_CONFIG_KEYS:
        text = config.get(key)
        if isinstance(text, Mapping):
            outer = {name: config[name] for name in ("dtype", "torch_dtype", "_name_or_path") if name in config}
            # transformers saves a sub-config's unset dtype as null, which names no dtype
            return {**outer, **{name: value for name, value in text.items() if value is not None or name not in outer}}
    if isinstance(model_type, str) and model_type in FLAT_TEXT_CONFIGS:
        return {**config, "model_type": FLAT_TEXT_CONFIGS[model_type]}
    return config


def _profile_of(totals: Totals, name: str) -> ModelProfile:
    return ModelProfile(
        name=name,
        kv_bytes_per_token=totals.kv_bytes,
        state_bytes=totals.state_bytes,
        linear_flops_per_token=float(2 * totals.linear_params + totals.conv_flops),
        recurrent_flops_per_token=float(totals.recurrent_flops),
        attention_flops_coefficient=float(totals.attention_coefficient),
        attention_layers=totals.attention_layers,
        recurrent_layers=totals.recurrent_layers,
    )


def load_profile(name_or_path: str) -> ModelProfile:
    """A built-in profile by name, or one computed from a ``config.json`` path (a regular file
    of at most ``MAX_CONFIG_BYTES``)."""
    if not isinstance(name_or_path, (str, Path)):
        raise InvalidTypeError(f"a model profile is named by a str or a Path, got {type(name_or_path).__name__}")
    if name_or_path in BUILTIN_CONFIGS:
        return profile_from_config(BUILTIN_CONFIGS[name_or_path], name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        raise InvalidArgumentError(
            f"unknown model profile {name_or_path!r}; built in: {', '.join(PROFILE_NAMES)}, or a config.json path"
        )
    data = read_bounded(path, MAX_CONFIG_BYTES, InvalidConfigError)
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:  # ValueError: bad JSON, or an int over the digit limit
        raise InvalidConfigError(f"{path}: cannot read a model config ({error})") from None
    except RecursionError:
        raise InvalidConfigError(f"{path}: cannot read a model config (JSON nested too deeply)") from None
    return profile_from_config(config, path.parent.name or path.stem)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?b?\s*$", re.IGNORECASE | re.ASCII)  # not other scripts' digits
_UNIT_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
MAX_SIZE = 2**63  # sizes are int64 downstream


def parse_size(text: str) -> int:
    """Bytes from ``400GB`` (400e9), ``512MiB`` (512 * 2**20), ``1.5T``, ``4096`` (bytes)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a size must be a string, got {type(text).__name__}")
    match = _SIZE.match(text)
    if not match:
        raise InvalidArgumentError(f"cannot parse size {text!r}; use e.g. 400GB, 512MiB or 4096")
    number, prefix, binary = match.groups()
    power = _UNIT_POWERS[prefix.lower()] if prefix else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value < 1:
        raise InvalidArgumentError(f"size {text!r} is below one byte")
    if not value < MAX_SIZE:
        raise InvalidArgumentError(f"size {text!r} is over the {MAX_SIZE:,} bytes (8 EiB) a size may name")
    return int(round(value))
