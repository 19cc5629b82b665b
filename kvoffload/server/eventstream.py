"""The node's event stream (``[events]``): every tier's stored and removed blocks, published as
vLLM's KV events so a KV-aware router reads them as it reads a vLLM engine's.

Wire, as vLLM's ``ZmqEventPublisher``: a PUB socket sends (topic, sequence number as 8 bytes
big-endian, msgpack ``KVEventBatch``); a ROUTER on ``replay_endpoint`` answers a request of one
frame, the first sequence number wanted (8 bytes big-endian), with every kept batch from it on as
(topic, sequence, payload) and then ("", ``END_SEQ``, run id). Sequence numbers start at 0 with
each manager and have no gaps; the run id (the manager's) tells a follower that a restarted
manager began a new sequence.

A request of the one frame ``STREAM_SNAPSHOT_REQUEST`` is answered with what the stream told so far, as
a snapshot: batches that start with ``AllBlocksCleared`` and list every block held, each sent as
(topic, the sequence number the next published batch will carry, payload), then the end frame.
A subscriber that applies it and then the published batches from that number on holds the
node's index, however late it joined (the peer tier's followers do; vLLM-format subscribers
never ask).

It never blocks the manager: the manager hands each turn's events to a bounded queue
(``publish``) and a thread of its own encodes and sends them, what waits in the queue together
in one batch. When the queue is full the batch is dropped and counted, and the stream is marked
lost: later events are dropped too until the manager, once the queue has room, hands over a
snapshot (``publish_snapshot``), sent as ``AllBlocksCleared`` followed by every block the tiers
hold: a subscriber that applies the batches in order holds the service's index again.

A ``tcp://`` endpoint is served with CURVE only: the service's secret key, and the subscriber
keys of ``service.curve_authorized_dir``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvoffload.config import EventsConfig, ServiceConfig
from kvoffload.runtime.runspec import FatalStartError
from kvoffload.wire.events import (
    STREAM_END_SEQ,
    STREAM_SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    TierEvent,
    vllm_events,
)
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import Locality, Medium

log = structlog.get_logger()

END_SEQ = STREAM_END_SEQ.to_bytes(8, "big", signed=True)
SNAPSHOT_EVENTS_PER_BATCH = 16
POLL_S = 0.05
HANDOVER_S = 0.005
"""How long the manager gathers events before it queues them for the thread."""


@dataclass(slots=True)
class _Batch:
    ts: float
    events: list[TierEvent]
    snapshot: bool = False


_STOP = _Batch(0.0, [])
"""Queued by ``close``: the thread sends what came before it and ends."""


class _Told:
    """What the stream's batches told each tier holds: (tier, medium, locality, tenant) ->
    keys, in the order told."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, Medium, Locality, str], dict[bytes, None]] = {}

    def apply(self, events: list[TierEvent], snapshot: bool) -> None:
        if snapshot:
            self.held.clear()
        for event in events:
            keys = self.held.setdefault(
                (event.tier, event.medium, event.locality, event.tenant), {}
            )
            if event.removed:
                for key in event.keys:
                    keys.pop(key, None)
            else:
                keys.update(dict.fromkeys(event.keys))

    def events(self) -> list[TierEvent]:
        return [
            TierEvent(tier, medium, locality, False, list(keys), tenant)
            for (tier, medium, locality, tenant), keys in self.held.items()
            if keys
        ]


