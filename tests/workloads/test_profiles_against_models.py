"""Every family a profile can be computed for, checked against the model transformers builds
from the same config: the KV per token and the state per checkpoint the profile charges are
what the model's own cache holds after a probe forward (``engine.hf.introspect``), with one
convolution column less per channel (the profile keeps the window the next token needs; the
cache also keeps the column it just consumed). Then the published spellings of a config
(1-based layer lists, index lists, a multimodal wrapper) give the profile of the same model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridcache.engine.hf.introspect import probe_model  # noqa: E402
from hybridcache.errors import InvalidConfigError  # noqa: E402
from hybridcache.profiles import profile_from_config  # noqa: E402
from tests.engine.hf.tiny_configs import tiny_config  # noqa: E402

FAMILIES = ["bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "jamba", "qwen3_next", "qwen3_5_text",
            "qwen3_5_moe_text", "lfm2", "lfm2_moe", "kimi_linear"]


def _float32(config) -> dict:
    values = config.to_dict()
    values.pop("torch_dtype", None)
    return {**values, "dtype": "float32"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_profile_charges_what_the_model_caches(family):
    config = tiny_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    with torch.no_grad():
        layers = probe_model(model, config.vocab_size).layers
    kv = sum(math.prod(spec.shape) for layer in layers for spec in layer.kv)
    states = [spec for layer in layers for spec in layer.state]
    convolutions = [spec for spec in states if "conv" in spec.name]
    needed = sum(math.prod(spec.shape) for spec in states) - sum(math.prod(spec.shape[:-1]) for spec in convolutions)
    profile = profile_from_config(_float32(config))
    assert profile.kv_bytes_per_token == 4 * kv
    assert profile.state_bytes == 4 * needed
    assert profile.attention_layers == sum(bool(layer.kv) for layer in layers)
    assert profile.recurrent_layers == sum(bool(layer.state) for layer in layers)
    assert profile.linear_flops_per_token > 0 and profile.attention_flops_coefficient > 0


def _kimi_published(values: dict) -> dict:
    """Kimi-Linear as its checkpoint spells it: the linear layers in ``linear_attn_config``
    (1-based lists), the dense layers as ``first_k_dense_replace``."""
    kinds = values.pop("layer_types")
    published = {key: value for key, value in values.items() if not key.startswith("linear_") and key != "mlp_layer_types"}
    published["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        "num_heads": values["linear_num_heads"], "head_dim": values["linear_head_dim"],
        "short_conv_kernel_size": values["linear_conv_kernel_dim"],
    }
    published["first_k_dense_replace"] = values["mlp_layer_types"].count("dense")
    return published


def test_the_published_spellings_give_the_same_profile():
    kimi = _float32(tiny_config("kimi_linear"))
    assert kimi["mlp_layer_types"][:2] == ["dense", "sparse"]  # what first_k_dense_replace = 1 means
    assert profile_from_config(_kimi_published(dict(kimi))) == profile_from_config(kimi)
    lfm2 = _float32(tiny_config("lfm2"))
    indexed = {key: value for key, value in lfm2.items() if key != "layer_types"}
    indexed["full_attn_idxs"] = [i for i, kind in enumerate(lfm2["layer_types"]) if kind == "full_attention"]
    assert profile_from_config(indexed) == profile_from_config(lfm2)
    qwen = _float32(tiny_config("qwen3_5_text"))
    wrapped = {"model_type": "qwen3_5", "dtype": "float32", "text_config": {k: v for k, v in qwen.items() if k != "dtype"}}
    assert profile_from_config(wrapped, "q") == profile_from_config(qwen, "q")


@pytest.mark.parametrize(("family", "change", "named"), [
    ("kimi_linear", lambda c: c.update(linear_attn_config={**c["linear_attn_config"], "kda_layers": [1, 2, 3]}),
     "split"),
    ("kimi_linear", lambda c: c.update(linear_attn_config={**c["linear_attn_config"], "full_attn_layers": [0, 2]}),
     "full_attn_layers"),
    ("kimi_linear", lambda c: c.update(linear_attn_config="3:1"), "linear_attn_config"),
    ("kimi_linear", lambda c: c.pop("num_experts"), "num_experts"),
    ("lfm2", lambda c: c.update(full_attn_idxs=[1, 99]), "full_attn_idxs"),
    ("lfm2", lambda c: c.update(full_attn_idxs=[True]), "full_attn_idxs"),
    ("lfm2", lambda c: c.update(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=-1.0), "block_ffn_dim_multiplier"),
    ("lfm2", lambda c: c.update(conv_L_cache=0), "conv_L_cache"),
    ("bamba", lambda c: c.update(attn_layer_indices="1"), "attn_layer_indices"),
])
def test_a_published_spelling_with_a_bad_field_is_refused_by_name(family, change, named):
    values = _float32(tiny_config(family))
    if family == "kimi_linear":
        values = _kimi_published(values)
    elif family == "lfm2":
        values = {key: value for key, value in values.items() if key != "layer_types"}
        values["full_attn_idxs"] = [1, 3]
    change(values)
    with pytest.raises(InvalidConfigError, match=named):
        profile_from_config(values)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.sampled_from(["auto", "full_attention", "linear_attention", "conv", "mamba", "dense", "sparse", "float32"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(FAMILIES), data=st.data())
def test_any_corrupted_field_gives_a_profile_or_an_invalid_config_error(family, data):
    values = _float32(tiny_config(family))
    if family == "kimi_linear" and data.draw(st.booleans()):
        values = _kimi_published(values)
    for _ in range(data.draw(st.integers(1, 3))):
        nested = values.get("linear_attn_config") if data.draw(st.booleans()) else None
        target = nested if isinstance(nested, dict) and nested else values  # a corrupted one may be empty
        target[data.draw(st.sampled_from(sorted(target)))] = data.draw(JSON_VALUES)
    try:
        profile = profile_from_config(values)
    except InvalidConfigError:
        return
    assert profile.kv_bytes_per_token >= 1 and profile.state_bytes >= 1
