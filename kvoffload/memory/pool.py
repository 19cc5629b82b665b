"""The host pool: one POSIX shared-memory segment of ``num_slots`` fixed-size block slots.

Ownership: the supervisor ``create``s the segment (mode 0600, per-run name) and is the only
process that ``unlink``s it. Every process that moves bytes ``attach``es and ``close``s its own
mapping. Slot views (memoryview, numpy, ``torch.from_numpy`` of a slot array) are zero-copy
windows into the mapping that keep it alive; callers must drop them before ``close`` or the unmap
is left to the garbage collector. ``torch.frombuffer`` over the mapping does NOT keep it alive
(a tensor could outlive the unmap), so it is not used on the pool.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import PAGE_BYTES
from kvoffload.memory.cuda_host import register_host_memory, unregister_host_memory
from kvoffload.memory.shmseg import OwnedSegment, attach_segment, close_mapping, create_segment

log = get_logger()


class PoolMismatch(Exception):
    """An existing segment does not have the size the caller expects."""


def _validate_geometry(name: str, num_slots: int, block_bytes: int) -> None:
    if not name.startswith("/") or "/" in name[1:] or len(name) < 2:
        raise ValueError(f"pool name must be '/<name>' without further slashes, got {name!r}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if block_bytes <= 0 or block_bytes % PAGE_BYTES:
        raise ValueError(
            f"block_bytes must be a positive multiple of {PAGE_BYTES}, got {block_bytes}"
        )


def _reserve_and_prefault(fd: int, mapping: mmap.mmap, size: int) -> None:
    """Allocate every page now: first touch costs about 1 s per GiB, and touching a page of a
    full tmpfs later would kill the toucher with SIGBUS instead of failing here with ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        log.debug("pool_fallocate_unsupported", error=repr(exc))
    populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
    if populate is not None:
        try:
            mapping.madvise(populate)
            return
        except OSError as exc:
            log.debug("pool_madvise_populate_failed", error=repr(exc))
    pages = np.frombuffer(mapping, dtype=np.uint8)
    try:
        pages[::PAGE_BYTES] = 0  # the segment is new, so it is all zeros already
    finally:
        del pages


class HostPool(OwnedSegment):
    """A mapped host pool. Build it with ``create`` (creator) or ``attach`` (everyone else)."""

    what = "host pool"

    def __init__(
        self, name: str, num_slots: int, block_bytes: int, mapping: mmap.mmap, creator: bool
    ) -> None:
        self._name = name
        self._num_slots = num_slots
        self._block_bytes = block_bytes
        self._creator = creator
        self._mmap: mmap.mmap | None = mapping
        self._array: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8).reshape(
            num_slots, block_bytes
        )
        self._address = int(self._array.ctypes.data)
        self._cuda_registered = False
        self._unlinked = False

    @classmethod
    def create(cls, name: str, num_slots: int, block_bytes: int, prefault: bool = True) -> HostPool:
        """Create and map a new segment (FileExistsError if ``name`` exists). With ``prefault``
        every page is allocated up front; an ENOSPC there unlinks the segment and raises
        OSError."""
        _validate_geometry(name, num_slots, block_bytes)
        size = num_slots * block_bytes
        prepare = (
            (lambda fd, mapping: _reserve_and_prefault(fd, mapping, size)) if prefault else None
        )
        mapping = create_segment(name, size, "host pool", prepare)
        log.debug("pool_created", pool=name, slots=num_slots, bytes=size, prefault=prefault)
        return cls(name, num_slots, block_bytes, mapping, creator=True)

    @classmethod
    def attach(cls, name: str, num_slots: int, block_bytes: int) -> HostPool:
        """Map an existing segment, page tables populated. FileNotFoundError if it does not exist; PoolMismatch if its
        size is not ``num_slots * block_bytes``."""
        _validate_geometry(name, num_slots, block_bytes)
        size = num_slots * block_bytes

        def check_size(actual: int) -> None:
            if actual != size:
                raise PoolMismatch(
                    f"host pool {name} is {actual} bytes, expected {num_slots} slots x "
                    f"{block_bytes} bytes = {size}"
                )

        mapping = attach_segment(name, "host pool", check_size, populate=True)
        return cls(name, num_slots, block_bytes, mapping, creator=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def size(self) -> int:
        return self._num_slots * self._block_bytes

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def cuda_registered(self) -> bool:
        return self._cuda_registered

    def _live_array(self) -> np.ndarray:
        if self._array is None:
            raise ValueError(f"host pool {self._name} is closed")
        return self._array

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self._num_slots})")

    def slot(self, slot: int) -> memoryview:
        """Writable zero-copy view of one slot (``block_bytes`` long, format ``B``)."""
        return self.slot_array(slot).data

    def slot_array(self, slot: int) -> np.ndarray:
        """Writable zero-copy uint8 array of one slot."""
        self._check_slot(slot)
        return self._live_array()[slot]

    def as_numpy(self) -> np.ndarray:
        """Writable zero-copy uint8 array of shape ``(num_slots, block_bytes)``."""
        return self._live_array()[:]

    def address(self) -> int:
        """Base address of this process's mapping (page aligned)."""
        self._live_array()
        return self._address

    def register_cuda(self) -> bool:
        """Pin this process's mapping for CUDA DMA; False without CUDA or on failure. Idempotent."""
        if not self._cuda_registered:
            self._cuda_registered = register_host_memory(self.address(), self.size)
        return self._cuda_registered

    def close(self) -> None:
        """Unregister from CUDA, then unmap. Idempotent. If views handed out are still alive the
        unmap is deferred to the garbage collector (logged as ``shm_close_deferred``)."""
        if self._array is None:
            return
        if self._cuda_registered:
            unregister_host_memory(self._address)
            self._cuda_registered = False
        self._array = None
        mapping, self._mmap = self._mmap, None
        assert mapping is not None
        close_mapping(mapping, "host pool", self._name)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"HostPool({self._name!r}, num_slots={self._num_slots}, "
            f"block_bytes={self._block_bytes}, {state})"
        )
