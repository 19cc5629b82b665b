"""The CURVE gate of a ``tcp://`` endpoint (the manager's client endpoint, a peer worker's fetch
endpoint): a ZAP handler that admits the client keys of ``service.curve_authorized_dir``, and a
watch on the socket's handshakes that logs and counts every connection refused.

Refused get no answer; each is logged (``<channel>_handshake_refused``, e.g.
``client_handshake_refused``, with the
peer address, the client key's fingerprint when the handshake got as far as the key, and the
reason), at most ``LOG_BURST`` lines per ``LOG_WINDOW_S`` (the lines left out are counted in
the next one, or in a ``<channel>_handshakes_not_logged`` line once the window is over), and
counted by reason (``counts``: the manager's status and metrics). Reasons:

- ``unknown_key``: a CURVE client whose public key is not in the authorized directory;
- ``no_curve``: a ZeroMQ client without CURVE (or with another mechanism);
- ``bad_curve``: a CURVE handshake that failed its cryptography (a wrong server key);
- ``protocol_error``: another ZMTP protocol error;
- ``no_handshake``: a connection closed before a ZMTP handshake (not ZeroMQ: junk, a scan);
- ``handshake_failed``: the connection failed during the handshake (reset, timed out).

A connection is told apart by its file descriptor (the monitor's ``ACCEPTED`` and
``DISCONNECTED`` events carry it); a failure event comes just before the ``DISCONNECTED`` of its
connection, and a ZAP request names the peer's address, so it is matched with the oldest
connection from that address still in its handshake. The peer address is read when the
connection is accepted; one closed before that reads "unknown".

Keys added to or removed from the authorized directory take effect without a restart (the
directory is re-read when its modification time changes). Everything runs on one thread of its
own; ``counts`` may be read from any thread.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = structlog.get_logger()

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
LOG_BURST = 5
LOG_WINDOW_S = 10.0
FINGERPRINT_CHARS = 10
"""A key's fingerprint: the first characters of its Z85 form, as in its ``.key`` file."""
POLL_MS = 200
REASONS = (
    "unknown_key",
    "no_curve",
    "bad_curve",
    "protocol_error",
    "no_handshake",
    "handshake_failed",
)
_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no_curve",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "bad_curve",
}


def fingerprint(key: bytes) -> str:
    """The first ``FINGERPRINT_CHARS`` of a 32-byte public key's Z85 form."""
    return z85.encode(key).decode("ascii")[:FINGERPRINT_CHARS]


@dataclass
class _Connection:
    peer: str
    ip: str
    admitted: bool = False
    reported: bool = False


class _RateLimit:
    """At most ``burst`` log lines per ``window_s``; counts the ones left out."""

    def __init__(self, burst: int, window_s: float) -> None:
        self._burst, self._window_s = burst, window_s
        self._window_start = 0.0
        self._logged = 0
        self.left_out = 0

    def allow(self, now: float) -> bool:
        if now - self._window_start >= self._window_s:
            self._window_start, self._logged = now, 0
        if self._logged < self._burst:
            self._logged += 1
            return True
        self.left_out += 1
        return False

    def window_over(self, now: float) -> bool:
        return now - self._window_start >= self._window_s


