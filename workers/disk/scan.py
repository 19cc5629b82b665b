"""Classify the records of one slab file by reading their header pages, and with ``verify``
their payloads too (``DiskStore.get`` verifies every payload checksum in any case); and
``scan_store``: every slab file of a store scanned in parallel, the newest copy of each key
kept."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    PAGE_BYTES,
    CorruptBlock,
    block_checksum,
    decode_header,
)
from workers.disk.layout import SlabLayout
from workers.disk.rawio import preadv_all

_BLANK_HEADER = bytes(HEADER_SIZE)


@dataclass(slots=True)
class SlabScan:
    """Records of one slab: ``found`` holds (key, record, generation) of valid headers;
    ``invalid`` records hold bytes that are not a valid header of this layout (torn, foreign,
    truncated); ``corrupt`` holds (key, record) of valid headers whose payload, when verified,
    fails the header's checksum; ``unreadable`` records failed to read. Blank records are in
    none of them."""

    slab: int
    found: list[tuple[bytes, int, int]] = field(default_factory=list)
    invalid: list[int] = field(default_factory=list)
    corrupt: list[tuple[bytes, int]] = field(default_factory=list)
    unreadable: list[int] = field(default_factory=list)


def scan_slab(
    fd: int, layout: SlabLayout, slab: int, before_read: Callable[[], None], verify: bool = False
) -> SlabScan:
    """Read the header page of every record of ``slab`` that starts inside the file; with
    ``verify``, read each whole record and check its payload against the header's checksum.

    ``fd`` may be an O_DIRECT descriptor. ``before_read`` runs before each read and may raise
    OSError (fault injection); such a record, like one whose read fails, is ``unreadable``.
    """
    result = SlabScan(slab)
    file_size = os.fstat(fd).st_size
    size = layout.record_size if verify else PAGE_BYTES
    buf = mmap.mmap(-1, size)
    payload = memoryview(buf)[PAGE_BYTES : PAGE_BYTES + layout.block_bytes]
    first = layout.first_record(slab)
    try:
        for index in range(layout.slab_records(slab)):
            record = first + index
            offset = index * layout.record_size
            if offset + PAGE_BYTES > file_size:
                break
            want = min(size, file_size - offset)
            try:
                before_read()
                if preadv_all(fd, [buf], offset, size) < want:
                    raise OSError("short read of a record")
            except OSError:
                result.unreadable.append(record)
                continue
            raw = buf[:HEADER_SIZE]
            if raw == _BLANK_HEADER:
                continue
            try:
                header = decode_header(raw, layout.fingerprint)
            except CorruptBlock:
                result.invalid.append(record)
                continue
            whole = offset + layout.record_size <= file_size
            if header.payload_len != layout.block_bytes or not whole:
                result.invalid.append(record)
                continue
            if verify and block_checksum(payload, header.slices, header.slice_bytes) != (
                header.checksum
            ):
                result.corrupt.append((header.key, record))
                continue
            result.found.append((header.key, record, header.generation))
    finally:
        payload.release()
        buf.close()
    return result


@dataclass(slots=True)
class StoreScan:
    """The slab files of a store, scanned: ``best`` maps each key to the (record, generation)
    of its newest valid copy; ``to_clear`` holds the records to clear (invalid headers, older
    copies of a key, corrupt payloads); ``unreadable`` the records whose read failed;
    ``corrupt`` the keys with a copy that failed its payload check."""

    best: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    to_clear: list[int] = field(default_factory=list)
    unreadable: list[int] = field(default_factory=list)
    corrupt: set[bytes] = field(default_factory=set)


def scan_store(
    header_fds: dict[int, int],
    layout: SlabLayout,
    before_read: Callable[[], None],
    verify: bool,
    on_batch: Callable[[list[bytes]], None] | None,
    batch_size: int,
    threads: int,
) -> StoreScan:
    """Scan every slab of ``header_fds`` (slab -> descriptor) on up to ``threads`` threads and
    keep the newest copy of each key; ``on_batch`` receives the keys found, in lists of up to
    ``batch_size``, while the scan goes on (in this thread), and the rest at the end."""
    out = StoreScan()
    best = out.best
    pending: list[bytes] = []
    if header_fds:
        with ThreadPoolExecutor(
            min(threads, len(header_fds)), thread_name_prefix="disk-scan"
        ) as pool:
            futures = [
                pool.submit(scan_slab, fd, layout, slab, before_read, verify)
                for slab, fd in header_fds.items()
            ]
            for future in as_completed(futures):
                result = future.result()
                for key, record, generation in result.found:
                    known = best.get(key)
                    if known is None:
                        best[key] = (record, generation)
                        pending.append(key)
                    elif generation > known[1]:
                        out.to_clear.append(known[0])
                        best[key] = (record, generation)
                    else:
                        out.to_clear.append(record)
                out.to_clear.extend(result.invalid)
                for key, record in result.corrupt:
                    out.corrupt.add(key)
                    out.to_clear.append(record)
                out.unreadable.extend(result.unreadable)
                if len(pending) >= batch_size:
                    pending = _announce(on_batch, pending, batch_size)
    _announce(on_batch, pending, batch_size, flush=True)
    return out


def _announce(
    on_batch: Callable[[list[bytes]], None] | None,
    pending: list[bytes],
    batch_size: int,
    flush: bool = False,
) -> list[bytes]:
    """Hand full batches (and with ``flush`` the remainder) to ``on_batch``; returns the rest."""
    while len(pending) >= batch_size or (flush and pending):
        batch, pending = pending[:batch_size], pending[batch_size:]
        if on_batch is not None:
            on_batch(batch)
    return pending
