"""Write-back: which blocks eviction may take while their cascades are under way, and the
backpressure a store meets when no block may go.

A key is *dirty* for a secondary tier while it is in the host pool and its cascade to that tier
has not landed: it waits in the tier's backlog, or a cascade of it is in flight (``Cascades``
keeps each tier's dirty keys). What happens to dirty keys when room is needed is the tier's
``WriteBack`` rule:

- ``HOLD`` (the disk tier): a dirty key is held in the pool (``PrimaryIndex.hold``) from the
  moment it is queued for the tier until its cascade lands or is given up for a counted reason
  (``tier_full``, ``retry_bound``; a ``reset_cache`` gives up what an offline tier never got as
  ``evicted``). Eviction never takes it. When no clean key is left, a store is refused at once
  (``no_space``): the pool pushes back instead of dropping a block it acknowledged.
- ``BEST_EFFORT`` (the object tier): dirty keys are evicted only when no clean key is left, and
  each is then given up for that tier, counted and logged (``cascade_dropped``, ``evicted``).

``Eviction`` allocates slots under these rules and counts the stores refused for lack of clean
room (``stores_refused_dirty``: refused while held blocks took the slots that would have made
room) and how long stores were refused for (``store_backpressure_s``: from a refused store to
the next store that got slots, counted as stores come). Stores never wait in the manager.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING

from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import Allocation, Key, WriteBack

if TYPE_CHECKING:
    from kvoffload.tiering.cascades import Cascades

__all__ = ["Eviction", "Guard", "WriteBack"]

Guard = Callable[[Collection[Key]], Collection[Key]]
"""Wraps the keys an eviction must not take with more it must not take, asked last."""


class _Protected(Collection[Key]):
    """The keys of the call that needs the room and the best-effort tiers' dirty keys, without
    copying them (eviction only asks ``in``)."""

    def __init__(self, protected: Collection[Key], dirty: Sequence[Collection[Key]]) -> None:
        self._parts = (protected, *dirty)

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self._parts)

    def __iter__(self) -> Iterator[Key]:
        seen: set[Key] = set()
        for part in self._parts:
            for key in part:
                if key not in seen:
                    seen.add(key)
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Eviction:
    def __init__(
        self,
        primary: PrimaryIndex,
        cascades: Cascades,
        stats: TieringStats,
        clock: Callable[[], float],
    ) -> None:
        self.primary = primary
        self.cascades = cascades
        self.stats = stats
        self._clock = clock
        self._refusing_since: float | None = None

    def allocate(
        self, keys: Sequence[Key], protected: Collection[Key], guard: Guard | None = None
    ) -> Allocation | None:
        """``PrimaryIndex.allocate`` under the write-back rules: held keys never go; keys dirty
        for a best-effort tier go only when nothing clean can make room. ``guard`` wraps what
        each attempt protects, asked last (tenant shares, ``tenants.ShareGuard``)."""
        dirty = self.cascades.best_effort_dirty()
        if any(dirty):
            first: Collection[Key] = _Protected(protected, dirty)
            allocated = self.primary.allocate(keys, guard(first) if guard else first)
            if allocated is not None:
                return allocated
        return self.primary.allocate(keys, guard(protected) if guard else protected)

    def allocate_clean(self, keys: Sequence[Key], protected: Collection[Key]) -> Allocation | None:
        """``allocate`` where the room needs no key dirty for a best-effort tier; None (nothing
        changed) where it would, or where there is no room at all."""
        dirty = self.cascades.best_effort_dirty()
        return self.primary.allocate(
            keys, _Protected(protected, dirty) if any(dirty) else protected
        )

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        """``PrimaryIndex.evict`` under the same rules (a tenant over its cap making room)."""
        dirty = self.cascades.best_effort_dirty()
        if any(dirty):
            evicted = self.primary.evict(n, _Protected(protected, dirty))
            if evicted is not None:
                return evicted
        return self.primary.evict(n, protected)

    def store_allocated(self, allocated: Allocation) -> None:
        """A store got its slots: a refusal streak ends."""
        if allocated.new_keys and self._refusing_since is not None:
            self._streak(refusing=False)

    def _streak(self, refusing: bool) -> None:
        """``store_backpressure_s`` grows at each store call of a refusal streak, so it is up
        to date while stores keep being refused."""
        now = self._clock()
        if self._refusing_since is not None:
            self.stats.store_backpressure_s += now - self._refusing_since
        self._refusing_since = now if refusing else None

    def store_refused(self, keys: Sequence[Key]) -> None:
        """A store found no slot (``no_space``): counted, and counted as refused for lack of
        clean room when the held keys (waiting for their cascade, or in one) took the room."""
        self.stats.store_allocation_failures += 1
        primary = self.primary
        held = primary.held_count
        if held:
            need = sum(1 for k in dict.fromkeys(keys) if k not in primary) - primary.free_slots
            if need <= primary.evictable_count + held:
                self.stats.stores_refused_dirty += 1
        self._streak(refusing=True)
