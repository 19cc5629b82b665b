"""Eviction policies of the primary tier (LRU, ARC), selectable by name.

A policy orders keys only. Whether a key may be evicted is the primary index's ref count
(``ref_count(key) == 0``); a policy never selects pinned (> 0), in-flight (-1) or protected keys.
``evict`` is atomic: it returns exactly ``n`` keys and forgets them, or returns None and changes
nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator

from kvoffload.tiering.types import Key

RefCount = Callable[[Key], int]


class CachePolicy:
    """Interface every policy implements."""

    name = ""

    def __init__(self, capacity: int, ref_count: RefCount) -> None:
        self.capacity = capacity
        self._ref_count = ref_count

    def insert(self, key: Key) -> None:
        raise NotImplementedError

    def remove(self, key: Key) -> None:
        raise NotImplementedError

    def touch(self, keys: Iterable[Key]) -> None:
        """Record an access; the first key of ``keys`` ends up the most recent."""
        raise NotImplementedError

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def _evictable(self, key: Key, protected: Collection[Key]) -> bool:
        return self._ref_count(key) == 0 and key not in protected


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int, ref_count: RefCount) -> None:
        super().__init__(capacity, ref_count)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Iterable[Key]) -> None:
        order = self._order
        for key in reversed(list(keys)):
            if key in order:
                order.move_to_end(key)

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        if n <= 0:
            return []
        chosen: list[Key] = []
        for key in self._order:
            if self._evictable(key, protected):
                chosen.append(key)
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            return None
        for key in chosen:
            del self._order[key]
        return chosen

    def clear(self) -> None:
        self._order.clear()

    def order(self) -> list[Key]:
        """Keys from least to most recent."""
        return list(self._order)


class ARCPolicy(CachePolicy):
    """Adaptive replacement: T1 (seen once), T2 (seen again), ghost lists B1/B2, target |T1|."""

    name = "arc"

    def __init__(self, capacity: int, ref_count: RefCount) -> None:
        super().__init__(capacity, ref_count)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.target_t1 = 0.0

    def insert(self, key: Key) -> None:
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self.t1[key] = None

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def touch(self, keys: Iterable[Key]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                if self._ref_count(key) >= 0:
                    del self.t1[key]
                    self.t2[key] = None
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                step = max(1.0, len(self.b2) / len(self.b1))
                self.target_t1 = min(float(self.capacity), self.target_t1 + step)
            elif key in self.b2:
                step = max(1.0, len(self.b1) / len(self.b2))
                self.target_t1 = max(0.0, self.target_t1 - step)

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        if n <= 0:
            return []
        from_t1 = self._candidates(self.t1, protected)
        from_t2 = self._candidates(self.t2, protected)
        chosen: list[tuple[Key, bool]] = []
        t1_size = len(self.t1)
        target = int(self.target_t1)
        while len(chosen) < n:
            prefer_t1 = t1_size >= target
            first, second = (from_t1, from_t2) if prefer_t1 else (from_t2, from_t1)
            key = next(first, None)
            in_t1 = prefer_t1
            if key is None:
                key = next(second, None)
                in_t1 = not prefer_t1
            if key is None:
                return None
            chosen.append((key, in_t1))
            if in_t1:
                t1_size -= 1
        for key, in_t1 in chosen:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in chosen]

    def _candidates(self, lst: OrderedDict[Key, None], protected: Collection[Key]) -> Iterator[Key]:
        return (key for key in lst if self._evictable(key, protected))

    def _trim_ghosts(self) -> None:
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)

    def clear(self) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()
        self.target_t1 = 0.0


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int, ref_count: RefCount) -> CachePolicy:
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(capacity, ref_count)
