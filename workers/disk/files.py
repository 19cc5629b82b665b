"""The open files of a ``DiskStore``: the lock on its layout directory and each slab file's
descriptors (buffered, and O_DIRECT when the store uses it).

A slab file is opened when ``open`` finds it, or created and allocated to its full size on its
first write (with durability ``fsync``, the file and the directory are synced before any
record is written into it). Thread safe: descriptors are created under a lock, and read
without one once a slab file is sized.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvoffload.runtime.locks import flock_holder
from workers.disk.errors import LayoutError
from workers.disk.layout import LOCK_FILE, SlabLayout, fsync_directory
from workers.disk.rawio import O_DIRECT


@dataclass(slots=True)
class SlabFile:
    buffered: int
    direct: int | None
    sized: bool

    @property
    def header_fd(self) -> int:
        return self.buffered if self.direct is None else self.direct


class SlabFiles:
    def __init__(self, durable: bool, fault: Callable[[str, bytes], None]) -> None:
        """``durable``: sync a new slab file and its directory once allocated; ``fault(op,
        key)`` runs before each allocation (fault injection)."""
        self.direct_io = False
        """Open an O_DIRECT descriptor next to each buffered one."""
        self._durable = durable
        self._fault = fault
        self._lock = threading.Lock()
        self._files: dict[int, SlabFile] = {}
        self._lock_fd: int | None = None

    def __getitem__(self, slab: int) -> SlabFile:
        return self._files[slab]

    def get(self, slab: int) -> SlabFile | None:
        return self._files.get(slab)

    def values(self) -> Iterable[SlabFile]:
        return self._files.values()

    def lock_directory(self, layout: SlabLayout) -> None:
        """Take the layout directory's lock; LayoutError if another store holds it."""
        fd = os.open(layout.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = flock_holder(layout.directory / LOCK_FILE)
            by = f" (pid {holder})" if holder is not None else ""
            raise LayoutError(f"{layout.directory} is open in another DiskStore{by}") from None
        self._lock_fd = fd

    def open_existing(self, layout: SlabLayout) -> list[int]:
        """Open the slab files of ``layout`` that exist; returns their numbers."""
        existing = [s for s in range(layout.n_slabs) if layout.slab_path(s).exists()]
        for slab in existing:
            self._files[slab] = self._open(layout, slab, create=False)
        return existing

    def writable(self, layout: SlabLayout, slab: int, key: bytes) -> SlabFile:
        """The slab's descriptors, creating the file and allocating its full size on first use."""
        slab_file = self._files.get(slab)
        if slab_file is not None and slab_file.sized:
            return slab_file
        with self._lock:
            slab_file = self._files.get(slab)
            if slab_file is None:
                slab_file = self._open(layout, slab, create=True)
                self._files[slab] = slab_file
            if not slab_file.sized:
                self._fault("allocate", key)
                _allocate(slab_file.buffered, layout.slab_bytes(slab))
                if self._durable:
                    os.fsync(slab_file.buffered)
                    fsync_directory(layout.directory)
                slab_file.sized = True
        return slab_file

    def release(self) -> None:
        """Close every descriptor and unlock the directory."""
        with self._lock:
            for slab_file in self._files.values():
                os.close(slab_file.buffered)
                if slab_file.direct is not None:
                    os.close(slab_file.direct)
            self._files.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open(self, layout: SlabLayout, slab: int, create: bool) -> SlabFile:
        path = layout.slab_path(slab)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        buffered = os.open(path, flags, 0o600)
        direct = None
        if self.direct_io:
            try:
                direct = os.open(path, os.O_RDWR | os.O_CLOEXEC | O_DIRECT)
            except BaseException:
                os.close(buffered)
                raise
        return SlabFile(buffered, direct, sized=False)


def _allocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes of disk for the file; a filesystem without fallocate gets a size."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))
