"""Serving this node's blocks to the nodes that follow it (the holder's side of a fetch).

Two ROUTERs: the fetch endpoint (``peer.fetch_endpoint``: CURVE with the service's secret key,
and a ``CurveGate`` admitting the keys of ``service.curve_authorized_dir``; each refusal logged
as ``peer_handshake_refused``) takes ``PeerFetch`` requests and answers refusals; the bulk
endpoint (``peer.bulk_endpoint``, plain tcp://) carries the answers, every frame sealed with the
fetch's AES-256-GCM key (``seal``), to the requester's socket named by the fetch. Its thread
checks each fetch (protocol version, deployment fingerprint, tenant key) and refuses a mismatch
with one log line per requester's key and reason. At most ``max_served_fetches`` are served at once,
so the fleet never takes more than that from this node's own engines; up to
``QUEUED_PER_SERVED`` times as many wait, and more are refused ``BUSY``.

A fetch is served on one of ``max_served_fetches`` threads, each a client of this node's own
manager (the client channel, as an engine) with one request open per tenant id, which reads the
pool and the disk only (``kv_load_tiers``: a holder never asks S3 or its own peers for
another node). It looks the keys up with a pin in one lookup (a fetch is most often a run of
a prefix; keys past a MISS are then asked one by one, ``lookup_many``: one round trip), asks
again for keys being promoted from the disk until ``wait_ms`` (each ask held at the manager
until one of them lands),
seals the pinned slots' bytes (the one pass over them), releases the pins (without waiting for
the reply) and hands the sealed frames to the ROUTER thread. A requester's bulk socket not
connected yet is waited for up to ``BULK_WAIT_S``. A client session that breaks (this worker
dies) loses its pins at the manager with it.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq
import zmq.auth

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.handshakes import FINGERPRINT_CHARS, CurveGate
from kvoffload.wire import protocol as p
from kvoffload.wire.vocab import ErrorCode, LookupResult
from workers.peer.seal import seal
from workers.slotheaders import SlotHeaders

log = get_logger()

BULK_WAIT_S = 1.0
"""How long an answer waits for its requester's bulk socket to connect."""
POLL_MS = 50
BULK_RETRY_MS = 2
QUEUED_PER_SERVED = 4
"""Fetches that may wait for a serving thread, per thread; more are refused ``busy``."""
LOCAL_TIERS = {"kv_load_tiers": [{"medium": "storage", "locality": "local"}]}
"""What a fetch may be served from besides the pool: the disk."""


@dataclass(slots=True)
class ServeStats:
    fetches: int = 0
    keys_served: int = 0
    bytes_served: int = 0
    keys_absent: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    answers_lost: int = 0


@dataclass(slots=True)
class _Answer:
    """Frames for the ROUTER thread to send to ``identity``, on the bulk socket or not; one
    for a bulk socket not connected yet is tried again until ``give_up_at``."""

    identity: bytes
    frames: list[bytes | memoryview]
    bulk: bool = False
    give_up_at: float = 0.0


def _requester(frame: zmq.Frame) -> str:
    """The fingerprint of the CURVE key a request came with (as ``CurveGate`` logs keys)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return str(user)[:FINGERPRINT_CHARS]


@dataclass(slots=True)
class _ThreadClient:
    """A serving thread's client of the manager and its requests, one open per tenant id."""

    client: KVOffloadClient
    requests: dict[str, str] = field(default_factory=dict)

    def request(self, tenant: str) -> str:
        req = self.requests.get(tenant)
        if req is None:
            req = f"peer-serve-{threading.get_ident()}-{tenant or 'none'}"
            self.client.new_request(req, params=LOCAL_TIERS, tid=tenant)
            self.requests[tenant] = req
        return req


