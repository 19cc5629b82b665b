"""The peer tier's index: which followed node holds which key (pure bookkeeping, no sockets).

What a node holds is what its node stream told: blocks stored into or removed from its pool
and its disk (the tiers it serves from; its object tier is reached through the bucket, and
what it promoted from its own peers is not announced). A key is in the index while at least
one node holds it in either tier. The index is a hint: the holder decides at fetch time.

``NodeFeed`` orders one node's stream: batches apply in sequence order only; a batch that
skips ahead starts a catch-up from the first missing number (``replay_from``), one that goes
back, a replay whose end names another run, or a replay that no longer reaches back, starts
a snapshot (``wants_snapshot``), and until the snapshot arrives the node's keys stay as they
were. A snapshot replaces the node's keys, then the batches kept since it apply on top.

``PeerIndex`` merges the nodes: ``take_changes`` gives the keys that became held by some node
and those no node holds any more since the last call, as the manager's tier index wants them.
It holds at most ``max_keys`` keys; a key told beyond that is not indexed (counted in
``keys_not_indexed``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

POOL_TIER = 1
DISK_TIER = 2
"""Bits of the tiers a node holds a key in."""


class Change(enum.Enum):
    """What one event of a node's stream does to the node's keys."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class TierChange:
    """One event of a node's stream: ``keys`` entered or left ``tier`` (a ``*_TIER`` bit);
    ``CLEARED`` empties every tier of the node."""

    change: Change
    tier: int = 0
    keys: tuple[bytes, ...] = ()


class PeerIndex:
    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._held: dict[str, dict[bytes, int]] = {}
        """node -> key -> the tiers (bits) it holds the key in."""
        self._holders: dict[bytes, dict[str, None]] = {}
        """key -> the nodes holding it, in the order they were told."""
        self._changed: dict[bytes, None] = {}
        self._reported: set[bytes] = set()
        self.keys_not_indexed = 0

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, key: bytes) -> list[str]:
        """The nodes that hold ``key`` as far as their streams told (empty: none)."""
        return list(self._holders.get(key, ()))

    def node_keys(self, node: str) -> int:
        return len(self._held.get(node, {}))

    def apply(self, node: str, changes: Iterable[TierChange]) -> None:
        held = self._held.setdefault(node, {})
        for change in changes:
            if change.change is Change.CLEARED:
                self.clear(node)
                held = self._held.setdefault(node, {})
            elif change.change is Change.STORED:
                for key in change.keys:
                    self._store(node, held, key, change.tier)
            else:
                for key in change.keys:
                    self._remove(node, held, key, change.tier)

    def clear(self, node: str) -> None:
        """Forget every key of ``node`` (a new run, a silent stream, before a snapshot)."""
        for key in self._held.pop(node, {}):
            self._drop_holder(node, key)

    def _store(self, node: str, held: dict[bytes, int], key: bytes, tier: int) -> None:
        tiers = held.get(key, 0)
        if tiers:
            held[key] = tiers | tier
            return
        holders = self._holders.get(key)
        if holders is None:
            if len(self._holders) >= self.max_keys:
                self.keys_not_indexed += 1
                return
            holders = self._holders[key] = {}
            self._changed[key] = None
        holders[node] = None
        held[key] = tier

    def _remove(self, node: str, held: dict[bytes, int], key: bytes, tier: int) -> None:
        tiers = held.get(key, 0) & ~tier
        if key not in held:
            return
        if tiers:
            held[key] = tiers
            return
        del held[key]
        self._drop_holder(node, key)

    def _drop_holder(self, node: str, key: bytes) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.pop(node, None)
        if not holders:
            del self._holders[key]
            self._changed[key] = None

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys some node holds now that were not reported, reported keys no node holds)."""
        added: list[bytes] = []
        removed: list[bytes] = []
        for key in self._changed:
            held = key in self._holders
            if held and key not in self._reported:
                added.append(key)
                self._reported.add(key)
            elif not held and key in self._reported:
                removed.append(key)
                self._reported.discard(key)
        self._changed.clear()
        return added, removed

    def announce_all(self) -> list[bytes]:
        """Every key held, reported afresh (a restarted manager asks for the whole index)."""
        self._changed.clear()
        self._reported = set(self._holders)
        return list(self._holders)


@dataclass(slots=True)
class NodeFeed:
    """The order of one node's stream (module docstring). ``next_seq`` -1: not synced yet
    (a snapshot is due)."""

    run: str = ""
    next_seq: int = -1
    kept: dict[int, list[TierChange]] = field(default_factory=dict)
    """Batches received ahead of ``next_seq`` (or while a snapshot is awaited)."""
    wants_snapshot: bool = True
    replay_from: int = -1
    """The first sequence number a catch-up asks for (-1: none wanted)."""
    max_kept: int = 4096

    def on_batch(self, seq: int, changes: list[TierChange]) -> list[list[TierChange]]:
        """A published batch; returns the batches to apply now, in order."""
        if self.next_seq < 0 or self.wants_snapshot:
            self._keep(seq, changes)
            return []
        if seq < self.next_seq:
            self.wants_snapshot = True  # a restarted manager numbers from 0 again
            self.kept.clear()
            return []
        self._keep(seq, changes)
        ready = self._take_in_order()
        if self.kept and self.replay_from < 0:
            self.replay_from = self.next_seq
        return ready

    def on_replay(
        self, run: str, batches: list[tuple[int, list[TierChange]]]
    ) -> list[list[TierChange]]:
        """A catch-up's answer (its batches from ``replay_from`` on, and the run its end
        named); returns the batches to apply now, in order."""
        self.replay_from = -1
        if self.next_seq < 0 or self.wants_snapshot:
            return []
        if run != self.run:
            self.wants_snapshot = True
            self.kept.clear()
            return []
        for seq, changes in batches:
            if seq >= self.next_seq:
                self.kept.setdefault(seq, changes)
        ready = self._take_in_order()
        if self.kept:
            # the replay no longer reaches back to the first missing batch
            self.wants_snapshot = True
            self.kept.clear()
        return ready

    def on_snapshot(
        self, run: str, next_seq: int, changes: list[TierChange]
    ) -> list[list[TierChange]]:
        """A snapshot stamped with the sequence number of the first batch after it (a
        ``CLEARED`` leads ``changes``); returns it, then the batches kept from there on."""
        self.run = run
        self.next_seq = next_seq
        self.wants_snapshot = False
        self.replay_from = -1
        for seq in [s for s in self.kept if s < self.next_seq]:
            del self.kept[seq]
        ready = [changes, *self._take_in_order()]
        if self.kept:
            self.replay_from = self.next_seq
        return ready

    def lost(self) -> None:
        """The node went silent or away: a snapshot is due when it answers again."""
        self.wants_snapshot = True
        self.replay_from = -1
        self.kept.clear()

    def _keep(self, seq: int, changes: list[TierChange]) -> None:
        if len(self.kept) >= self.max_kept:
            self.lost()  # too far behind to catch up batch by batch
        self.kept[seq] = changes

    def _take_in_order(self) -> list[list[TierChange]]:
        ready = []
        while self.next_seq in self.kept:
            ready.append(self.kept.pop(self.next_seq))
            self.next_seq += 1
        return ready
