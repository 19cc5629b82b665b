"""``DiskStore``: the disk tier's storage engine. Fixed-size blocks live in preallocated slab
files of fixed-size records (see ``workers.disk.layout``); payloads move straight between the
files and the caller's host-pool slots.

Contracts:

* Writes: a put writes its record (header page, then payload) with one ``pwritev`` and, with
  ``durability="fsync"``, one fdatasync; the key is indexed only after both returned.
* Torn records are never served. A crash (kill -9, power loss) during a put may leave a record
  torn: a valid header over a payload that is partly old bytes. The header's xxh3 of the
  payload is what guarantees this: ``get`` verifies it before returning (see Reads), and
  ``open`` verifies it for every record unless the directory carries the clean mark, which
  ``close`` writes (after an fdatasync of every slab file) only when no record can be torn:
  no put was in flight, and no header clear after a failed write or a bad read failed. ``open``
  removes the mark durably before any write, so a crash from then on reads as unclean. A
  failed record is dropped and its header page cleared, like any invalid header.
* Reads verify the header (crc, magic, version, fingerprint, key, length, generation) and the
  payload's xxh3_64 checksum, block by block; ``get_many`` reads records that lie one after
  another with one ``preadv`` (a thread's consecutive puts take consecutive records of one
  slab file while they are free, see ``RecordIndex.reserve``). A bad copy raises
  ``CorruptBlock``, leaves the index and has its header page cleared. Other read errors raise
  ``TransientIOError`` and keep the block, except that ``MAX_READ_ERRORS`` consecutive EIO on
  one record count as corruption.
* Capacity: record bytes never exceed ``capacity_bytes``. Recency (LRU) follows put, get and
  touch; after ``open()`` it follows write order. Records pinned by an in-progress get are
  never evicted or overwritten; a put that finds nothing to reuse raises ``StoreFull``.
* Overwriting a key reuses its record in place when no get is reading it (the key leaves the
  index and the new record is written over the old one). While a get reads it, the new copy
  goes to another record and the old one is cleared after the read; the header generation
  makes the newest copy win at the next scan if a crash comes in between.
* ENOSPC/EDQUOT fails the put with that OSError and sets ``degraded`` until a put succeeds.
* Thread safety: every public method may be called from many threads at once, except
  ``open`` and ``close``, which must not overlap other calls. One lock guards the index and
  allocation metadata and is never held during I/O.
* I/O mode: O_DIRECT when the probe in ``open()`` succeeds and ``block_bytes`` is a multiple of
  ``PAGE_BYTES``, else buffered I/O. With O_DIRECT a slot that is not page aligned is moved
  through the buffered descriptor of the same file, which the kernel keeps coherent.
* Only ``open`` scans: header pages after a clean close, whole records otherwise (one read of
  the stored bytes). Slab files beyond the capacity (after shrinking it) are left untouched
  and ignored.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import structlog

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    PAGE_BYTES,
    BlockChecksum,
    BlockHeader,
    CorruptBlock,
    decode_header,
    payload_checksum,
    verify_payload,
)
from workers.disk.errors import TransientIOError
from workers.disk.files import SlabFile, SlabFiles
from workers.disk.layout import (
    SlabLayout,
    adopt_layout,
    make_private_directory,
    mark_clean,
    plan_layout,
    take_clean_mark,
)
from workers.disk.rawio import (
    ZERO_PAGE,
    is_page_aligned,
    page_buffer,
    preadv_all,
    probe_direct_io,
    pwrite_all,
    pwritev_all,
)
from workers.disk.record_index import RecordIndex
from workers.disk.scan import scan_store

FaultHook = Callable[[str, bytes], None]
"""Called as ``hook(op, key)`` before each I/O; may raise OSError to inject a failure. ``op`` is
one of ``FAULT_OPS``; ``key`` is the block's key, or ``b""`` for scan reads and scan clears."""

FAULT_OPS = (
    "allocate",
    "write_record",
    "fsync",
    "read",
    "clear",
    "scan",
)

MAX_READ_ERRORS = 3
READ_RUN_BYTES = 1 << 19
"""Payload bytes of adjacent records that one ``preadv`` of ``get_many`` reads at most (a
promotion's chunk of 1 MiB goes as two reads of 512 KiB: a 64 x 256 KiB cold prefix whose
records all follow each other read at 0.97 GB/s so, 0.78 in reads of 1 MiB)."""
MAX_RUN_RECORDS = 256
"""Records of one such read at most (two buffers each, within the kernel's IOV_MAX)."""
SCAN_THREADS = 8
DURABILITY_MODES = ("none", "fsync")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


