"""The hybrid families transformers 5.24 added: GLM-5-Next and Qwen4-Exp (indexed attention:
an indexer key per token beside the attention's KV; linear attention, whose state transformers
keeps in float32 and the profile in ``mamba_ssm_cache_dtype``, so bfloat16 runs name float32),
Inkling-2, Inkling-2 looped and ZAYA (every layer attention with short convolutions around it).
Each is built in transformers from a tiny config, in float32 and in bfloat16, and the KV bytes
per token and the checkpoint bytes the profile charges are what the model's own cache holds after
a probe forward: every key, value and indexer tensor per token; every recurrent state; every
convolution window less the one column the next token does not need, except where the model
keeps exactly the columns it needs (Qwen4-Exp's dilated PLE window and n-gram token ids, ZAYA's
query-key window). Then the transformers default configs are profiled by hand, a multimodal
wrapper by its language model, and bad fields and windowed layers are refused by name."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridcache.errors import InvalidConfigError  # noqa: E402
from hybridcache.profiles import profile_from_config  # noqa: E402
from tests.workloads.model_caches import config_values, row_bytes  # noqa: E402
from tests.workloads.test_profiles_against_models import JSON_VALUES  # noqa: E402

PROBE = 3
VOCAB = 96
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1}
_INKLING = {**_SMALL, "num_key_value_heads": 1, "unpadded_vocab_size": VOCAB, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "conv_kernel_size": 3, "d_rel": 8,
            "rel_extent": 16, "n_layers_per_attn_res_block": 2, "sliding_window_size": 16,
            "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1, "swa_head_dim": 16,
            "layer_types": ["hybrid"] * 4}

# family -> (config class, tiny fields, conv_states indices the model keeps whole)
TINY = {
    "glm5_next_text": ("Glm5NextTextConfig", {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "pad_token_id": 0, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "index_topk": 16, "index_kpool": 4, "index_head_dim": 8,
        "index_n_heads": 2, "linear_head_dim": 8, "linear_num_heads": 4, "hc_mult": 2,
        "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "indexer_types": ["full", "full", "shared", "full"],  # layer 2 reuses layer 1's top-k: no indexer key
    }, ()),
    "qwen4_exp_text": ("Qwen4ExpTextConfig", {
        **_SMALL, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "hc_count": 2, "hc_lowrank": 8,
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4, "ple_layer_ids": [1], "ple_embed_dim": 32, "heads_per_ngram": 2,
        "ngram_vocab_size_base": 50, "eos_token_id": 2, "split_ngram_parts": 1,
        "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    }, (1, 2)),
    "inkling2_text": ("Inkling2TextConfig", _INKLING, ()),
    "inkling2_loop_text": ("Inkling2LoopTextConfig", {
        **_INKLING, "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 3, "loop_gate_rank": 8,
    }, ()),
    "zaya": ("ZayaConfig", {
        **_SMALL, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 16, "router_hidden_size": 16,
        "cca_time0": 2, "cca_time1": 3,
    }, (0,)),
}


FLOAT32_STATES = {"glm5_next_text", "qwen4_exp_text"}  # the linear-attention states transformers keeps in float32


def _tiny(family: str, **fields):
    class_name, values, _ = TINY[family]
    return getattr(transformers, class_name)(**{**values, **fields})




def _measured(cache, whole_windows: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(KV bytes per token, needed state bytes, attention layers, recurrent layers) of a cache."""
    kv = state = attending = recurrent = 0
    for layer in cache.layers:
        per_token = [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
        per_token = [tensor for tensor in per_token if isinstance(tensor, torch.Tensor)]
        if per_token:
            assert all(tensor.shape[-2 if tensor.dim() == 4 else 1] == PROBE for tensor in per_token)
            kv += sum(row_bytes(tensor) for tensor in per_token) // PROBE
            attending += 1
        windows = {index: tensor for index, tensor in getattr(layer, "conv_states", {}).items() if tensor is not None}
        states = [tensor for tensor in getattr(layer, "recurrent_states", {}).values() if tensor is not None]
        if windows or states:
            state += sum(row_bytes(tensor) for tensor in states)
            state += sum(row_bytes(tensor) - (0 if index in whole_windows else row_bytes(tensor[..., 0]))
                         for index, tensor in windows.items())
            recurrent += 1
    return kv, state, attending, recurrent


def _model(config, dtype):
    if config.model_type == "glm5_next_text":  # transformers pairs this text config with no causal-LM head
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
        return Glm5NextTextModel._from_config(config, experts_implementation="eager", dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager", dtype=dtype).eval()


def _probe(config, dtype):
    with torch.no_grad():
        outputs = _model(config, dtype)(input_ids=torch.arange(PROBE).unsqueeze(0) + 3, use_cache=True)
    return outputs.past_key_values if outputs.past_key_values is not None else outputs.cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_a_profile_charges_what_the_model_caches(family, dtype):
    config = _tiny(family)
    cache = _probe(config, getattr(torch, dtype))
    kv, state, attending, recurrent = _measured(cache, TINY[family][2])
    values = config_values(config, dtype)
    if family in FLOAT32_STATES:
        values["mamba_ssm_cache_dtype"] = "float32"
    profile = profile_from_config(values)
    assert (profile.kv_bytes_per_token, profile.state_bytes) == (kv, state)
    assert (profile.attention_layers, profile.recurrent_layers) == (attending, recurrent)
    assert profile.linear_flops_per_token > 0 and profile.attention_flops_coefficient > 0


def test_the_tiny_bytes_by_hand():
    """The float32 figures above, written out (b = 4)."""
    expected = {
        # two MLA layers' latent (16 + 0 rotary); one indexer key + gate score + validity (2 * 8 + 1);
        # two KDA layers: 4 heads of 8 x 8, and 3 * 32 channels x 3 columns
        "glm5_next_text": ((2 * 16 + 17) * 4, 2 * (4 * 8 * 8 * 4 + 3 * 32 * 3 * 4)),
        # two gated attention layers (2 KV heads of 16) and their indexer keys (16); two Gated DeltaNet
        # layers (4 x 8 x 8, 64 channels x 3 columns), one with PLE (64 channels x 3 * 3, two int64 ids)
        "qwen4_exp_text": (2 * (2 * 2 * 16 + 16) * 4, 2 * (4 * 8 * 8 * 4 + 64 * 3 * 4) + 64 * 9 * 4 + 2 * 8),
        # four layers of one KV head of 16; four float32 windows of 2 columns: key, value, 2 x hidden
        "inkling2_text": (4 * 2 * 16 * 4, 4 * 2 * (16 + 32) * 2 * 4),
        "inkling2_loop_text": (8 * 2 * 16 * 4, 8 * 2 * (16 + 32) * 2 * 4),  # layers 2, 3 cached in 3 passes
        # four layers of 2 KV heads of 16; (4 + 2) * 16 channels x (2 + 3 - 2) columns, half the value width
        "zaya": (4 * 2 * 2 * 16 * 4, 4 * (96 * 3 + 16) * 4),
    }
    for family, (kv, state) in expected.items():
        profile = profile_from_config(config_values(_tiny(family)))
        assert (profile.kv_bytes_per_token, profile.state_bytes) == (kv, state), family


def test_qwen4_stores_the_prompts_own_positions_beside_its_indexer():
    """Not charged: the rotary positions kept on the first indexed layer are 0, 1, 2, ... of the
    prompt, which a prefix cache rebuilds from the prompt as it does the token ids."""
    cache = _probe(_tiny("qwen4_exp_text"), torch.float32)
    positions = cache.layers[1].indexer_position_ids
    assert positions.dtype == torch.int64 and torch.equal(positions, torch.arange(PROBE).expand(3, 1, PROBE))
    assert all(getattr(layer, "indexer_position_ids", None) is None for layer in cache.layers[2:])


# transformers leaves Qwen4-Exp's indexer unset; these fields build one (its key at least the rotary width)
_QSA = {"indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 2048,
        "indexer_compress_ratio": 16}


@pytest.mark.parametrize(("config_class", "fields", "expected"), [
    # 45 layers, MLA at every fourth (11), all indexers run; latent 512 + 0 rotary, indexer 2 * 128 + 1, bf16;
    # 34 KDA layers of 64 heads of 128 and 3 * 64 * 128 channels x 3 columns
    ("Glm5NextTextConfig", {}, (11 * (512 + 257) * 2, 34 * (64 * 128 * 128 * 2 + 3 * 64 * 128 * 3 * 2), 11, 34)),
    # 40 layers, attention at every fourth (10): 2 KV heads of 256 and a 256 indexer key; 30 Gated DeltaNet
    # layers: 32 x 128 x 128, 8,192 channels x 3; PLE at layers 1, 2: 4 x 2,048 channels x 3 * 3, 2 int64 ids
    ("Qwen4ExpTextConfig", {**_QSA, "ple_layer_ids": [1, 2], "eos_token_id": 1},
     (10 * (2 * 2 * 256 + 256) * 2, 30 * (32 * 128 * 128 * 2 + 8192 * 3 * 2) + 2 * (8192 * 9 * 2 + 2 * 8), 10, 30)),
    # 48 full layers of 8 KV heads of 128; float32 windows of 3 columns: key, value, 2 x 4,608
    ("Inkling2TextConfig", {"layer_types": ["hybrid"] * 48},
     (48 * 2 * 8 * 128 * 2, 48 * 2 * (1024 + 4608) * 3 * 4, 48, 48)),
    # 24 layers, 6..17 run 3 times: 48 cache layers; hidden 2,304
    ("Inkling2LoopTextConfig", {"layer_types": ["hybrid"] * 24},
     (48 * 2 * 8 * 128 * 2, 48 * 2 * (1024 + 2304) * 3 * 4, 48, 48)),
    # 40 layers of 2 KV heads of 128; (8 + 2) * 128 channels x 2 columns and 128 delayed values, bf16
    ("ZayaConfig", {}, (40 * 2 * 2 * 128 * 2, 40 * (1280 * 2 + 128) * 2, 40, 40)),
])
def test_the_default_configs_by_hand(config_class, fields, expected):
    values = config_values(getattr(transformers, config_class)(**fields), "bfloat16")
    profile = profile_from_config(values)
    assert (profile.kv_bytes_per_token, profile.state_bytes, profile.attention_layers, profile.recurrent_layers) == expected


@pytest.mark.parametrize(("wrapper", "family"), [
    ("Glm5NextConfig", "glm5_next_text"), ("Qwen4ExpConfig", "qwen4_exp_text"),
    ("Inkling2Config", "inkling2_text"), ("Inkling2LoopConfig", "inkling2_loop_text"),
])
def test_a_multimodal_checkpoint_is_profiled_by_its_language_model(wrapper, family):
    text = {name: value for name, value in config_values(_tiny(family)).items() if name != "dtype"}
    vision = {"vision_config": {"text_hidden_size": text["hidden_size"]}} if "Inkling" in wrapper else {}
    outer = getattr(transformers, wrapper)(text_config=text, **vision).to_dict()
    outer.pop("torch_dtype", None)
    assert outer["text_config"]["model_type"] == family and outer["text_config"]["dtype"] is None
    wrapped = {**outer, "dtype": "float32"}  # the text config's null dtype names none: the outer one holds
    assert profile_from_config(wrapped, "m") == profile_from_config({**text, "dtype": "float32"}, "m")


def test_a_text_only_glm5_next_checkpoint_keeps_its_fields_at_the_top_level():
    flat = {**config_values(_tiny("glm5_next_text")), "model_type": "glm5_next"}
    assert profile_from_config(flat, "g") == profile_from_config(config_values(_tiny("glm5_next_text")), "g")


@pytest.mark.parametrize(("family", "change", "named"), [
    ("glm5_next_text", {"indexer_types": ["full", "shared", "full", "full"]}, "shares the indexer top-k of layer 0"),
    ("glm5_next_text", {"indexer_types": None, "index_topk_pattern": "FFXF"}, "index_topk_pattern"),
    ("glm5_next_text", {"index_kpool": 0}, "index_kpool"),
    ("glm5_next_text", {"qk_rope_head_dim": -1}, "qk_rope_head_dim"),
    ("glm5_next_text", {"hc_mult": "4"}, "hc_mult"),
    ("glm5_next_text", {"n_routed_experts": 1}, "routes to 2 of only 1"),
    ("qwen4_exp_text", {"indexer_head_dim": None}, "leaves the QSA indexer unset \\(indexer_head_dim\\)"),
    ("qwen4_exp_text", {"indexer_kv_heads": 2}, "indexer_kv_heads"),
    ("qwen4_exp_text", {"indexer_budget": 10}, "indexer_budget 10 is not a multiple"),
    ("qwen4_exp_text", {"ple_layer_ids": [2]}, "linear_attention layers only"),
    ("qwen4_exp_text", {"ple_layer_ids": [0]}, "ple_layer_ids"),
    ("qwen4_exp_text", {"ple_embed_dim": 30}, "ple_embed_dim 30"),
    ("qwen4_exp_text", {"ngram_size": 1}, "ngram_size"),
    ("inkling2_text", {"conv_kernel_size": 0}, "conv_kernel_size"),
    ("inkling2_text", {"layer_types": ["hybrid", "sliding"]}, "layer_types"),
    ("inkling2_loop_text", {"loop_layer_index_start": 4, "loop_layer_index_end": 2}, "must be below"),
    ("inkling2_loop_text", {"loop_num_passes": 0}, "loop_num_passes"),
    ("zaya", {"cca_time1": 0}, "cca_time1"),
    ("zaya", {"num_experts_per_tok": 8}, "routes to 8 of only 4"),
    ("zaya", {"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_a_bad_field_is_refused_by_name(family, change, named):
    values = config_values(_tiny(family))
    for name, value in change.items():
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
    with pytest.raises(InvalidConfigError, match=named):
        profile_from_config(values)


@pytest.mark.parametrize(("config", "named"), [
    (lambda: transformers.Inkling2TextConfig(), "layers \\[0, 1, 2, 3, 4, 6, .* \\(sliding_window_size 1024\\)"),
    (lambda: transformers.Inkling2LoopTextConfig(), "sliding_window_size 1024"),
    (lambda: _tiny("inkling2_text", layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]),
     "layers \\[0, 2\\] attend over a sliding window"),
    (lambda: _tiny("zaya", layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid"], sliding_window=8),
     "layers \\[1\\] attend over a sliding window \\(sliding_window 8\\)"),
    (lambda: transformers.Qwen4ExpTextConfig(), "leaves the QSA indexer unset"),
])
def test_windowed_layers_and_unbuildable_defaults_are_refused_with_the_reason(config, named):
    with pytest.raises(InvalidConfigError, match=named):
        profile_from_config(config_values(config(), "bfloat16"))


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(sorted(TINY)), data=st.data())
def test_any_corrupted_field_gives_a_profile_or_an_invalid_config_error(family, data):
    values = config_values(_tiny(family))
    for _ in range(data.draw(st.integers(1, 3))):
        values[data.draw(st.sampled_from(sorted(values)))] = data.draw(JSON_VALUES)
    try:
        profile = profile_from_config(values)
    except InvalidConfigError:
        return
    assert profile.kv_bytes_per_token >= 1 and profile.state_bytes >= 1
