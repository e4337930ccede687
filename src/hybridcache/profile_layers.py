"""The pieces a model profile is summed from: a config's fields as the formulas read them
(``Fields``: every count checked, every layer list of known kinds), the running totals
(``Totals``) and one formula per kind of layer (attention, latent attention, Mamba1 and Mamba2,
Gated DeltaNet, Kimi Delta Attention, LFM2's short convolution, MLP and experts). The formulas
are written out in ``profiles``' docstring; the architectures that combine them are
``profile_architectures``.

Owns nothing between calls: a ``Totals`` is filled by one architecture for one config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hybridcache.errors import InvalidConfigError

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass
class Totals:
    kv_bytes: int = 0
    state_bytes: int = 0
    linear_params: int = 0
    conv_flops: int = 0
    recurrent_flops: int = 0
    attention_coefficient: int = 0
    attention_layers: int = 0
    recurrent_layers: int = 0


# --- config fields ----------------------------------------------------------------------------

MAX_DIMENSION = 2**24  # widths, heads, states, experts: far above any published model
MAX_LAYERS = 4096


class Fields:
    """A model config whose fields are checked as the formulas read them: every count or width
    is an int (not a bool) in ``[minimum, 2**24]``, every layer list a list of known kinds. A
    bad field raises ``InvalidConfigError`` naming it."""

    def __init__(self, config: dict, model_type: str) -> None:
        self.config, self.model_type = config, model_type

    def int(self, name: str, minimum: int = 1, maximum: int = MAX_DIMENSION) -> int:
        if name not in self.config:
            raise InvalidConfigError(f"{self.model_type} config lacks {name!r}")
        return self._checked(name, self.config[name], minimum, maximum)

    def optional_int(self, name: str) -> int | None:
        value = self.config.get(name)
        return None if value is None else self._checked(name, value, 1, MAX_DIMENSION)

    def _checked(self, name: str, value: object, minimum: int, maximum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} must be an int in [{minimum}, {maximum:,}], got {value!r}"
            )
        return value

    def kinds(self, name: str, allowed: Mapping[str, str], letters: bool = False) -> list[str]:
        """The layer kinds listed in ``name`` (a list, or with ``letters`` a string of one-letter
        kinds), each mapped through ``allowed``."""
        if name not in self.config:
            raise InvalidConfigError(f"{self.model_type} config lacks {name!r}")
        listed = self.config[name]
        if not isinstance(listed, (list, str) if letters else list) or not 1 <= len(listed) <= MAX_LAYERS:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} must list 1 to {MAX_LAYERS} layer kinds, got {shown(listed)}"
            )
        unknown = [kind for kind in listed if not isinstance(kind, str) or kind not in allowed]
        if unknown:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} holds unknown layer kinds {shown(unknown[:3])}; known: {', '.join(allowed)}"
            )
        self._check_layer_count(name, len(listed))
        return [allowed[kind] for kind in listed]

    def _check_layer_count(self, name: str, listed: int) -> None:
        """A layer list must name every layer: transformers builds ``num_hidden_layers`` of them,
        so a shorter or longer list would size some other model."""
        if "num_hidden_layers" not in self.config:
            return
        layers = self.int("num_hidden_layers", 1, MAX_LAYERS)
        if layers != listed:
            raise InvalidConfigError(
                f"{self.model_type} config: {name} lists {listed} layer kinds but num_hidden_layers is {layers}"
            )

    def dtype_bytes(self, name: str, default: str | None) -> int:
        """Bytes of the dtype ``name`` names (``default`` when it is absent or null); anything
        but a known dtype string (False, 0, [] included) is refused."""
        dtype = self.config.get(name)
        dtype = default if dtype is None else dtype
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise InvalidConfigError(f"unsupported dtype {shown(dtype)} ({name})")
        return DTYPE_BYTES[dtype]

    def with_field(self, name: str, value: object) -> "Fields":
        return Fields({**self.config, name: value}, self.model_type)


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- layer formulas ------------------------------------------------------------------------


def attention(totals: Totals, cfg: Fields, q_gate: bool = False, width: int | None = None,
              head_dim: int | None = None) -> None:
    """Softmax attention over the whole prefix. ``width``: the projections' input when it is not
    the hidden size (Zamba's shared block reads the hidden state and the embeddings together);
    ``head_dim`` when the config's own field is not the one the model uses."""
    hidden, heads, kv_heads = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_key_value_heads")
    head_dim = head_dim or cfg.optional_int("head_dim") or hidden // heads
    if head_dim < 1:
        raise InvalidConfigError(f"{cfg.model_type} config: hidden_size {hidden} < num_attention_heads {heads}")
    totals.kv_bytes += 2 * kv_heads * head_dim * cache_bytes(cfg)
    q_out = heads * head_dim * (2 if q_gate else 1)  # Qwen3-Next's gated attention doubles q_proj
    totals.linear_params += (width or hidden) * (q_out + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    totals.attention_coefficient += 4 * heads * head_dim
    totals.attention_layers += 1


def mamba2(totals: Totals, cfg: Fields, geometry: tuple[int, int, int, int, int]) -> None:
    heads, head_dim, d_state, groups, d_conv = geometry
    hidden, d_inner = cfg.int("hidden_size"), heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    totals.state_bytes += heads * head_dim * d_state * ssm_bytes(cfg) + conv_dim * (d_conv - 1) * cache_bytes(cfg)
    totals.linear_params += hidden * (2 * d_inner + 2 * groups * d_state + heads) + d_inner * hidden
    totals.conv_flops += 2 * conv_dim * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def mamba1(totals: Totals, cfg: Fields, geometry: tuple[int, int, int, int]) -> None:
    d_inner, d_state, d_conv, dt_rank = geometry
    hidden = cfg.int("hidden_size")
    totals.state_bytes += d_inner * d_state * ssm_bytes(cfg) + d_inner * (d_conv - 1) * cache_bytes(cfg)
    totals.linear_params += hidden * 2 * d_inner + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner + d_inner * hidden
    totals.conv_flops += 2 * d_inner * d_conv
    totals.recurrent_flops += 5 * d_inner * d_state
    totals.recurrent_layers += 1


def mamba1_geometry(cfg: Fields, names: tuple[str, str, str, str, str]) -> tuple[int, int, int, int]:
    """(d_inner, d_state, d_conv, dt_rank) from the fields ``names`` (hidden size, expand,
    d_state, d_conv, dt rank); a dt rank of ``"auto"`` or absent is ceil(hidden / 16), as
    transformers fills it in."""
    hidden_name, expand, d_state, d_conv, dt_rank = names
    hidden = cfg.int(hidden_name)
    rank = cfg.config.get(dt_rank, "auto")
    rank = -(-hidden // 16) if rank in ("auto", None) else cfg.int(dt_rank)
    return cfg.int(expand) * hidden, cfg.int(d_state), cfg.int(d_conv), rank


def gated_delta(totals: Totals, cfg: Fields) -> None:
    hidden, kernel = cfg.int("hidden_size"), cfg.int("linear_conv_kernel_dim")
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_dim, v_dim = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    totals.state_bytes += v_heads * k_dim * v_dim * ssm_bytes(cfg) + conv_dim * (kernel - 1) * cache_bytes(cfg)
    totals.linear_params += hidden * (conv_dim + v_heads * v_dim + 2 * v_heads) + v_heads * v_dim * hidden
    totals.conv_flops += 2 * conv_dim * kernel
    totals.recurrent_flops += 7 * v_heads * k_dim * v_dim
    totals.recurrent_layers += 1


def mlp(totals: Totals, hidden: int, intermediate: int, gated: bool = True) -> None:
    totals.linear_params += (3 if gated else 2) * hidden * intermediate


def moe(totals: Totals, hidden: int, experts: tuple[int, int, int], shared: int) -> None:
    count, top_k, intermediate = experts
    if top_k > count:
        raise InvalidConfigError(f"a MoE layer routes to {top_k} of only {count} experts")
    totals.linear_params += hidden * count + top_k * 3 * hidden * intermediate + 3 * hidden * shared


def cache_bytes(cfg: Fields) -> int:
    """``dtype``, or ``torch_dtype`` (its older name) where it is absent, or bfloat16."""
    if cfg.config.get("dtype") is None:
        return cfg.dtype_bytes("torch_dtype", "bfloat16")
    return cfg.dtype_bytes("dtype", None)


def ssm_bytes(cfg: Fields) -> int:
    return cache_bytes(cfg) if cfg.config.get("mamba_ssm_cache_dtype") is None else cfg.dtype_bytes("mamba_ssm_cache_dtype", None)


def layers_at(cfg: Fields, name: str, indices: object, base: int = 0) -> set[int]:
    """The 0-based layers a config lists by index (``base``: the first index it uses)."""
    layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices) \
            or not all(base <= i < layers + base for i in indices):
        raise InvalidConfigError(
            f"{cfg.model_type} config: {name} must list layer indices in [{base}, {layers + base}), got {shown(indices)}"
        )
    return {i - base for i in indices}

def short_conv(totals: Totals, cfg: Fields) -> None:
    """LFM2's gated short convolution: in projection to B, C, x; a depthwise causal
    convolution of ``conv_L_cache`` taps; out projection. Its state is the window alone."""
    hidden, kernel = cfg.int("hidden_size"), cfg.int("conv_L_cache")
    totals.state_bytes += hidden * (kernel - 1) * cache_bytes(cfg)
    totals.linear_params += 3 * hidden * hidden + hidden * hidden
    totals.conv_flops += 2 * hidden * kernel + 2 * hidden  # the taps, and the two gates
    totals.recurrent_layers += 1

def first_int(cfg: Fields, names: tuple[str, ...], minimum: int = 1, default: int | None = None) -> int:
    """The first of ``names`` the config holds (published checkpoints and transformers name
    some fields differently); ``default`` when it holds none, if one is given."""
    for name in names:
        if name in cfg.config:
            return cfg.int(name, minimum)
    if default is not None:
        return default
    raise InvalidConfigError(f"{cfg.model_type} config lacks {' or '.join(repr(name) for name in names)}")


def defaulted(cfg: Fields, name: str, default: int, minimum: int = 1) -> int:
    """``name``, or ``default`` where the config leaves it out or null (transformers fills in
    the same)."""
    return default if cfg.config.get(name) is None else cfg.int(name, minimum)


def latent_attention(totals: Totals, cfg: Fields) -> None:
    """Multi-head latent attention (Kimi-Linear, DeepSeek-V3): a serving engine caches the
    compressed latent and the rotary key per token, ``kv_lora_rank + qk_rope_head_dim``."""
    hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
    rank, nope, value = (cfg.int(name) for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))
    rope = cfg.int("qk_rope_head_dim", 0)  # 0: GLM-5-Next's NoPE attention
    q_rank = cfg.optional_int("q_lora_rank")
    query = heads * (nope + rope)
    totals.kv_bytes += (rank + rope) * cache_bytes(cfg)
    totals.linear_params += (hidden * query if q_rank is None else hidden * q_rank + q_rank * query)
    totals.linear_params += hidden * (rank + rope) + rank * heads * (nope + value) + heads * value * hidden
    totals.attention_coefficient += 2 * heads * (nope + rope) + 2 * heads * value
    totals.attention_layers += 1

def delta_attention(totals: Totals, cfg: Fields, heads: int, dim: int, kernel: int, full_rank_gates: bool = False) -> None:
    """Kimi Delta Attention: q, k, v with short convolutions, forget and output gates (low-rank
    in Kimi-Linear, full-rank in Bailing-Hybrid), a per-head ``dim x dim`` state."""
    hidden, width = cfg.int("hidden_size"), heads * dim
    gates = 2 * hidden * width if full_rank_gates else 2 * (hidden * dim + dim * width)
    totals.state_bytes += heads * dim * dim * ssm_bytes(cfg) + 3 * width * (kernel - 1) * cache_bytes(cfg)
    totals.linear_params += 3 * hidden * width + gates + hidden * heads + width * hidden
    totals.conv_flops += 2 * 3 * width * kernel
    totals.recurrent_flops += 7 * heads * dim * dim
    totals.recurrent_layers += 1

def lightning_attention(totals: Totals, cfg: Fields, heads: int, head_dim: int) -> None:
    """MiniMax's lightning (linear) attention: fused q, k, v, an output gate, and a decayed
    ``head_dim x head_dim`` key-value state per head; no convolution."""
    hidden, width = cfg.int("hidden_size"), heads * head_dim
    totals.state_bytes += heads * head_dim * head_dim * ssm_bytes(cfg)
    totals.linear_params += 3 * hidden * width + 2 * width * hidden  # qkv, output gate, out projection
    totals.recurrent_flops += 6 * heads * head_dim * head_dim  # decay, k v^T update, q readout
    totals.recurrent_layers += 1


def rejected_windowed(cfg: Fields, kinds: list[str], window_field: str = "sliding_window") -> None:
    """Refuse layers that attend over a window: their cache drops the keys that slid out, so
    an exact prefix cache cannot hold or restore them as it does whole-prefix KV."""
    windowed = [layer for layer, kind in enumerate(kinds) if kind == "windowed"]
    if windowed:
        raise InvalidConfigError(
            f"{cfg.model_type} config: layers {shown(windowed)} attend over a sliding window "
            f"({window_field} {shown(cfg.config.get(window_field))}), not the whole prefix; a windowed "
            "attention cache is not profiled (its keys slide out, so a prefix's KV cannot be kept exactly)"
        )


def mamba2_geometry(cfg: Fields) -> tuple[int, int, int, int, int]:
    """(heads, head dim, d_state, groups, d_conv) under the granite / falcon field names."""
    names = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")
    return tuple(cfg.int(name) for name in names)


def delta_hybrid_layers(totals: Totals, cfg: Fields, kinds: list[str], delta: tuple[int, int, int],
                        dense_first: int, shared_default: int, bailing: bool = False) -> Totals:
    """Kimi-Linear's, Bailing-Hybrid's and GLM-5-Next's stack: MLA at ``"attention"`` layers (Bailing's with a
    per-head output gate), Kimi Delta Attention of ``delta`` (heads, head dim, kernel; Bailing's
    gates full-rank) elsewhere; a dense MLP where ``mlp_layer_types`` says so, else at the first
    ``first_k_dense_replace`` (default ``dense_first``) layers, and MoE with shared experts at
    the others (``kinds`` and ``mlp_layer_types`` each checked to name every layer)."""
    hidden, layers = cfg.int("hidden_size"), len(kinds)
    if "mlp_layer_types" in cfg.config:
        dense_at = [kind == "dense" for kind in cfg.kinds("mlp_layer_types", {"dense": "dense", "sparse": "sparse"})]
    else:
        first = first_int(cfg, ("first_k_dense_replace",), 0, default=dense_first)
        dense_at = [layer < first for layer in range(layers)]
    experts = (first_int(cfg, ("num_experts", "num_local_experts", "n_routed_experts")),
               first_int(cfg, ("num_experts_per_token", "num_experts_per_tok")), cfg.int("moe_intermediate_size"))
    shared = first_int(cfg, ("num_shared_experts", "n_shared_experts"), 0, default=shared_default)
    for layer, kind in enumerate(kinds):
        if kind == "attention":
            latent_attention(totals, cfg)
            if bailing:
                totals.linear_params += hidden * cfg.int("num_attention_heads")
        else:
            delta_attention(totals, cfg, *delta, full_rank_gates=bailing)
        if dense_at[layer]:
            mlp(totals, hidden, cfg.int("intermediate_size"))
        else:
            moe(totals, hidden, experts, shared * experts[2])
    return totals
