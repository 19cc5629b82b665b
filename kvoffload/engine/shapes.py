"""The reference engine's model shapes: its layers, heads and KV blocks (``ModelConfig``) and
the two models it ships (``DEMO_MODEL``, ``BENCH_MODEL``)."""

from __future__ import annotations

from dataclasses import dataclass

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model and of its KV blocks (K and V of ``block_tokens`` tokens per layer)."""

    vocab_size: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    ffn: int = 768
    block_tokens: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of K (or V) of one block of one layer."""
        return self.block_tokens * self.kv_heads * self.head_dim * FLOAT32_BYTES

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V): the pool's ``block_bytes``."""
        return 2 * self.layers * self.kv_row_bytes

    def describe(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads "
            f"x {self.head_dim}, ffn {self.ffn}, vocab {self.vocab_size}, float32, "
            f"{self.block_tokens} tokens = {self.block_bytes} bytes per block"
        )


DEMO_MODEL = ModelConfig()
"""The demo and test model: 65536-byte blocks (4 layers x K,V x 16 tokens x 4 heads x 32 x 4 B)."""

BENCH_MODEL = ModelConfig(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, ffn=1536)
"""The TTFT benchmark model: about 25 M parameters, 131072-byte blocks."""

MODELS = {"demo": DEMO_MODEL, "bench": BENCH_MODEL}
