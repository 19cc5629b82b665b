"""Following the node streams of the nodes a peer tier fetches from (one thread for all).

For each node of ``[peer] nodes``: a SUB socket on its ``events_endpoint`` and a DEALER on its
``replay_endpoint`` (tcp:// with CURVE: this node's key pair, the node's server key). The
thread asks each node for a snapshot when it starts following it and whenever its
``NodeFeed`` wants one, asks for a catch-up when a batch is missing, and, while a node's
stream is quiet, asks it every ``poll_s`` for the batches after the last one it applied (an
answer names the node's run, so a restart is caught even without traffic). A node that
answers nothing for ``silent_after_s`` is taken out of the index (its keys fall through to the
next tier) until it answers again.

Only keys matter here: a stream must name blocks by kvoffload's keys (``events.key_form =
"key"``); batches that name them otherwise are counted and ignored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.auth

from kvoffload.config import PeerNodeConfig
from kvoffload.logs import get_logger
from kvoffload.wire.events import (
    STREAM_END_SEQ,
    STREAM_SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from workers.peer.index import DISK_TIER, POOL_TIER, Change, NodeFeed, PeerIndex, TierChange

log = get_logger()

POLL_TIMEOUT_MS = 50

_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def tier_changes(payload: bytes) -> tuple[list[TierChange], int]:
    """A stream payload's events as changes of the tiers a node serves from (its pool, told
    without an ``ownership``, and its ``disk``); returns them and the number of blocks named
    otherwise than by key (ignored). ``msgspec.DecodeError`` for a payload that is not a
    ``KVEventBatch``."""
    batch = _batch_decoder.decode(payload)
    changes: list[TierChange] = []
    foreign = 0
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            changes.append(TierChange(Change.CLEARED))
            continue
        if event.ownership is None and event.medium == "CPU":
            tier = POOL_TIER
        elif event.ownership == "disk":
            tier = DISK_TIER
        else:
            continue
        keys = tuple(k for k in event.block_hashes if isinstance(k, bytes))
        foreign += len(event.block_hashes) - len(keys)
        kind = Change.STORED if isinstance(event, BlockStored) else Change.REMOVED
        assert isinstance(event, BlockStored | BlockRemoved)
        changes.append(TierChange(kind, tier, keys))
    return changes, foreign


@dataclass(slots=True)
class _Asked:
    """A request on a node's replay socket awaiting its end frame."""

    snapshot: bool
    sent_at: float
    batches: list[tuple[int, list[TierChange]]] = field(default_factory=list)


@dataclass(slots=True)
class _Node:
    cfg: PeerNodeConfig
    sub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes]
    feed: NodeFeed = field(default_factory=NodeFeed)
    asked: _Asked | None = None
    heard_at: float = 0.0
    silent: bool = False


@dataclass(slots=True)
class FollowStats:
    """Counters of the followers (read by the worker's stats)."""

    batches: int = 0
    snapshots: int = 0
    catch_ups: int = 0
    silences: int = 0
    runs: int = 0
    foreign_keys: int = 0
    bad_batches: int = 0


