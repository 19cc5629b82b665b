"""What each tier holds, as a router should hear it: blocks stored and blocks removed.

Tier 0 is the host pool: a block is announced once its write has landed (a device store
acknowledged, a promotion landed, an adopted block verified), and its removal once it leaves
the pool (evicted for anyone's traffic, removed by a tenant drop, emptied by a reset); a write
that fails was never announced. Tier ``i`` > 0 is the ledger's secondary tier ``i - 1``: an
indexed tier (disk) announces what enters and leaves its index; when its worker restarts and
announces its index again, only the difference is announced, once the index is complete. A
probed tier (the object store) announces what its cascades stored and the keys it was found not
to hold (or that the manager deleted); the bucket's own ageing is not seen.

Recording costs nothing until ``start``: the parts ask ``active`` before they build an event.
Each event names the tenant that owns its blocks (``NO_TENANT`` for none), so a consumer can
withhold a tenant's blocks from whoever did not serve that tenant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.tiering.types import Key
from kvoffload.wire.tenant_ids import NO_TENANT

POOL = 0
"""The tier number of the host pool; secondary tier ``i`` of the ledger is ``i + 1``."""


@dataclass(slots=True)
class TierEvent:
    """``keys`` entered (``removed`` False) or left tier ``tier``; all are ``tenant``'s."""

    tier: int
    removed: bool
    keys: list[Key]
    tenant: str = NO_TENANT


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


class TierEvents:
    """The ledger's event log: every tier's sink (``sink``) appends to it once ``start`` was
    called; ``take`` hands the events over in order. ``owners`` names each event's tenant;
    the sinks ask it before the blocks leave a tier."""

    def __init__(self, owners: BlockOwners = NO_OWNERS) -> None:
        self.active = False
        self._events: list[TierEvent] = []
        self._owners = owners

    def start(self) -> None:
        """Record from now on (a second call does nothing)."""
        self.active = True

    def sink(self, tier: int) -> EventSink:
        return _TierSink(self, tier)

    def take(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out

    def record(self, tier: int, removed: bool, keys: Sequence[Key]) -> None:
        if not keys:
            return
        owners = self._owners
        if not owners.active:
            self._events.append(TierEvent(tier, removed, list(keys)))
            return
        by_tenant: dict[str, list[Key]] = {}
        for key in keys:
            by_tenant.setdefault(owners.owner_of(tier, key), []).append(key)
        self._events.extend(TierEvent(tier, removed, ks, tid) for tid, ks in by_tenant.items())


class _TierSink:
    __slots__ = ("_log", "_tier")

    def __init__(self, log: TierEvents, tier: int) -> None:
        self._log = log
        self._tier = tier

    @property
    def active(self) -> bool:
        return self._log.active

    def stored(self, keys: Sequence[Key]) -> None:
        self._log.record(self._tier, False, keys)

    def removed(self, keys: Sequence[Key]) -> None:
        self._log.record(self._tier, True, keys)
