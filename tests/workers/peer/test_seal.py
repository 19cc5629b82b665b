"""The seal of a peer fetch's frames: AES-256-GCM round trips into a slot-sized buffer, and
every altered frame, other key or other nonce is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvoffload.wire.protocol import peer_seal_nonce
from workers.peer.seal import TAG_BYTES, SealBroken, open_bytes, open_into, seal


@pytest.mark.parametrize("size", [1, 16, 17, 4096, 262144])
def test_a_sealed_block_opens_into_a_buffer_of_its_own_size(size: int) -> None:
    # A fixed key: with a random one, a 1-byte block's ciphertext equals it once in 256 runs.
    key, nonce = bytes(range(32)), peer_seal_nonce(7, 1)
    block = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    sealed = seal(key, nonce, memoryview(block))
    assert len(sealed) == size + TAG_BYTES and bytes(sealed[:size]) != block.tobytes()
    slot = np.zeros(size, dtype=np.uint8)
    open_into(key, nonce, sealed, memoryview(slot))
    assert np.array_equal(slot, block)


def test_an_altered_frame_another_key_or_another_nonce_does_not_open() -> None:
    key, nonce = os.urandom(32), peer_seal_nonce(7, 1)
    sealed = bytearray(seal(key, nonce, b"x" * 1000))
    assert open_bytes(key, nonce, sealed) == b"x" * 1000
    with pytest.raises(SealBroken):
        open_bytes(os.urandom(32), nonce, sealed)
    with pytest.raises(SealBroken):
        open_bytes(key, peer_seal_nonce(7, 2), sealed)  # another frame's place
    with pytest.raises(SealBroken):
        open_bytes(key, peer_seal_nonce(8, 1), sealed)  # another fetch's
    sealed[500] ^= 1
    with pytest.raises(SealBroken):
        open_bytes(key, nonce, sealed)
    with pytest.raises(SealBroken):
        open_into(key, nonce, sealed, memoryview(bytearray(999)))  # the wrong size


def test_nonces_never_repeat_within_a_fetch_or_across_fetches() -> None:
    nonces = {peer_seal_nonce(f, i) for f in range(50) for i in range(50)}
    assert len(nonces) == 2500 and all(len(n) == 12 for n in nonces)
