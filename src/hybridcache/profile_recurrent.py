"""Models without attention as sums of layers: Mamba, FalconMamba, Mamba2 and RWKV, whose
profiles have no KV at all (``attention_layers == 0``); and the recurrent families this
profile does not cover, refused with the reason (``REFUSED``). ``profile_architectures`` lists
them in ``ARCHITECTURES``.

Owns nothing mutable: functions and read-only tables.
"""

from __future__ import annotations

from types import MappingProxyType

from hybridcache.errors import InvalidConfigError
from hybridcache.profile_layers import (
    MAX_LAYERS,
    Fields,
    Totals,
    cache_bytes,
    defaulted,
    mamba1,
    mamba1_geometry,
    mamba2,
    mlp,
)


def _mamba(cfg: Fields) -> Totals:
    """Mamba and FalconMamba: Mamba1 layers alone. transformers sizes the inner width as
    ``expand * hidden_size`` and ignores a saved ``intermediate_size``."""
    totals = Totals()
    geometry = mamba1_geometry(cfg, ("hidden_size", "expand", "state_size", "conv_kernel", "time_step_rank"))
    for _ in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):
        mamba1(totals, cfg, geometry)
    return totals


def _mamba2(cfg: Fields) -> Totals:
    """Mamba2 (Mamba-Codestral): Mamba2 layers alone; ``num_heads * head_dim`` must be the
    inner width ``expand * hidden_size``, as transformers checks."""
    totals = Totals()
    heads, head_dim = cfg.int("num_heads"), cfg.int("head_dim")
    if heads * head_dim != cfg.int("expand") * cfg.int("hidden_size"):
        raise InvalidConfigError(
            f"{cfg.model_type} config: num_heads * head_dim ({heads * head_dim}) must equal expand * hidden_size "
            f"({cfg.int('expand') * cfg.int('hidden_size')})"
        )
    geometry = (heads, head_dim, cfg.int("state_size"), cfg.int("n_groups"), cfg.int("conv_kernel"))
    for _ in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):
        mamba2(totals, cfg, geometry)
    return totals


RWKV_WKV_BYTES = 4  # numerator, denominator and running maximum: float32 whatever the weights' dtype


def _rwkv(cfg: Fields) -> Totals:
    """RWKV(-4): per layer a time mix (key, value, receptance, output; the WKV recurrence) and
    a channel mix. Its state per layer is ``hidden_size`` wide five times: the two token-shift
    vectors in the cache dtype, and the WKV numerator, denominator and maximum in float32 (the
    model allocates them so)."""
    totals, hidden = Totals(), cfg.int("hidden_size")
    width = defaulted(cfg, "attention_hidden_size", hidden)
    ffn = defaulted(cfg, "intermediate_size", 4 * hidden)
    for _ in range(cfg.int("num_hidden_layers", 1, MAX_LAYERS)):
        totals.state_bytes += hidden * (2 * cache_bytes(cfg) + 3 * RWKV_WKV_BYTES)
        totals.linear_params += 3 * hidden * width + width * hidden + hidden * hidden  # time mix; the channel mix's receptance
        mlp(totals, hidden, ffn, gated=False)  # the channel mix's key and value
        totals.recurrent_flops += 8 * width  # two decayed sums (numerator, denominator) and their readout
        totals.recurrent_layers += 1
    return totals


def _refused(reason: str):
    def refuse(cfg: Fields) -> Totals:
        raise InvalidConfigError(f"{cfg.model_type} is not profiled: {reason}")
    return refuse


REFUSED = MappingProxyType({
    # RecurrentGemma's attention layers see a local window only (attention_window_size)
    "recurrent_gemma": _refused(
        "its attention layers attend over a local window of attention_window_size tokens, not the whole "
        "prefix, so a prefix's KV cannot be cached exactly"
    ),
    "xlstm": _refused(
        "its mLSTM cells keep a (C, n, m) state per head in inference_state_dtype, with widths the config rounds "
        "up to multiples of 64, and no formula here has yet been checked against transformers' xLSTMCache"
    ),
})

PURE_RECURRENT = frozenset({"mamba", "falcon_mamba", "mamba2", "rwkv"})  # no attention, by design

RECURRENT = MappingProxyType({
    "mamba": _mamba,
    "falcon_mamba": _mamba,
    "mamba2": _mamba2,
    "rwkv": _rwkv,
    **REFUSED,
})