GetOutcome = BlockHeader | KeyError | CorruptBlock | TransientIOError
"""One key's result of ``DiskStore.get_many``."""


@dataclass(frozen=True, slots=True)
class _PinnedRead:
    """One key of a ``get_many``: its place in the call, its pinned record and destination."""

    index: int
    key: bytes
    record: int
    generation: int
    view: memoryview


class DiskStore:
    """Blocks of ``block_bytes`` under opaque keys (1..64 bytes) in ``<root>/<fingerprint hex>/``.

    ``capacity_bytes`` bounds the record bytes (header page + page-rounded payload per block).
    ``durability="fsync"`` fdatasyncs each record before its key is indexed.
    ``direct_io``: None probes O_DIRECT, True requires it, False never uses it.
    ``fault_hook``: see ``FaultHook``. Call ``open()`` before anything else.
    """

    def __init__(
        self,
        root: str | Path,
        block_bytes: int,
        fingerprint: bytes,
        capacity_bytes: int,
        durability: str = "none",
        records_per_slab: int = 256,
        direct_io: bool | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        if len(fingerprint) != 16:
            raise ValueError(f"fingerprint must be 16 bytes, got {len(fingerprint)}")
        if direct_io and block_bytes % PAGE_BYTES:
            raise ValueError(f"direct_io=True needs block_bytes to be a multiple of {PAGE_BYTES}")
        self._layout: SlabLayout = plan_layout(
            Path(root), block_bytes, fingerprint, capacity_bytes, records_per_slab
        )
        self._durable = durability == "fsync"
        self._direct_io_request = direct_io
        self._direct_io = False
        self._fault_hook = fault_hook
        self._lock = threading.Lock()
        self._files = SlabFiles(self._durable, self._fault)
        self._index = RecordIndex(self._layout.n_records, self._layout.records_per_slab)
        self._local = threading.local()
        self._is_open = False
        self._degraded = False
        self._torn_possible = False

    # ---- lifecycle -------------------------------------------------------------------------

    def open(
        self, on_batch: Callable[[list[bytes]], None] | None = None, batch_size: int = 4096
    ) -> None:
        """Create the layout directory (0700, see ``make_private_directory``) and lock it,
        check or write ``layout.json`` (0600), choose the I/O mode, and rebuild the index from
        the header pages of existing slab files (after an unclean close, every payload is
        verified too). Records that are not a valid header of this layout, payloads that fail
        their checksum, and older duplicate copies of a key get their header page cleared; the
        keys lost to a failed checksum are logged (``disk_scan_corrupt_blocks``). ``on_batch``
        receives the found keys in lists of up to ``batch_size`` while the scan goes on (it runs
        in this thread). LayoutError if the directory holds an incompatible layout or another
        process has it open."""
        if self._is_open:
            raise RuntimeError("DiskStore is already open")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        make_private_directory(self._layout.directory)
        self._files.lock_directory(self._layout)
        try:
            self._layout = adopt_layout(self._layout)
            self._direct_io = self._files.direct_io = self._choose_direct_io()
            clean = take_clean_mark(self._layout.directory)
            self._torn_possible = False
            found = self._scan(on_batch, batch_size, verify=not clean)
        except BaseException:
            self._files.release()
            raise
        self._is_open = True
        self._log.info(
            "disk_store_opened",
            blocks=found,
            clean=clean,
            direct_io=self._direct_io,
            records=self._layout.n_records,
            record_size=self._layout.record_size,
            durability="fsync" if self._durable else "none",
        )

    def close(self) -> None:
        """Flush the slab files, mark the directory clean unless a failed put may have left a
        torn record behind (see the module docstring), close files and unlock the directory.
        In-flight calls must have returned. Idempotent."""
        with self._lock:
            if not self._is_open:
                return
            self._is_open = False
        try:
            if not self._torn_possible:
                for slab_file in self._files.values():
                    os.fdatasync(slab_file.buffered)
                mark_clean(self._layout.directory)
        except OSError as exc:
            self._log.warning("disk_clean_mark_failed", error=str(exc))
        finally:
            self._files.release()

    # ---- properties ------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The layout directory, ``<root>/<fingerprint hex>``."""
        return self._layout.directory

    @property
    def block_bytes(self) -> int:
        return self._layout.block_bytes

    @property
    def record_size(self) -> int:
        return self._layout.record_size

    @property
    def capacity_bytes(self) -> int:
        """Usable capacity: the requested capacity rounded down to whole records."""
        return self._layout.n_records * self._layout.record_size

    @property
    def used_bytes(self) -> int:
        """Bytes of records that are indexed, being written, or waiting for a read to finish."""
        with self._lock:
            return self._index.used_records * self._layout.record_size

    @property
    def degraded(self) -> bool:
        """True after a put failed for lack of space, until a put succeeds."""
        return self._degraded

    @property
    def direct_io(self) -> bool:
        """Whether this store uses O_DIRECT (decided by ``open()``)."""
        return self._direct_io

    # ---- index queries ---------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            return self._index.keys()

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark the given stored keys most recently used (absent keys are ignored)."""
        with self._lock:
            for key in keys:
                self._index.touch(key)

    # ---- block I/O -------------------------------------------------------------------------

    def put(
        self,
        key: bytes,
        src,
        evicted: list[bytes] | None = None,
        checksum: BlockChecksum | None = None,
    ) -> list[bytes]:
        """Store ``src`` (a buffer of exactly ``block_bytes``) under ``key``; returns the keys
        evicted to make room (at most one). ``checksum``: the checksum of ``src`` taken when its
        bytes were written, maybe in slices (stored as is, so bytes that changed since fail
        their check when read); the xxh3 of ``src`` computed when None. Raises StoreFull, or the OSError of a failed
        write; then the new bytes are not visible and the key's previous copy may be gone too.
        ``evicted``, when given, receives the evicted keys as soon as they leave the index, so
        the caller learns of them even when the write then fails; each eviction is logged
        (``disk_keys_evicted``) before the evicted block's header is touched."""
        self._require_open()
        _check_key(key)
        view = self._payload_view(src, writable=False)
        if checksum is None:
            checksum = BlockChecksum(payload_checksum(view))
        with self._lock:
            reservation = self._index.reserve(key, getattr(self._local, "last_record", -1))
        self._local.last_record = reservation.record
        if reservation.evicted:
            self._log.info(
                "disk_keys_evicted", for_key=key.hex(), keys=[k.hex() for k in reservation.evicted]
            )
            if evicted is not None:
                evicted.extend(reservation.evicted)
        record = reservation.record
        slab, offset = self._layout.locate(record)
        header_may_be_valid = reservation.stale_header
        try:
            slab_file = self._files.writable(self._layout, slab, key)
            fd = slab_file.buffered
            if slab_file.direct is not None and is_page_aligned(view):
                fd = slab_file.direct
            page = self._write_page()
            header = checksum.header(
                key, len(view), self._layout.fingerprint, reservation.generation
            )
            page[:HEADER_SIZE] = header.encode()
            header_may_be_valid = True
            self._fault("write_record", key)
            pwritev_all(fd, [page, view], offset, PAGE_BYTES + len(view))
            self._sync(slab_file, key)
        except BaseException as exc:
            cleared = not header_may_be_valid or self._clear_header(record, key)
            with self._lock:
                self._index.release(record, cleared)
            if isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS:
                self._degraded = True
                self._log.warning("disk_store_degraded", key=key.hex(), error=str(exc))
            raise
        with self._lock:
            to_clear = self._index.commit(key, record)
            recovered, self._degraded = self._degraded, False
        if recovered:
            self._log.info("disk_store_recovered", key=key.hex())
        if to_clear is not None:
            self._clear_and_release(to_clear, key)
        return reservation.evicted

    def get(self, key: bytes, dst) -> BlockHeader:
        """Copy ``key``'s payload into ``dst`` (a writable buffer of exactly ``block_bytes``) and
        return its verified header (whose checksum is that of the bytes now in ``dst``).
        KeyError if absent; CorruptBlock if the stored copy is bad (it is dropped);
        TransientIOError if the read failed but the block is kept. After a failure ``dst`` may
        hold garbage."""
        outcome = self.get_many([key], [dst])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def get_many(self, keys: Sequence[bytes], dsts: Sequence[Any]) -> list[GetOutcome]:
        """``get`` of each key into its ``dst``: for each, its verified header or the exception
        ``get`` would raise (KeyError, CorruptBlock, TransientIOError). Records that lie one
        after another in a slab file, in the order given, are read with one ``preadv`` of up to
        ``READ_RUN_BYTES`` of payload (the fault hook runs for each of their keys first); a
        run whose read fails or comes up short is read again key by key, so each key gets its
        own outcome."""
        self._require_open()
        views = [self._payload_view(dst, writable=True) for dst in dsts]
        outcomes: list[GetOutcome | None] = [None] * len(keys)
        pinned: list[_PinnedRead] = []
        with self._lock:
            for index, key in enumerate(keys):
                try:
                    record, generation = self._index.pin(key)
                except KeyError as exc:
                    outcomes[index] = exc
                    continue
                pinned.append(_PinnedRead(index, key, record, generation, views[index]))
        try:
            for run in self._runs(pinned):
                for read, outcome in zip(run, self._read_run(run), strict=True):
                    outcomes[read.index] = outcome
        finally:
            to_clear: list[_PinnedRead] = []
            corrupt: list[tuple[_PinnedRead, CorruptBlock]] = []
            with self._lock:
                for read in pinned:
                    bad = outcomes[read.index]
                    if isinstance(bad, CorruptBlock):
                        corrupt.append((read, bad))
                        self._index.drop(read.key, read.record)
                    if self._index.unpin(read.record):
                        to_clear.append(read)
            for read, bad in corrupt:
                self._log.warning(
                    "disk_block_corrupt", key=read.key.hex(), record=read.record, reason=str(bad)
                )
            for read in to_clear:
                self._clear_and_release(read.record, read.key)
        return cast(list[GetOutcome], outcomes)

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if it was absent. Its header page is cleared now, or after the
        reads in progress finish."""
        self._require_open()
        with self._lock:
            record = self._index.record_of(key)
            if record is None:
                return False
            must_clear = self._index.drop(key, record)
        if must_clear:
            self._clear_and_release(record, key)
        return True

    # ---- internals -------------------------------------------------------------------------

    @property
    def _log(self) -> Any:
        """A lazy structlog logger bound to this store's directory (resolved at log time)."""
        return structlog.get_logger(directory=str(self._layout.directory))

    def _runs(self, reads: list[_PinnedRead]) -> Iterable[list[_PinnedRead]]:
        """``reads`` in order, cut into runs of records that follow each other in one slab file
        (records of whole pages only), each of at most ``READ_RUN_BYTES`` of payload."""
        layout = self._layout
        block_bytes = layout.block_bytes
        contiguous = layout.record_size == PAGE_BYTES + block_bytes
        most = max(1, min(READ_RUN_BYTES // block_bytes, MAX_RUN_RECORDS))
        run: list[_PinnedRead] = []
        for read in reads:
            if run and (
                not contiguous
                or len(run) >= most
                or read.record != run[-1].record + 1
                or layout.locate(read.record)[0] != layout.locate(run[0].record)[0]
            ):
                yield run
                run = []
            run.append(read)
        if run:
            yield run

    def _read_run(self, run: list[_PinnedRead]) -> list[GetOutcome]:
        """The outcomes of ``run`` (records one after another, see ``_runs``)."""
        if len(run) == 1:
            return [self._read_one(run[0])]
        slab, offset = self._layout.locate(run[0].record)
        slab_file = self._files[slab]
        pages = self._read_pages(len(run))
        fd = slab_file.buffered
        if slab_file.direct is not None and all(is_page_aligned(r.view) for r in run):
            fd = slab_file.direct
        bufs: list[Any] = []
        for page, read in zip(pages, run, strict=False):
            bufs += (page, read.view)
        total = len(run) * self._layout.record_size
        try:
            for read in run:
                self._fault("read", read.key)
            got = preadv_all(fd, bufs, offset, total)
        except OSError:
            got = -1
        if got != total:  # each key's own read says which failed, and how
            return [self._read_one(read) for read in run]
        outcomes: list[GetOutcome] = [
            self._check(read, page) for read, page in zip(run, pages, strict=False)
        ]
        with self._lock:
            for read, outcome in zip(run, outcomes, strict=True):
                if not isinstance(outcome, CorruptBlock):
                    self._index.note_read_ok(read.record)
        return outcomes

    def _read_one(self, read: _PinnedRead) -> GetOutcome:
        """One record's read: its header, or CorruptBlock / TransientIOError."""
        slab, offset = self._layout.locate(read.record)
        slab_file = self._files[slab]
        page = self._read_pages(1)[0]
        fd = slab_file.buffered
        if slab_file.direct is not None and is_page_aligned(read.view):
            fd = slab_file.direct
        total = PAGE_BYTES + len(read.view)
        try:
            self._fault("read", read.key)
            got = preadv_all(fd, [page, read.view], offset, total)
        except OSError as exc:
            with self._lock:
                failures = self._index.note_read_error(read.record)
            if exc.errno == errno.EIO and failures >= MAX_READ_ERRORS:
                return CorruptBlock(f"{failures} consecutive read errors: {exc}")
            return TransientIOError(exc.errno, f"reading block failed: {exc.strerror or exc}")
        if got != total:
            outcome: GetOutcome = CorruptBlock(f"short read: {got} of {total} bytes")
        else:
            outcome = self._check(read, page)
        if not isinstance(outcome, CorruptBlock):
            with self._lock:
                self._index.note_read_ok(read.record)
        return outcome

    def _check(self, read: _PinnedRead, page: mmap.mmap) -> BlockHeader | CorruptBlock:
        """The verified header of a record read into ``page`` and ``read.view``, or the
        CorruptBlock it is."""
        try:
            header = decode_header(page, self._layout.fingerprint)
            if header.generation != read.generation:
                raise CorruptBlock(
                    f"generation {header.generation} differs from the index ({read.generation})"
                )
            verify_payload(header, read.key, read.view)
        except CorruptBlock as exc:
            return exc
        return header

    def _clear_header(self, record: int, key: bytes) -> bool:
        """Zero ``record``'s header page; False (logged) if that failed."""
        slab, offset = self._layout.locate(record)
        slab_file = self._files.get(slab)
        if slab_file is None:
            return True
        try:
            self._fault("clear", key)
            pwrite_all(slab_file.header_fd, ZERO_PAGE, offset)
        except OSError as exc:
            self._torn_possible = True
            self._log.warning("disk_header_clear_failed", record=record, error=str(exc))
            return False
        return True

    def _clear_and_release(self, record: int, key: bytes) -> None:
        cleared = self._clear_header(record, key)
        with self._lock:
            self._index.release(record, cleared)

    def _scan(
        self, on_batch: Callable[[list[bytes]], None] | None, batch_size: int, verify: bool
    ) -> int:
        layout = self._layout
        existing = self._files.open_existing(layout)
        scan = scan_store(
            {slab: self._files[slab].header_fd for slab in existing},
            layout,
            partial(self._fault, "scan", b""),
            verify,
            on_batch,
            batch_size,
            SCAN_THREADS,
        )
        best, to_clear, stale = scan.best, scan.to_clear, scan.unreadable
        stale.extend(r for r in to_clear if not self._clear_header(r, b""))
        self._torn_possible = self._torn_possible or bool(stale)
        if to_clear or stale:
            self._log.warning(
                "disk_scan_dropped_records", cleared=len(to_clear), unreadable=len(stale)
            )
        lost = sorted(scan.corrupt.difference(best))
        if lost:
            self._log.warning("disk_scan_corrupt_blocks", keys=[key.hex() for key in lost])
        entries = [(key, record, generation) for key, (record, generation) in best.items()]
        self._index = RecordIndex.from_scan(
            layout.n_records, layout.records_per_slab, entries, stale
        )
        return len(entries)

    def _choose_direct_io(self) -> bool:
        if self._direct_io_request is False:
            return False
        if self._layout.block_bytes % PAGE_BYTES:
            self._log.info(
                "disk_direct_io_off_unaligned_block", block_bytes=self._layout.block_bytes
            )
            return False
        if probe_direct_io(self._layout.directory):
            return True
        if self._direct_io_request:
            raise OSError(errno.EINVAL, f"O_DIRECT is not supported in {self._layout.directory}")
        self._log.warning("disk_direct_io_unavailable", block_bytes=self._layout.block_bytes)
        return False

    def _sync(self, slab_file: SlabFile, key: bytes) -> None:
        if self._durable:
            self._fault("fsync", key)
            os.fdatasync(slab_file.buffered)

    def _fault(self, op: str, key: bytes) -> None:
        if self._fault_hook is not None:
            self._fault_hook(op, key)

    def _read_pages(self, count: int) -> list[mmap.mmap]:
        """This thread's aligned pages that reads' headers land in (at least ``count``)."""
        pages: list[mmap.mmap] = getattr(self._local, "read_pages", [])
        while len(pages) < count:
            pages.append(page_buffer())
        self._local.read_pages = pages
        return pages

    def _write_page(self) -> mmap.mmap:
        """This thread's aligned header page for writes; bytes past the header stay zero."""
        page = getattr(self._local, "write_page", None)
        if page is None:
            page = self._local.write_page = page_buffer()
        return page

    def _payload_view(self, buf, writable: bool) -> memoryview:
        view = memoryview(buf)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if view.nbytes != self._layout.block_bytes:
            raise ValueError(
                f"buffer holds {view.nbytes} bytes, blocks are {self._layout.block_bytes}"
            )
        if writable and view.readonly:
            raise ValueError("destination buffer is read-only")
        return view

    def _require_open(self) -> None:
        if not self._is_open:
            raise RuntimeError("DiskStore is not open")


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes")
