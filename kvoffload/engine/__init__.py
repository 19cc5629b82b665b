"""The reference inference engine: a compact torch transformer over a paged KV cache that reuses
prefixes through kvoffload (demo, end-to-end tests, TTFT benchmark). Imports torch."""

from .hashing import block_keys
from .model import BENCH_MODEL, DEMO_MODEL, MODELS, ModelConfig, TinyDecoder
from .paged_cache import CacheFull, PagedKVCache
from .scheduler import Engine, Generation

__all__ = [
    "BENCH_MODEL",
    "DEMO_MODEL",
    "MODELS",
    "CacheFull",
    "Engine",
    "Generation",
    "ModelConfig",
    "PagedKVCache",
    "TinyDecoder",
    "block_keys",
]
