"""Manager-side view of one secondary tier (disk, object store).

An *indexed* tier (disk) answers lookups from the key index its worker reports (hello, stores,
evictions). A *probed* tier (object store, shared by many machines) answers from a verdict
cache and asks its worker when a key is unknown (RETRY until the answer arrives).
A failed transfer or probe turns a key into a miss only for the requests that waited on it;
only the tier's confirmation that it does not hold a key is shared with every request.
No I/O here: the tiering library turns what the proxy asks for into jobs (the cascades to
the tier, and their backlog, are ``cascades.Cascades``' to keep).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvoffload.tiering.events import NO_EVENTS, EventSink
from kvoffload.tiering.types import Key, Locality, Medium, OffloadPolicy, WriteBack
from kvoffload.tiering.verdicts import VerdictCache
from kvoffload.wire.vocab import LookupResult, MissReason


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Static description of a secondary tier.

    ``max_inflight_cascade_keys``: the most keys this tier's cascades in flight may pin; the
    keys beyond it wait in the tier's cascade backlog (no job id consumed). 0: unbounded.
    ``max_cascade_job_keys``: the most keys of one cascade job (more go as several jobs).
    0: unbounded.
    ``writeback``: what the tier's dirty keys may suffer when the pool needs room
    (``writeback``: ``HOLD`` keeps them until their cascade lands, ``BEST_EFFORT`` evicts them
    last, counted).
    ``request_level``: the tier wants every block of every request, prefix hits included.
    ``capacity_keys``: the blocks the tier holds at most, for a manager that chooses what
    leaves it (tenant shares, the tenants' room); 0: the tier's worker evicts by itself.
    ``stores``: the tier keeps this node's blocks (cascades go to it, its index is published
    and counted per tenant). False for a tier that only promotes what others hold (the peer
    tier: its index is what other nodes announce)."""

    name: str
    medium: Medium = Medium.STORAGE
    locality: Locality = Locality.LOCAL
    indexed: bool = True
    max_inflight_cascade_keys: int = 0
    max_cascade_job_keys: int = 0
    writeback: WriteBack = WriteBack.BEST_EFFORT
    request_level: bool = False
    capacity_keys: int = 0
    stores: bool = True


class IndexListener(Protocol):
    """Hears of the keys a tier gains and loses while ``active`` (tenant accounting,
    ``tenants.owners``)."""

    active: bool

    def added(self, tier: SecondaryTier, keys: list[Key]) -> None: ...

    def removed(self, tier: SecondaryTier, keys: list[Key]) -> None: ...

    def cleared(self, tier: SecondaryTier) -> None: ...


class _NoIndexListener:
    active = False

    def added(self, tier: SecondaryTier, keys: list[Key]) -> None:
        return None

    def removed(self, tier: SecondaryTier, keys: list[Key]) -> None:
        return None

    def cleared(self, tier: SecondaryTier) -> None:
        return None


NO_INDEX_LISTENER: IndexListener = _NoIndexListener()


