"""Verifiable block contents for soak runs and fault tests.

A block's bytes are a pure function of its key (``expected_block``), and keys form prefix
chains (``conversation_keys``), so any block loaded from any tier, stored by any client, can
be checked byte for byte (``mismatch``). Device blocks are filled with ``POISON`` before a load,
so a load that reports success without copying is caught too.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

POISON = 0xEE


def conversation_keys(namespace: bytes, conversation: int, length: int) -> list[bytes]:
    """Prefix-hash chain of 32-byte keys: key[i] = blake2b(key[i-1] || i)."""
    prev = hashlib.blake2b(namespace + conversation.to_bytes(4, "little"), digest_size=32).digest()
    keys = []
    for i in range(length):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=32).digest()
        keys.append(prev)
    return keys


def expected_block(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes of ``key``'s block: 64-bit words mixing the key's hash with their position,
    so a flipped byte, a shifted block or another key's block never matches."""
    seed = np.uint64(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") | 1)
    words = np.arange(1, nbytes // 8 + 1, dtype=np.uint64) * seed
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)


def mismatch(actual: np.ndarray, expected: np.ndarray) -> dict[str, Any] | None:
    """None when equal, else where and how the bytes differ."""
    if np.array_equal(actual, expected):
        return None
    diff = np.flatnonzero(actual != expected)
    return {
        "first_offset": int(diff[0]),
        "bytes_differ": int(diff.size),
        "poison": bool(np.all(actual == POISON)),
    }
