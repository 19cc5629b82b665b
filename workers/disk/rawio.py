"""Low-level file I/O for the disk store: page-aligned buffers, the O_DIRECT probe, and
positional reads/writes that either move every requested byte or say how far they got."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog

from kvoffload.memory.blockformat import PAGE_BYTES

O_DIRECT: int = getattr(os, "O_DIRECT", 0)

ZERO_PAGE = mmap.mmap(-1, PAGE_BYTES)
"""A page-aligned page of zeros. Never written to: any thread may use it as a write source."""


def page_buffer() -> mmap.mmap:
    """A fresh zeroed, page-aligned ``PAGE_BYTES`` buffer (anonymous mmap), usable with O_DIRECT."""
    return mmap.mmap(-1, PAGE_BYTES)


def round_up(n: int, multiple: int = PAGE_BYTES) -> int:
    return -(-n // multiple) * multiple


def is_page_aligned(buf) -> bool:
    """True when the first byte of ``buf`` (any buffer, read-only allowed) sits on a page boundary."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % PAGE_BYTES == 0


def pwrite_all(fd: int, buf, offset: int) -> None:
    """Write all of ``buf`` at ``offset``; a short write is continued, a zero-length one is EIO."""
    size = len(buf)
    done = os.pwrite(fd, buf, offset)
    if done == size:
        return
    view = memoryview(buf).cast("B")
    while done < size:
        n = os.pwrite(fd, view[done:], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def pwritev_all(fd: int, bufs: Sequence, offset: int, total: int) -> None:
    """Write ``bufs`` (``total`` bytes together) contiguously at ``offset`` with one ``pwritev``;
    a short write is continued, a zero-length one is EIO."""
    done = os.pwritev(fd, bufs, offset)
    if done == total:
        return
    views = [memoryview(b).cast("B") for b in bufs]
    skip = done
    while done < total:
        while skip >= len(views[0]):
            skip -= len(views.pop(0))
        if skip:
            views[0] = views[0][skip:]
        n = os.pwritev(fd, views, offset + done)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n
        skip = n


def preadv_all(fd: int, bufs: Sequence, offset: int, total: int) -> int:
    """Fill ``bufs`` (``total`` bytes together) from ``offset``; return bytes read (< total at EOF)."""
    done = os.preadv(fd, bufs, offset)
    if done == total or done == 0:
        return done
    views = [memoryview(b).cast("B") for b in bufs]
    skip = done
    while views and skip >= len(views[0]):
        skip -= len(views.pop(0))
    while views:
        if skip:
            views[0] = views[0][skip:]
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        skip = n
        while views and skip >= len(views[0]):
            skip -= len(views.pop(0))
    return done


def probe_direct_io(directory: Path) -> bool:
    """Whether O_DIRECT works in ``directory``: write and read back one aligned page in a temporary
    file there (removed afterwards). Any failure, including a platform without O_DIRECT, is False."""
    if not O_DIRECT:
        return False
    path = directory / f".direct-io-probe-{os.getpid()}"
    written, read_back = page_buffer(), page_buffer()
    written.write(os.urandom(PAGE_BYTES))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o600)
    except OSError as exc:
        structlog.get_logger().debug("disk_direct_io_probe_failed", step="open", error=str(exc))
        return False
    try:
        pwrite_all(fd, written, 0)
        return (
            preadv_all(fd, [read_back], 0, PAGE_BYTES) == PAGE_BYTES and read_back[:] == written[:]
        )
    except OSError as exc:
        structlog.get_logger().debug("disk_direct_io_probe_failed", step="io", error=str(exc))
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
