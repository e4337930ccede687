"""The families added beside the first eleven (Zamba, Zamba2, LFM3, OLMo-Hybrid, Bailing-Hybrid,
MiniMax, LaraMini, and the pure recurrent Mamba, FalconMamba, Mamba2, RWKV), each checked
against the model transformers builds from a tiny config: the KV bytes per token and the
checkpoint bytes the profile charges are what the model's own cache holds after a probe
forward, read here from whatever the model returns (a ``DynamicCache`` of per-layer objects,
MiniMax's cache with its lightning states beside it, RWKV's state tensors), less the one
convolution column per channel the next token does not need. Then the checkpoints' other
spellings give the same profile, and a bad field or a windowed attention is refused by name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridcache.errors import InvalidConfigError  # noqa: E402
from hybridcache.profiles import profile_from_config  # noqa: E402
from tests.engine.hf.tiny_configs import VOCAB, tiny_config  # noqa: E402
from tests.workloads.model_caches import config_values, row_bytes  # noqa: E402
from tests.workloads.test_profiles_against_models import JSON_VALUES  # noqa: E402

PROBE = 3
FULL_ONLY = {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}

# family -> a tiny config of it whose attention (if any) covers the whole prefix
TINY = {
    "zamba": lambda: tiny_config("zamba"),
    "zamba2": lambda: tiny_config("zamba2"),
    "lfm3": lambda: tiny_config("lfm3"),
    "olmo_hybrid": lambda: tiny_config("olmo_hybrid"),
    "bailing_hybrid": lambda: tiny_config("bailing_hybrid"),
    "minimax": lambda: tiny_config("minimax"),
    "lara_mini": lambda: _with(tiny_config("lara_mini"), **FULL_ONLY),
    "mamba2": lambda: tiny_config("mamba2"),
    "mamba": lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3,
                                              expand=2, conv_kernel=4),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                                           num_hidden_layers=3, expand=2, conv_kernel=4),
    "rwkv": lambda: transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                            attention_hidden_size=32, intermediate_size=64),
}
PURE_RECURRENT = {"mamba", "falcon_mamba", "mamba2", "rwkv"}


def _with(config, **fields):
    values = {key: value for key, value in config.to_dict().items() if key != "hybrid_layer_ids"}  # derived
    return type(config)(**{**values, **fields})




def _measured(outputs) -> tuple[int, int, int, int]:
    """(KV bytes per token, needed state bytes, attention layers, recurrent layers) of the cache
    the probe forward returned."""
    if getattr(outputs, "state", None) is not None:  # RWKV: five [1, hidden, layers] tensors
        layers = outputs.state[0].shape[-1]
        return 0, sum(row_bytes(tensor) for tensor in outputs.state), 0, layers
    cache = outputs.past_key_values
    kv = state = attending = recurrent = 0
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.numel():  # MLA caches its latent and its rotary key apart
            assert keys.shape[-2] == values.shape[-2] == PROBE
            kv += (row_bytes(keys) + row_bytes(values)) // PROBE
            attending += 1
        states = [tensor for kind in ("conv_states", "recurrent_states")
                  for tensor in getattr(layer, kind, {}).values() if isinstance(tensor, torch.Tensor)]
        convolutions = [tensor for tensor in getattr(layer, "conv_states", {}).values() if isinstance(tensor, torch.Tensor)]
        lightning = getattr(cache, "linear_cache", [])
        if index < len(lightning) and isinstance(lightning[index], torch.Tensor):
            states.append(lightning[index])
        if states:
            state += sum(row_bytes(tensor) for tensor in states) - sum(row_bytes(tensor[..., 0]) for tensor in convolutions)
            recurrent += 1
    return kv, state, attending, recurrent


def _probe(config, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager", dtype=dtype).eval()
    with torch.no_grad():
        return _measured(model(input_ids=torch.arange(PROBE).unsqueeze(0) % VOCAB, use_cache=True))


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_profile_charges_what_the_model_caches(family):
    config = TINY[family]()
    kv, state, attending, recurrent = _probe(config)
    profile = profile_from_config(config_values(config))
    assert (profile.kv_bytes_per_token, profile.state_bytes) == (kv, state)
    assert (profile.attention_layers, profile.recurrent_layers) == (attending, recurrent)
    assert profile.pure_recurrent == (family in PURE_RECURRENT)
    assert profile.linear_flops_per_token > 0 and profile.recurrent_flops_per_token >= 0
    if profile.pure_recurrent:
        assert profile.attention_flops_coefficient == 0 and profile.state_tokens_equivalent == math.inf


def test_rwkv_keeps_its_wkv_state_in_float32_under_bfloat16():
    config = TINY["rwkv"]()
    _, state, _, _ = _probe(config, torch.bfloat16)
    assert profile_from_config(config_values(config, "bfloat16")).state_bytes == state == 3 * 32 * (2 * 2 + 3 * 4)


def test_zamba2_counts_the_kv_of_every_hybrid_layer_that_calls_a_shared_block():
    config = _with(tiny_config("zamba2"), num_mem_blocks=1, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"])
    kv, state, attending, _ = _probe(config)
    profile = profile_from_config(config_values(config))
    assert attending == 3 and profile.kv_bytes_per_token == kv == 3 * 2 * 4 * 16 * 4
    assert profile.state_bytes == state


def _legacy_kinds(values: dict) -> dict:
    """Zamba's checkpoints as saved before transformers 5: ``mamba`` for the Mamba layers."""
    kinds = ["mamba" if kind == "linear_attention" else kind for kind in values["layers_block_type"]]
    return {**values, "layers_block_type": kinds}


