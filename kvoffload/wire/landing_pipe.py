"""The landing channel's transport: a named pipe from tier workers to one waiting client.

A client that takes ``Landed`` notices creates a FIFO in the run's private directory and names
it in ``Connect.landing_endpoint`` as ``fifo://<path>`` (``LandingPipe``, the reading end).
A worker's job thread writes each notice into it (``LandingWriters``) as one frame: a 4-byte
little-endian length, then the msgpack ``Landed``, at most ``PIPE_BUF`` bytes in all, so the
kernel keeps each frame whole between writers (``landing_frames`` cuts a larger notice in
several). The client's own thread polls the pipe's descriptor and reads the frames.

Why a pipe and not a ZeroMQ socket: a notice is on the path a cold load waits on, and a
ZeroMQ hop wakes the sender's I/O thread and the receiver's I/O thread before the receiving
thread; a pipe write wakes the receiving thread only. On a 2-core host those two wake-ups
compete with the disk worker and the manager for the cores during every cold load.

Writes never block: a notice the pipe cannot take (the client far behind: the pipe full) or a
client gone (no reader: ``ENXIO`` or ``EPIPE``) is dropped and counted; the client stops
waiting at its deadline and asks the manager, which learns of every key from the job anyway.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import stat
import struct
import threading
from collections import OrderedDict

from kvoffload.wire.protocol import Landed, encode

LANDING_SCHEME = "fifo://"
FRAME_BYTES = select.PIPE_BUF
"""The largest frame, length included: what one ``write`` to a pipe keeps whole."""
PIPE_BYTES = 256 << 10
"""The pipe's capacity the client asks for: about 2,400 one-key notices (the kernel's default,
64 KiB, holds 600). Kept modest: a user's pipes share a budget (``pipe-user-pages-soft``,
64 MiB by default) past which new pipes get only two pages."""
PIPES_PER_WORKER = 64
"""Client pipes a worker keeps open; the least recently used is closed first."""

_LENGTH = struct.Struct("<I")


def pipe_path(endpoint: str) -> str:
    """The FIFO's path of a landing endpoint ("" when it is not one)."""
    if not endpoint.startswith(LANDING_SCHEME):
        return ""
    path = endpoint.removeprefix(LANDING_SCHEME)
    return path if os.path.isabs(path) else ""


def landing_frames(notice: Landed) -> list[bytes]:
    """``notice`` as frames of at most ``FRAME_BYTES``: one when it fits, else several notices
    of the same ticket, each with part of its keys (then of its ``failed``), ``final`` on the
    last only. ValueError if one key's share alone does not fit."""
    frame = encode(notice)
    if len(frame) + _LENGTH.size <= FRAME_BYTES:
        return [_LENGTH.pack(len(frame)) + frame]
    told, failed = len(notice.keys), len(notice.failed)
    if told + failed <= 1:
        raise ValueError(f"a landing notice of one key encodes to {len(frame)} bytes")
    if told > 1 or (told == 1 and failed == 0):
        half = told // 2 if told > 1 else 1
        first = Landed(
            notice.ticket, notice.keys[:half], notice.slots[:half], notice.checksums[:half]
        )
        rest = Landed(
            notice.ticket,
            notice.keys[half:],
            notice.slots[half:],
            notice.checksums[half:],
            notice.failed,
            notice.final,
        )
    elif told == 1:
        first = Landed(notice.ticket, notice.keys, notice.slots, notice.checksums)
        rest = Landed(notice.ticket, failed=notice.failed, final=notice.final)
    else:
        half = failed // 2
        first = Landed(notice.ticket, failed=notice.failed[:half])
        rest = Landed(notice.ticket, failed=notice.failed[half:], final=notice.final)
    return landing_frames(first) + landing_frames(rest)


