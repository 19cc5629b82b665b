"""Index of the primary tier (the host pool): key -> (slot, ref_cnt).

ref_cnt states: -1 a write into the slot is in flight (not readable, not evictable);
0 ready and evictable; n > 0 ready and pinned by n readers.
A ready key may also be *held* (``hold``/``release``, counted apart from its readers): a held
key is readable but never evicted (the write-back of ``writeback.py``: its cascade to a tier
that must get it has not landed yet).
Slots are handed out never-used first (increasing), then freed ones (last freed first).
With ``track_invalidations`` every slot freed or handed to a new key is recorded until
``take_invalidated_slots``, so the caller can forget what the slot held (its slot header).
The ``PoolListener`` hears of every key that enters the index and every key that leaves it,
except by ``reset`` (tenant accounting, ``tenants.owners``). The ``EventSink`` hears of every
key that becomes ready and of every ready key that leaves, ``reset`` included
(``tiering.events``), before its listener does.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from kvoffload.tiering.events import NO_EVENTS, EventSink
from kvoffload.tiering.policies import make_policy
from kvoffload.tiering.types import Allocation, Key, NotReady, ProtocolViolation
from kvoffload.wire.vocab import LookupResult

WRITING = -1


class PoolListener(Protocol):
    def pool_added(self, keys: Sequence[Key]) -> None: ...

    def pool_dropped(self, key: Key) -> None: ...


class _NoPoolListener:
    def pool_added(self, keys: Sequence[Key]) -> None:
        return None

    def pool_dropped(self, key: Key) -> None:
        return None


NO_POOL_LISTENER: PoolListener = _NoPoolListener()


class PrimaryIndex:
    """Pure bookkeeping: who owns which slot. Never touches bytes."""

    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        track_invalidations: bool = False,
        listener: PoolListener = NO_POOL_LISTENER,
        events: EventSink = NO_EVENTS,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._track_invalidations = track_invalidations
        self._invalidated: list[int] = []
        self._slot: dict[Key, int] = {}
        self._refs: dict[Key, int] = {}
        self._free: list[int] = []
        self._next_unused = 0
        self._evictable = 0
        self._holds: dict[Key, int] = {}
        self.policy = make_policy(policy, num_slots, self._eviction_refs)
        self.recently_evicted: OrderedDict[Key, None] = OrderedDict()
        self.evictions = 0
        self._listener = listener
        self._events = events

    def ref_count(self, key: Key) -> int:
        """ref_cnt of a present key; KeyError if absent."""
        return self._refs[key]

    def _eviction_refs(self, key: Key) -> int:
        """What the policy sees: ref_cnt, plus one while the key is held (never 0 then)."""
        return self._refs[key] + (key in self._holds)

    def lookup(self, key: Key) -> LookupResult:
        ref = self._refs.get(key)
        if ref is None:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if ref == WRITING else LookupResult.HIT

    def ready_run(self, keys: Sequence[Key], start: int = 0) -> int:
        """Number of consecutive ready keys from ``keys[start]`` (the all-HIT fast path)."""
        get = self._refs.get
        n = 0
        for key in keys[start:] if start else keys:
            if get(key, WRITING) < 0:
                break
            n += 1
        return n

    def __contains__(self, key: Key) -> bool:
        return key in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def slot_of(self, key: Key) -> int:
        return self._slot[key]

    @property
    def free_slots(self) -> int:
        return len(self._free) + self.num_slots - self._next_unused

    @property
    def evictable_count(self) -> int:
        """Ready keys neither pinned nor held."""
        return self._evictable

    @property
    def held_count(self) -> int:
        """Keys held (``hold``), pinned or not."""
        return len(self._holds)

    def is_held(self, key: Key) -> bool:
        return key in self._holds

    def hold(self, keys: Iterable[Key]) -> None:
        """+1 hold on each key (all must be ready, else NotReady and nothing changes). A held
        key is never evicted; holds are counted apart from pins."""
        keys = list(keys)
        for key in keys:
            ref = self._refs.get(key)
            if ref is None or ref == WRITING:
                raise NotReady(f"key {key.hex()} is not ready in the primary tier")
        for key in keys:
            held = self._holds.get(key, 0)
            self._holds[key] = held + 1
            if not held and self._refs[key] == 0:
                self._evictable -= 1

    def release(self, keys: Iterable[Key]) -> None:
        """-1 hold on each key; a key that is not held is a protocol violation."""
        keys = list(keys)
        for key in keys:
            if key not in self._holds:
                raise ProtocolViolation(f"key {key.hex()} is not held")
        for key in keys:
            held = self._holds[key] - 1
            if held:
                self._holds[key] = held
                continue
            del self._holds[key]
            if self._refs[key] == 0:
                self._evictable += 1

    def allocate(self, keys: Iterable[Key], protected: Collection[Key]) -> Allocation | None:
        """Reserve slots (ref_cnt -1) for the keys not yet present; None, changing nothing,
        when not enough slots can be freed without evicting pinned, in-flight or protected
        keys."""
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._refs))
        if not new_keys:
            return Allocation([], [], [])
        need = len(new_keys) - self.free_slots
        evicted: list[Key] = []
        if need > 0:
            chosen = self.evict(need, protected)
            if chosen is None:
                return None
            evicted = chosen
        slots = []
        for key in new_keys:
            slot = self._take_slot()
            self._slot[key] = slot
            self._refs[key] = WRITING
            self.policy.insert(key)
            slots.append(slot)
        self._listener.pool_added(new_keys)
        return Allocation(new_keys, slots, evicted)

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        """Evict ``n`` idle keys (neither pinned, written, held nor protected) in the policy's
        order; None, changing nothing, when there are not that many."""
        if n > self._evictable:
            return None
        chosen = self.policy.evict(n, protected)
        if chosen is None:
            return None
        if self._events.active:
            self._events.removed(chosen)
        for key in chosen:
            self._drop(key)
            self._remember_evicted(key)
        self.evictions += len(chosen)
        return chosen

    def remove(self, keys: Iterable[Key]) -> list[Key]:
        """Remove the idle keys among ``keys`` (ready, neither pinned nor held) at once, not as
        evictions (a tenant drop); returns them. The others are left alone."""
        refs, holds = self._refs, self._holds
        removed = [k for k in dict.fromkeys(keys) if refs.get(k) == 0 and k not in holds]
        if removed and self._events.active:
            self._events.removed(removed)
        for key in removed:
            self.policy.remove(key)
            self._drop(key)
        return removed

    def complete_write(self, keys: Iterable[Key], success: bool) -> list[Key]:
        """Finish in-flight writes. Success: -1 -> 0. Failure: the key is removed, slot freed.

        Keys that are absent or already ready are left alone. Returns the keys changed."""
        changed = []
        for key in keys:
            if self._refs.get(key) != WRITING:
                continue
            if success:
                self._refs[key] = 0
                self._evictable += 1
            else:
                self.policy.remove(key)
                self._drop(key)
            changed.append(key)
        if success and changed and self._events.active:
            self._events.stored(changed)
        return changed

    def pin(self, keys: Iterable[Key]) -> list[int]:
        """+1 reader on each key (all must be ready, else NotReady and nothing changes)."""
        keys = list(keys)
        refs, holds = self._refs, self._holds
        found = list(map(refs.get, keys))
        if None in found or WRITING in found:
            bad = next(
                k for k, ref in zip(keys, found, strict=True) if ref is None or ref == WRITING
            )
            raise NotReady(f"key {bad.hex()} is not ready in the primary tier")
        for key in keys:
            ref = refs[key]
            if ref == 0 and key not in holds:
                self._evictable -= 1
            refs[key] = ref + 1
        slot = self._slot
        return [slot[key] for key in keys]

    def unpin(self, keys: Iterable[Key]) -> None:
        """-1 reader on each key; a key that is not pinned is a protocol violation."""
        keys = list(keys)
        refs, holds = self._refs, self._holds
        if min(map(refs.get, keys, itertools.repeat(0)), default=1) <= 0:
            bad = next(k for k in keys if refs.get(k, 0) <= 0)
            raise ProtocolViolation(f"key {bad.hex()} is not pinned")
        for key in keys:
            ref = refs[key] - 1
            refs[key] = ref
            if ref == 0 and key not in holds:
                self._evictable += 1

    def _idle_changed(self, key: Key, delta: int) -> None:
        """A ready key's last pin went (+1) or its first came (-1): evictable unless held."""
        if key not in self._holds:
            self._evictable += delta

    def touch(self, keys: Iterable[Key]) -> None:
        self.policy.touch(keys)

    def adopt(self, entries: Sequence[tuple[Key, int]]) -> None:
        """Rebuild an unused index from blocks found in the pool: each (key, slot) enters at that
        exact slot as an in-flight write (ref_cnt -1, HIT_PENDING) that ``complete_write``
        finishes; the other slots are free. Entries are inserted oldest first (policy order).
        ValueError, changing nothing, if the index was used since its creation or reset, or a
        key or slot repeats, or a slot is out of range."""
        if self._refs or self._next_unused or self._free:
            raise ValueError("only an unused primary index can adopt blocks")
        keys = [key for key, _ in entries]
        slots = [slot for _, slot in entries]
        if len(set(keys)) != len(keys) or len(set(slots)) != len(slots):
            raise ValueError("adopted keys and slots must be unique")
        bad = [slot for slot in slots if not 0 <= slot < self.num_slots]
        if bad:
            raise ValueError(f"slots {bad[:4]} not in [0, {self.num_slots})")
        if not entries:
            return
        for key, slot in entries:
            self._slot[key] = slot
            self._refs[key] = WRITING
            self.policy.insert(key)
        self._listener.pool_added(keys)
        taken = set(slots)
        self._next_unused = self.num_slots
        self._free = [slot for slot in range(self.num_slots - 1, -1, -1) if slot not in taken]

    def take_invalidated_slots(self) -> list[int]:
        """Slots freed or handed to a new key since the last call (always empty without
        ``track_invalidations``); a slot may appear more than once."""
        out, self._invalidated = self._invalidated, []
        return out

    def reset(self) -> None:
        """Forget everything (callers guarantee no job still targets a slot)."""
        if self._events.active:
            self._events.removed([k for k, ref in self._refs.items() if ref != WRITING])
        if self._track_invalidations:
            self._invalidated.extend(self._slot.values())
        self._slot.clear()
        self._refs.clear()
        self._free.clear()
        self._next_unused = 0
        self._evictable = 0
        self._holds.clear()
        self.policy.clear()
        self.recently_evicted.clear()

    def pinned_count(self) -> int:
        return sum(1 for r in self._refs.values() if r > 0)

    def writing_count(self) -> int:
        return sum(1 for r in self._refs.values() if r == WRITING)

    def ready_keys(self) -> list[Key]:
        """Every present key whose write has landed."""
        return [k for k, r in self._refs.items() if r != WRITING]

    def items(self) -> Iterable[tuple[Key, int, int]]:
        """(key, slot, ref_cnt) for every present key."""
        return ((k, self._slot[k], r) for k, r in self._refs.items())

    def _take_slot(self) -> int:
        if self._next_unused < self.num_slots:
            slot = self._next_unused
            self._next_unused += 1
        else:
            slot = self._free.pop()
        if self._track_invalidations:
            self._invalidated.append(slot)
        return slot

    def _drop(self, key: Key) -> None:
        self._listener.pool_dropped(key)
        if self._refs.pop(key) == 0:
            self._idle_changed(key, -1)
        self._holds.pop(key, None)
        slot = self._slot.pop(key)
        self._free.append(slot)
        if self._track_invalidations:
            self._invalidated.append(slot)

    def _remember_evicted(self, key: Key) -> None:
        self.recently_evicted[key] = None
        if len(self.recently_evicted) > self.num_slots:
            self.recently_evicted.popitem(last=False)
