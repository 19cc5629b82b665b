"""What each tier holds, as a router should hear it: blocks stored and blocks removed.

The host pool (``PRIMARY``): a block is announced once its write has landed (a device store
acknowledged, a promotion landed, an adopted block verified), and its removal once it leaves
the pool (evicted for anyone's traffic, removed by a tenant drop, emptied by a reset); a write
that fails was never announced. A secondary tier: an indexed tier (disk) announces what enters and leaves its index; when its worker restarts and
announces its index again, only the difference is announced, once the index is complete. A
probed tier (the object store) announces what its cascades stored and the keys it was found not
to hold (or that the manager deleted); the bucket's own ageing is not seen.

Recording costs nothing until ``start``: the parts ask ``active`` before they build an event.
Each event (``kvoffload.wire.events.TierEvent``, the form clients take) names the tenant that
owns its blocks (``NO_TENANT`` for none), so a consumer can withhold a tenant's blocks from
whoever did not serve that tenant. Tier numbers: 0 is the pool, ``i + 1`` the ledger's
secondary tier ``i``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvoffload.tiering.types import Key
from kvoffload.wire.events import TierEvent
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import Locality, Medium

POOL = 0
"""The tier number of the host pool; secondary tier ``i`` of the ledger is ``i + 1``."""


class EventSink(Protocol):
    """Where one tier reports what it gained and lost, while ``active``."""

    @property
    def active(self) -> bool: ...

    def stored(self, keys: Sequence[Key]) -> None: ...

    def removed(self, keys: Sequence[Key]) -> None: ...


class _NoEvents:
    active = False

    def stored(self, keys: Sequence[Key]) -> None:
        return None

    def removed(self, keys: Sequence[Key]) -> None:
        return None


NO_EVENTS: EventSink = _NoEvents()


class BlockOwners(Protocol):
    """Who owns each tier's blocks, while ``active`` (``tenants.owners``)."""

    @property
    def active(self) -> bool: ...

    def owner_of(self, tier: int, key: Key) -> str:
        """The tenant owning ``key`` on tier number ``tier`` (``NO_TENANT`` for none)."""
        ...


class _NoOwners:
    active = False

    def owner_of(self, tier: int, key: Key) -> str:
        return NO_TENANT


NO_OWNERS: BlockOwners = _NoOwners()


class EventLog:
    """The ledger's event log: every tier's sink (``sink``) appends to it once ``start`` was
    called; ``take`` hands the events over in order. ``owners`` names each event's tenant;
    the sinks ask it before the blocks leave a tier."""

    def __init__(self, owners: BlockOwners = NO_OWNERS) -> None:
        self.active = False
        self._events: list[TierEvent] = []
        self._owners = owners
        self._sinks: dict[int, _TierSink] = {}

    def start(self) -> None:
        """Record from now on (a second call does nothing)."""
        self.active = True

    def sink(self, tier: int, name: str, medium: Medium, locality: Locality) -> EventSink:
        """The sink of tier number ``tier``, named ``name``."""
        sink = self._sinks[tier] = _TierSink(self, tier, name, medium, locality)
        return sink

    def take(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out

    def snapshot(self, held: Mapping[int, Iterable[Key]]) -> list[TierEvent]:
        """``held`` (tier number -> the keys the events told it holds) as stored events, as
        ``take`` would have given them; the log's pending events are left as they are."""
        pending, self._events = self._events, []
        try:
            for tier, keys in held.items():
                self.record(self._sinks[tier], False, list(keys))
            return self._events
        finally:
            self._events = pending

    def record(self, sink: _TierSink, removed: bool, keys: Sequence[Key]) -> None:
        if not keys:
            return
        owners = self._owners
        name, medium, locality = sink.name, sink.medium, sink.locality
        if not owners.active:
            self._events.append(TierEvent(name, medium, locality, removed, list(keys)))
            return
        by_tenant: dict[str, list[Key]] = {}
        for key in keys:
            by_tenant.setdefault(owners.owner_of(sink.tier, key), []).append(key)
        self._events.extend(
            TierEvent(name, medium, locality, removed, ks, tid) for tid, ks in by_tenant.items()
        )


class _TierSink:
    __slots__ = ("_log", "locality", "medium", "name", "tier")

    def __init__(
        self, log: EventLog, tier: int, name: str, medium: Medium, locality: Locality
    ) -> None:
        self._log = log
        self.tier = tier
        self.name = name
        self.medium = medium
        self.locality = locality

    @property
    def active(self) -> bool:
        return self._log.active

    def stored(self, keys: Sequence[Key]) -> None:
        self._log.record(self, False, keys)

    def removed(self, keys: Sequence[Key]) -> None:
        self._log.record(self, True, keys)
