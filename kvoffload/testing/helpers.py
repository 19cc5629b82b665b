"""Small helpers of tests, the soak and the benchmarks: keys, polling, a free port, the checkout,
engine-side KV caches of random bytes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from kvoffload.extras import EXTRAS, missing_extra, missing_modules
from kvoffload.memory.kvcache import SharedKVCache

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The root of the source checkout (tests and benchmarks run from one)."""


def keys_for(prefix: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys: ``prefix-i`` padded with dots."""
    return [f"{prefix}-{i}".encode().ljust(32, b".") for i in range(n)]


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 20.0,
    what: str = "a condition",
    interval_s: float = 0.05,
) -> T:
    """The first truthy value of ``predicate()``, polled every ``interval_s``; TimeoutError
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return value


def skip_without_extra(extra: str, modules: Sequence[str] | None = None) -> None:
    """Skip the calling test (or, at module level, the whole test module) when a module of
    ``extra`` (or of ``modules``) is missing; the reason names the extra to install."""
    __tracebackhide__ = True  # pytest reports the skip at the caller's line
    reason = missing_extra(extra, modules)
    if reason is not None:
        import pytest

        for name in missing_modules(EXTRAS[extra] if modules is None else modules):
            pytest.importorskip(name, reason=f"needs {reason}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def random_kv_cache(num_blocks: int, row_bytes: list[int], seed: int) -> SharedKVCache:
    """A new shared-memory KV cache (a fresh name) whose rows hold seeded random bytes; the
    caller closes and unlinks it."""
    cache = SharedKVCache.create(None, num_blocks, row_bytes)
    rng = np.random.default_rng(seed)
    for tensor in cache.tensors:
        tensor[:] = rng.integers(0, 256, size=tensor.shape, dtype=np.uint8)
    return cache
