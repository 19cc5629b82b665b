"""Fetching blocks from a holder node (the requester's side of a fetch).

``HolderLink`` talks to one node: pairs of DEALER sockets, one pair per fetch in flight and
reused after an answer. The control socket (CURVE: this node's key pair, the node's server key)
sends each ``PeerFetch`` to the node's fetch endpoint and hears its refusals; the bulk socket
(plain tcp://, a random routing id named in the fetch, said hello with once so the holder knows
it) receives the answer, every frame sealed with the fetch's fresh AES-256-GCM key. A pair whose
fetch timed out is closed, so a late answer never meets the next fetch. Each link has a
breaker: after ``failure_threshold`` fetches in a row that got no usable answer (timeout,
refusal, a malformed or unsealable reply) the node is not asked for a cooldown that doubles
each time it opens again, up to ``max_cooldown_s``; an answered fetch closes it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.auth

from kvoffload.config import PeerConfig, PeerNodeConfig
from kvoffload.wire import protocol as p
from workers.peer.seal import TAG_BYTES, SealBroken, open_bytes

BULK_ID_BYTES = 16


class FetchFailed(Exception):
    """A fetch got no usable answer; ``reason`` is short (``timeout``, ``refused:<code>``,
    ``bad_reply``, ``breaker_open``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True)
class Fetched:
    """A holder's answer: its ``PeerBlocks`` and one sealed frame per key it sent (open
    frame ``i`` with ``key`` and ``peer_seal_nonce(fetch_id, i + 1)``)."""

    blocks: p.PeerBlocks
    frames: list[zmq.Frame]
    key: bytes
    fetch_id: int


@dataclass(slots=True)
class _Pair:
    control: zmq.Socket[bytes]
    bulk: zmq.Socket[bytes]
    bulk_id: bytes


@dataclass(slots=True)
class InFlight:
    """A fetch sent (``HolderLink.begin``) and not answered yet."""

    pair: _Pair
    key: bytes
    fetch_id: int


@dataclass(frozen=True, slots=True)
class FetchFields:
    """What every fetch of this node says the same: its deployment fingerprint, tenant key
    check and how long a holder may take to bring blocks from its disk."""

    deployment: bytes
    tenant_check: str
    wait_ms: int


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
        self._idle: list[_Pair] = []
        self._all: list[_Pair] = []
        self._closed = False

    def _pair(self) -> _Pair:
        with self._lock:
            if self._closed:
                raise FetchFailed("closed")
            if self._idle:
                return self._idle.pop()
        control = self._ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        control.curve_publickey = self._client_public
        control.curve_secretkey = self._client_secret
        control.curve_serverkey = self._server_public
        control.connect(self.node.fetch_endpoint)
        bulk_id = os.urandom(BULK_ID_BYTES)
        bulk = self._ctx.socket(zmq.DEALER)
        bulk.setsockopt(zmq.LINGER, 0)
        bulk.setsockopt(zmq.ROUTING_ID, bulk_id)
        bulk.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        bulk.connect(self.node.bulk_endpoint)
        bulk.send(b"")  # the holder learns this socket's routing id from it
        pair = _Pair(control, bulk, bulk_id)
        with self._lock:
            self._all.append(pair)
        return pair

    def _give_back(self, pair: _Pair, reuse: bool) -> None:
        with self._lock:
            if reuse and not self._closed:
                self._idle.append(pair)
                return
            if pair in self._all:
                self._all.remove(pair)
        pair.control.close(linger=0)
        pair.bulk.close(linger=0)

    def begin(self, keys: list[bytes], tenant: str, fetch_id: int, fixed: FetchFields) -> InFlight:
        """Send a fetch of ``keys`` for ``tenant``; ``finish`` takes its answer. FetchFailed
        at once while the breaker is open."""
        if not self.breaker.allow():
            raise FetchFailed("breaker_open")
        pair = self._pair()
        key = os.urandom(32)
        msg = p.PeerFetch(
            p.PROTOCOL_VERSION,
            fetch_id,
            fixed.deployment,
            fixed.tenant_check,
            tenant,
            keys,
            pair.bulk_id,
            key,
            fixed.wait_ms,
        )
        try:
            pair.control.send(p.encode(msg))
        except zmq.ZMQError as exc:
            self._give_back(pair, False)
            raise FetchFailed("send_failed", str(exc)) from None
        return InFlight(pair, key, fetch_id)

    def finish(self, fetch: InFlight, timeout_s: float, block_bytes: int) -> Fetched:
        """The holder's answer to ``fetch``, its header opened; FetchFailed when none usable
        came in ``timeout_s`` (counted by the breaker)."""
        pair, key, fetch_id = fetch.pair, fetch.key, fetch.fetch_id
        reuse = False
        try:
            frames = self._answer(pair, fetch_id, timeout_s)
            reuse = True
            try:
                header = open_bytes(key, p.peer_seal_nonce(fetch_id, 0), frames[0].buffer)
                blocks = p.decode_peer_reply(header)
            except SealBroken as exc:
                raise FetchFailed("bad_reply", str(exc)) from None
            if not isinstance(blocks, p.PeerBlocks) or blocks.fetch_id != fetch_id:
                raise FetchFailed("bad_reply", "the sealed header is not this fetch's")
            sealed = frames[1:]
            if len(sealed) != len(blocks.keys) or len(blocks.checksums) != len(blocks.keys):
                raise FetchFailed("bad_reply", f"{len(sealed)} frames for {len(blocks.keys)} keys")
            if any(len(frame) != block_bytes + TAG_BYTES for frame in sealed):
                raise FetchFailed("bad_reply", "a block frame of the wrong size")
        except p.ProtocolError as exc:
            self.breaker.failed()
            raise FetchFailed("bad_reply", str(exc)) from None
        except FetchFailed as exc:
            if exc.reason != "refused:busy":
                self.breaker.failed()
            raise
        finally:
            self._give_back(pair, reuse)
        self.breaker.succeeded()
        return Fetched(blocks, sealed, key, fetch_id)

    def _answer(self, pair: _Pair, fetch_id: int, timeout_s: float) -> list[zmq.Frame]:
        """The bulk frames of this fetch's answer; FetchFailed for a refusal on the control
        socket, or none in time."""
        poller = zmq.Poller()
        poller.register(pair.control, zmq.POLLIN)
        poller.register(pair.bulk, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if not ready:
                raise FetchFailed("timeout", f"no answer in {timeout_s:.2f}s")
            if pair.control in ready:
                reply = p.decode_peer_reply(pair.control.recv())
                if isinstance(reply, p.PeerRefused) and reply.fetch_id in (fetch_id, -1):
                    raise FetchFailed(f"refused:{reply.code.value}", reply.message)
            if pair.bulk in ready:
                frames = pair.bulk.recv_multipart(copy=False)
                if frames:
                    return frames

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs, self._all, self._idle = list(self._all), [], []
        for pair in pairs:
            pair.control.close(linger=0)
            pair.bulk.close(linger=0)
