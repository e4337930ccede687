"""Fixtures: tiny random checkpoints saved with ``save_pretrained``, one directory per family
per test session, and the transformers oracle loaded back independently of the adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from tests.engine.hf.tiny_configs import tiny_config


def save_tiny_model(family: str, directory, *, sensitive: bool = True, seed: int = 0) -> str:
    """A family without a causal-LM class (GLM-5-Next's text model) is saved as its base model,
    so that loading it shows how the engine refuses such a checkpoint."""
    torch.manual_seed(seed)
    config = tiny_config(family, sensitive=sensitive)
    model_class = AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel
    model = model_class.from_config(config, experts_implementation="eager")
    model.save_pretrained(directory)
    return str(directory)


def load_oracle(directory: str) -> torch.nn.Module:
    """transformers' own model from the same directory, float64, no hybridcache code involved."""
    model = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.float64, experts_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """The oracle runs on one thread too: torch's multi-threaded float64 depthwise conv1d is
    three orders of magnitude slower on these tiny tensors."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(family)`` -> the directory of that family's tiny sensitive checkpoint."""
    saved: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in saved:
            saved[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return saved[family]

    return get