class NodeStream:
    def __init__(self, cfg: EventsConfig, svc: ServiceConfig, run_id: str = "") -> None:
        """Bind the PUB (and replay ROUTER) sockets and start the publishing thread;
        FatalStartError when an endpoint cannot be served. ``run_id``: this manager's (each
        start has its own), sent at the end of every replay."""
        self._cfg = cfg
        self._run_id = run_id.encode()
        self._topic = cfg.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        endpoints = [e for e in (cfg.endpoint, cfg.replay_endpoint) if e]
        curve = any(e.startswith("tcp://") for e in endpoints)
        try:
            if curve:
                self._start_curve(svc)
            self._pub = self._bind(zmq.PUB, cfg.endpoint, svc, curve)
            self._pub.set_hwm(cfg.hwm)
            self._replay = (
                self._bind(zmq.ROUTER, cfg.replay_endpoint, svc, curve)
                if cfg.replay_endpoint
                else None
            )
        except BaseException:
            self._close_sockets()
            raise
        self._queue: queue.Queue[_Batch] = queue.Queue(cfg.queue_batches)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_batches)
        self._told = _Told()
        self._seq = 0
        """The sequence number of the next batch (the publishing thread's)."""
        self._lost = False
        self._outbox: list[TierEvent] = []
        self._handed_over = 0.0
        self.dropped_batches = 0
        self.snapshots = 0
        self.sent_batches = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-events", daemon=True)
        self._thread.start()
        log.info("node_events_started", endpoint=cfg.endpoint, replay=cfg.replay_endpoint)

    def _start_curve(self, svc: ServiceConfig) -> None:
        if not (svc.curve_server_secret_file and svc.curve_authorized_dir):
            raise FatalStartError(
                "a tcp:// events endpoint requires CURVE keys (service.curve_server_secret_file"
                " and service.curve_authorized_dir)"
            )
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=svc.curve_authorized_dir)

    def _bind(self, kind: int, endpoint: str, svc: ServiceConfig, curve: bool) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if curve:
            public, secret = zmq.auth.load_certificate(svc.curve_server_secret_file)
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_server = True
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise FatalStartError(
                f"events endpoint {endpoint!r}: cannot listen: {exc.strerror}"
            ) from exc
        return sock

    # ---- the manager's side ---------------------------------------------------------------

    def publish(self, events: list[TierEvent]) -> None:
        """Hand over one turn's events (without the tenants' blocks unless
        ``tenant_blocks``); they are queued with the next turns' for up to ``HANDOVER_S``.
        Never blocks. Dropped while the stream is lost."""
        if not self._cfg.tenant_blocks:
            events = [e for e in events if e.tenant == NO_TENANT]
        if events and not self._lost:
            self._outbox.extend(events)
        self.hand_over(time.monotonic())

    def hand_over(self, now: float) -> None:
        """Queue what ``publish`` gathered once ``HANDOVER_S`` passed since the last time."""
        if self._outbox and now - self._handed_over >= HANDOVER_S:
            self._handed_over = now
            self.flush()

    def flush(self) -> None:
        """Queue what ``publish`` gathered now."""
        if not self._outbox:
            return
        events, self._outbox = self._outbox, []
        try:
            self._queue.put_nowait(_Batch(time.time(), events))
        except queue.Full:
            self._lost = True
            self.dropped_batches += 1
            log.warning("node_events_dropped", queue_batches=self._cfg.queue_batches)

    def wants_snapshot(self) -> bool:
        """The stream lost a batch and its queue has room again for the snapshot."""
        return self._lost and self._queue.qsize() < self._cfg.queue_batches // 2

    def publish_snapshot(self, held: list[TierEvent]) -> None:
        """Queue the snapshot that ends a loss: ``held`` as stored events after a clear."""
        if not self._cfg.tenant_blocks:
            held = [e for e in held if e.tenant == NO_TENANT]
        self._lost = False
        self._outbox.clear()
        self.snapshots += 1
        self._queue.put_nowait(_Batch(time.time(), held, snapshot=True))
        log.info("node_events_resent", events=len(held))

    def close(self) -> None:
        """Send what is gathered and queued (for up to a second), then close the sockets."""
        self.flush()
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=1.0)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_pub", "_replay"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- the publishing thread ------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        form = self._cfg.key_form
        held_back: _Batch | None = None
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            batch = held_back
            held_back = None
            if batch is None:
                try:
                    batch = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            if batch is _STOP:
                return
            if not batch.snapshot:  # what waited behind it goes in the same send
                while not self._queue.empty():
                    follower = self._queue.get_nowait()
                    if follower is _STOP or follower.snapshot:
                        held_back = follower
                        break
                    batch.events.extend(follower.events)
            self._told.apply(batch.events, batch.snapshot)
            converted = vllm_events(batch.events, form)
            parts = _snapshot_parts(converted) if batch.snapshot else [converted]
            for events in parts:
                payload = encoder.encode(KVEventBatch(ts=batch.ts, events=events))
                seq = self._seq
                try:
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError as exc:
                    log.warning("node_events_send_failed", error=str(exc))
                self._kept.append((seq, payload))
                self._seq += 1
                self.sent_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or not (len(frames[2]) == 8 or frames[2] == STREAM_SNAPSHOT_REQUEST):
            log.warning("node_events_bad_replay_request", frames=len(frames))
            return
        client, _, request = frames
        if request == STREAM_SNAPSHOT_REQUEST:
            self._serve_snapshot(client)
            return
        first = int.from_bytes(request, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, self._run_id))

    def _serve_snapshot(self, client: bytes) -> None:
        """What the batches published so far told, as a snapshot stamped with the sequence
        number of the next batch."""
        assert self._replay is not None
        encoder = msgspec.msgpack.Encoder()
        at = self._seq.to_bytes(8, "big")
        converted = vllm_events(self._told.events(), self._cfg.key_form)
        now = time.time()
        for events in _snapshot_parts(converted):
            payload = encoder.encode(KVEventBatch(ts=now, events=events))
            self._replay.send_multipart((client, b"", self._topic, at, payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, self._run_id))


def _snapshot_parts(
    converted: list[BlockStored | BlockRemoved | AllBlocksCleared],
) -> list[list[BlockStored | BlockRemoved | AllBlocksCleared]]:
    """A snapshot's events in batches of ``SNAPSHOT_EVENTS_PER_BATCH``, the first led by
    ``AllBlocksCleared``."""
    step = SNAPSHOT_EVENTS_PER_BATCH
    parts = [converted[i : i + step] for i in range(0, len(converted), step)]
    return [[AllBlocksCleared(), *(parts[0] if parts else [])], *parts[1:]]
