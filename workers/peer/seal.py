"""Sealing the frames of a peer fetch's answer: AES-256-GCM under the fetch's key.

The fetch endpoint is CURVE, but libzmq's CURVE moves a few hundred MB/s at most, so the
blocks travel on the bulk endpoint, each frame sealed here (AES-NI through ``cryptography``:
GB/s per core): the ciphertext, then the 16-byte tag. The key is fresh for each fetch and
travels inside CURVE; each frame has its own nonce (``protocol.peer_seal_nonce``). Sealing a
block is the one pass over its slot on the holder; opening one writes it straight into the
requester's slot, the one copy there.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

TAG_BYTES = 16
_SLACK = 15
"""``update_into`` wants this much room past the data it writes."""


class SealBroken(Exception):
    """A frame that does not open under the fetch's key (tampered, or another fetch's)."""


def seal(key: bytes, nonce: bytes, data: memoryview | bytes) -> memoryview:
    """``data`` sealed: ciphertext then tag, in a buffer of its own."""
    size = len(data)
    out = bytearray(size + TAG_BYTES + _SLACK)
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    written = encryptor.update_into(data, out)
    encryptor.finalize()
    assert written == size
    out[size : size + TAG_BYTES] = encryptor.tag
    return memoryview(out)[: size + TAG_BYTES]


def open_into(key: bytes, nonce: bytes, sealed: memoryview | bytes, out: memoryview) -> None:
    """Open ``sealed`` into ``out`` (exactly its plaintext's size); SealBroken, with ``out``
    then holding garbage, when it does not open."""
    view = memoryview(sealed)
    size = len(view) - TAG_BYTES
    if size != len(out) or size < 0:
        raise SealBroken(f"a sealed frame of {len(view)} bytes for {len(out)}")
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, bytes(view[size:]))).decryptor()
    head = max(0, size - TAG_BYTES)
    done = decryptor.update_into(view[:head], out) if head else 0
    tail = bytearray(size - head + _SLACK)
    rest = decryptor.update_into(view[head:size], tail)
    out[done : done + rest] = tail[:rest]
    try:
        decryptor.finalize()
    except InvalidTag:
        raise SealBroken("the frame's tag does not match") from None


def open_bytes(key: bytes, nonce: bytes, sealed: memoryview | bytes) -> bytes:
    """``open_into`` a new buffer."""
    out = bytearray(max(0, len(sealed) - TAG_BYTES))
    open_into(key, nonce, sealed, memoryview(out))
    return bytes(out)
