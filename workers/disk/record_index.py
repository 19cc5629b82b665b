"""In-memory bookkeeping of the disk store: key -> record map in LRU order, record states,
read pins and the free list. Not thread safe: ``DiskStore`` calls it under its lock, and does
every I/O that a state change asks for (invalidating or clearing a header page) outside it.

Record states::

    FREE      in the free list; ``stale`` says its header page may still hold a valid header
    RESERVED  owned by one caller: being written by a put, or having its header page cleared
    LIVE      indexed under a key
    RETIRED   no longer indexed but pinned by reads; cleared when the last read unpins it
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from workers.disk.errors import StoreFull

FREE, RESERVED, LIVE, RETIRED = range(4)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A record handed to a put. ``stale_header``: its header page may hold a valid header (an
    evicted or overwritten block), which a put that fails before writing the record must clear."""

    record: int
    generation: int
    stale_header: bool
    evicted: list[bytes]


def allocation_order(n_records: int, records_per_slab: int) -> list[int]:
    """Every record, slab after slab round robin (the first record of each slab, then the
    second, ...): consecutive puts land in different slab files, so writes in flight at once
    do not queue on one file's inode lock."""
    slabs = -(-n_records // records_per_slab)
    return [
        slab * records_per_slab + index
        for index in range(records_per_slab)
        for slab in range(slabs)
        if slab * records_per_slab + index < n_records
    ]


class RecordIndex:
    """``records_per_slab``: free records are handed out in ``allocation_order``."""

    def __init__(self, n_records: int, records_per_slab: int) -> None:
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._state = bytearray(n_records)
        self._stale = bytearray(n_records)
        self._pins = [0] * n_records
        self._key: list[bytes | None] = [None] * n_records
        self._generation = [0] * n_records
        self._read_errors = [0] * n_records
        self._order = allocation_order(n_records, records_per_slab)
        self._records_per_slab = records_per_slab
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(self._order)
        self._next_generation = 1

    @classmethod
    def from_scan(
        cls,
        n_records: int,
        records_per_slab: int,
        entries: Iterable[tuple[bytes, int, int]],
        stale: Iterable[int] = (),
    ) -> RecordIndex:
        """An index of the scanned ``(key, record, generation)`` entries (distinct keys and
        records), LRU order by generation. Every other record is free; those in ``stale`` may
        hold a valid header on disk."""
        index = cls(n_records, records_per_slab)
        for key, record, generation in sorted(entries, key=lambda e: e[2]):
            index._state[record] = LIVE
            index._key[record] = key
            index._generation[record] = generation
            index._lru[key] = record
            index._next_generation = max(index._next_generation, generation + 1)
        for record in stale:
            index._stale[record] = 1
        index._free = OrderedDict.fromkeys(r for r in index._order if index._state[r] == FREE)
        return index

    @property
    def used_records(self) -> int:
        return len(self._state) - len(self._free)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """Indexed keys, least recently used first."""
        return list(self._lru)

    def record_of(self, key: bytes) -> int | None:
        return self._lru.get(key)

    def touch(self, key: bytes) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def reserve(self, key: bytes, after: int = -1) -> Reservation:
        """A record for a put of ``key``: the key's own record when no read pins it (it leaves
        the index now), else a free record (the one after record ``after`` in its slab when
        that one is free, so one writer's puts lie one after another and read back in one
        read; else the next in allocation order), else the least recently used unpinned one
        (its key is evicted). StoreFull when none of these exists."""
        generation = self._next_generation
        self._next_generation += 1
        own = self._lru.get(key)
        if own is not None and self._pins[own] == 0:
            del self._lru[key]
            return self._take(own, generation, True, [])
        if self._free:
            record = after + 1
            next_in_slab = after >= 0 and record % self._records_per_slab != 0
            if next_in_slab and record in self._free:
                del self._free[record]
            else:
                record, _ = self._free.popitem(last=False)
            return self._take(record, generation, bool(self._stale[record]), [])
        for victim_key, record in self._lru.items():
            if self._pins[record] == 0:
                del self._lru[victim_key]
                return self._take(record, generation, True, [victim_key])
        raise StoreFull(f"all {len(self._state)} records are pinned or being written")

    def commit(self, key: bytes, record: int) -> int | None:
        """Index the written ``record`` under ``key`` as most recently used. Returns a record
        whose header page the caller must now clear and ``release``: the one ``key`` had before
        (if unpinned), or ``record`` itself if a newer copy of ``key`` was committed meanwhile."""
        previous = self._lru.get(key)
        if previous is not None and self._generation[previous] > self._generation[record]:
            return record
        self._state[record] = LIVE
        self._key[record] = key
        self._lru[key] = record
        self._lru.move_to_end(key)
        if previous is None:
            return None
        self._state[previous] = RETIRED
        return previous if self._settle(previous) else None

    def release(self, record: int, cleared: bool) -> None:
        """Return a RESERVED record to the free list; ``cleared`` says its header page is blank."""
        self._state[record] = FREE
        self._stale[record] = 0 if cleared else 1
        self._key[record] = None
        self._read_errors[record] = 0
        self._free[record] = None

    def pin(self, key: bytes) -> tuple[int, int]:
        """Pin ``key``'s record against reuse for a read and mark it most recently used.
        Returns (record, generation); KeyError if absent."""
        record = self._lru[key]
        self._pins[record] += 1
        self._lru.move_to_end(key)
        return record, self._generation[record]

    def unpin(self, record: int) -> bool:
        """Undo one ``pin``; True when the record became RESERVED and the caller must clear it."""
        self._pins[record] -= 1
        return self._settle(record)

    def drop(self, key: bytes, record: int) -> bool:
        """Remove ``key`` from the index if it still maps to ``record``. True when the record
        became RESERVED and the caller must clear it; a pinned record waits for its last unpin."""
        if self._lru.get(key) != record:
            return False
        del self._lru[key]
        self._state[record] = RETIRED
        return self._settle(record)

    def note_read_error(self, record: int) -> int:
        """Count a failed read of ``record``; returns the consecutive failures so far."""
        self._read_errors[record] += 1
        return self._read_errors[record]

    def note_read_ok(self, record: int) -> None:
        self._read_errors[record] = 0

    def _take(
        self, record: int, generation: int, stale_header: bool, evicted: list[bytes]
    ) -> Reservation:
        self._state[record] = RESERVED
        self._key[record] = None
        self._generation[record] = generation
        self._read_errors[record] = 0
        return Reservation(record, generation, stale_header, evicted)

    def _settle(self, record: int) -> bool:
        if self._state[record] == RETIRED and self._pins[record] == 0:
            self._state[record] = RESERVED
            return True
        return False
