"""Warm restart: blocks a restarted manager finds in the pool, adopted until verified.

``adopt`` enters them at their exact slots as in-flight writes (HIT_PENDING, not evictable), so
no request reads them and no key takes their slots; ``complete`` makes the verified ones ready
and frees the others.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.types import Key


class Adoption:
    def __init__(self, primary: PrimaryIndex) -> None:
        self.primary = primary
        self._adopting: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._adopting)

    def adopt(self, entries: Sequence[tuple[Key, int]]) -> None:
        """Enter blocks found in the pool, oldest first, each at its exact slot. Only before
        any other use of the primary tier (ValueError otherwise, see ``PrimaryIndex.adopt``)."""
        self.primary.adopt(entries)
        self._adopting = dict(entries)

    def pending(self) -> list[tuple[Key, int]]:
        """(key, slot) of the adopted blocks still awaiting verification."""
        return list(self._adopting.items())

    def complete(
        self, keys: Iterable[Key], ok_keys: Collection[Key]
    ) -> tuple[list[Key], list[Key]]:
        """Those of ``keys`` in ``ok_keys`` become ready (HIT), the others are freed (MISS).
        Keys no longer awaiting verification are ignored. Returns (ready, dropped)."""
        ok = set(ok_keys)
        ready: list[Key] = []
        dropped: list[Key] = []
        for key in keys:
            if self._adopting.pop(key, None) is not None:
                (ready if key in ok else dropped).append(key)
        self.primary.complete_write(ready, True)
        self.primary.complete_write(dropped, False)
        return ready, dropped

    def clear(self) -> None:
        """The primary tier is emptied: nothing awaits verification any more."""
        self._adopting.clear()
