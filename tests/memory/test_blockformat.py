"""Block headers, checksums and slices."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.memory.blockformat import (
    BlockChecksum,
    CorruptBlock,
    block_checksum,
    combine_checksums,
    decode_header,
    make_header,
    slice_checksums,
    verify_payload,
)

FP = bytes(range(16))


def test_a_block_in_slices_checks_every_slice_and_its_header_round_trips() -> None:
    payload = np.random.default_rng(1).integers(0, 256, size=4 * 8192, dtype=np.uint8)
    digests = slice_checksums(payload, 2, 8192)  # two ranks of 8 KiB, then an unused tail
    header = make_header(
        b"k" * 16, payload, FP, 7, BlockChecksum(combine_checksums(digests), 2, 8192)
    )
    assert header.checksum == block_checksum(payload, 2, 8192)

    decoded = decode_header(header.encode(), FP)
    assert (decoded.slices, decoded.slice_bytes, decoded.checksum) == (2, 8192, header.checksum)
    verify_payload(decoded, b"k" * 16, payload)
    payload[3 * 8192] ^= 1  # outside both slices: nobody wrote or reads it
    verify_payload(decoded, b"k" * 16, payload)
    payload[8192 + 5] ^= 1  # inside rank 1's slice
    with pytest.raises(CorruptBlock, match="checksum"):
        verify_payload(decoded, b"k" * 16, payload)


def test_a_header_of_one_slice_is_the_header_without_slices() -> None:
    payload = np.arange(8192, dtype=np.uint8)
    one = make_header(b"k" * 16, payload, FP)
    assert one.encode()[116:] == bytes(12)  # the slice fields stay zero
    assert decode_header(one.encode(), FP).slices == 1


def test_torn_slice_fields_are_refused() -> None:
    payload = np.arange(4 * 4096, dtype=np.uint8)
    raw = bytearray(
        make_header(b"k" * 16, payload, FP, checksum=BlockChecksum(1, 4, 4096)).encode()
    )
    raw[116] ^= 1  # the slice count
    with pytest.raises(CorruptBlock, match="slice"):
        decode_header(bytes(raw), FP)
    with pytest.raises(ValueError, match="do not fit"):
        make_header(b"k" * 16, payload, FP, checksum=BlockChecksum(1, 4, 8192))