class SecondaryTier:
    def __init__(
        self,
        spec: TierSpec,
        listener: IndexListener = NO_INDEX_LISTENER,
        events: EventSink = NO_EVENTS,
    ) -> None:
        """``events``: hears what the tier gains and loses (``tiering.events``); while an
        indexed tier's worker announces its index again, only the difference is told, once
        ``index_announced``."""
        self.spec = spec
        self.index: set[Key] = set()
        self.verdicts = VerdictCache()
        self._failed: dict[str, dict[Key, MissReason]] = {}
        self._touched: OrderedDict[Key, None] = OrderedDict()
        self.online = True
        """The tier's worker is connected and its index announced (cascades wait while not)."""
        self._listener = listener
        self._events = events
        self._announced_before: set[Key] | None = None
        """While the worker announces its index again: the index the events last told."""

    @property
    def name(self) -> str:
        return self.spec.name

    def lookup(self, key: Key, req_id: str) -> tuple[LookupResult, MissReason]:
        failed = self._failed.get(req_id)
        if failed is not None and key in failed:
            return LookupResult.MISS, failed[key]
        if self.spec.indexed:
            if key in self.index:
                return LookupResult.HIT, MissReason.NONE
            return LookupResult.MISS, MissReason.ABSENT
        found = self.verdicts.lookup(key, req_id)
        if found is None:
            return LookupResult.RETRY, MissReason.PROBING
        return (
            (LookupResult.HIT, MissReason.NONE) if found else (LookupResult.MISS, MissReason.ABSENT)
        )

    def holds(self, key: Key, req_id: str) -> bool | None:
        """What ``lookup`` answers for ``key`` where it can answer without side effects: True
        (HIT) or False (MISS, absent) on an indexed tier; None where only ``lookup`` can
        answer (a probed tier, or a key whose load failed for the request)."""
        if not self.spec.indexed:
            return None
        failed = self._failed.get(req_id)
        if failed is not None and key in failed:
            return None
        return key in self.index

    def knows(self, key: Key) -> bool:
        """True if the tier is known to hold the key (no probe is started)."""
        if self.spec.indexed:
            return key in self.index
        return self.verdicts.cached(key) is True

    def load_failed(self, keys: Iterable[Key], absent: Collection[Key], req_id: str | None) -> None:
        """A load of these keys failed. The request (None: no active request) must not promote
        them again; keys in ``absent`` are gone from the tier for everyone; for the others the
        tier keeps its answer, except that a probed tier forgets its positive verdict so a
        fresh request probes again."""
        keys = list(keys)
        if req_id is not None:
            self.mark_request_miss(req_id, keys, MissReason.FAILED_LOAD)
        gone = [k for k in keys if k in absent]
        self._remove(gone)
        self.verdicts.mark_miss(gone)
        self.verdicts.forget(k for k in keys if k not in absent)

    def probe_done(
        self, found: Iterable[Key], absent: Iterable[Key], failed: Iterable[Key]
    ) -> dict[Key, set[str]]:
        """Record a probe's answer: ``found`` and ``absent`` are confirmed (shared); the probe
        of ``failed`` keys did not answer. Returns, per failed key, the requests that waited on
        it (the caller marks it a miss for them: ``mark_request_miss``)."""
        found = list(found)
        self.verdicts.resolve([*found, *absent], found)
        return self.verdicts.fail(failed)

    def mark_request_miss(self, req_id: str, keys: Iterable[Key], reason: MissReason) -> None:
        """These keys are a miss on this tier for this request only, until it finishes."""
        self._failed.setdefault(req_id, {}).update(dict.fromkeys(keys, reason))

    def stored(self, keys: Iterable[Key]) -> None:
        keys = list(keys)
        self._add(keys)
        self.verdicts.mark_present(keys)

    def apply_index_update(self, added: Iterable[Key], removed: Iterable[Key]) -> None:
        """The worker reports keys it now holds / no longer holds (eviction, corrupt copy)."""
        removed = list(removed)
        self._add(list(added))
        self._remove(removed)
        self.verdicts.mark_miss(removed)

    def forget(self, keys: Iterable[Key]) -> None:
        """The manager removes these keys from the tier (its ``DELETE`` job is under way):
        they are a miss for everyone from now on."""
        keys = list(keys)
        self._remove(keys)
        self.verdicts.mark_miss(keys)

    def clear_index(self) -> None:
        """The tier's worker (re)started and will announce its whole index again."""
        if self._events.active and self._announced_before is None:
            self._announced_before = set(self.index)
        self.index.clear()
        if self._listener.active:
            self._listener.cleared(self)

    def index_announced(self) -> None:
        """The worker's index is complete again: tell the events what changed meanwhile."""
        before, self._announced_before = self._announced_before, None
        if before is None or not self._events.active:
            return
        self._events.removed([k for k in before if k not in self.index])
        self._events.stored([k for k in self.index if k not in before])

    def announced_index(self) -> set[Key]:
        """The index as the events told it (while the worker announces it again: as it was)."""
        return self.index if self._announced_before is None else self._announced_before

    def _telling(self) -> bool:
        return self._events.active and self._announced_before is None

    def _add(self, keys: list[Key]) -> None:
        listening, telling = self._listener.active, self._telling()
        if listening or telling:
            fresh = [k for k in dict.fromkeys(keys) if k not in self.index]
            if fresh and listening:
                self._listener.added(self, fresh)
            if fresh and telling:
                self._events.stored(fresh)
        if self.spec.indexed:
            self.index.update(keys)

    def _remove(self, keys: list[Key]) -> None:
        listening, telling = self._listener.active, self._telling()
        if listening or telling:
            index = self.index
            keys = [k for k in dict.fromkeys(keys) if k in index or not self.spec.indexed]
            if keys and telling:
                self._events.removed(keys)
            if keys and listening:
                self._listener.removed(self, keys)
        self.index.difference_update(keys)

    def on_new_request(self, req_id: str) -> OffloadPolicy:
        return OffloadPolicy.REQUEST_LEVEL if self.spec.request_level else OffloadPolicy.CHUNK_LEVEL

    def on_request_finished(self, req_id: str) -> None:
        self._failed.pop(req_id, None)
        self.verdicts.release(req_id)

    def tracked_requests(self) -> int:
        """Requests this tier keeps state for (failed loads, verdict references)."""
        return len(self._failed.keys() | self.verdicts.requests())

    def touch(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._touched[key] = None
            self._touched.move_to_end(key)

    def take_touched(self) -> list[Key]:
        keys = list(self._touched)
        self._touched.clear()
        return keys

    def has_queued_probes(self) -> bool:
        return self.verdicts.has_queued()
