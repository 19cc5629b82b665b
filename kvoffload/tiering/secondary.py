"""Manager-side view of one secondary tier (disk, object store).

An *indexed* tier (disk) answers lookups from the key index its worker reports (hello, stores,
evictions). A *probed* tier (object store, shared by many machines) answers from a verdict
cache and asks its worker when a key is unknown (RETRY until the answer arrives).
No I/O here: the tiering manager turns what the proxy asks for into jobs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from .types import Key, Locality, LookupResult, Medium, MissReason, OffloadPolicy
from .verdicts import VerdictCache


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Static description of a secondary tier.

    ``max_inflight_cascade_keys``: admission bound; a cascade that would exceed it is dropped
    (nothing pinned, no job id consumed). 0 means unbounded.
    ``request_level``: the tier wants every block of every request, prefix hits included."""

    name: str
    medium: Medium = Medium.STORAGE
    locality: Locality = Locality.LOCAL
    indexed: bool = True
    max_inflight_cascade_keys: int = 0
    request_level: bool = False


class SecondaryTier:
    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.index: set[Key] = set()
        self.verdicts = VerdictCache()
        self._failed: dict[str, set[Key]] = {}
        self._touched: OrderedDict[Key, None] = OrderedDict()
        self.inflight_cascade_keys = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def lookup(self, key: Key, req_id: str) -> tuple[LookupResult, MissReason]:
        failed = self._failed.get(req_id)
        if failed is not None and key in failed:
            return LookupResult.MISS, MissReason.FAILED_LOAD
        if self.spec.indexed:
            if key in self.index:
                return LookupResult.HIT, MissReason.NONE
            return LookupResult.MISS, MissReason.ABSENT
        found = self.verdicts.lookup(key, req_id)
        if found is None:
            return LookupResult.RETRY, MissReason.PROBING
        return (LookupResult.HIT, MissReason.NONE) if found else (LookupResult.MISS, MissReason.ABSENT)

    def knows(self, key: Key) -> bool:
        """True if the tier is known to hold the key (no probe is started)."""
        if self.spec.indexed:
            return key in self.index
        return self.verdicts.cached(key) is True

    def mark_miss(self, keys: Iterable[Key], req_id: str | None) -> None:
        """A load of these keys failed: this request (None: no active request) must not
        promote them again."""
        keys = list(keys)
        self.verdicts.mark_miss(keys)
        if req_id is not None:
            self._failed.setdefault(req_id, set()).update(keys)

    def stored(self, keys: Iterable[Key]) -> None:
        keys = list(keys)
        if self.spec.indexed:
            self.index.update(keys)
        self.verdicts.mark_present(keys)

    def apply_index_update(self, added: Iterable[Key], removed: Iterable[Key]) -> None:
        """The worker reports keys it now holds / no longer holds (eviction, corrupt copy)."""
        removed = list(removed)
        self.index.update(added)
        self.index.difference_update(removed)
        self.verdicts.mark_miss(removed)

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

    def admits_cascade(self, num_keys: int) -> bool:
        bound = self.spec.max_inflight_cascade_keys
        return bound <= 0 or self.inflight_cascade_keys + num_keys <= bound

    def has_queued_probes(self) -> bool:
        return self.verdicts.has_queued()
