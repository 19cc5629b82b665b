"""Durable cascades: every key that lands in the primary tier reaches every secondary tier.

Every key that lands in the primary tier (a store, or an adopted block) is cascaded to every
secondary tier that does not hold it. Keys a tier cannot take now (its worker is offline, see
``TieringLedger.set_tier_online``, its cascades in flight already pin
``max_inflight_cascade_keys``, or older keys wait before them) and keys whose cascade failed wait
in the tier's backlog, in order; a failed key is retried with exponential backoff. A cascade
goes out as jobs of at most ``max_cascade_job_keys`` keys. A key is given up only for a
``CascadeDrop`` reason (it was evicted first, the tier is full, or ``max_attempts`` failed), each
counted per tier and logged (``cascade_dropped``) with its keys.

From the moment a key is queued for a tier until its cascade lands or it is given up, it is
*dirty* for that tier (``TierCascades.dirty``). A ``WriteBack.HOLD`` tier holds its dirty keys
in the pool (``PrimaryIndex.hold``), so eviction never takes them; a ``BEST_EFFORT`` tier's dirty
keys are evicted last (``writeback.Eviction``) and then given up as ``evicted``.

Request-level tiers also get the keys of a store that were already present: ready ones at once,
the ones still being written parked on their request until their write lands.

Pure bookkeeping like the rest of the tiering library: cascades leave as ``TransferJob``s handed
to ``submit``, and come back through ``done``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.logs import get_logger
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import (
    Admission,
    CascadeDrop,
    Key,
    RequestState,
    TransferJob,
    WriteBack,
)
from kvoffload.wire.vocab import JobKind, LookupResult

log = get_logger()

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


@dataclass(slots=True)
class PendingCascade:
    """A key waiting in a tier's cascade backlog: ``attempts`` failed so far; not submitted
    again before ``not_before``; ``in_flight`` while a retry of it runs."""

    attempts: int = 0
    not_before: float = 0.0
    in_flight: bool = False


@dataclass(slots=True)
class TierCascades:
    """One tier's cascade state: the keys waiting for a cascade (``backlog``), when the backlog
    is worth looking at again (``due_at``), the keys its cascades in flight pin, and its dirty
    keys (in the backlog or in a cascade in flight)."""

    backlog: OrderedDict[Key, PendingCascade] = field(default_factory=OrderedDict)
    due_at: float = 0.0
    inflight_keys: int = 0
    dirty: dict[Key, None] = field(default_factory=dict)


class CascadeRoom(Protocol):
    """Room on the tiers that someone else decides (tenants' shares and caps,
    ``tenants.room``): the cascades of a tier it ``tracks`` go through ``admit``, and it hears
    of the keys sent and done."""

    def tracks(self, tier_idx: int) -> bool: ...

    def admit(self, tier_idx: int, keys: list[Key]) -> Admission: ...

    def sent(self, tier_idx: int, keys: list[Key]) -> None: ...

    def done(self, tier_idx: int, keys: list[Key]) -> None: ...


class _EveryRoom:
    """A ``CascadeRoom`` that tracks no tier."""

    def tracks(self, tier_idx: int) -> bool:
        return False

    def admit(self, tier_idx: int, keys: list[Key]) -> Admission:
        return Admission(now=list(keys))

    def sent(self, tier_idx: int, keys: list[Key]) -> None:
        return None

    def done(self, tier_idx: int, keys: list[Key]) -> None:
        return None


EVERY_ROOM: CascadeRoom = _EveryRoom()


class Cascades:
    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        primary: PrimaryIndex,
        stats: TieringStats,
        clock: Callable[[], float],
        submit: Callable[[TransferJob], None],
        *,
        max_attempts: int,
        backoff_s: float,
        backoff_max_s: float,
        per_tier: Sequence[TierCascades] | None = None,
        room: CascadeRoom = EVERY_ROOM,
    ) -> None:
        """A failed key is retried after ``backoff_s``, doubling up to ``backoff_max_s``, and
        given up after ``max_attempts`` failures. ``submit`` takes each new cascade job.
        ``per_tier``: each tier's cascade state (new when None; given when ``room`` reads it
        too); ``room``: who admits the cascades of the tiers it tracks."""
        self.tiers = tiers
        self.primary = primary
        self.stats = stats
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._submit = submit
        self.per_tier = list(per_tier) if per_tier is not None else [TierCascades() for _ in tiers]
        self._parked_requests: set[str] = set()
        self._room = room

    # ---- submission -----------------------------------------------------------------------

    def submit(self, tier_idx: int, keys: list[Key], req_id: str | None) -> None:
        """Cascade the ready keys the tier does not hold: as many as it has room for now, the
        others into its backlog (all of them when older keys wait there, so the backlog goes
        out in order)."""
        tier, state = self.tiers[tier_idx], self.per_tier[tier_idx]
        if not tier.spec.stores:
            return
        keys = [k for k in dict.fromkeys(keys) if not tier.knows(k) and k not in state.backlog]
        if not keys:
            return
        self._dirty(tier_idx, keys)
        waiting = any(not entry.in_flight for entry in state.backlog.values())
        room = 0 if waiting else self.room(tier_idx, len(keys))
        send = self._admit(tier_idx, keys[:room]) if room else []
        if room < len(keys):
            now = self._clock()
            for key in keys[room:]:
                state.backlog[key] = PendingCascade(not_before=now)
            state.due_at = min(state.due_at, now)
            self.stats.tier(tier_idx + 1).cascade_keys_deferred += len(keys) - room
        if send:
            self._send(tier_idx, send, req_id)

    def _admit(self, tier_idx: int, keys: list[Key]) -> list[Key]:
        """The keys that may go now (the room's ``admit``, where it tracks the tier); the
        ones waiting for room go to the backlog, the ones without any are given up."""
        room = self._room
        if not keys or not room.tracks(tier_idx):
            return keys
        admission = room.admit(tier_idx, keys)
        state = self.per_tier[tier_idx]
        if admission.wait:
            now = self._clock()
            for key in admission.wait:
                entry = state.backlog.get(key)
                if entry is None:
                    state.backlog[key] = PendingCascade(not_before=now)
                else:
                    entry.in_flight = False
            # the removals' results look again; this is the fallback should one be lost
            state.due_at = min(state.due_at, now + self.backoff_s)
        for reason, gone in (
            (CascadeDrop.TIER_FULL, admission.full),
            (CascadeDrop.TENANT_CAP, admission.capped),
        ):
            for key in gone:
                state.backlog.pop(key, None)
            self._drop(tier_idx, gone, reason)
            self._clean(tier_idx, gone)
        return admission.now

    def submit_everywhere(self, keys: list[Key], req_id: str | None) -> None:
        """Cascade keys that just became ready to every secondary tier."""
        for tier_idx in range(len(self.tiers)):
            self.submit(tier_idx, keys, req_id)

    def room(self, tier_idx: int, wanted: int) -> int:
        """How many of ``wanted`` keys a cascade may pin now (0 while the tier is offline)."""
        tier = self.tiers[tier_idx]
        if not tier.online:
            return 0
        bound = tier.spec.max_inflight_cascade_keys
        if bound <= 0:
            return wanted
        return max(0, min(wanted, bound - self.per_tier[tier_idx].inflight_keys))

    def _send(self, tier_idx: int, keys: list[Key], req_id: str | None) -> None:
        """Cascade jobs of at most ``max_cascade_job_keys`` keys each; each pins its slots."""
        step = self.tiers[tier_idx].spec.max_cascade_job_keys or len(keys)
        if self._room.tracks(tier_idx):
            self._room.sent(tier_idx, keys)
        for first in range(0, len(keys), step):
            chunk = keys[first : first + step]
            slots = self.primary.pin(chunk)
            self.per_tier[tier_idx].inflight_keys += len(chunk)
            self._submit(TransferJob(0, tier_idx, JobKind.CASCADE, chunk, slots, req_id))

    def _dirty(self, tier_idx: int, keys: list[Key]) -> None:
        """Ready keys become dirty for the tier (a HOLD tier holds them in the pool, once per
        key however many of its cascades are under way)."""
        dirty = self.per_tier[tier_idx].dirty
        fresh = [k for k in keys if k not in dirty]
        dirty.update(dict.fromkeys(fresh))
        if self.tiers[tier_idx].spec.writeback is WriteBack.HOLD:
            self.primary.hold(fresh)

    def _clean(self, tier_idx: int, keys: Iterable[Key]) -> None:
        """Keys are no longer dirty for the tier (stored, or given up): a HOLD tier lets go of
        the ones still in the pool."""
        dirty = self.per_tier[tier_idx].dirty
        gone = [k for k in keys if k in dirty]
        for key in gone:
            del dirty[key]
        if self.tiers[tier_idx].spec.writeback is WriteBack.HOLD:
            self.primary.release([k for k in gone if self.primary.is_held(k)])

    # ---- request-level tiers: keys already present ----------------------------------------

    def cascade_existing(self, state: RequestState, keys: list[Key]) -> None:
        """Cascade the ready keys to the request-level tiers now; park the ones still being
        written (they are retried at each step end); drop the absent ones."""
        ready = []
        for key in keys:
            result = self.primary.lookup(key)
            if result is HIT:
                ready.append(key)
            elif result is HIT_PENDING:
                state.parked_cascade_keys[key] = None
                self._parked_requests.add(state.ctx.req_id)
        if ready:
            for i in sorted(state.request_level_tiers):
                self.submit(i, ready, state.ctx.req_id)

    def retry_parked(
        self, requests: Mapping[str, RequestState], finalize: Callable[[str], None]
    ) -> None:
        """Try the parked keys of every request again; ``finalize`` follows each request's."""
        for req_id in list(self._parked_requests):
            state = requests[req_id]
            parked = list(state.parked_cascade_keys)
            state.parked_cascade_keys.clear()
            self._parked_requests.discard(req_id)
            self.cascade_existing(state, parked)
            finalize(req_id)

    def unpark(self, req_id: str) -> None:
        """The request's parked keys were dropped (cache reset)."""
        self._parked_requests.discard(req_id)

    # ---- results --------------------------------------------------------------------------

    def done(self, job: TransferJob, ok: list[Key], failed: list[Key], full: set[Key]) -> None:
        """A cascade's result: its slots are unpinned, stored keys leave the backlog; failed
        ones wait there for their backoff, or are given up (tier full, retry bound)."""
        tier_idx = job.tier
        tier, state = self.tiers[tier_idx], self.per_tier[tier_idx]
        state.inflight_keys -= len(job.keys)
        self._room.done(tier_idx, job.keys)
        self.primary.unpin(job.keys)
        tier.stored(ok)
        for key in ok:
            state.backlog.pop(key, None)
        self._clean(tier_idx, ok)
        now = self._clock()
        retry_bound: list[Key] = []
        for key in failed:
            if key in full:
                state.backlog.pop(key, None)
                continue
            entry = state.backlog.get(key)
            if entry is None:
                entry = state.backlog[key] = PendingCascade()
                self._dirty(tier_idx, [key])  # a second cascade of a key already clean
            entry.in_flight = False
            entry.attempts += 1
            if entry.attempts >= self.max_attempts:
                del state.backlog[key]
                retry_bound.append(key)
                continue
            backoff = self.backoff_s * 2 ** (entry.attempts - 1)
            entry.not_before = now + min(backoff, self.backoff_max_s)
        if state.backlog:
            state.due_at = 0.0  # room was freed and retries were scheduled: look again
        self._drop(tier_idx, [k for k in failed if k in full], CascadeDrop.TIER_FULL)
        self._drop(tier_idx, retry_bound, CascadeDrop.RETRY_BOUND)
        self._clean(tier_idx, [*full, *retry_bound])

    # ---- backlogs -------------------------------------------------------------------------

    def retry_due(self) -> None:
        """Submit what is due in the backlog of every online tier."""
        now = self._clock()
        for tier_idx, tier in enumerate(self.tiers):
            state = self.per_tier[tier_idx]
            if tier.online and state.backlog and now >= state.due_at:
                self._retry(tier_idx, now)

    def _retry(self, tier_idx: int, now: float) -> None:
        """Submit the backlog keys that are due, ready and within the tier's room, in backlog
        order; forget the ones the tier now holds; give up the ones evicted meanwhile. The scan
        stops once the room is used (a cascade's result looks again)."""
        tier, state = self.tiers[tier_idx], self.per_tier[tier_idx]
        room = self.room(tier_idx, len(state.backlog))
        batch: list[Key] = []
        settled: list[Key] = []
        evicted: list[Key] = []
        due_at = math.inf
        for key, entry in state.backlog.items():
            if len(batch) >= room:
                break
            if entry.in_flight:
                continue
            if tier.knows(key):
                settled.append(key)
                continue
            result = self.primary.lookup(key)
            if result is MISS:
                evicted.append(key)
            elif entry.not_before > now:
                due_at = min(due_at, entry.not_before)
            elif result is HIT_PENDING:
                due_at = min(due_at, now + self.backoff_s)
            elif len(batch) < room:
                batch.append(key)
        for key in settled + evicted:
            del state.backlog[key]
        state.due_at = due_at
        self._drop(tier_idx, evicted, CascadeDrop.EVICTED)
        self._clean(tier_idx, settled + evicted)
        batch = self._admit(tier_idx, batch)
        if batch:
            for key in batch:
                state.backlog[key].in_flight = True
            self.stats.tier(tier_idx + 1).cascade_keys_resubmitted += len(batch)
            self._send(tier_idx, batch, None)

    def has_due(self) -> bool:
        """Some online tier's backlog is worth looking at now."""
        now = self._clock()
        return any(
            tier.online and state.backlog and now >= state.due_at
            for tier, state in zip(self.tiers, self.per_tier, strict=True)
        )

    def tier_online(self, tier_idx: int) -> None:
        """The tier's worker is back: look at its backlog at once."""
        self.per_tier[tier_idx].due_at = 0.0

    def best_effort_dirty(self) -> list[dict[Key, None]]:
        """The dirty keys of each BEST_EFFORT tier (evicted only when nothing else can make
        room; a HOLD tier's are held, never evicted)."""
        return [
            state.dirty
            for tier, state in zip(self.tiers, self.per_tier, strict=True)
            if tier.spec.writeback is WriteBack.BEST_EFFORT
        ]

    def evicted(self, keys: Iterable[Key]) -> None:
        """Keys left the primary tier: those still waiting for a cascade are given up."""
        keys = list(keys)
        for tier_idx, state in enumerate(self.per_tier):
            gone = [k for k in keys if state.backlog.pop(k, None) is not None]
            self._drop(tier_idx, gone, CascadeDrop.EVICTED)
            self._clean(tier_idx, gone)

    def discard(self, keys: set[Key]) -> None:
        """Keys whose cascades are no longer wanted (their tenant was dropped): out of every
        backlog now, unless a cascade of them is in flight (it reports as usual)."""
        for tier_idx, state in enumerate(self.per_tier):
            gone = [k for k in keys if k in state.backlog and not state.backlog[k].in_flight]
            for key in gone:
                del state.backlog[key]
            self._clean(tier_idx, gone)

    def give_up_all(self) -> None:
        """The primary tier is emptied: every key still in a backlog is given up as evicted
        (no cascade is in flight then: every dirty key is in a backlog)."""
        for tier_idx, state in enumerate(self.per_tier):
            left = list(state.backlog)
            state.backlog.clear()
            self._drop(tier_idx, left, CascadeDrop.EVICTED)
            self._clean(tier_idx, list(state.dirty))

    def flush(self) -> None:
        """Make every backlog key due now, backoff or not."""
        for state in self.per_tier:
            for entry in state.backlog.values():
                entry.not_before = 0.0
            state.due_at = 0.0

    def backlog(self, online_only: bool = False) -> int:
        """Keys waiting in the backlogs (of the online tiers only, if asked)."""
        return sum(
            len(state.backlog)
            for tier, state in zip(self.tiers, self.per_tier, strict=True)
            if tier.online or not online_only
        )

    def has_parked(self) -> bool:
        return bool(self._parked_requests)

    def _drop(self, tier_idx: int, keys: list[Key], reason: CascadeDrop) -> None:
        if not keys:
            return
        self.stats.cascade_dropped(tier_idx + 1, reason, len(keys))
        log.warning(
            "cascade_dropped",
            tier=self.tiers[tier_idx].name,
            reason=reason.value,
            count=len(keys),
            keys=[k.hex() for k in keys],
        )
