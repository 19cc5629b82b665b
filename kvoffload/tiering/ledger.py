"""The tiering ledger: the contract of docs/design/tiering.md as pure bookkeeping.

It owns the primary index, the secondary-tier proxies, the request states and the job table.
It does no I/O: jobs it creates are queued in an outbox (``take_submissions``) and their outcomes
come back through ``apply_result``. Every job it creates gets exactly one result applied, either
from its tier or from ``fail_worker_jobs`` / ``expire_probes``.

Pinning rules: ``prepare_load`` pins (caller releases with ``complete_load``); a cascade pins its
slots until its result is applied; a landed promotion is pinned for its request until the request
loads it or finishes (within ``unread_promotion_cap`` slots). A key whose cascade to a
``WriteBack.HOLD`` tier has not landed is held in the pool, never evicted; a store that finds no
other room is refused (``writeback.Eviction``).

Its parts, each in its module: ``RequestTable`` (request states and how a request ends),
``PrefixLookup`` (a request's prefix across the tiers),
``Promotions`` (queued per step, landed, protected until read), ``Cascades`` (durable cascades
to every secondary tier: backlogs, retries, drops), ``PendingDeadlines`` (how long a request
waits for a key being written), ``TierJobs`` (the jobs in flight and their results),
``Adoption`` (warm restart) and ``Tenancy`` (tenants: owners, visibility, shares, caps, drops;
``tiering.tenants``).

Warm restart: ``adopt`` enters blocks found in the pool as in-flight writes (HIT_PENDING) and
``complete_adoption`` makes the verified ones ready and frees the rest. With
``track_slot_invalidations``, ``take_invalidated_slots`` lists every slot freed or handed to a
new key, so the caller can clear what described the slot's old contents.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

from kvoffload.logs import get_logger
from kvoffload.tiering.adoption import Adoption
from kvoffload.tiering.cascades import Cascades, TierCascades
from kvoffload.tiering.deadlines import PendingDeadlines
from kvoffload.tiering.events import POOL, EventLog
from kvoffload.tiering.jobs import TierJobs, split_outcome
from kvoffload.tiering.lookup import PrefixLookup
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.promotions import Promotions
from kvoffload.tiering.requests import RequestTable
from kvoffload.tiering.secondary import SecondaryTier, TierSpec
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.tenants import DropProgress, Tenancy, TenantPolicy
from kvoffload.tiering.tenants.drops import TenantDrops
from kvoffload.tiering.tenants.owners import TenantOwners
from kvoffload.tiering.tenants.pool import PoolShares
from kvoffload.tiering.tenants.room import TenantRoom
from kvoffload.tiering.types import (
    JobsInFlight,
    Key,
    LandingTag,
    OffloadPolicy,
    PrefixResult,
    PrepareStoreOutput,
    ProtocolViolation,
    ReqContext,
    RequestState,
    TransferJob,
    TransferResult,
)
from kvoffload.tiering.writeback import Eviction
from kvoffload.wire.events import TierEvent
from kvoffload.wire.status import TieringStatus, TierState
from kvoffload.wire.vocab import PRIMARY, JobKind, Locality, Medium

log = get_logger()


class TieringLedger:
    def __init__(
        self,
        num_slots: int,
        tiers: Sequence[TierSpec] = (),
        *,
        policy: str = "lru",
        hit_pending_deadline_s: float = 30.0,
        unread_promotion_cap: int | None = None,
        probe_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        track_slot_invalidations: bool = False,
        first_job_id: int = 1,
        cascade_max_attempts: int = 8,
        cascade_backoff_s: float = 0.05,
        cascade_backoff_max_s: float = 5.0,
        tenant_policy: TenantPolicy | None = None,
    ) -> None:
        """``first_job_id``: where the job id counter starts (a restarted manager starts past
        every id its predecessor could have used, so a late result never matches a new job).
        A failed cascade key is retried after ``cascade_backoff_s``, doubling up to
        ``cascade_backoff_max_s``, and given up after ``cascade_max_attempts`` failures.
        ``tenant_policy``: the tenants' shares and caps (``tenants``)."""
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tier names: {names}")
        # The parts are wired here, each handed what it calls when it is built: the tenants'
        # owners listen to the pool and the tiers, their room admits cascades, the tenancy
        # hears of the jobs' results.
        owners = TenantOwners(tenant_policy or TenantPolicy(), num_slots, tiers, clock)
        self.events = EventLog(owners)
        pool_events = self.events.sink(POOL, PRIMARY, Medium.CPU, Locality.LOCAL)
        self.primary = PrimaryIndex(
            num_slots, policy, track_slot_invalidations, owners, pool_events
        )
        self.adoption = Adoption(self.primary)
        self.tiers = [
            SecondaryTier(
                spec, owners, self.events.sink(i + 1, spec.name, spec.medium, spec.locality)
            )
            if spec.stores
            else SecondaryTier(spec)  # holds nothing of this node's: no events, no owners
            for i, spec in enumerate(tiers)
        ]
        self._tier_by_name = {t.name: i for i, t in enumerate(self.tiers)}
        self._clock = clock
        states: dict[str, RequestState] = {}
        self._outbox: list[TransferJob] = []
        self.stats = TieringStats([PRIMARY, *names])
        cascade_state = [TierCascades() for _ in self.tiers]
        room = TenantRoom(owners, self.tiers, cascade_state, self._submit)
        self.cascades = Cascades(
            self.tiers,
            self.primary,
            self.stats,
            clock,
            self._submit,
            max_attempts=cascade_max_attempts,
            backoff_s=cascade_backoff_s,
            backoff_max_s=cascade_backoff_max_s,
            per_tier=cascade_state,
            room=room,
        )
        self.eviction = Eviction(self.primary, self.cascades, self.stats, clock)
        unread_cap = (
            max(1, num_slots // 4) if unread_promotion_cap is None else unread_promotion_cap
        )
        self.promotions = Promotions(
            len(self.tiers), self.primary, self.stats, self._submit, unread_cap
        )
        self.deadlines = PendingDeadlines(hit_pending_deadline_s, states, self.stats, clock)
        self._lookup = PrefixLookup(
            self.primary, self.tiers, self.stats, self.deadlines, self._start_promotions, owners
        )
        self.tenancy = Tenancy(
            owners,
            PoolShares(owners, self.primary, self.eviction),
            room,
            TenantDrops(owners, self.primary, self.tiers, self.cascades, room),
            self.primary,
            self.tiers,
            self.eviction.allocate,
            self._record_evictions,
        )
        self.requests = RequestTable(
            states, self.tiers, self.promotions, self.deadlines, self.cascades, self.tenancy
        )
        self.jobs = TierJobs(
            self.tiers,
            self.stats,
            clock,
            first_job_id=first_job_id,
            probe_timeout_s=probe_timeout_s,
            cascades=self.cascades,
            promotions=self.promotions,
            deadlines=self.deadlines,
            active=self.requests.active,
            listener=self.tenancy,
        )

    # ---- identity -------------------------------------------------------------------------

    def tier_index(self, name: str) -> int:
        """Index of a secondary tier by name; KeyError if unknown."""
        return self._tier_by_name[name]

    def next_job_id(self) -> int:
        """One increasing counter for every job of the service (device jobs included)."""
        return self.jobs.next_id()

    def set_tier_online(self, tier_name: str, online: bool) -> None:
        """Whether the tier's worker is connected and its index announced (a new ledger starts
        with every tier online). Cascades for an offline tier wait in its backlog, unpinned,
        and go out once it is back."""
        tier_idx = self.tier_index(tier_name)
        self.tiers[tier_idx].online = online
        if online:
            self.tiers[tier_idx].index_announced()
            self.cascades.tier_online(tier_idx)

    # ---- request lifecycle ----------------------------------------------------------------

    def on_new_request(self, ctx: ReqContext) -> OffloadPolicy:
        """Create (or replace) the request's state (``RequestTable.start``)."""
        return self.requests.start(ctx)

    def on_request_finished(self, req_id: str) -> None:
        """No more submit-side calls for this request (``RequestTable.finish``)."""
        self.requests.finish(req_id)

    # ---- lookup ---------------------------------------------------------------------------

    def lookup(self, req_id: str, keys: Sequence[Key]) -> PrefixResult:
        """Evaluate keys in order, stopping at the first MISS (see ``lookup.PrefixLookup``). A
        finished request is refused (RequestFinishedError): it may start nothing."""
        state = self.requests.open(req_id)
        result = self._lookup.evaluate(state, keys)
        self.tenancy.looked_up(state.ctx.tenant, result)
        return result

    def promote_now(self, req_id: str, landing: LandingTag | None = None) -> list[TransferJob]:
        """Submit the request's queued promotions now instead of at the step's end (one job
        per tier), each carrying ``landing``; returns them (also in ``take_submissions``)."""
        return self.promotions.flush(req_id, landing)

    def _start_promotions(
        self, state: RequestState, wanted: Sequence[tuple[int, Key]], protected: Collection[Key]
    ) -> int:
        """Promote each ``(tier index, key)`` of ``wanted`` (keys absent from the pool, no two
        alike) for the request, in order; returns how many started: all, or those before the
        first that found no slot (``_start_promotion``). Slots for all of them at once when
        the room needs no dirty key and no tenant rules apply: the same slots and evictions
        as one at a time."""
        if len(wanted) > 1 and not self.tenancy.active:
            allocated = self.eviction.allocate_clean([key for _, key in wanted], protected)
            if allocated is not None:
                self._record_evictions(allocated.evicted)
                now = self._clock()
                req_id = state.ctx.req_id
                for (tier_idx, key), slot in zip(wanted, allocated.slots, strict=True):
                    self.promotions.queue(tier_idx, req_id, key, slot)
                    self.deadlines.arm(state, key, now)
                return len(wanted)
        for started, (tier_idx, key) in enumerate(wanted):
            if not self._start_promotion(tier_idx, state, key, protected):
                return started
        return len(wanted)

    def _start_promotion(
        self, tier_idx: int, state: RequestState, key: Key, protected: Collection[Key]
    ) -> bool:
        allocated = self.tenancy.allocate(state.ctx.tenant, [key], protected, refuse=False)
        if allocated is None or not allocated.new_keys:
            self.stats.promotion_allocation_failures += 1
            return False
        self._record_evictions(allocated.evicted)
        self.promotions.queue(tier_idx, state.ctx.req_id, key, allocated.slots[0])
        self.deadlines.arm(state, key, self._clock())
        return True

    # ---- loads (primary -> device) --------------------------------------------------------

    def prepare_load(self, req_id: str, keys: Sequence[Key]) -> list[int]:
        """Pin ready keys for a device load; returns their slots co-indexed with keys.
        All keys must be HIT (NotReady otherwise, nothing pinned). Release with complete_load."""
        state = self.requests.open(req_id)
        slots = self.primary.pin(keys)
        self.promotions.read(state, keys)
        return slots

    def complete_load(self, keys: Iterable[Key]) -> None:
        """Release the pins of a finished device load (success or not)."""
        self.primary.unpin(keys)

    def touch(self, keys: Sequence[Key]) -> None:
        """Recency for the primary policy and every secondary tier (first key most recent)."""
        self.primary.touch(keys)
        for tier in self.tiers:
            tier.touch(keys)
        self.tenancy.touch(keys)

    # ---- stores (device -> primary -> every secondary tier) -------------------------------

    def prepare_store(self, req_id: str, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not already present. None: no space (nothing changed).

        Keys already present go, for request-level tiers, straight to a cascade (ready) or are
        parked until their in-flight write lands."""
        state = self.requests.open(req_id)
        allocated = self.tenancy.allocate(state.ctx.tenant, keys, set(keys))
        if allocated is None:
            self.eviction.store_refused(keys)
            return None
        self.eviction.store_allocated(allocated)
        new_keys, slots, evicted = allocated
        self._record_evictions(evicted)
        if new_keys:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            fresh = set(new_keys)
            self.cascades.cascade_existing(
                state, [k for k in dict.fromkeys(keys) if k not in fresh]
            )
        return PrepareStoreOutput(new_keys, slots, evicted)

    def complete_store(
        self,
        req_id: str,
        keys: Sequence[Key],
        success: bool = True,
        successful_keys: Collection[Key] | None = None,
    ) -> None:
        """Finish a device store prepared by ``prepare_store`` (same partial-success rules as a
        TransferResult). Keys that landed are cascaded to every secondary tier."""
        state = self.requests.get(req_id)
        if state.pending_primary_stores <= 0:
            raise ProtocolViolation(f"request {req_id!r} has no pending store")
        ok, failed = split_outcome(keys, success, successful_keys)
        violation = ok is None
        if ok is None:
            log.error("store_result_rejected", req_id=req_id, error="successful_keys not a subset")
            ok, failed = [], list(keys)
        self.primary.complete_write(failed, False)
        landed = self.tenancy.landed(self.primary.complete_write(ok, True))
        self.deadlines.landed(landed)
        state.pending_primary_stores -= 1
        if landed:
            self.cascades.submit_everywhere(landed, req_id)
        self.requests.finalize(req_id)
        if violation:
            raise ProtocolViolation("successful_keys is not a subset of the stored keys")

    def flush_cascade_backlogs(self) -> None:
        """Make every backlog key due now, backoff or not (before a ``reset_cache``)."""
        self.cascades.flush()

    def cascade_backlog(self, online_only: bool = False) -> int:
        """Keys waiting in the cascade backlogs (of the online tiers only, if asked)."""
        return self.cascades.backlog(online_only)

    def _submit(self, job: TransferJob) -> None:
        self.tenancy.job_created(job)
        self.jobs.add(job)
        self._outbox.append(job)

    # ---- step end -------------------------------------------------------------------------

    def end_step(self) -> list[int]:
        """Submit queued promotions (one job per (tier, request)), retry parked cascades,
        send each probed tier's batch of unknown keys (one probe job per tier per step), and
        time out probes that went unanswered. Returns the ids of the probes timed out."""
        self.promotions.flush()
        self.cascades.retry_parked(self.requests.states, self.requests.finalize)
        self.cascades.retry_due()
        for i, tier in enumerate(self.tiers):
            if tier.has_queued_probes():
                keys = tier.verdicts.take_queued()
                if keys:
                    self._submit(TransferJob(0, i, JobKind.PROBE, keys, [], None))
        return self.expire_probes()

    def expire_probes(self) -> list[int]:
        """Fail probe jobs older than probe_timeout_s (their keys resolve to MISS)."""
        return self.jobs.expire_probes()

    def take_submissions(self) -> list[TransferJob]:
        """Jobs created since the last call, in creation order, for the transport to send."""
        out, self._outbox = self._outbox, []
        return out

    def take_touched(self, tier_name: str) -> list[Key]:
        return self.tiers[self.tier_index(tier_name)].take_touched()

    def take_events(self) -> list[TierEvent]:
        """What the tiers gained and lost since the last call, in order, once ``events`` was
        started (``tiering.events``)."""
        return self.events.take()

    def event_snapshot(self) -> list[TierEvent]:
        """What the events told the pool and each indexed tier hold now, as stored events (a
        probed tier's blocks cannot be listed)."""
        held: dict[int, Iterable[Key]] = {POOL: self.primary.ready_keys()}
        held.update(
            (i + 1, t.announced_index())
            for i, t in enumerate(self.tiers)
            if t.spec.indexed and t.spec.stores
        )
        return self.events.snapshot(held)

    # ---- results --------------------------------------------------------------------------

    def apply_result(self, tier_name: str, result: TransferResult) -> TransferJob:
        """Apply a tier's result (``TierJobs.apply``)."""
        return self.jobs.apply(tier_name, result)

    def apply_progress(self, tier_name: str, job_id: int, keys: Iterable[Key]) -> list[Key]:
        """Promoted keys that landed before their job's result (``TierJobs.progress``)."""
        return self.jobs.progress(tier_name, job_id, keys)

    def fail_worker_jobs(self, tier_name: str) -> list[int]:
        """The tier's worker died: every job in flight on it fails (``TierJobs.fail_tier``)."""
        return self.jobs.fail_tier(self.tier_index(tier_name))

    def reset_tier_index(self, tier_name: str) -> None:
        """A tier's worker (re)started and will announce its whole index again."""
        self.tiers[self.tier_index(tier_name)].clear_index()

    def apply_index_update(
        self, tier_name: str, added: Iterable[Key], removed: Iterable[Key]
    ) -> None:
        self.tiers[self.tier_index(tier_name)].apply_index_update(added, removed)

    def _record_evictions(self, evicted: list[Key]) -> None:
        if evicted:
            self.promotions.evicted(evicted)
            self.stats.tier(0).evictions += len(evicted)
            self.cascades.evicted(evicted)

    # ---- warm restart ---------------------------------------------------------------------

    def adopt(self, entries: Sequence[tuple[Key, int]]) -> None:
        """Enter blocks found in the pool as writes awaiting verification (``Adoption.adopt``)."""
        self.adoption.adopt(entries)

    def adopting(self) -> list[tuple[Key, int]]:
        """(key, slot) of the adopted blocks still awaiting verification."""
        return self.adoption.pending()

    def complete_adoption(
        self, keys: Iterable[Key], ok_keys: Collection[Key]
    ) -> tuple[list[Key], list[Key]]:
        """Finish the verification of adopted ``keys`` (``Adoption.complete``, ignoring keys
        a ``reset_cache`` dropped since); the ready ones are cascaded to every tier that does not
        hold them. Returns (ready, dropped)."""
        ready, dropped = self.adoption.complete(keys, ok_keys)
        self.deadlines.landed(ready)
        if ready:
            self.cascades.submit_everywhere(ready, None)
        return ready, dropped

    def take_invalidated_slots(self) -> list[int]:
        """Slots freed or handed to a new key since the last call (empty unless
        ``track_slot_invalidations``)."""
        return self.primary.take_invalidated_slots()

    # ---- whole-cache operations -----------------------------------------------------------

    def has_pending_work(self) -> bool:
        return bool(
            self.jobs
            or self._outbox
            or self.promotions.has_queued()
            or self.cascades.has_parked()
            or any(t.has_queued_probes() for t in self.tiers)
            or self.cascades.has_due()
        )

    def jobs_in_flight(self) -> int:
        return len(self.jobs)

    def reset_cache(self) -> None:
        """Empty the primary tier. The caller first lets every in-flight job finish (or fails it);
        queued promotions are dropped, pending store counts zeroed, finished requests finalised,
        active requests kept usable. Secondary tiers keep their data; the keys still in a
        cascade backlog are given up as evicted (``flush_cascade_backlogs`` first lets the
        online tiers take them)."""
        if self.jobs:
            raise JobsInFlight(f"{len(self.jobs)} jobs still in flight")
        self.cascades.give_up_all()
        self._outbox.clear()
        self.promotions.reset()
        self.requests.reset()
        self.deadlines.clear()
        self.adoption.clear()
        self.primary.reset()
        self.tenancy.reset()

    def snapshot(self) -> TieringStatus:
        """Gauges and counters for status and metrics; per tenant (by id) once tenants are
        active, without the bytes their blocks take (the caller knows the tiers' sizes)."""
        primary, stats = self.primary, self.stats
        return TieringStatus(
            slots=primary.num_slots,
            used_slots=len(primary),
            pinned_slots=primary.pinned_count(),
            writing_slots=primary.writing_count(),
            held_slots=primary.held_count,
            unverified_slots=len(self.adoption),
            unread_promotion_pins=self.promotions.unread_total,
            jobs_in_flight=len(self.jobs),
            cascade_backlog=self.cascade_backlog(),
            requests=len(self.requests),
            tiers={
                tier.name: TierState(
                    indexed_keys=len(tier.index),
                    verdicts=len(tier.verdicts),
                    tracked_requests=tier.tracked_requests(),
                    online=tier.online,
                    cascade_backlog=len(cascades.backlog),
                    dirty_keys=len(cascades.dirty),
                    cascade_inflight_keys=cascades.inflight_keys,
                )
                for tier, cascades in zip(self.tiers, self.cascades.per_tier, strict=True)
            },
            hit_pending_expired=stats.hit_pending_expired,
            promotion_allocation_failures=stats.promotion_allocation_failures,
            store_allocation_failures=stats.store_allocation_failures,
            stores_refused_dirty=stats.stores_refused_dirty,
            store_backpressure_s=round(stats.store_backpressure_s, 6),
            promoted_keys=stats.promoted_keys,
            promoted_keys_consumed=stats.promoted_keys_consumed,
            promotion_amplification=stats.promotion_amplification,
            per_tier=stats.per_tier(),
            tenants=self.tenancy.snapshot(),
        )

    # ---- tenants --------------------------------------------------------------------------

    def drop_tenant(self, tid: str) -> DropProgress:
        """Drop every block of ``tid`` from the pool and every tier (``tenants.drops``)."""
        return self.tenancy.drop(tid, self.jobs.in_flight())

    def take_finished_drops(self) -> list[DropProgress]:
        return self.tenancy.take_finished_drops()
