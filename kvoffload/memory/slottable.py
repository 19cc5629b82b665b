"""The slot header table: one ``BlockHeader`` (128 bytes) per host-pool slot, in its own small
POSIX shared-memory segment next to the pool.

A header describes the block a slot holds once that block's bytes are completely written: the
worker that wrote the slot stamps it (key, payload length, xxh3 checksum of the slot, deployment
fingerprint, generation = the job id); the manager clears it whenever the slot is freed or handed
to a new key. A restarted manager rebuilds its primary index from these headers. The table holds
metadata only, never block bytes.

Ownership is the pool's: the supervisor ``create``s (mode 0600) and ``unlink``s the segment;
every other process ``attach``es and ``close``s its own mapping. Writes are not atomic across
processes: a reader that sees a half-written or half-cleared header fails its crc and skips it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np

from kvoffload.memory.blockformat import HEADER_SIZE, BlockHeader, CorruptBlock, decode_header
from kvoffload.memory.shmseg import OwnedSegment, attach_segment, close_mapping, create_segment

_ZERO_HEADER = bytes(HEADER_SIZE)


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
        mapping = create_segment(name, num_slots * HEADER_SIZE, "slot table")
        return cls(name, num_slots, mapping, creator=True)

    @classmethod
    def attach(cls, name: str, num_slots: int) -> SlotTable:
        """Map an existing table. FileNotFoundError if absent; ValueError if its size is not
        ``num_slots`` headers."""
        size = num_slots * HEADER_SIZE

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

    def write(self, slot: int, header: BlockHeader) -> None:
        """Describe ``slot`` with ``header`` (call only after the slot's bytes are complete)."""
        offset = self._offset(slot)
        self._live()[offset : offset + HEADER_SIZE] = header.encode()

    def clear(self, slot: int) -> None:
        """Forget what ``slot`` held."""
        offset = self._offset(slot)
        self._live()[offset : offset + HEADER_SIZE] = _ZERO_HEADER

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
        rows = np.frombuffer(self._live(), dtype=np.uint8).reshape(self._num_slots, HEADER_SIZE)
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
