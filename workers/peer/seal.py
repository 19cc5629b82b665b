"""Sealing the frames of a peer fetch's answer: AES-256-GCM under the fetch's key.

The fetch endpoint is CURVE, but libzmq's CURVE moves a few hundred MB/s at most, so the
blocks travel on the bulk endpoint, each frame sealed here (AES-NI through ``cryptography``:
GB/s per core, the GIL released): the ciphertext, then the 16-byte tag. The key is fresh for
each fetch and travels inside CURVE; each frame has its own nonce
(``protocol.peer_seal_nonce``). Sealing a block is the one pass over its slot on the holder;
opening one writes it straight into the requester's slot, the one copy there.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16


class SealBroken(Exception):
    """A frame that does not open under the fetch's key (tampered, or another fetch's)."""


def seal(key: bytes, nonce: bytes, data: memoryview | bytes) -> memoryview:
    """``data`` sealed: ciphertext then tag, in a buffer of its own."""
    out = bytearray(len(data) + TAG_BYTES)
    AESGCM(key).encrypt_into(nonce, data, None, out)
    return memoryview(out)


def open_into(key: bytes, nonce: bytes, sealed: memoryview | bytes, out: memoryview) -> None:
    """Open ``sealed`` into ``out`` (exactly its plaintext's size); SealBroken, with ``out``
    then holding garbage, when it does not open."""
    if len(sealed) - TAG_BYTES != len(out) or len(sealed) < TAG_BYTES:
        raise SealBroken(f"a sealed frame of {len(sealed)} bytes for {len(out)}")
    try:
        AESGCM(key).decrypt_into(nonce, sealed, None, out)
    except InvalidTag:
        raise SealBroken("the frame's tag does not match") from None


def open_bytes(key: bytes, nonce: bytes, sealed: memoryview | bytes) -> bytes:
    """``open_into`` a new buffer."""
    out = bytearray(max(0, len(sealed) - TAG_BYTES))
    open_into(key, nonce, sealed, memoryview(out))
    return bytes(out)