class LandingPipe:
    """The client's end: a FIFO it created and reads (not thread-safe: the client's thread).

    The client also holds the pipe open for writing, so it never reads end-of-file while no
    worker has it open. ``close`` closes both ends and removes the FIFO."""

    def __init__(self, path: str) -> None:
        os.mkfifo(path, 0o600)
        try:
            self._read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._keep_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._close_fds()
            os.unlink(path)
            raise
        with contextlib.suppress(OSError, AttributeError):  # a smaller pipe works too
            fcntl.fcntl(self._read_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.path = path
        self.endpoint = f"{LANDING_SCHEME}{path}"
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)
        self._pending = bytearray()

    def frames(self, timeout_ms: int = 0) -> list[bytes]:
        """The frames written since the last call, waiting up to ``timeout_ms`` for the first
        (0: none waited for). What is kept between calls is only ever part of a frame, whose
        rest is waited for. A length that no frame can have drops what is buffered."""
        if timeout_ms > 0 and not self._poll.poll(timeout_ms):
            return []
        while True:
            try:
                chunk = os.read(self._read_fd, PIPE_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        out: list[bytes] = []
        pending, start = self._pending, 0
        while len(pending) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(pending, start)
            if length > FRAME_BYTES - _LENGTH.size:
                start = len(pending)
                break
            end = start + _LENGTH.size + length
            if end > len(pending):
                break
            out.append(bytes(pending[start + _LENGTH.size : end]))
            start = end
        del pending[:start]
        return out

    def close(self) -> None:
        self._close_fds()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _close_fds(self) -> None:
        for name in ("_read_fd", "_keep_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class LandingWriters:
    """A worker's writing ends of its clients' pipes, shared by its job threads: each write
    (at most ``FRAME_BYTES``) and each open or close happens under one lock, so no thread
    writes to a descriptor another closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, int] = OrderedDict()

    def write(self, endpoint: str, frames: list[bytes]) -> str:
        """Write ``frames`` to ``endpoint``'s pipe in order; "" when every one went, else why
        the rest were dropped: "no_reader" (the client is gone), "full", "not_a_pipe",
        "bad_endpoint". After a write the calling thread yields its core once (below)."""
        reason = self._write(endpoint, frames)
        if not reason:
            # A pipe write wakes its reader synchronously: the kernel queues the waiting client
            # on this core, expecting the writer to sleep now. The writer goes on instead (the
            # job's progress and result to send), so without this the client, whose wait the
            # notice ends, would run only after that work (about 100-200 µs on a 2-core host).
            # When nothing is queued here, the yield returns at once.
            os.sched_yield()
        return reason

    def _write(self, endpoint: str, frames: list[bytes]) -> str:
        with self._lock:
            fd = self._fds.get(endpoint)
            if fd is None:
                fd_or_reason = self._open(endpoint)
                if isinstance(fd_or_reason, str):
                    return fd_or_reason
                fd = fd_or_reason
            else:
                self._fds.move_to_end(endpoint)
            for frame in frames:
                try:
                    os.write(fd, frame)
                except BlockingIOError:
                    return "full"
                except OSError:  # EPIPE: the client closed its pipe
                    self._close(endpoint)
                    return "no_reader"
            return ""

    def close(self) -> None:
        with self._lock:
            for endpoint in list(self._fds):
                self._close(endpoint)

    def _open(self, endpoint: str) -> int | str:
        path = pipe_path(endpoint)
        if not path:
            return "bad_endpoint"
        try:  # nothing but a FIFO is opened (opening some devices does something)
            if not stat.S_ISFIFO(os.stat(path, follow_symlinks=False).st_mode):
                return "not_a_pipe"
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            return "no_reader" if exc.errno in (errno.ENXIO, errno.ENOENT) else "not_a_pipe"
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            return "not_a_pipe"
        if len(self._fds) >= PIPES_PER_WORKER:
            self._close(next(iter(self._fds)))
        self._fds[endpoint] = fd
        return fd

    def _close(self, endpoint: str) -> None:
        os.close(self._fds.pop(endpoint))
