"""Create, attach, close and unlink the POSIX shared-memory segments kvoffload maps (the host
pool, the slot header table, engines' KV caches).

Contract: the creator makes the segment with mode 0600 and is the only one that unlinks it;
every process closes its own mapping. A mapping with live exported views (numpy arrays over it)
cannot be unmapped yet: ``close_mapping`` then leaves it to the garbage collector and logs it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable

import posix_ipc

from kvoffload.logs import get_logger

log = get_logger()

# Fills the page tables at attach time: the first touch of a shared page in a new process costs
# a minor fault, which would otherwise land on the first transfers.
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def create_segment(
    name: str, size: int, what: str, prepare: Callable[[int, mmap.mmap], None] | None = None
) -> mmap.mmap:
    """Create (O_CREX, mode 0600) and map a new segment; FileExistsError if ``name`` exists.
    ``prepare(fd, mapping)`` runs before the fd is closed (e.g. reserving pages); if anything
    fails the segment is unmapped and unlinked again."""
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"{what} {name} already exists") from exc
    try:
        os.fchmod(shm.fd, 0o600)
        mapping = mmap.mmap(shm.fd, size)
        try:
            if prepare is not None:
                prepare(shm.fd, mapping)
        except BaseException:
            mapping.close()
            raise
    except BaseException:
        shm.close_fd()
        shm.unlink()
        raise
    shm.close_fd()
    return mapping


def attach_segment(
    name: str, what: str, check_size: Callable[[int], None] | None = None, populate: bool = False
) -> mmap.mmap:
    """Map an existing segment whole. FileNotFoundError if it does not exist, ValueError if
    ``name`` is not a valid segment name; ``check_size`` sees the segment's size first and raises
    to refuse it."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"{what} {name} does not exist") from exc
    except ValueError as exc:
        raise ValueError(f"bad {what} name {name!r}: {exc}") from None
    try:
        size = os.fstat(shm.fd).st_size
        if check_size is not None:
            check_size(size)
        return mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | (MAP_POPULATE if populate else 0))
    finally:
        shm.close_fd()


def stat_segment(name: str, what: str) -> os.stat_result:
    """``fstat`` of an existing segment, opened read-only and never mapped (its size and
    identity, cheaply). FileNotFoundError if it does not exist, PermissionError if it cannot
    be opened, ValueError for a bad name."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"{what} {name} does not exist") from exc
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(f"{what} {name} cannot be opened: {exc}") from None
    except (ValueError, posix_ipc.Error) as exc:
        raise ValueError(f"bad {what} name {name!r}: {exc}") from None
    try:
        return os.fstat(shm.fd)
    finally:
        shm.close_fd()


def close_mapping(mapping: mmap.mmap, what: str, name: str) -> None:
    """Unmap; with views still alive the unmap is deferred to the garbage collector."""
    try:
        mapping.close()
    except BufferError:
        log.warning("shm_close_deferred", what=what, segment=name)


def unlink_segment(name: str) -> None:
    """Remove a segment's name; a name already gone is ignored."""
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)


class OwnedSegment:
    """Base of a mapped segment object: the creator-only, idempotent ``unlink`` and the context
    manager (exit closes; the creator also unlinks). Subclasses set ``_name``, ``_creator`` and
    ``_unlinked`` and implement ``close``; ``what`` names the segment in errors."""

    what = "segment"
    _name: str
    _creator: bool
    _unlinked: bool

    def close(self) -> None:
        raise NotImplementedError

    def unlink(self) -> None:
        """Remove the segment's name (creator only; mappings stay valid until closed).
        Idempotent; a name that is already gone is ignored."""
        if not self._creator:
            raise PermissionError(
                f"{self.what} {self._name} was attached, only its creator unlinks"
            )
        if self._unlinked:
            return
        unlink_segment(self._name)
        self._unlinked = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
        if self._creator:
            self.unlink()