def _without(values: dict, *names: str) -> dict:
    return {key: value for key, value in values.items() if key not in names}


# family -> a published spelling of its tiny config, which must give the same profile
PUBLISHED = {
    "zamba": lambda v: _legacy_kinds(v),
    "zamba_layout": lambda v: _without(v, "layers_block_type"),  # the layout from attn_layer_period / offset
    "zamba_auto_rank": lambda v: {**v, "mamba_dt_rank": "auto"},  # tiny hidden 32: ceil(32 / 16) = 2
    "zamba2": lambda v: _legacy_kinds(v),
    "olmo_hybrid": lambda v: {**_without(v, "linear_num_value_heads"), "linear_key_head_dim": 8},
    "bailing_hybrid": lambda v: _without(v, "layer_types", "mlp_layer_types", "linear_head_dim",
                                         "linear_num_heads", "linear_conv_kernel_dim"),
    "minimax": lambda v: {**_without(v, "layer_types"), "attn_type_list": [0, 1, 0, 1]},
    "mamba": lambda v: {**v, "time_step_rank": "auto", "intermediate_size": 12345},  # derived, not read
    "rwkv": lambda v: {**v, "attention_hidden_size": None, "intermediate_size": None},
}


@pytest.mark.parametrize("spelling", sorted(PUBLISHED))
def test_the_published_spellings_give_the_same_profile(spelling):
    family = spelling.split("_layout")[0].split("_auto")[0]
    values = config_values(TINY[family]())
    if spelling == "rwkv":
        values = {**values, "intermediate_size": 4 * 32}
    if spelling == "zamba_layout":
        assert values["layers_block_type"] == ["linear_attention", "linear_attention", "hybrid", "linear_attention"]
    assert profile_from_config(PUBLISHED[spelling](dict(values))) == profile_from_config(values)


def test_olmo_hybrid_fills_in_its_linear_widths_as_transformers_does():
    linear = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "num_key_value_heads", "layer_types")
    config = transformers.OlmoHybridConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=5,
                                           num_attention_heads=4)
    values = config_values(config)
    assert (values["linear_key_head_dim"], values["linear_value_head_dim"]) == (12, 24)
    assert profile_from_config(_without(values, *linear)) == profile_from_config(values)


def test_bailing_reads_the_checkpoints_expert_names():
    values = config_values(TINY["bailing_hybrid"]())
    assert {"num_experts", "num_experts_per_token", "num_shared_experts"} <= set(values)
    renamed = {**_without(values, "num_experts", "num_experts_per_token", "num_shared_experts"),
               "num_local_experts": values["num_experts"], "num_experts_per_tok": values["num_experts_per_token"],
               "n_shared_experts": values["num_shared_experts"]}
    assert profile_from_config(renamed) == profile_from_config(values)


@pytest.mark.parametrize(("wrapper", "key", "family"), [
    ("lfm2_vl", "text_config", "lfm2"), ("lfm3_vl", "text_config", "lfm3"),
    ("nemotron_h_omni", "llm_config", "nemotron_h"), ("nemotron_h_omni", "text_config", "nemotron_h"),
])
def test_a_multimodal_checkpoint_is_profiled_by_its_language_model(wrapper, key, family):
    text = config_values(TINY[family]() if family in TINY else tiny_config(family))
    wrapped = {"model_type": wrapper, "dtype": "float32", "vision_config": {"model_type": "siglip2_vision_model"},
               key: {name: value for name, value in text.items() if name != "dtype"}}
    assert profile_from_config(wrapped, "m") == profile_from_config(text, "m")


