"""The reference inference engine: a compact torch transformer over a paged KV cache that reuses
prefixes through kvoffload (demo, end-to-end tests, TTFT benchmark). Imports torch."""

from kvoffload.engine.hashing import block_keys
from kvoffload.engine.model import TinyDecoder
from kvoffload.engine.paged_cache import CacheFull, PagedKVCache
from kvoffload.engine.scheduler import Engine, Generation
from kvoffload.engine.shapes import BENCH_MODEL, DEMO_MODEL, MODELS, ModelConfig

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
