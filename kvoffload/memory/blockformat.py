"""Self-describing header of a block stored outside the host pool (disk records, S3 objects).

Layout (little endian, ``HEADER_SIZE`` bytes)::

    magic        4s   b"KVOB"
    version      H    FORMAT_VERSION
    key_len      H    1..MAX_KEY_BYTES
    payload_len  Q    bytes of block payload that follow the header (or the record's header page)
    checksum     Q    xxh3_64 of the payload
    fingerprint  16s  deployment fingerprint (block size + layout id + format version)
    key          64s  the key, zero padded
    generation   Q    writer's monotonically increasing sequence number (newest copy wins)
    header_crc   I    xxh32 of every byte before it
    slices       H    0 (one slice: the whole payload) or 2..MAX_SLICES
    slice_bytes  I    bytes of each slice (0 with one slice)
    slices_crc   I    xxh32 of every byte before it (0 with one slice)
    (zero padding up to HEADER_SIZE)

A block written in slices (one per tensor-parallel rank: rank ``r`` owns the payload bytes
``[r * slice_bytes, (r + 1) * slice_bytes)``, and no rank sees the whole block) has as its
checksum the xxh3 of its slices' xxh3 digests (``block_checksum``): each writer hashes its own
slice, and anyone holding the payload can check the whole. A header of one slice leaves the
slice fields zero, so it is byte for byte the header of a block without slices.

A header that fails its own crc, carries another magic/version/fingerprint, or whose payload
fails the checksum is never served: callers get ``CorruptBlock``.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

PAGE_BYTES = 4096
"""A memory page, and the header page of a disk record: pool blocks are whole pages, and
``O_DIRECT`` I/O moves whole, page-aligned pages."""

MAGIC = b"KVOB"
FORMAT_VERSION = 1
MAX_KEY_BYTES = 64
HEADER_SIZE = 128
MAX_SLICES = 8
"""Most slices a block is written in (tensor-parallel ranks that each hold a slice)."""

_FIELDS = struct.Struct("<4sHHQQ16s64sQ")
_CRC = struct.Struct("<I")
_SLICES = struct.Struct("<HI")
_SLICES_AT = _FIELDS.size + _CRC.size
_SLICES_CRC_AT = _SLICES_AT + _SLICES.size
assert _SLICES_CRC_AT + _CRC.size <= HEADER_SIZE


def disk_record_bytes(block_bytes: int) -> int:
    """Bytes one block takes in the disk tier: a header page, then the payload in whole
    pages (``workers.disk.layout``)."""
    return PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES


class CorruptBlock(Exception):
    """The stored bytes are not a valid block for this key and deployment."""


@dataclass(frozen=True, slots=True)
class BlockChecksum:
    """A block's checksum as a header carries it: ``value`` is its ``block_checksum`` of
    ``slices`` slices of ``slice_bytes`` (one slice: the payload's xxh3)."""

    value: int
    slices: int = 1
    slice_bytes: int = 0

    def digests(self, payload: Any) -> list[int]:
        """The digests a reader verifies the block by, slice by slice (as a lookup reply's
        ``checksums`` gives them): ``[value]`` for one slice, else each slice's xxh3 of
        ``payload``."""
        if self.slices <= 1:
            return [self.value]
        return slice_checksums(payload, self.slices, self.slice_bytes)

    def header(
        self, key: bytes, payload_len: int, fingerprint: bytes, generation: int = 0
    ) -> BlockHeader:
        """The header of a block of ``payload_len`` bytes with this checksum."""
        return BlockHeader(
            key, payload_len, self.value, fingerprint, generation, self.slices, self.slice_bytes
        )


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """``slices`` > 1: the payload was written in that many slices of ``slice_bytes`` and
    ``checksum`` is their ``block_checksum``; 1: ``checksum`` is the payload's xxh3."""

    key: bytes
    payload_len: int
    checksum: int
    fingerprint: bytes
    generation: int = 0
    slices: int = 1
    slice_bytes: int = 0

    def __post_init__(self) -> None:
        if self.slices > 1 and not (
            self.slices <= MAX_SLICES
            and self.slice_bytes > 0
            and self.slices * self.slice_bytes <= self.payload_len
        ):
            raise ValueError(
                f"{self.slices} slices of {self.slice_bytes} bytes do not fit a payload of "
                f"{self.payload_len} (at most {MAX_SLICES} slices)"
            )

    def encode(self) -> bytes:
        body = _FIELDS.pack(
            MAGIC,
            FORMAT_VERSION,
            len(self.key),
            self.payload_len,
            self.checksum,
            self.fingerprint,
            self.key,
            self.generation,
        )
        head = body + _CRC.pack(xxhash.xxh32_intdigest(body))
        if self.slices > 1:
            head += _SLICES.pack(self.slices, self.slice_bytes)
            head += _CRC.pack(xxhash.xxh32_intdigest(head))
        return head.ljust(HEADER_SIZE, b"\0")

    @property
    def block_checksum(self) -> BlockChecksum:
        return BlockChecksum(self.checksum, self.slices, self.slice_bytes)


def deployment_fingerprint(block_bytes: int, layout_id: str) -> bytes:
    """16 bytes that differ whenever blocks written by one deployment cannot be read by another."""
    text = f"kvoffload/{FORMAT_VERSION}/{block_bytes}/{layout_id}".encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def payload_checksum(payload) -> int:
    """xxh3_64 of a bytes-like payload (buffer protocol, no copy)."""
    return xxhash.xxh3_64_intdigest(payload)


def slice_checksums(payload, slices: int, slice_bytes: int) -> list[int]:
    """The xxh3 of each of the payload's first ``slices`` slices of ``slice_bytes``."""
    view = memoryview(payload).cast("B")
    return [payload_checksum(view[r * slice_bytes : (r + 1) * slice_bytes]) for r in range(slices)]


def combine_checksums(digests: list[int]) -> int:
    """The checksum of a block written in slices: the xxh3 of its slices' digests."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def block_checksum(payload, slices: int = 1, slice_bytes: int = 0) -> int:
    """The checksum a header of ``slices`` slices carries for ``payload``."""
    if slices <= 1:
        return payload_checksum(payload)
    return combine_checksums(slice_checksums(payload, slices, slice_bytes))


def make_header(
    key: bytes,
    payload,
    fingerprint: bytes,
    generation: int = 0,
    checksum: BlockChecksum | None = None,
) -> BlockHeader:
    """The header of ``payload`` stored under ``key``; ``checksum``: the payload's checksum
    when the caller already has it (taken when the bytes were written, maybe in slices), the
    payload's xxh3 computed now when None."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key length {len(key)} outside 1..{MAX_KEY_BYTES}")
    if checksum is None:
        checksum = BlockChecksum(payload_checksum(payload))
    return checksum.header(key, len(memoryview(payload).cast("B")), fingerprint, generation)


def decode_header(raw, fingerprint: bytes) -> BlockHeader:
    """Parse and validate a header; raise CorruptBlock if it is not one of ours."""
    raw = bytes(memoryview(raw)[:HEADER_SIZE])
    if len(raw) < _FIELDS.size + _CRC.size:
        raise CorruptBlock("short header")
    body = raw[: _FIELDS.size]
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    if xxhash.xxh32_intdigest(body) != crc:
        raise CorruptBlock("header checksum mismatch")
    magic, version, key_len, payload_len, checksum, fp, key, generation = _FIELDS.unpack(body)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version} != {FORMAT_VERSION}")
    if fp != fingerprint:
        raise CorruptBlock("deployment fingerprint differs")
    if not 1 <= key_len <= MAX_KEY_BYTES:
        raise CorruptBlock("bad key length")
    slices, slice_bytes = _decode_slices(raw)
    try:
        return BlockHeader(
            key[:key_len], payload_len, checksum, fp, generation, slices, slice_bytes
        )
    except ValueError as exc:
        raise CorruptBlock(str(exc)) from None


def _decode_slices(raw: bytes) -> tuple[int, int]:
    ext = raw[_SLICES_AT : _SLICES_CRC_AT + _CRC.size]
    if len(ext) < _SLICES.size + _CRC.size or not any(ext):
        return 1, 0
    (crc,) = _CRC.unpack_from(raw, _SLICES_CRC_AT)
    if xxhash.xxh32_intdigest(raw[:_SLICES_CRC_AT]) != crc:
        raise CorruptBlock("slice fields checksum mismatch")
    slices, slice_bytes = _SLICES.unpack_from(raw, _SLICES_AT)
    if slices < 2:
        raise CorruptBlock(f"bad slice count {slices}")
    return slices, slice_bytes


def verify_payload(header: BlockHeader, key: bytes, payload) -> None:
    """Raise CorruptBlock unless payload belongs to key and matches the header's checksum."""
    if header.key != key:
        raise CorruptBlock("stored key differs")
    view = memoryview(payload).cast("B")
    if len(view) != header.payload_len:
        raise CorruptBlock(f"payload length {len(view)} != {header.payload_len}")
    if block_checksum(view, header.slices, header.slice_bytes) != header.checksum:
        raise CorruptBlock("payload checksum mismatch")
