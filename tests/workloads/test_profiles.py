import json

import pytest

from hybridcache.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError
from hybridcache.profiles import BUILTIN_CONFIGS, PROFILE_NAMES, load_profile, parse_size, profile_from_config


def test_marconi_7b_has_the_issue_figures():
    profile = load_profile("marconi-7b")
    assert profile.kv_bytes_per_token == 4 * 2 * 4096 * 2 == 65_536
    assert profile.state_bytes == 24 * (4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 4 * 2) == 26_787_840
    assert round(profile.state_tokens_equivalent) == 409
    assert (profile.attention_layers, profile.recurrent_layers) == (4, 24)


def test_prefill_flops_are_additive_and_quadratic_in_attention():
    profile = load_profile("qwen3-next-80b-a3b")
    assert profile.prefill_flops(0, 700) + profile.prefill_flops(700, 1000) == pytest.approx(profile.prefill_flops(0, 1000))
    per_token = profile.linear_flops_per_token + profile.recurrent_flops_per_token
    assert profile.prefill_flops(0, 10) == pytest.approx(10 * per_token + profile.attention_flops_coefficient * 55)
    assert profile.prefill_flops(5, 5) == 0
    with pytest.raises(InvalidArgumentError):
        profile.prefill_flops(5, 4)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_every_builtin_profile_is_plausible(name):
    profile = load_profile(name)
    assert profile.kv_bytes_per_token > 0 and profile.state_bytes > 1e6
    assert 1e9 < profile.linear_flops_per_token < 1e11  # 0.5B .. 50B active weights


def test_qwen3_next_bytes():
    profile = load_profile("qwen3-next-80b-a3b")
    assert profile.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert profile.state_bytes == 36 * (32 * 128 * 128 * 2 + conv_dim * 3 * 2)


# Fields where the built-in config departs from the transformers default (each one commented
# in profiles.py), or that the transformers class spells differently.
OVERRIDDEN = {
    "qwen3-next-80b-a3b": {"intermediate_size", "max_position_embeddings", "dtype"},
    "granite-4.0-h-small": {"num_hidden_layers", "layer_types", "num_key_value_heads", "mamba_d_state",
                            "num_local_experts", "num_experts_per_tok", "intermediate_size",
                            "shared_intermediate_size", "vocab_size", "max_position_embeddings", "dtype"},
    "nemotron-h-8b": {"hybrid_override_pattern", "max_position_embeddings", "dtype"},
    "falcon-h1-7b": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "mamba_n_heads", "mamba_d_head", "mamba_d_ssm", "intermediate_size", "vocab_size",
                     "max_position_embeddings", "dtype"},
    "jamba-1.5-mini": {"dtype"},
}


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_builtin_configs_match_transformers_defaults_except_documented_overrides(name):
    transformers = pytest.importorskip("transformers")
    config = BUILTIN_CONFIGS[name]
    defaults = transformers.AutoConfig.for_model(config["model_type"]).to_dict()
    if name == "granite-4.0-h-small":  # transformers spells the layer kinds differently
        assert defaults["layer_types"][0] == "linear_attention"
    for field, value in config.items():
        if field in OVERRIDDEN[name] or field == "model_type":
            continue
        assert field in defaults, f"{name}: {field} is not a transformers config field"
        assert defaults[field] == value, f"{name}: {field} = {value!r}, transformers default {defaults[field]!r}"


def test_granite_layer_layout():
    layers = BUILTIN_CONFIGS["granite-4.0-h-small"]["layer_types"]
    assert len(layers) == 40 and [i for i, kind in enumerate(layers) if kind == "attention"] == [5, 15, 25, 35]
    assert load_profile("granite-4.0-h-small").attention_layers == 4


def test_nemotron_pattern_counts():
    profile = load_profile("nemotron-h-8b")
    assert (profile.attention_layers, profile.recurrent_layers) == (4, 24)


def test_profile_from_a_config_json_path(tmp_path):
    path = tmp_path / "jamba" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(BUILTIN_CONFIGS["jamba-1.5-mini"])))
    from_path = load_profile(str(path))
    assert from_path.name == "jamba"
    assert from_path.state_bytes == load_profile("jamba-1.5-mini").state_bytes


def test_bad_profiles(tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown model profile"):
        load_profile("gpt-5")
    with pytest.raises(InvalidConfigError, match="unsupported model_type"):
        profile_from_config({"model_type": "llama"})
    with pytest.raises(InvalidConfigError, match="lacks"):
        profile_from_config({"model_type": "jamba", "hidden_size": 8})
    with pytest.raises(InvalidConfigError, match="dtype"):
        profile_from_config(dict(BUILTIN_CONFIGS["jamba-1.5-mini"], dtype="int3"))
    broken = tmp_path / "config.json"
    broken.write_text("{")
    with pytest.raises(InvalidConfigError, match="cannot read"):
        load_profile(str(broken))


@pytest.mark.parametrize("dtype", [False, 0, [], {}, ""])
@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
def test_a_dtype_is_one_of_the_known_names(field, dtype):
    with pytest.raises(InvalidConfigError, match=rf"unsupported dtype .* \({field}\)"):
        profile_from_config({**BUILTIN_CONFIGS["jamba-1.5-mini"], "dtype": None, field: dtype})


@pytest.mark.parametrize("name", [None, 5, b"marconi-7b", ["marconi-7b"]])
def test_a_profile_is_named_by_a_str_or_a_path(name):
    with pytest.raises(InvalidTypeError, match="a model profile is named by a str or a Path"):
        load_profile(name)


def test_a_config_mapping_is_copied_before_it_is_read():
    class Hostile(dict):
        def get(self, key, default=None):
            raise KeyError(key)

    config = Hostile(BUILTIN_CONFIGS["marconi-7b"])
    assert profile_from_config(config, "marconi-7b") == load_profile("marconi-7b")


@pytest.mark.parametrize("text, value", [
    ("400GB", 400 * 10**9), ("512MiB", 512 * 2**20), ("1.5T", 1_500_000_000_000), ("4096", 4096),
    ("2KiB", 2048), ("10 gb", 10**10), ("3k", 3000), ("7B", 7),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "12XB", "0.1", "1e9", "400 G B", "\u0661\u0662\u0663GB", "12\u2003GB"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgumentError):
        parse_size(text)



@pytest.mark.parametrize("delta", [-1, 1, -30])
@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "granite-4.0-h-small"])
def test_layer_kinds_that_disagree_with_num_hidden_layers_are_refused(name, delta):
    config = dict(BUILTIN_CONFIGS[name])
    config["num_hidden_layers"] = len(config["layer_types"]) + delta
    with pytest.raises(InvalidConfigError, match="lists .* layer kinds but num_hidden_layers is"):
        profile_from_config(config)


def test_a_nemotron_pattern_shorter_than_its_layers_is_refused():
    config = dict(BUILTIN_CONFIGS["nemotron-h-8b"])
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    profile_from_config(config)  # agreeing counts are read
    config["hybrid_override_pattern"] = config["hybrid_override_pattern"][:-1]
    with pytest.raises(InvalidConfigError, match="lists 51 layer kinds but num_hidden_layers is 52"):
        profile_from_config(config)
