"""Classify the records of one slab file by reading their header pages (payloads are not read;
``DiskStore.get`` verifies every payload checksum)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload.blockformat import HEADER_SIZE, CorruptBlock, decode_header
from workers.disk.layout import SlabLayout
from workers.disk.rawio import PAGE_SIZE, page_buffer, preadv_all

_BLANK_HEADER = bytes(HEADER_SIZE)


@dataclass(slots=True)
class SlabScan:
    """Records of one slab: ``found`` holds (key, record, generation) of valid headers;
    ``invalid`` records hold bytes that are not a valid header of this layout (torn, foreign,
    truncated); ``unreadable`` records failed to read. Blank records are in none of them."""

    slab: int
    found: list[tuple[bytes, int, int]] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)
    unreadable: list[int] = field(default_factory=list)


def scan_slab(fd: int, layout: SlabLayout, slab: int, before_read: Callable[[], None]) -> SlabScan:
    """Read the header page of every record of ``slab`` that starts inside the file.

    ``fd`` may be an O_DIRECT descriptor. ``before_read`` runs before each read and may raise
    OSError (fault injection); such a record, like one whose read fails, is ``unreadable``.
    """
    result = SlabScan(slab)
    file_size = os.fstat(fd).st_size
    page = page_buffer()
    first = layout.first_record(slab)
    for index in range(layout.slab_records(slab)):
        record = first + index
        offset = index * layout.record_size
        if offset + PAGE_SIZE > file_size:
            break
        try:
            before_read()
            if preadv_all(fd, [page], offset, PAGE_SIZE) != PAGE_SIZE:
                raise OSError("short read of a header page")
        except OSError:
            result.unreadable.append(record)
            continue
        raw = page[:HEADER_SIZE]
        if raw == _BLANK_HEADER:
            continue
        try:
            header = decode_header(raw, layout.fingerprint)
        except CorruptBlock:
            result.invalid.append(record)
            continue
        if header.payload_len != layout.block_bytes or offset + layout.record_size > file_size:
            result.invalid.append(record)
            continue
        result.found.append((header.key, record, header.generation))
    return result
