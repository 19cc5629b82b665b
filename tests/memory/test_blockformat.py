"""The copy-and-checksum pass of block stores."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.memory.blockformat import CHECKSUM_CHUNK_BYTES, copy_with_checksum, payload_checksum


@pytest.mark.parametrize("size", [4096, CHECKSUM_CHUNK_BYTES, 2 * CHECKSUM_CHUNK_BYTES + 12288])
def test_copy_with_checksum_copies_and_hashes_every_chunk(size: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert copy_with_checksum(dst, src) == payload_checksum(src)
    assert np.array_equal(dst, src)


def test_copy_with_checksum_needs_a_contiguous_destination() -> None:
    src = np.ones(8192, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        copy_with_checksum(np.zeros(16384, dtype=np.uint8)[::2], src)
