"""Which of vLLM's KV cache layouts kvoffload serves, checked once when the connector starts.

vLLM gives each attention kind of a model its own KV cache group. kvoffload serves a group
whose every layer is plain full attention (MLA included), sliding-window attention or chunked
local attention: their state is the KV of the tokens, block by block, which a pool slot holds
as bytes. A group that holds another kind of state (Mamba and other linear-attention states,
cross-attention, attention sinks, ...) is refused with one error naming it, before the engine
serves a request."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)

SUPPORTED_SPECS = (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
)
"""Exact classes: subclasses (attention sinks, sliding-window MLA, ...) keep other state."""


class UnsupportedLayout(ValueError):
    """A KV cache group of the model is of a kind kvoffload does not serve."""


def check_supported_layout(kv_cache_config: KVCacheConfig) -> None:
    """UnsupportedLayout naming every group kind kvoffload cannot serve, and what it serves."""
    refused: dict[str, list[int]] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        for spec in iter_layer_specs(group.kv_cache_spec):
            if type(spec) not in SUPPORTED_SPECS:
                refused.setdefault(type(spec).__name__, []).append(group_id)
    if refused:
        kinds = ", ".join(
            f"{kind} (group {', '.join(map(str, sorted(set(ids))))})"
            for kind, ids in sorted(refused.items())
        )
        served = ", ".join(spec.__name__ for spec in SUPPORTED_SPECS)
        raise UnsupportedLayout(
            f"kvoffload cannot offload this model's KV cache groups of kind {kinds}; it serves "
            f"groups of {served}. Run this model without the kvoffload connector."
        )


def sliding_windows(kv_group_configs: object) -> dict[int, int | None]:
    """vLLM's group index -> the chunks a resumed request reads of that group (its sliding
    window, or its local-attention chunk, in offload chunks), None for full attention. Read
    from the offloading scheduler's per-group configs; empty when they are not shaped as in
    the vLLM versions this was built for."""
    try:
        return {
            int(config.group_idx): config.sliding_window_size_in_chunks
            for config in kv_group_configs  # type: ignore[attr-defined]
        }
    except (AttributeError, TypeError):
        return {}