class FetchServer:
    def __init__(
        self,
        cfg: Config,
        client_endpoint: str,
        pool: HostPool,
        headers: SlotHeaders | None,
        deployment: bytes,
        tenant_check: str,
    ) -> None:
        self._cfg = cfg
        self._endpoint = cfg.peer.fetch_endpoint
        self._client_endpoint = client_endpoint
        self._pool = pool
        self._headers = headers
        self._deployment = deployment
        self._tenant_check = tenant_check
        self.stats = ServeStats()
        self._lock = threading.Lock()
        self._busy = 0
        self._refusals_logged: set[tuple[str, str]] = set()
        self._answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        svc = cfg.service
        public, secret = zmq.auth.load_certificate(svc.curve_server_secret_file)
        self._sock.curve_publickey = public
        self._sock.curve_secretkey = secret
        self._sock.curve_server = True
        self._gate = CurveGate(self._ctx, self._sock, svc.curve_authorized_dir, channel="peer")
        self._bulk = self._ctx.socket(zmq.ROUTER)
        self._bulk.setsockopt(zmq.LINGER, 0)
        self._bulk.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bulk.setsockopt(zmq.MAXMSGSIZE, 1024)  # requesters only say hello on it
        self._waiting: list[_Answer] = []
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        wake = f"inproc://peer-serve-wake-{id(self):x}"
        self._wake_recv.bind(wake)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        self._serving = ThreadPoolExecutor(
            max_workers=cfg.peer.max_served_fetches, thread_name_prefix="peer-serve"
        )
        self._local = threading.local()
        self._all_clients: list[KVOffloadClient] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-fetch-server", daemon=True)

    def start(self) -> None:
        """Listen (ValueError naming the endpoint when it cannot) and start serving."""
        bulk = self._cfg.peer.bulk_endpoint
        try:
            self._sock.bind(self._endpoint)
            self._bulk.bind(bulk)
        except zmq.ZMQError as exc:
            self._gate.stop()
            raise ValueError(
                f"peer.fetch_endpoint = {self._endpoint!r}, peer.bulk_endpoint = {bulk!r}: "
                f"cannot listen: {exc.strerror}"
            ) from exc
        self._thread.start()
        log.info("peer_fetch_serving", endpoint=self._endpoint, bulk_endpoint=bulk)

    def handshake_refusals(self) -> dict[str, int]:
        return self._gate.counts()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self._serving.shutdown(wait=True, cancel_futures=True)
        for client in self._all_clients:
            client.close()
        self._gate.stop()
        for sock in (self._sock, self._bulk, self._wake_send, self._wake_recv):
            sock.close(linger=0)
        self._ctx.term()

    # ---- the ROUTER thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._bulk, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(BULK_RETRY_MS if self._waiting else POLL_MS))
            if self._wake_recv in ready:
                while self._wake_recv.poll(0):
                    self._wake_recv.recv()
            if self._bulk in ready:
                while self._bulk.poll(0):
                    self._bulk.recv_multipart()  # a requester's hello: its socket is here
            self._send_answers()
            if self._sock in ready:
                for _ in range(64):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_request(frames)

    def _send_answers(self) -> None:
        answers, self._waiting = self._waiting, []
        while True:
            try:
                answers.append(self._answers.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        for answer in answers:
            sock = self._bulk if answer.bulk else self._sock
            try:
                sock.send_multipart([answer.identity, *answer.frames], copy=False)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH and answer.bulk and now < answer.give_up_at:
                    self._waiting.append(answer)  # its bulk socket is still connecting
                    continue
                with self._lock:
                    self.stats.answers_lost += 1
                log.warning("peer_answer_not_sent", bulk=answer.bulk, error=str(exc))

    def _answer(self, answer: _Answer) -> None:
        self._answers.put(answer)
        with self._wake_lock:
            self._wake_send.send(b"")

    def _on_request(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            return
        identity, frame = frames[0].bytes, frames[1].bytes
        requester = _requester(frames[1])
        try:
            fetch = p.decode_peer_fetch(frame)
        except p.ProtocolError as exc:
            self._refuse(identity, requester, -1, ErrorCode.BAD_MESSAGE, str(exc))
            return
        if fetch.version != p.PROTOCOL_VERSION:
            reason = f"protocol version {fetch.version} != {p.PROTOCOL_VERSION}"
            self._refuse(identity, requester, fetch.fetch_id, ErrorCode.VERSION_MISMATCH, reason)
            return
        if fetch.deployment != self._deployment:
            reason = "another deployment (block format, block_bytes or layout differ)"
            self._refuse(identity, requester, fetch.fetch_id, ErrorCode.DEPLOYMENT_MISMATCH, reason)
            return
        if fetch.tenant_check != self._tenant_check:
            reason = "tenant ids made with another tenant key"
            self._refuse(identity, requester, fetch.fetch_id, ErrorCode.TENANT_KEY_MISMATCH, reason)
            return
        if len(fetch.keys) > self._cfg.peer.max_fetch_keys:
            reason = f"{len(fetch.keys)} keys > {self._cfg.peer.max_fetch_keys}"
            self._refuse(identity, requester, fetch.fetch_id, ErrorCode.TOO_MANY_KEYS, reason)
            return
        with self._lock:
            if self._busy >= self._cfg.peer.max_served_fetches * QUEUED_PER_SERVED:
                busy = True
            else:
                busy = False
                self._busy += 1
        if busy:
            self._refuse(
                identity, requester, fetch.fetch_id, ErrorCode.BUSY, "serving its limit of fetches"
            )
            return
        self._serving.submit(self._serve, identity, fetch)

    def _refuse(
        self, identity: bytes, requester: str, fetch_id: int, code: ErrorCode, message: str
    ) -> None:
        """Answer a refusal; the first of each code for each requester (its key) is logged,
        every one counted."""
        with self._lock:
            self.stats.refused[code.value] = self.stats.refused.get(code.value, 0) + 1
            first = (requester, code.value) not in self._refusals_logged
            if first and code is not ErrorCode.BUSY:
                self._refusals_logged.add((requester, code.value))
        if first and code is not ErrorCode.BUSY:
            log.warning(
                "peer_fetch_refused", code=code.value, reason=message, key_fingerprint=requester
            )
        self._answer(_Answer(identity, [p.encode(p.PeerRefused(fetch_id, code, message))]))

    # ---- the serving threads --------------------------------------------------------------

    def _thread_client(self) -> _ThreadClient:
        """This serving thread's client of the manager (connected on first use)."""
        mine = getattr(self._local, "client", None)
        if mine is None:
            client = KVOffloadClient(
                self._client_endpoint, name="peer-serve", auto_reconnect=True, timeout_s=5.0
            )
            mine = self._local.client = _ThreadClient(client)
            with self._lock:
                self._all_clients.append(client)
        return mine

    def _serve(self, identity: bytes, fetch: p.PeerFetch) -> None:
        try:
            self._serve_fetch(fetch)
        except Exception as exc:
            log.exception("peer_fetch_failed", fetch_id=fetch.fetch_id)
            refusal = p.PeerRefused(fetch.fetch_id, ErrorCode.INTERNAL, str(exc))
            self._answer(_Answer(identity, [p.encode(refusal)]))
        finally:
            with self._lock:
                self._busy -= 1

    def _serve_fetch(self, fetch: p.PeerFetch) -> None:
        mine = self._thread_client()
        client, req = mine.client, mine.request(fetch.tenant)
        pinned: dict[bytes, int] = {}
        try:
            absent, failed = self._pin(client, req, fetch, pinned)
            keys = [k for k in fetch.keys if k in pinned]
            checksums = [self._checksum(pinned[k], k) for k in keys]
            header = p.PeerBlocks(fetch.fetch_id, keys, checksums, absent, failed)
            frames: list[bytes | memoryview] = [
                seal(fetch.key, p.peer_seal_nonce(fetch.fetch_id, 0), p.encode(header))
            ]
            frames += [
                seal(fetch.key, p.peer_seal_nonce(fetch.fetch_id, i), self._pool.slot(pinned[k]))
                for i, k in enumerate(keys, start=1)
            ]
        finally:
            if pinned:
                try:
                    client.complete_load(req, list(pinned), wait=False)
                except KVOffloadError as exc:
                    log.warning(
                        "peer_fetch_release_failed", fetch_id=fetch.fetch_id, error=str(exc)
                    )
        self._answer(_Answer(fetch.bulk_id, frames, True, time.monotonic() + BULK_WAIT_S))
        with self._lock:
            self.stats.fetches += 1
            self.stats.keys_served += len(keys)
            self.stats.bytes_served += len(keys) * self._pool.block_bytes
            self.stats.keys_absent += len(absent)

    def _pin(
        self, client: KVOffloadClient, req: str, fetch: p.PeerFetch, pinned: dict[bytes, int]
    ) -> tuple[list[bytes], list[bytes]]:
        """Pin every key of ``fetch`` this node holds for its tenant into ``pinned`` (key ->
        slot), asking again for keys being promoted until ``wait_ms`` (the manager holds each
        such ask until one of them lands); returns (absent, failed) keys."""
        deadline = time.monotonic() + fetch.wait_ms / 1000
        pending = list(dict.fromkeys(fetch.keys))
        absent: list[bytes] = []
        whole = True  # a fetch is most often a run of a prefix: one lookup for all of it
        wait_ms = 0
        while pending:
            if whole:
                outcome = client.lookup(req, pending, pin=True, wait_ms=wait_ms)
                answered = list(zip(pending, outcome.results, outcome.slots, strict=False))
                # keys past a MISS were not looked at: each is asked on its own next
                whole = len(answered) == len(pending)
                rest = pending[len(answered) :]
            else:
                outcomes = client.lookup_many(req, [[k] for k in pending], pin=True)
                answered = [
                    (k, o.results[0], o.slots[0]) if o.results else (k, LookupResult.MISS, -1)
                    for k, o in zip(pending, outcomes, strict=True)
                ]
                whole, rest = True, []
            still: list[bytes] = []
            for key, result, slot in answered:
                if result is LookupResult.HIT:
                    pinned[key] = slot
                elif result is LookupResult.MISS:
                    absent.append(key)
                else:
                    still.append(key)
            pending = still + rest
            if rest:
                continue
            wait_ms = int((deadline - time.monotonic()) * 1000)
            if pending and wait_ms <= 0:
                break
        return absent, pending

    def _checksum(self, slot: int, key: bytes) -> p.PeerChecksum:
        """The block's checksum from its slot header, else taken now."""
        stamped = self._headers.checksum_of(slot, key) if self._headers is not None else None
        if stamped is None:
            return p.PeerChecksum(payload_checksum(self._pool.slot(slot)))
        return p.PeerChecksum(stamped.value, stamped.slices, stamped.slice_bytes)