class Followers:
    """Runs the following thread over ``index`` (guarded by ``lock``) once ``start``ed."""

    def __init__(
        self,
        nodes: tuple[PeerNodeConfig, ...],
        client_secret_file: str,
        index: PeerIndex,
        lock: threading.Lock,
        *,
        poll_s: float = 1.0,
        silent_after_s: float = 3.0,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_change``: called (from the thread) after the index changed."""
        self._nodes_cfg = nodes
        self._client_secret_file = client_secret_file
        self._index = index
        self._lock = lock
        self._poll_s = poll_s
        self._silent_after_s = silent_after_s
        self._on_change = on_change
        self.stats = FollowStats()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="peer-follow", daemon=True)
        self._nodes: dict[str, _Node] = {}
        self.silent_nodes: set[str] = set()

    def start(self) -> None:
        """Start following (nothing to do without nodes)."""
        for cfg in self._nodes_cfg:
            self._nodes[cfg.name] = _Node(cfg, self._subscriber(cfg), self._replayer(cfg))
        if self._nodes:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for node in self._nodes.values():
            node.sub.close(linger=0)
            node.replay.close(linger=0)
        self._ctx.term()

    # ---- sockets --------------------------------------------------------------------------

    def _curve(self, sock: zmq.Socket[bytes], cfg: PeerNodeConfig) -> None:
        public, secret = zmq.auth.load_certificate(self._client_secret_file)
        server, _ = zmq.auth.load_certificate(cfg.server_key_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server

    def _subscriber(self, cfg: PeerNodeConfig) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        self._curve(sock, cfg)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(cfg.events_endpoint)
        return sock

    def _replayer(self, cfg: PeerNodeConfig) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._curve(sock, cfg)
        sock.connect(cfg.replay_endpoint)
        return sock

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for node in self._nodes.values():
            poller.register(node.sub, zmq.POLLIN)
            poller.register(node.replay, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            for node in self._nodes.values():
                self._ask(node, now, poller)
            try:
                ready = dict(poller.poll(POLL_TIMEOUT_MS))
            except zmq.ZMQError:
                return
            for node in self._nodes.values():
                try:
                    if node.sub in ready:
                        self._on_published(node)
                    if node.replay in ready:
                        self._on_replayed(node)
                except Exception:
                    log.exception("peer_follow_failed", node=node.cfg.name)

    def _ask(self, node: _Node, now: float, poller: zmq.Poller) -> None:
        """Send the request the node's feed wants, or a poll of a quiet node; take a node
        whose request went unanswered out of the index."""
        if node.asked is not None:
            if now - node.asked.sent_at < self._silent_after_s:
                return
            self._silenced(node, poller)
        feed = node.feed
        if feed.wants_snapshot:
            node.replay.send_multipart((b"", STREAM_SNAPSHOT_REQUEST))
            node.asked = _Asked(True, now)
        elif feed.replay_from >= 0:
            node.replay.send_multipart((b"", feed.replay_from.to_bytes(8, "big")))
            node.asked = _Asked(False, now)
            self.stats.catch_ups += 1
        elif now - node.heard_at >= self._poll_s:
            node.replay.send_multipart((b"", feed.next_seq.to_bytes(8, "big")))
            node.asked = _Asked(False, now)

    def _silenced(self, node: _Node, poller: zmq.Poller) -> None:
        """The node did not answer in time: its keys leave the index, its replay socket is
        made anew (a late answer to the old one must not be taken for a new one's)."""
        if not node.silent:
            node.silent = True
            self.silent_nodes.add(node.cfg.name)
            self.stats.silences += 1
            log.warning("peer_node_silent", node=node.cfg.name, after_s=self._silent_after_s)
            with self._lock:
                self._index.clear(node.cfg.name)
            self._on_change()
        node.feed.lost()
        poller.unregister(node.replay)
        node.replay.close(linger=0)
        node.replay = self._replayer(node.cfg)
        poller.register(node.replay, zmq.POLLIN)
        node.asked = None

    def _on_published(self, node: _Node) -> None:
        frames = node.sub.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad_batches += 1
            return
        changes = self._changes(node, frames[2])
        if changes is None:
            return
        seq = int.from_bytes(frames[1], "big")
        self.stats.batches += 1
        node.heard_at = time.monotonic()
        self._apply(node, node.feed.on_batch(seq, changes))

    def _on_replayed(self, node: _Node) -> None:
        frames = node.replay.recv_multipart(zmq.NOBLOCK)
        asked = node.asked
        if asked is None or len(frames) != 4 or len(frames[2]) != 8:
            return  # an answer to a request given up on
        _, _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq != STREAM_END_SEQ:
            changes = self._changes(node, payload)
            if changes is not None:
                asked.batches.append((seq, changes))
            return
        node.asked = None
        node.heard_at = time.monotonic()
        run = payload.decode(errors="replace")
        if node.silent:
            node.silent = False
            self.silent_nodes.discard(node.cfg.name)
            log.info("peer_node_answering", node=node.cfg.name)
        if asked.snapshot:
            self._on_snapshot(node, run, asked.batches)
        else:
            if run != node.feed.run and node.feed.run:
                self.stats.runs += 1
                log.info("peer_node_new_run", node=node.cfg.name, run=run)
            self._apply(node, node.feed.on_replay(run, asked.batches))

    def _on_snapshot(
        self, node: _Node, run: str, batches: list[tuple[int, list[TierChange]]]
    ) -> None:
        next_seq = batches[0][0] if batches else 0
        changes = [change for _, part in batches for change in part]
        if not changes or changes[0].change is not Change.CLEARED:
            changes.insert(0, TierChange(Change.CLEARED))
        self.stats.snapshots += 1
        ready = node.feed.on_snapshot(run, next_seq, changes)
        self._apply(node, ready)
        with self._lock:
            keys = self._index.node_keys(node.cfg.name)
        log.info("peer_node_synced", node=node.cfg.name, run=run, seq=next_seq, keys=keys)

    def _changes(self, node: _Node, payload: bytes) -> list[TierChange] | None:
        try:
            changes, foreign = tier_changes(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.stats.bad_batches += 1
            log.warning("peer_stream_bad_batch", node=node.cfg.name, error=str(exc))
            return None
        if foreign:
            if not self.stats.foreign_keys:
                log.warning(
                    "peer_stream_not_keyed",
                    node=node.cfg.name,
                    hint='the node streams a peer tier follows need events.key_form = "key"',
                )
            self.stats.foreign_keys += foreign
        return changes

    def _apply(self, node: _Node, batches: list[list[TierChange]]) -> None:
        if not batches:
            return
        with self._lock:
            for changes in batches:
                self._index.apply(node.cfg.name, changes)
        self._on_change()
