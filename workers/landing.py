"""``Landed`` notices from a tier worker's job threads to the clients that wait for them.

A promotion with a ``LandingTarget`` tells its client of each key the moment its slot is
complete, straight from the job thread that landed it, so the client does not wait for the
manager to hear of it and answer (docs/design/cold-loads.md). Each job thread keeps its own
PUSH socket per client endpoint (ZeroMQ sockets are not thread-safe), at most
``SOCKETS_PER_THREAD`` of them, the least recently used closed first. A send never blocks: a
notice the socket cannot queue (a client gone, or far behind) is dropped and counted; such a
client stops waiting at its deadline and asks the manager, which learns of every key from the
job's progress and result in any case.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import zmq

from kvoffload.logs import get_logger
from kvoffload.wire.protocol import MAX_MESSAGE_BYTES, Landed, LandingTarget, encode

log = get_logger()

SOCKETS_PER_THREAD = 64
SEND_HWM = 1024
"""Notices queued per client endpoint before more are dropped."""


class LandingNotifier:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._ctx = ctx
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[zmq.Socket[bytes]] = []
        self.sent = 0
        self.dropped = 0

    def landed(
        self,
        target: LandingTarget,
        keys: Sequence[bytes],
        slots: Sequence[int],
        checksums: Sequence[list[int]],
        final: bool = False,
    ) -> None:
        """Tell ``target`` that ``keys`` landed in ``slots`` with these digests; ``final``:
        they were the job's last, none failed."""
        self._send(
            target,
            Landed(target.ticket, list(keys), list(slots), list(checksums), final=final),
        )

    def over(self, target: LandingTarget, failed: Sequence[bytes]) -> None:
        """Tell ``target`` that its job is over and which of its keys failed."""
        self._send(target, Landed(target.ticket, failed=list(failed), final=True))

    def _send(self, target: LandingTarget, msg: Landed) -> None:
        frame = encode(msg)
        if len(frame) > MAX_MESSAGE_BYTES:
            self.dropped += 1
            log.error("landing_notice_too_large", bytes=len(frame), ticket=target.ticket)
            return
        try:
            self._socket(target.endpoint).send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.warning(
                "landing_notice_dropped",
                endpoint=target.endpoint,
                ticket=target.ticket,
                error=str(exc),
            )
            return
        self.sent += 1

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        socks: OrderedDict[str, zmq.Socket[bytes]] | None = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = OrderedDict()
        sock = socks.get(endpoint)
        if sock is not None:
            socks.move_to_end(endpoint)
            return sock
        if len(socks) >= SOCKETS_PER_THREAD:
            _, oldest = socks.popitem(last=False)
            with self._lock:
                self._all.remove(oldest)
            oldest.close(linger=0)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(endpoint)
        socks[endpoint] = sock
        with self._lock:
            self._all.append(sock)
        return sock

    def close(self) -> None:
        """Close every thread's sockets (the job threads have stopped)."""
        with self._lock:
            socks, self._all = self._all, []
        for sock in socks:
            sock.close(linger=0)
