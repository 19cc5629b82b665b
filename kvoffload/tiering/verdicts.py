"""Existence verdicts for a tier that cannot be indexed locally (a shared object store).

A key is probed once however many requests ask for it. Each entry is referenced by the requests
that looked it up and is dropped when the last of them finishes; an entry whose probe is in
flight survives until its answer arrives (so new requests can share it).
``lookup`` answers None (unknown yet: RETRY), True (present) or False (absent).
Only a confirmed answer is shared: a probe that failed drops its entries (``fail``), and a
transient load failure forgets a positive verdict (``forget``), so a later lookup probes again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvoffload.tiering.types import Key


class Phase(enum.Enum):
    QUEUED = 1
    IN_FLIGHT = 2
    RESOLVED = 3


@dataclass(slots=True)
class Verdict:
    phase: Phase = Phase.QUEUED
    found: bool | None = None
    requests: set[str] = field(default_factory=set)


class VerdictCache:
    def __init__(self) -> None:
        self._entries: dict[Key, Verdict] = {}
        self._by_request: dict[str, set[Key]] = {}
        self._queued: list[Key] = []

    def lookup(self, key: Key, req_id: str) -> bool | None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Verdict()
            self._queued.append(key)
        entry.requests.add(req_id)
        self._by_request.setdefault(req_id, set()).add(key)
        return entry.found if entry.phase is Phase.RESOLVED else None

    def take_queued(self) -> list[Key]:
        """Keys to probe now (once each); they move to IN_FLIGHT."""
        batch = [k for k in self._queued if k in self._entries]
        self._queued = []
        for key in batch:
            self._entries[key].phase = Phase.IN_FLIGHT
        return batch

    def resolve(self, keys: Iterable[Key], found: Iterable[Key]) -> None:
        """Record a probe's answer: keys in ``found`` exist, the other keys do not."""
        found = set(found)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.phase = Phase.RESOLVED
            entry.found = key in found
            if not entry.requests:
                del self._entries[key]

    def fail(self, keys: Iterable[Key]) -> dict[Key, set[str]]:
        """The probe of these keys failed: their in-flight entries are dropped (the next lookup
        probes again). Returns, per dropped key, the requests that were waiting on it."""
        waiting: dict[Key, set[str]] = {}
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.phase is not Phase.IN_FLIGHT:
                continue
            del self._entries[key]
            if entry.requests:
                waiting[key] = entry.requests
        return waiting

    def forget(self, keys: Iterable[Key]) -> None:
        """Drop positive verdicts (a load failed transiently): the next lookup probes again."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.phase is Phase.RESOLVED and entry.found:
                del self._entries[key]

    def mark_miss(self, keys: Iterable[Key]) -> None:
        """Force a cached verdict to absent (the tier confirmed it does not hold the key);
        unknown keys are ignored."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.phase = Phase.RESOLVED
                entry.found = False

    def mark_present(self, keys: Iterable[Key]) -> None:
        """A store to the tier succeeded: existing entries become present."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.phase = Phase.RESOLVED
                entry.found = True

    def release(self, req_id: str) -> None:
        for key in self._by_request.pop(req_id, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.requests.discard(req_id)
            if not entry.requests and entry.phase is not Phase.IN_FLIGHT:
                del self._entries[key]

    def requests(self) -> set[str]:
        """Requests that still reference an entry."""
        return set(self._by_request)

    def has_queued(self) -> bool:
        return bool(self._queued)

    def __len__(self) -> int:
        return len(self._entries)

    def cached(self, key: Key) -> bool | None:
        """The resolved verdict for a key, or None if unknown or unresolved (no probe started)."""
        entry = self._entries.get(key)
        return entry.found if entry is not None and entry.phase is Phase.RESOLVED else None

    def phase(self, key: Key) -> Phase | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.phase