class CurveGate:
    """Serves ZAP for ``sock``'s context and watches ``sock``'s handshakes (see the module
    docstring). Create it before ``sock`` binds; ``stop`` it before the socket is closed."""

    def __init__(
        self,
        zctx: zmq.Context[zmq.Socket[bytes]],
        sock: zmq.Socket[bytes],
        authorized_dir: str,
        channel: str = "client",
    ) -> None:
        """``channel`` names the log events (``<channel>_handshake_refused``)."""
        self._refused_event = f"{channel}_handshake_refused"
        self._left_out_event = f"{channel}_handshakes_not_logged"
        self._dir = Path(authorized_dir)
        self._keys: set[bytes] = set()
        self._dir_mtime: float | None = None
        self._reload_keys()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)
        self._connections: dict[int, _Connection] = {}
        self._last_failure: str | None = None
        self._limit = _RateLimit(LOG_BURST, LOG_WINDOW_S)
        self._sock = sock
        self._monitor_endpoint = f"inproc://kvoffload-{channel}-monitor-{id(self):x}"
        sock.monitor(self._monitor_endpoint, _EVENTS)
        self._zap = zctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._monitor = zctx.socket(zmq.PAIR)
        self._monitor.linger = 0
        self._monitor.connect(self._monitor_endpoint)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="curve-gate", daemon=True)
        self._thread.start()

    def counts(self) -> dict[str, int]:
        """Refused handshakes since start, by reason."""
        with self._lock:
            return dict(self._counts)

    def stop(self) -> None:
        """Stop the thread and close its sockets (the caller's thread owns ``sock``)."""
        self._stopping.set()
        self._thread.join()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._zap in events:
                    self._on_zap(self._zap.recv_multipart())
                if self._monitor in events:
                    self._on_event(parse_monitor_message(self._monitor.recv_multipart()))
                self._log_left_out(time.monotonic())
        except Exception:
            log.exception("curve_gate_failed")
        finally:
            self._zap.close()
            self._monitor.close()

    def _on_zap(self, frames: list[bytes]) -> None:
        if len(frames) < 6:
            return  # not a ZAP request: no id to answer
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        key = frames[6] if len(frames) > 6 else b""
        ip = address.decode("utf-8", "replace")
        connection = self._handshaking_from(ip)
        ok = version == ZAP_VERSION and mechanism == b"CURVE" and self._authorized(key)
        if ok:
            if connection is not None:
                connection.admitted = True
            user = z85.encode(key)
            self._zap.send_multipart([ZAP_VERSION, request_id, b"200", b"OK", user, b""])
            return
        self._zap.send_multipart([ZAP_VERSION, request_id, b"400", b"unknown key", b"", b""])
        if connection is not None:
            connection.reported = True
        peer = connection.peer if connection is not None else ip
        self._refused(peer, "unknown_key", fingerprint(key) if len(key) == 32 else "")

    def _authorized(self, key: bytes) -> bool:
        if len(key) != 32:
            return False
        if key not in self._keys:
            self._reload_keys()
        return key in self._keys

    def _reload_keys(self) -> None:
        try:
            mtime = self._dir.stat().st_mtime
        except OSError as exc:
            log.error("curve_authorized_dir_unreadable", path=str(self._dir), error=str(exc))
            return
        if mtime == self._dir_mtime:
            return
        self._dir_mtime = mtime
        self._keys = {z85.decode(k) for k in zmq.auth.load_certificates(self._dir)}

    def _handshaking_from(self, ip: str) -> _Connection | None:
        for connection in self._connections.values():
            if connection.ip == ip and not connection.admitted and not connection.reported:
                return connection
        return None

    def _on_event(self, event: Mapping[str, Any]) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self._connections[value] = _peer_of(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._last_failure = _PROTOCOL_REASONS.get(value, "protocol_error")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._last_failure = "handshake_failed"
        elif kind == zmq.EVENT_DISCONNECTED:
            connection = self._connections.pop(value, None)
            reason, self._last_failure = self._last_failure, None
            if connection is None:
                if reason is not None:
                    self._refused("unknown", reason, "")
            elif not connection.admitted and not connection.reported:
                self._refused(connection.peer, reason or "no_handshake", "")

    def _refused(self, peer: str, reason: str, key: str) -> None:
        with self._lock:
            self._counts[reason] += 1
        if self._limit.allow(time.monotonic()):
            left_out, self._limit.left_out = self._limit.left_out, 0
            log.warning(
                self._refused_event,
                peer=peer,
                key_fingerprint=key or None,
                reason=reason,
                not_logged_before=left_out,
            )

    def _log_left_out(self, now: float) -> None:
        if self._limit.left_out and self._limit.window_over(now):
            log.warning(self._left_out_event, refused=self._limit.left_out)
            self._limit.left_out = 0


def _peer_of(fd: int) -> _Connection:
    """The connection on ``fd``, with its peer address read now ("unknown" if it is gone)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return _Connection("unknown", "")
    try:
        with socket.socket(fileno=dup) as sock:
            address = sock.getpeername()
    except OSError:
        return _Connection("unknown", "")
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        shown = f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
        return _Connection(shown, host)
    return _Connection(str(address), "")
