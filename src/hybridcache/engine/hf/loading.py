"""Opening a local checkpoint directory, turning every way it can fail into a specific error.

Owns nothing: ``load_causal_lm`` returns a freshly loaded model in eval mode.
"""

from __future__ import annotations

import json

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hybridcache.engine.hf.config import HFModelConfig
from hybridcache.errors import ModelLoadError, ModelWeightsError, UnsupportedModelError
from hybridcache.files import MAX_CONFIG_BYTES, read_bounded

# Eager experts: the fused grouped-GEMM expert path rejects float64. Attention keeps the model's
# default (SDPA where the family has it): eager attention runs its softmax in float32.
_IMPLEMENTATIONS = {"experts_implementation": "eager"}


def _model_type(config: HFModelConfig) -> str:
    """The ``model_type`` written in ``config.json``; a missing or unreadable file is a load error."""
    path = config.directory / "config.json"
    data = read_bounded(path, MAX_CONFIG_BYTES, ModelLoadError)  # a FIFO or a device is refused, not read
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ModelLoadError(f"cannot read {path}: {error}") from error
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelLoadError(f"{path} has no model_type")
    return raw["model_type"]


def load_model_config(config: HFModelConfig) -> transformers.PretrainedConfig:
    """The checkpoint's transformers config; an architecture transformers lacks is refused."""
    model_type = _model_type(config)
    if model_type not in transformers.CONFIG_MAPPING:
        raise UnsupportedModelError(f"transformers {transformers.__version__} has no architecture {model_type!r}")
    try:
        model_config = AutoConfig.from_pretrained(config.directory, local_files_only=True)
    except Exception as error:  # transformers raises builtin errors of many kinds for a bad config
        raise ModelLoadError(f"cannot parse the config in {config.directory}: {error}") from error
    if type(model_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(f"architecture {model_type!r} has no causal language-model class")
    return model_config


def _check_loading_info(info: dict) -> None:
    problems = {
        kind: sorted(str(key) for key in info.get(kind) or ())
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        summary = "; ".join(f"{kind}: {keys[:4]}{' ...' if len(keys) > 4 else ''}" for kind, keys in problems.items())
        raise ModelWeightsError(f"checkpoint weights do not match its config ({summary})")


def load_causal_lm(config: HFModelConfig) -> torch.nn.Module:
    """Load the checkpoint's causal LM with every weight present and of the right shape."""
    model_config = load_model_config(config)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            config.directory,
            config=model_config,
            local_files_only=True,
            dtype=getattr(torch, config.dtype),
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # report mismatches through ``info`` rather than raising
            **_IMPLEMENTATIONS,
        )
    except OSError as error:
        raise ModelLoadError(f"no loadable weights in {config.directory}: {error}") from error
    except Exception as error:  # a corrupt weights file surfaces as any builtin error
        raise ModelWeightsError(f"cannot load the weights in {config.directory}: {error}") from error
    _check_loading_info(info)
    return model.eval()
