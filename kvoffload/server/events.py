"""The tiers' events as the manager serves them: to clients that take them (``TakeTierEvents``)
and to the node stream (``eventstream``).

The tiering library records events only once started (``tiering.events``): at the first
``TakeTierEvents``, or at start when the node stream is configured. Each turn of the loop,
``collect`` moves them into a ring, at most ``EVENT_KEYS`` keys an event, numbered in order from
the manager's start time in nanoseconds, so a cursor from an earlier manager is never taken for
one of this manager's. The ring keeps ``events.feed_keys`` keys; a client whose cursor fell
behind it, or that starts, gets a snapshot (``protocol.TierEvents``) and then the events after it.

A client sees the blocks of no tenant and of the tenants it named in ``NewRequest``; never
another tenant's.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from kvoffload.server.eventstream import NodeStream
from kvoffload.tiering import TieringLedger
from kvoffload.wire import protocol as p
from kvoffload.wire.events import TierEvent
from kvoffload.wire.status import EventsStatus
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import PRIMARY

log = structlog.get_logger()

EVENT_KEYS = 4096
"""The most keys one event in the ring carries (a larger one is split)."""


@dataclass(slots=True)
class EventReader:
    """One client's place in the feed: the snapshot pages it has still to take, and the cursor
    the snapshot ends at."""

    snapshot: deque[TierEvent] = field(default_factory=deque)
    snapshot_cursor: int = 0


def split(events: Iterable[TierEvent], most: int = EVENT_KEYS) -> Iterable[TierEvent]:
    """``events`` with every event of more than ``most`` keys cut into events of ``most``."""
    for event in events:
        keys = event.keys
        if len(keys) <= most:
            yield event
            continue
        for start in range(0, len(keys), most):
            yield TierEvent(
                event.tier,
                event.medium,
                event.locality,
                event.removed,
                keys[start : start + most],
                event.tenant,
            )


class EventFeed:
    def __init__(self, tiering: TieringLedger, feed_keys: int, stream: NodeStream | None) -> None:
        self._tiering = tiering
        self._feed_keys = feed_keys
        self._ring: deque[tuple[int, TierEvent]] = deque()
        self._ring_keys = 0
        self._base = time.time_ns()
        self._last = self._base
        """The number of the newest event (``_base``: none yet)."""
        self._stream = stream
        self.resyncs = 0
        if stream is not None:
            tiering.events.start()

    def collect(self) -> None:
        """Move the tiering library's new events into the ring and to the node stream."""
        tiering = self._tiering
        if not tiering.events.active:
            return
        stream = self._stream
        if stream is not None and stream.wants_snapshot():
            stream.publish_snapshot(list(split(tiering.event_snapshot())))
        events = tiering.take_events()
        if not events:
            if stream is not None:
                stream.hand_over(time.monotonic())
            return
        ring = self._ring
        for event in split(events):
            self._last += 1
            ring.append((self._last, event))
            self._ring_keys += len(event.keys)
        while self._ring_keys > self._feed_keys and len(ring) > 1:
            self._ring_keys -= len(ring.popleft()[1].keys)
        if stream is not None:
            stream.publish(events)

    def take(self, reader: EventReader, msg: p.TakeTierEvents, tenants: set[str]) -> p.TierEvents:
        """The reply to one ``TakeTierEvents`` of a client whose tenants are ``tenants``."""
        tiering = self._tiering
        if not tiering.events.active:
            tiering.events.start()
            log.info("tier_events_started")
        self.collect()
        if msg.cursor == 0 or not reader.snapshot and not self._valid(msg.cursor):
            if msg.cursor != 0:
                log.info("tier_events_resync", cursor=msg.cursor, oldest=self._oldest())
            self.resyncs += 1
            events = (_visible(e, msg.prefix, tenants) for e in tiering.event_snapshot())
            reader.snapshot = deque(split(e for e in events if e is not None))
            reader.snapshot_cursor = self._last
            complete = [PRIMARY, *(t.name for t in tiering.tiers if t.spec.indexed)]
            return self._snapshot_page(reader, msg, resync=True, complete=complete)
        if reader.snapshot:
            return self._snapshot_page(reader, msg, resync=False, complete=[])
        return self._events_after(msg, tenants)

    def status(self) -> EventsStatus:
        stream = self._stream
        return EventsStatus(
            active=self._tiering.events.active,
            feed_events=len(self._ring),
            feed_keys=self._ring_keys,
            client_resyncs=self.resyncs,
            stream_batches=stream.sent_batches if stream is not None else 0,
            stream_dropped_batches=stream.dropped_batches if stream is not None else 0,
            stream_resends=stream.snapshots if stream is not None else 0,
        )

    def _oldest(self) -> int:
        return self._ring[0][0] if self._ring else self._last + 1

    def _valid(self, cursor: int) -> bool:
        return max(self._base, self._oldest() - 1) <= cursor <= self._last

    def _snapshot_page(
        self, reader: EventReader, msg: p.TakeTierEvents, resync: bool, complete: list[str]
    ) -> p.TierEvents:
        page: list[TierEvent] = []
        keys = 0
        pending = reader.snapshot
        while pending and (not page or keys + len(pending[0].keys) <= msg.max_keys):
            event = pending.popleft()
            page.append(event)
            keys += len(event.keys)
        return p.TierEvents(
            msg.rid,
            page,
            reader.snapshot_cursor,
            resync=resync,
            complete=complete,
            in_snapshot=bool(pending),
            more=bool(pending) or reader.snapshot_cursor < self._last,
        )

    def _events_after(self, msg: p.TakeTierEvents, tenants: set[str]) -> p.TierEvents:
        out: list[TierEvent] = []
        keys = 0
        cursor = msg.cursor
        for seq, event in itertools.islice(self._ring, msg.cursor - self._oldest() + 1, None):
            visible = _visible(event, msg.prefix, tenants)
            if visible is not None:
                if out and keys + len(visible.keys) > msg.max_keys:
                    break
                out.append(visible)
                keys += len(visible.keys)
            cursor = seq
        return p.TierEvents(msg.rid, out, cursor, more=cursor < self._last)


def _visible(event: TierEvent, prefix: bytes, tenants: set[str]) -> TierEvent | None:
    """``event`` as a client of ``tenants`` may see it: only its keys that start with
    ``prefix``; None when none is left or the blocks are another tenant's."""
    if event.tenant != NO_TENANT and event.tenant not in tenants:
        return None
    if not prefix:
        return event
    keys = [k for k in event.keys if k.startswith(prefix)]
    if not keys:
        return None
    if len(keys) == len(event.keys):
        return event
    return TierEvent(event.tier, event.medium, event.locality, event.removed, keys, event.tenant)
