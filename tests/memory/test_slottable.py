"""The slot header table: one BlockHeader per pool slot in its own shm segment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    BlockHeader,
    combine_checksums,
    deployment_fingerprint,
)
from kvoffload.memory.slottable import SlotTable
from kvoffload.server.warmstart import newest_per_key

FP = deployment_fingerprint(65536, "test")


def header(key: bytes, generation: int = 1, checksum: int = 7) -> BlockHeader:
    return BlockHeader(key, 65536, checksum, FP, generation)


@pytest.fixture
def table():
    t = SlotTable.create(f"/kvoffload-sttest-{uuid.uuid4().hex[:12]}", 8)
    yield t
    t.close()
    t.unlink()


def test_fresh_table_is_empty_and_write_read_clear_round_trip(table):
    assert table.read_all(FP) == []
    table.write(3, header(b"k" * 16, generation=5))
    table.write(6, header(b"j" * 16))
    assert table.read(3, FP) == header(b"k" * 16, generation=5)
    assert table.read_all(FP) == [(3, header(b"k" * 16, generation=5)), (6, header(b"j" * 16))]
    table.clear(3)
    assert table.read(3, FP) is None
    assert [slot for slot, _ in table.read_all(FP)] == [6]
    with pytest.raises(IndexError):
        table.write(8, header(b"k" * 16))


def test_invalid_torn_and_foreign_headers_are_skipped(table, tmp_path):
    table.write(0, header(b"a" * 16))
    table.write(1, header(b"b" * 16))
    table.write(2, BlockHeader(b"c" * 16, 65536, 1, deployment_fingerprint(65536, "other"), 1))
    with open(f"/dev/shm{table.name}", "r+b") as raw:  # flip one byte of slot 1's header body
        raw.seek(HEADER_SIZE + 40)
        byte = raw.read(1)
        raw.seek(HEADER_SIZE + 40)
        raw.write(bytes([byte[0] ^ 0xFF]))
    assert [slot for slot, _ in table.read_all(FP)] == [0]


def test_highest_generation_wins_per_key():
    found = [
        (0, header(b"a" * 16, generation=3)),
        (1, header(b"b" * 16, generation=9)),
        (2, header(b"a" * 16, generation=7)),
        (3, header(b"a" * 16, generation=5)),
    ]
    winners, losers = newest_per_key(found)
    assert winners == [(b"a" * 16, 2), (b"b" * 16, 1)]  # oldest generation first
    assert sorted(losers) == [0, 3]


def test_two_processes_see_the_same_table(table):
    child = textwrap.dedent(
        f"""
        from kvoffload.memory.blockformat import BlockHeader, deployment_fingerprint
        from kvoffload.memory.slottable import SlotTable
        fp = deployment_fingerprint(65536, "test")
        t = SlotTable.attach({table.name!r}, 8)
        assert [s for s, _ in t.read_all(fp)] == [4], t.read_all(fp)
        t.clear(4)
        t.write(5, BlockHeader(b"z" * 16, 65536, 11, fp, 2))
        t.close()
        """
    )
    table.write(4, header(b"y" * 16))
    subprocess.run([sys.executable, "-c", child], check=True, timeout=30)
    assert table.read_all(FP) == [(5, BlockHeader(b"z" * 16, 65536, 11, FP, 2))]


def test_attach_checks_existence_and_size_and_only_the_creator_unlinks(table):
    with pytest.raises(FileNotFoundError):
        SlotTable.attach(f"/kvoffload-sttest-missing-{os.getpid()}", 8)
    with pytest.raises(ValueError):
        SlotTable.attach(table.name, 9)
    other = SlotTable.attach(table.name, 8)
    with pytest.raises(PermissionError):
        other.unlink()
    other.close()
    with pytest.raises(FileExistsError):
        SlotTable.create(table.name, 8)


def test_a_block_in_slices_keeps_its_slice_digests_beside_its_header(table):
    digests = [11, 22, 33]
    header = BlockHeader(
        b"t" * 16, 3 * 4096, combine_checksums(digests), FP, 5, slices=3, slice_bytes=4096
    )
    table.write(2, header, digests)
    read = table.read(2, FP)
    assert read == header and table.slice_checksums(2, read) == digests
    with pytest.raises(ValueError, match="digests"):
        table.write(3, header, [11, 22, 34])  # they do not make the checksum
    one = BlockHeader(b"u" * 16, 4096, 99, FP)
    table.write(4, one)
    assert table.slice_checksums(4, one) == [99]

    other = [1, 2, 3]
    table.write(
        2,
        BlockHeader(
            b"v" * 16, 3 * 4096, combine_checksums(other), FP, 6, slices=3, slice_bytes=4096
        ),
        other,
    )
    assert table.slice_checksums(2, header) == []  # the digests of another block: not served
