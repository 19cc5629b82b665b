"""Which KV cache layouts the connector accepts, on vLLM's own spec classes: every attention
kind kvoffload serves passes; a state group (Mamba) or an attention kind with extra state is
refused with one error naming it and what is served."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvoffload.integrations.vllm.groups import UnsupportedLayout, check_supported_layout  # noqa: E402

ATTN = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_full_sliding_and_chunked_local_attention_are_served():
    check_supported_layout(
        config(
            SlidingWindowSpec(**ATTN, sliding_window=64),
            ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=128),
            FullAttentionSpec(**ATTN),
        )
    )
    uniform = UniformTypeKVCacheSpecs(
        block_size=32,
        kv_cache_specs={f"l{i}": SlidingWindowSpec(**ATTN, sliding_window=64) for i in range(2)},
    )
    check_supported_layout(config(uniform))  # an all-sliding-window model: one wrapped group


def test_a_mamba_state_group_is_refused_with_its_kind_and_what_is_served():
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedLayout) as err:
        check_supported_layout(config(FullAttentionSpec(**ATTN), mamba))
    text = str(err.value)
    assert "MambaSpec (group 1)" in text
    assert "FullAttentionSpec" in text and "SlidingWindowSpec" in text
    assert "without the kvoffload connector" in text
