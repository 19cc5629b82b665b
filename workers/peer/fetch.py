"""Fetching blocks from a holder node (the requester's side of a fetch).

``HolderLink`` talks to one node's fetch endpoint: DEALER sockets with CURVE (this node's key
pair, the node's server key), one per fetch in flight and reused after an answer; a socket
whose fetch timed out is closed, so a late answer never meets the next fetch. Each link has a
breaker: after ``failure_threshold`` fetches in a row that got no usable answer (timeout,
refusal, a malformed reply) the node is not asked for a cooldown that doubles each time it
opens again, up to ``max_cooldown_s``; an answered fetch closes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.auth

from kvoffload.config import PeerConfig, PeerNodeConfig
from kvoffload.wire import protocol as p


class FetchFailed(Exception):
    """A fetch got no usable answer; ``reason`` is short (``timeout``, ``refused:<code>``,
    ``bad_reply``, ``breaker_open``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True)
class Fetched:
    """A holder's answer: its ``PeerBlocks`` and one frame of bytes per key it sent."""

    blocks: p.PeerBlocks
    frames: list[zmq.Frame]


class NodeBreaker:
    """Consecutive-failure breaker of one node (thread-safe; time from ``clock``)."""

    def __init__(
        self,
        failure_threshold: int,
        cooldown_s: float,
        max_cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failure_threshold
        self._base = cooldown_s
        self._max = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._cooldown = cooldown_s
        self._open_until = 0.0

    @property
    def open(self) -> bool:
        return self._clock() < self._open_until

    def allow(self) -> bool:
        return not self.open

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._cooldown = self._base
            self._open_until = 0.0

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._failures < self._threshold:
                return False
            self._failures = 0
            self._open_until = self._clock() + self._cooldown
            self._cooldown = min(self._cooldown * 2, self._max)
            return True


class HolderLink:
    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], node: PeerNodeConfig, peer: PeerConfig
    ) -> None:
        self.node = node
        self._ctx = ctx
        self._client_public, self._client_secret = zmq.auth.load_certificate(
            peer.curve_client_secret_file
        )
        self._server_public, _ = zmq.auth.load_certificate(node.server_key_file)
        self.breaker = NodeBreaker(
            peer.breaker_failure_threshold, peer.breaker_cooldown_s, peer.breaker_max_cooldown_s
        )
        self._lock = threading.Lock()
        self._idle: list[zmq.Socket[bytes]] = []
        self._all: set[zmq.Socket[bytes]] = set()
        self._closed = False

    def _socket(self) -> zmq.Socket[bytes]:
        with self._lock:
            if self._closed:
                raise FetchFailed("closed")
            if self._idle:
                return self._idle.pop()
            sock = self._ctx.socket(zmq.DEALER)
            self._all.add(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        sock.curve_publickey = self._client_public
        sock.curve_secretkey = self._client_secret
        sock.curve_serverkey = self._server_public
        sock.connect(self.node.fetch_endpoint)
        return sock

    def _give_back(self, sock: zmq.Socket[bytes], reuse: bool) -> None:
        with self._lock:
            if reuse and not self._closed:
                self._idle.append(sock)
                return
            self._all.discard(sock)
        sock.close(linger=0)

    def fetch(self, msg: p.PeerFetch, timeout_s: float, block_bytes: int) -> Fetched:
        """Send ``msg`` and return the holder's answer; FetchFailed when none usable came in
        ``timeout_s`` (counted by the breaker), or at once while the breaker is open."""
        if not self.breaker.allow():
            raise FetchFailed("breaker_open")
        sock = self._socket()
        reuse = False
        try:
            sock.send(p.encode(msg))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms):
                    raise FetchFailed("timeout", f"no answer in {timeout_s:.2f}s")
                frames = sock.recv_multipart(copy=False)
                reply = p.decode_peer_reply(frames[0].bytes)
                if reply.fetch_id == msg.fetch_id:
                    break  # else a late answer to a fetch of this socket that was given up
            reuse = True
            if isinstance(reply, p.PeerRefused):
                raise FetchFailed(f"refused:{reply.code.value}", reply.message)
            blocks = frames[1:]
            if len(blocks) != len(reply.keys) or len(reply.checksums) != len(reply.keys):
                raise FetchFailed("bad_reply", f"{len(blocks)} frames for {len(reply.keys)} keys")
            if any(len(frame) != block_bytes for frame in blocks):
                raise FetchFailed("bad_reply", "a block frame of the wrong size")
        except p.ProtocolError as exc:
            self.breaker.failed()
            raise FetchFailed("bad_reply", str(exc)) from None
        except FetchFailed as exc:
            if exc.reason != "refused:busy":
                self.breaker.failed()
            raise
        finally:
            self._give_back(sock, reuse)
        self.breaker.succeeded()
        return Fetched(reply, blocks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._all, self._idle = list(self._all), set(), []
        for sock in socks:
            sock.close(linger=0)
