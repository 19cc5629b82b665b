"""Who holds a file's ``flock``: read from ``/proc/locks`` (Linux), to name the process that has a
disk store open."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

PROC_LOCKS = Path("/proc/locks")


def flock_holder(path: str | Path) -> int | None:
    """The pid holding an ``flock`` on ``path`` (an existing file), or None when there is none
    or it cannot be told (no ``/proc/locks``, the file is gone)."""
    try:
        st = os.stat(path)
        text = PROC_LOCKS.read_text()
    except OSError:
        return None
    by_inode = None
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:02:131 0 EOF"; waiters have "->" after the number
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        pid, where = fields[4], fields[5].split(":")
        if len(where) != 3 or not pid.isdigit() or not where[2].isdigit():
            continue
        if int(where[2]) != st.st_ino:
            continue
        try:
            dev = (int(where[0], 16), int(where[1], 16))
        except ValueError:
            continue
        if dev == (os.major(st.st_dev), os.minor(st.st_dev)):
            return int(pid)
        by_inode = int(pid)  # an overlay file system may show another device
    return by_inode


def flock_held(path: str | Path) -> bool:
    """True when another open file description holds an ``flock`` on ``path`` (probed with a
    non-blocking lock, released at once); False when it is free or does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False