@pytest.mark.parametrize(("family", "change", "named"), [
    ("lara_mini", None, "sliding window"),  # its released layout, windowed layers included
    ("lfm3", {"layer_types": ["conv", "full_attention", "sliding_attention", "full_attention"]}, "layers \\[2\\]"),
    ("lfm3", {"layer_types": None, "num_hidden_layers": 8}, "sliding window"),
    ("minimax", {"sliding_window": 64}, "sliding_window 64"),
    ("minimax", {"layer_types": None, "attn_type_list": [0, 1, 2, 1]}, "attn_type_list"),
    ("zamba", {"layers_block_type": ["mamba", "attention", "mamba", "hybrid"]}, "layers_block_type"),
    ("zamba", {"mamba_dt_rank": "big"}, "mamba_dt_rank"),
    ("zamba2", {"n_mamba_heads": 0}, "n_mamba_heads"),
    ("olmo_hybrid", {"linear_key_head_dim": -1}, "linear_key_head_dim"),
    ("bailing_hybrid", {"layer_types": None, "layer_group_size": 0}, "layer_group_size"),
    ("mamba2", {"num_heads": 3}, "num_heads \\* head_dim"),
    ("mamba", {"state_size": True}, "state_size"),
    ("rwkv", {"attention_hidden_size": "wide"}, "attention_hidden_size"),
])
def test_a_bad_field_or_a_windowed_attention_is_refused_by_name(family, change, named):
    values = config_values(tiny_config(family) if family == "lara_mini" else TINY[family]())
    for name, value in (change or {}).items():
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
    with pytest.raises(InvalidConfigError, match=named):
        profile_from_config(values)


@pytest.mark.parametrize(("config_class", "reason"), [("RecurrentGemmaConfig", "local window"),
                                                     ("xLSTMConfig", "not profiled: its mLSTM cells")])
def test_recurrent_families_not_profiled_are_refused_with_the_reason(config_class, reason):
    with pytest.raises(InvalidConfigError, match=reason):
        profile_from_config(config_values(getattr(transformers, config_class)()))


@pytest.mark.parametrize("kind", ["full_attention", "linear_attention"])
def test_a_hybrid_family_needs_both_kinds_of_layer(kind):
    """Only the pure recurrent families may lack attention: a hybrid's config without it is
    more likely a slip than a model."""
    values = config_values(tiny_config("olmo_hybrid"))
    values["layer_types"] = [kind] * 4
    with pytest.raises(InvalidConfigError, match="not a hybrid model"):
        profile_from_config(values)


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(sorted(TINY)), data=st.data())
def test_any_corrupted_field_gives_a_profile_or_an_invalid_config_error(family, data):
    values = config_values(TINY[family]())
    for _ in range(data.draw(st.integers(1, 3))):
        values[data.draw(st.sampled_from(sorted(values)))] = data.draw(JSON_VALUES)
    try:
        profile = profile_from_config(values)
    except InvalidConfigError:
        return
    assert profile.state_bytes >= 1 and (profile.kv_bytes_per_token == 0) == profile.pure_recurrent


@pytest.mark.parametrize(("family", "fields"), [
    ("zamba2", {"num_attention_heads": 8, "num_key_value_heads": 2, "attention_head_dim": 16}),  # read, not derived
    ("bailing_hybrid", {"short_conv_kernel_size": 3, "linear_conv_kernel_dim": 4}),  # the model reads the second
    ("bailing_hybrid", {"kv_lora_rank": 32}),  # a latent wider than the rotary key
    ("lara_mini", {"head_dim": None}),  # transformers' 128, not hidden / heads
])
def test_fields_the_model_reads_over_their_defaults_are_charged(family, fields):
    config = TINY[family]()
    values = {**config_values(config), **fields}
    if fields.get("head_dim", 0) is None:
        del values["head_dim"]
    built = type(config)(**{key: value for key, value in values.items() if key not in ("dtype", "hybrid_layer_ids")
                            and value is not None})
    kv, state, _, _ = _probe(built)
    profile = profile_from_config(values)
    assert (profile.kv_bytes_per_token, profile.state_bytes) == (kv, state)
