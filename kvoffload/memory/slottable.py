"""The slot header table: one ``BlockHeader`` (128 bytes) per host-pool slot, in its own small
POSIX shared-memory segment next to the pool.

A header describes the block a slot holds once that block's bytes are completely written: the
worker that wrote the slot stamps it (key, payload length, xxh3 checksum of the slot, deployment
fingerprint, generation = the job id); the manager clears it whenever the slot is freed or handed
to a new key. A restarted manager rebuilds its primary index from these headers. The table holds
metadata only, never block bytes.

A block written in slices (one per tensor-parallel rank) also keeps its slices' digests beside
its header (the headers come first in the segment, then ``MAX_SLICES`` digests per slot), so a
rank can check its own slice after a restart too. The digests need no checksum of their own:
they are read only when they combine into the header's checksum.

Ownership is the pool's: the supervisor ``create``s (mode 0600) and ``unlink``s the segment;
every other process ``attach``es and ``close``s its own mapping. Writes are not atomic across
processes: a reader that sees a half-written or half-cleared header fails its crc and skips it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence

import numpy as np

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    MAX_SLICES,
    BlockHeader,
    CorruptBlock,
    combine_checksums,
    decode_header,
)
from kvoffload.memory.shmseg import OwnedSegment, attach_segment, close_mapping, create_segment

_ZERO_HEADER = bytes(HEADER_SIZE)
_DIGESTS = struct.Struct(f"<{MAX_SLICES}Q")


def table_bytes(num_slots: int) -> int:
    """Bytes of the table segment of ``num_slots`` slots (headers, then slice digests)."""
    return num_slots * (HEADER_SIZE + _DIGESTS.size)


class SlotTable(OwnedSegment):
    """A mapped slot header table of ``num_slots`` entries. Build it with ``create`` or ``attach``."""

    what = "slot table"

    def __init__(self, name: str, num_slots: int, mapping: mmap.mmap, creator: bool) -> None:
        self._name = name
        self._num_slots = num_slots
        self._mmap: mmap.mmap | None = mapping
        self._creator = creator
        self._unlinked = False

    @classmethod
    def create(cls, name: str, num_slots: int) -> SlotTable:
        """Create and map a new, all-zero table (FileExistsError if ``name`` exists)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        mapping = create_segment(name, table_bytes(num_slots), "slot table")
        return cls(name, num_slots, mapping, creator=True)

    @classmethod
    def attach(cls, name: str, num_slots: int) -> SlotTable:
        """Map an existing table. FileNotFoundError if absent; ValueError if its size is not
        ``num_slots`` headers."""
        size = table_bytes(num_slots)

        def check_size(actual: int) -> None:
            if actual != size:
                raise ValueError(f"slot table {name} is {actual} bytes, expected {size}")

        mapping = attach_segment(name, "slot table", check_size)
        return cls(name, num_slots, mapping, creator=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def _live(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"slot table {self._name} is closed")
        return self._mmap

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self._num_slots})")
        return slot * HEADER_SIZE

    def _digests_offset(self, slot: int) -> int:
        return self._num_slots * HEADER_SIZE + self._offset(slot) // HEADER_SIZE * _DIGESTS.size

    def write(self, slot: int, header: BlockHeader, slice_checksums: Sequence[int] = ()) -> None:
        """Describe ``slot`` with ``header`` (call only after the slot's bytes are complete);
        ``slice_checksums``: the digests of a header of several slices (ValueError unless they
        combine into its checksum)."""
        offset, live = self._offset(slot), self._live()
        if header.slices > 1:
            if len(slice_checksums) != header.slices or (
                combine_checksums(list(slice_checksums)) != header.checksum
            ):
                raise ValueError(f"slot {slot}: the slice digests do not make the checksum")
            at = self._digests_offset(slot)
            padded = [*slice_checksums, *[0] * (MAX_SLICES - header.slices)]
            live[at : at + _DIGESTS.size] = _DIGESTS.pack(*padded)
        live[offset : offset + HEADER_SIZE] = header.encode()

    def clear(self, slot: int) -> None:
        """Forget what ``slot`` held."""
        offset = self._offset(slot)
        self._live()[offset : offset + HEADER_SIZE] = _ZERO_HEADER

    def slice_checksums(self, slot: int, header: BlockHeader) -> list[int]:
        """The digests of each slice of the block ``header`` (read from ``slot``) describes:
        ``[header.checksum]`` for a block of one slice; empty when the stored digests do not
        make the header's checksum (torn, or overwritten since)."""
        if header.slices <= 1:
            return [header.checksum]
        at = self._digests_offset(slot)
        digests = list(_DIGESTS.unpack(self._live()[at : at + _DIGESTS.size]))[: header.slices]
        return digests if combine_checksums(digests) == header.checksum else []

    def read(self, slot: int, fingerprint: bytes) -> BlockHeader | None:
        """The valid header of ``slot`` for this deployment, or None (zero, torn or foreign)."""
        offset = self._offset(slot)
        raw = self._live()[offset : offset + HEADER_SIZE]
        if raw == _ZERO_HEADER:
            return None
        try:
            return decode_header(raw, fingerprint)
        except CorruptBlock:
            return None

    def read_all(self, fingerprint: bytes) -> list[tuple[int, BlockHeader]]:
        """(slot, header) for every slot with a valid header, in slot order."""
        return list(self._iter_valid(fingerprint))

    def _iter_valid(self, fingerprint: bytes) -> Iterator[tuple[int, BlockHeader]]:
        rows = np.frombuffer(
            self._live(), dtype=np.uint8, count=self._num_slots * HEADER_SIZE
        ).reshape(self._num_slots, HEADER_SIZE)
        try:
            used = np.flatnonzero(rows.any(axis=1)).tolist()
        finally:
            del rows
        for slot in used:
            header = self.read(slot, fingerprint)
            if header is not None:
                yield slot, header

    def close(self) -> None:
        """Unmap (idempotent)."""
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            close_mapping(mapping, "slot table", self._name)
