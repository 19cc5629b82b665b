"""Prefix keys of KV blocks: a chained hash over full blocks of token ids.

``key[i] = blake2b(key[i-1] || tokens of block i as little-endian int32 || model_id)`` with a
32-byte digest and ``key[-1] = b""``. A key therefore names the whole prefix up to the end of its
block, for one model and KV layout (``model_id``). Keys are a pure function of their inputs:
stable across processes, runs and machines (never Python's ``hash``). Only full blocks get keys;
a trailing partial block has none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 32


def block_keys(tokens: Sequence[int], block_tokens: int, model_id: bytes) -> list[bytes]:
    """Keys of the ``len(tokens) // block_tokens`` full blocks of ``tokens``.

    Token ids must fit in int32 (ValueError otherwise)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must fit in int32")
    raw = ids.astype("<i4").tobytes()
    step = block_tokens * 4
    keys: list[bytes] = []
    prev = b""
    for i in range(len(ids) // block_tokens):
        prev = hashlib.blake2b(
            prev + raw[i * step : (i + 1) * step] + model_id, digest_size=KEY_BYTES
        ).digest()
        keys.append(prev)
    return keys
