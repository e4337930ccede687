"""A request checked against one engine (its config and its model's layout), and the sequence
built for it.

Owns nothing: pure checks. Every refusal raises the specific ``hybridcache.errors`` exception
and leaves the engine unchanged (nothing is queued before every check passed).
"""

from __future__ import annotations

from hybridcache.engine.engine_config import EngineConfig
from hybridcache.engine.model_api import ModelLayout
from hybridcache.engine.requests import Request
from hybridcache.errors import (
    InvalidArgumentError,
    InvalidNamespaceError,
    InvalidSpanError,
    InvalidTokenError,
    InvalidTypeError,
    RequestTooLargeError,
)
from hybridcache.sequence import MultimodalSpan, Sequence
from hybridcache.types import ceil_div


def validated_sequence(request: Request, config: EngineConfig, layout: ModelLayout) -> Sequence:
    """Check ``request`` against the engine's ``config`` and its model's ``layout``, and build
    its sequence."""
    if not isinstance(request, Request):
        raise InvalidTypeError(f"expected a Request, got {type(request).__name__}")
    prompt = request.prompt
    if not prompt.size:
        raise InvalidTokenError("a prompt needs at least one token")
    _check_model_inputs(request, layout)
    if config.adapters is not None and request.adapter is not None and request.adapter not in config.adapters:
        raise InvalidNamespaceError(f"unknown adapter {request.adapter!r}")
    # The last generated token is never fed back, so its KV is never needed.
    needed = ceil_div(prompt.size + request.max_new_tokens - 1, config.block_size)
    if needed > config.num_kv_blocks:
        raise RequestTooLargeError(
            f"the prompt and decode budget need {needed} KV blocks; the pool has {config.num_kv_blocks}"
        )
    spans = [MultimodalSpan(m.start, m.end, m.modality, m.content_id) for m in request.multimodal]
    return Sequence(
        prompt,
        adapter=request.adapter,
        cache_salt=request.cache_salt,
        multimodal=spans,
        want_routed_experts=request.return_routed_experts,
    )


def _check_model_inputs(request: Request, layout: ModelLayout) -> None:
    """What the model itself can take: its vocabulary, and adapters or multimodal spans only
    where its layout says it serves them."""
    if int(request.prompt.max()) >= layout.vocab_size:
        raise InvalidTokenError(f"prompt token ids must lie in [0, {layout.vocab_size})")
    if request.adapter is not None and not layout.serves_adapters:
        raise InvalidNamespaceError("this model serves no adapters")
    if request.multimodal and not layout.serves_multimodal:
        raise InvalidSpanError("this model serves no multimodal inputs")
    if request.return_routed_experts and not layout.routed_expert_width:
        raise InvalidArgumentError("this model routes no experts, so it has none to return")
