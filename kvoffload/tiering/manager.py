"""The tiering manager: the contract of docs/design/tiering.md as pure bookkeeping.

It owns the primary index, the secondary-tier proxies, the request states and the job table.
It does no I/O: jobs it creates are queued in an outbox (``take_submissions``) and their outcomes
come back through ``apply_result``. Every job it creates gets exactly one result applied, either
from its tier or from ``fail_worker_jobs`` / ``expire_probes``.

Pinning rules: ``prepare_load`` pins (caller releases with ``complete_load``); a cascade pins its
slots until its result is applied; a landed promotion is pinned for its request until the request
loads it or finishes (within ``unread_promotion_cap`` slots).

Durable cascades: every key that lands in the primary tier (a store, or an adopted block) is
cascaded to every secondary tier that does not hold it. Keys a tier cannot take now (its worker is
offline, see ``set_tier_online``, or its cascades in flight already pin
``max_inflight_cascade_keys``) and keys whose cascade failed wait in the tier's backlog, unpinned;
a failed key is retried with exponential backoff. A key is given up only for a ``CascadeDrop``
reason (it was evicted first, the tier is full, or ``cascade_max_attempts`` failed), each counted
per tier and logged (``cascade_dropped``) with its keys.

Warm restart: ``adopt`` enters blocks found in the pool as in-flight writes (HIT_PENDING) and
``complete_adoption`` makes the verified ones ready and frees the rest. With
``track_slot_invalidations``, ``take_invalidated_slots`` lists every slot freed or handed to a
new key, so the caller can clear what described the slot's old contents.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.logs import get_logger
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import PendingCascade, SecondaryTier, TierSpec
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import (
    Allocation,
    CascadeDrop,
    Evicted,
    JobsInFlight,
    Key,
    OffloadPolicy,
    PrefixResult,
    PrepareStoreOutput,
    ProtocolViolation,
    ReqContext,
    RequestFinishedError,
    TransferJob,
    TransferResult,
    UnknownJob,
    UnknownRequest,
    WrongTier,
)
from kvoffload.vocab import JobKind, LookupResult, MissReason

log = get_logger()

HIT, HIT_PENDING, RETRY, MISS = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)


@dataclass(slots=True)
class RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] = field(default_factory=set)
    parked_cascade_keys: OrderedDict[Key, None] = field(default_factory=OrderedDict)
    pending_deadlines: dict[Key, float] = field(default_factory=dict)
    expired: set[Key] = field(default_factory=set)
    unread: set[Key] = field(default_factory=set)


@dataclass(slots=True)
class PendingPromotion:
    keys: list[Key] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class TieringManager:
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
    ) -> None:
        """``first_job_id``: where the job id counter starts (a restarted manager starts past
        every id its predecessor could have used, so a late result never matches a new job).
        A failed cascade key is retried after ``cascade_backoff_s``, doubling up to
        ``cascade_backoff_max_s``, and given up after ``cascade_max_attempts`` failures."""
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tier names: {names}")
        self.primary = PrimaryIndex(num_slots, policy, track_slot_invalidations)
        self._adopting: dict[Key, int] = {}
        self.tiers = [SecondaryTier(spec) for spec in tiers]
        self._tier_by_name = {t.name: i for i, t in enumerate(self.tiers)}
        self.hit_pending_deadline_s = hit_pending_deadline_s
        self.unread_promotion_cap = (
            max(1, num_slots // 4) if unread_promotion_cap is None else unread_promotion_cap
        )
        self.probe_timeout_s = probe_timeout_s
        self.cascade_max_attempts = cascade_max_attempts
        self.cascade_backoff_s = cascade_backoff_s
        self.cascade_backoff_max_s = cascade_backoff_max_s
        self._clock = clock
        self._next_job_id = first_job_id
        self._jobs: dict[int, TransferJob] = {}
        self._requests: dict[str, RequestState] = {}
        self._pending_promotions: list[dict[str, PendingPromotion]] = [{} for _ in self.tiers]
        self._parked_requests: set[str] = set()
        self._outbox: list[TransferJob] = []
        self._landed: set[Key] = set()
        self._waiters: dict[Key, set[str]] = {}
        self._unread_total = 0
        self._events: list[Evicted] = []
        self.stats = TieringStats(["primary", *names])

    # ---- identity -------------------------------------------------------------------------

    def tier_index(self, name: str) -> int:
        """Index of a secondary tier by name; KeyError if unknown."""
        return self._tier_by_name[name]

    def next_job_id(self) -> int:
        """One increasing counter for every job of the service (device jobs included)."""
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    def request(self, req_id: str) -> RequestState:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {req_id!r}") from None

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def set_tier_online(self, tier_name: str, online: bool) -> None:
        """Whether the tier's worker is connected and its index announced (a new manager starts
        with every tier online). Cascades for an offline tier wait in its backlog, unpinned,
        and go out once it is back."""
        tier = self.tiers[self.tier_index(tier_name)]
        tier.online = online
        if online:
            tier.backlog_due_at = 0.0

    # ---- request lifecycle ----------------------------------------------------------------

    def on_new_request(self, ctx: ReqContext) -> OffloadPolicy:
        """Create (or replace) the request's state; REQUEST_LEVEL if any tier asks for it."""
        state = RequestState(ctx)
        for i, tier in enumerate(self.tiers):
            if tier.on_new_request(ctx.req_id) is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers.add(i)
        self._requests[ctx.req_id] = state
        if state.request_level_tiers:
            return OffloadPolicy.REQUEST_LEVEL
        return OffloadPolicy.CHUNK_LEVEL

    def on_request_finished(self, req_id: str) -> None:
        """No more submit-side calls for this request. Its queued promotions are submitted first;
        the secondary tiers hear of it once its stores and parked cascades have drained."""
        state = self.request(req_id)
        if state.is_finished:
            return
        self._flush_promotions(only_req=req_id)
        self._release_unread(state)
        self._disarm_all(state)
        state.is_finished = True
        self._maybe_finalize(req_id)

    def _maybe_finalize(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is None or not state.is_finished:
            return
        if state.pending_primary_stores or state.parked_cascade_keys:
            return
        for tier in self.tiers:
            tier.on_request_finished(req_id)
        del self._requests[req_id]

    # ---- lookup ---------------------------------------------------------------------------

    def lookup(self, req_id: str, keys: Sequence[Key]) -> PrefixResult:
        """Evaluate keys in order, stopping at the first MISS. A key found only in a secondary
        tier starts a promotion (HIT_PENDING) unless an earlier key is still uncertain (RETRY),
        in which case it answers RETRY and nothing is promoted past that point.
        A finished request is refused (RequestFinishedError): it may start nothing."""
        state = self.request(req_id)
        if state.is_finished:
            raise RequestFinishedError(f"request {req_id!r} is finished")
        leading_hits = self.primary.ready_run(keys)
        results = [HIT] * leading_hits
        reasons = [MissReason.NONE] * leading_hits
        uncertain = False
        protected = set(keys) if leading_hits < len(keys) else ()
        primary_lookup = self.primary.lookup
        none = MissReason.NONE
        not_hit_results: list[LookupResult] = []
        for key in keys[leading_hits:]:
            result = primary_lookup(key)
            if result is HIT:
                results.append(HIT)
                reasons.append(none)
                continue
            if result is HIT_PENDING:
                result, reason = self._pending_or_expired(state, key)
            else:
                result, reason = self._lookup_secondary(state, key, uncertain, protected)
            results.append(result)
            reasons.append(reason)
            not_hit_results.append(result)
            if result is MISS:
                break
            if result is RETRY:
                uncertain = True
        self.stats.record_lookups(len(results) - len(not_hit_results), not_hit_results)
        hit_prefix = leading_hits
        for result in results[leading_hits:]:
            if result is not HIT and result is not HIT_PENDING:
                break
            hit_prefix += 1
        return PrefixResult(results, reasons, hit_prefix, leading_hits)

    def _pending_or_expired(self, state: RequestState, key: Key) -> tuple[LookupResult, MissReason]:
        if key in state.expired:
            return MISS, MissReason.DEADLINE
        now = self._clock()
        deadline = self._arm_deadline(state, key, now)
        if now < deadline:
            return HIT_PENDING, MissReason.NONE
        state.expired.add(key)
        self.stats.hit_pending_expired += 1
        log.warning(
            "hit_pending_deadline_expired",
            req_id=state.ctx.req_id,
            key=key.hex(),
            deadline_s=self.hit_pending_deadline_s,
        )
        return MISS, MissReason.DEADLINE

    def _lookup_secondary(
        self, state: RequestState, key: Key, uncertain: bool, protected: Collection[Key]
    ) -> tuple[LookupResult, MissReason]:
        req_id = state.ctx.req_id
        tier_filter = state.ctx.tier_filter
        saw_retry = filtered = False
        reason = MissReason.ABSENT
        for i, tier in enumerate(self.tiers):
            if not tier_filter.allows(tier.spec.medium, tier.spec.locality):
                filtered = True
                continue
            result, tier_reason = tier.lookup(key, req_id)
            self.stats.tier_lookup(i + 1, result)
            if result is HIT:
                if uncertain:
                    return RETRY, MissReason.AWAITING_PREFIX
                if key in state.pending_deadlines:
                    pending = self._pending_or_expired(state, key)
                    if pending[0] is MISS:
                        return pending
                if self._start_promotion(i, state, key, protected):
                    return HIT_PENDING, MissReason.NONE
                return MISS, MissReason.PRIMARY_FULL
            if result is RETRY:
                saw_retry = True
            elif tier_reason is MissReason.FAILED_LOAD or tier_reason is MissReason.PROBE_FAILED:
                reason = tier_reason
        if saw_retry:
            return RETRY, MissReason.PROBING
        if reason is MissReason.ABSENT:
            if key in self.primary.recently_evicted:
                reason = MissReason.EVICTED
            elif filtered:
                reason = MissReason.FILTERED
        return MISS, reason

    def _start_promotion(
        self, tier_idx: int, state: RequestState, key: Key, protected: Collection[Key]
    ) -> bool:
        allocated = self._allocate([key], protected)
        if allocated is None or not allocated.new_keys:
            self.stats.promotion_allocation_failures += 1
            return False
        slots = allocated.slots
        self._record_evictions(allocated.evicted)
        pending = self._pending_promotions[tier_idx].setdefault(
            state.ctx.req_id, PendingPromotion()
        )
        pending.keys.append(key)
        pending.slots.append(slots[0])
        self._arm_deadline(state, key, self._clock())
        return True

    def _arm_deadline(self, state: RequestState, key: Key, now: float) -> float:
        """The HIT_PENDING deadline of (request, key): armed at the first wait, kept through
        failed rounds, disarmed when a write of the key lands (``_writes_landed``)."""
        deadline = state.pending_deadlines.get(key)
        if deadline is None:
            deadline = state.pending_deadlines[key] = now + self.hit_pending_deadline_s
            self._waiters.setdefault(key, set()).add(state.ctx.req_id)
        return deadline

    def _writes_landed(self, keys: Iterable[Key]) -> None:
        """These keys became ready: every wait on them is over, so a later wait (after an
        eviction) starts a new deadline window."""
        for key in keys:
            for req_id in self._waiters.pop(key, ()):
                state = self._requests.get(req_id)
                if state is not None:
                    state.pending_deadlines.pop(key, None)
                    state.expired.discard(key)

    def _disarm_all(self, state: RequestState) -> None:
        req_id = state.ctx.req_id
        for key in state.pending_deadlines:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(req_id)
                if not waiters:
                    del self._waiters[key]
        state.pending_deadlines.clear()
        state.expired.clear()

    # ---- loads (primary -> device) --------------------------------------------------------

    def prepare_load(self, req_id: str, keys: Sequence[Key]) -> list[int]:
        """Pin ready keys for a device load; returns their slots co-indexed with keys.
        All keys must be HIT (NotReady otherwise, nothing pinned). Release with complete_load."""
        state = self.request(req_id)
        if state.is_finished:
            raise RequestFinishedError(f"request {req_id!r} is finished")
        slots = self.primary.pin(keys)
        for key in keys:
            if key in state.unread:
                state.unread.discard(key)
                self._unread_total -= 1
                self.primary.unpin([key])
            if key in self._landed:
                self._landed.discard(key)
                self.stats.promoted_keys_consumed += 1
        return slots

    def complete_load(self, keys: Iterable[Key]) -> None:
        """Release the pins of a finished device load (success or not)."""
        self.primary.unpin(keys)

    def touch(self, keys: Sequence[Key]) -> None:
        """Recency for the primary policy and every secondary tier (first key most recent)."""
        self.primary.touch(keys)
        for tier in self.tiers:
            tier.touch(keys)

    # ---- stores (device -> primary -> every secondary tier) -------------------------------

    def prepare_store(self, req_id: str, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not already present. None: no space (nothing changed).

        Keys already present go, for request-level tiers, straight to a cascade (ready) or are
        parked until their in-flight write lands."""
        state = self.request(req_id)
        if state.is_finished:
            raise RequestFinishedError(f"request {req_id!r} is finished")
        allocated = self._allocate(keys, set(keys))
        if allocated is None:
            self.stats.store_allocation_failures += 1
            return None
        new_keys, slots, evicted = allocated
        self._record_evictions(evicted)
        if new_keys:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            fresh = set(new_keys)
            self._cascade_existing(state, [k for k in dict.fromkeys(keys) if k not in fresh])
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
        state = self.request(req_id)
        if state.pending_primary_stores <= 0:
            raise ProtocolViolation(f"request {req_id!r} has no pending store")
        ok, failed = _split_outcome(keys, success, successful_keys)
        violation = ok is None
        if ok is None:
            log.error("store_result_rejected", req_id=req_id, error="successful_keys not a subset")
            ok, failed = [], list(keys)
        self.primary.complete_write(failed, False)
        landed = self.primary.complete_write(ok, True)
        self._writes_landed(landed)
        state.pending_primary_stores -= 1
        if landed:
            for i in range(len(self.tiers)):
                self._submit_cascade(i, landed, req_id)
        self._maybe_finalize(req_id)
        if violation:
            raise ProtocolViolation("successful_keys is not a subset of the stored keys")

    def _cascade_existing(self, state: RequestState, keys: list[Key]) -> None:
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
                self._submit_cascade(i, ready, state.ctx.req_id)

    def _retry_parked_cascades(self) -> None:
        for req_id in list(self._parked_requests):
            state = self._requests[req_id]
            parked = list(state.parked_cascade_keys)
            state.parked_cascade_keys.clear()
            self._parked_requests.discard(req_id)
            self._cascade_existing(state, parked)
            self._maybe_finalize(req_id)

    def _submit_cascade(self, tier_idx: int, keys: list[Key], req_id: str | None) -> None:
        """Cascade the ready keys the tier does not hold: as many as it has room for now, the
        others into its backlog."""
        tier = self.tiers[tier_idx]
        keys = [k for k in dict.fromkeys(keys) if not tier.knows(k) and k not in tier.backlog]
        if not keys:
            return
        room = tier.cascade_room(len(keys))
        if room < len(keys):
            now = self._clock()
            for key in keys[room:]:
                tier.backlog[key] = PendingCascade(not_before=now)
            tier.backlog_due_at = min(tier.backlog_due_at, now)
            self.stats.tier(tier_idx + 1).cascade_keys_deferred += len(keys) - room
        if room:
            self._send_cascade(tier_idx, keys[:room], req_id)

    def _allocate(self, keys: Sequence[Key], protected: Collection[Key]) -> Allocation | None:
        """``PrimaryIndex.allocate`` that evicts keys still waiting for a cascade only when
        nothing else can make room."""
        waiting = [k for tier in self.tiers for k in tier.backlog]
        if waiting:
            allocated = self.primary.allocate(keys, {*protected, *waiting})
            if allocated is not None:
                return allocated
        return self.primary.allocate(keys, protected)

    def _send_cascade(self, tier_idx: int, keys: list[Key], req_id: str | None) -> None:
        slots = self.primary.pin(keys)
        self.tiers[tier_idx].inflight_cascade_keys += len(keys)
        self._submit(TransferJob(0, tier_idx, JobKind.CASCADE, keys, slots, req_id))

    def _cascade_done(
        self, tier_idx: int, ok: list[Key], failed: list[Key], full: set[Key]
    ) -> None:
        """A cascade's keys: stored ones leave the backlog; failed ones wait there for their
        backoff, or are given up (tier full, retry bound)."""
        tier = self.tiers[tier_idx]
        for key in ok:
            tier.backlog.pop(key, None)
        now = self._clock()
        retry_bound: list[Key] = []
        for key in failed:
            if key in full:
                tier.backlog.pop(key, None)
                continue
            entry = tier.backlog.get(key)
            if entry is None:
                entry = tier.backlog[key] = PendingCascade()
            entry.in_flight = False
            entry.attempts += 1
            if entry.attempts >= self.cascade_max_attempts:
                del tier.backlog[key]
                retry_bound.append(key)
                continue
            backoff = self.cascade_backoff_s * 2 ** (entry.attempts - 1)
            entry.not_before = now + min(backoff, self.cascade_backoff_max_s)
        if tier.backlog:
            tier.backlog_due_at = 0.0  # room was freed and retries were scheduled: look again
        self._drop_cascades(tier_idx, [k for k in failed if k in full], CascadeDrop.TIER_FULL)
        self._drop_cascades(tier_idx, retry_bound, CascadeDrop.RETRY_BOUND)

    def _retry_backlogs(self) -> None:
        now = self._clock()
        for tier_idx, tier in enumerate(self.tiers):
            if tier.online and tier.backlog and now >= tier.backlog_due_at:
                self._retry_backlog(tier_idx, now)

    def _retry_backlog(self, tier_idx: int, now: float) -> None:
        """Submit the backlog keys that are due, ready and within the tier's room; forget the
        ones the tier now holds; give up the ones evicted meanwhile."""
        tier = self.tiers[tier_idx]
        room = tier.cascade_room(len(tier.backlog))
        batch: list[Key] = []
        settled: list[Key] = []
        evicted: list[Key] = []
        due_at = math.inf
        for key, entry in tier.backlog.items():
            if entry.in_flight:
                continue
            if tier.knows(key):
                settled.append(key)
                continue
            state = self.primary.lookup(key)
            if state is MISS:
                evicted.append(key)
            elif entry.not_before > now:
                due_at = min(due_at, entry.not_before)
            elif state is HIT_PENDING:
                due_at = min(due_at, now + self.cascade_backoff_s)
            elif len(batch) < room:
                batch.append(key)
        for key in settled + evicted:
            del tier.backlog[key]
        tier.backlog_due_at = due_at
        self._drop_cascades(tier_idx, evicted, CascadeDrop.EVICTED)
        if batch:
            for key in batch:
                tier.backlog[key].in_flight = True
            self.stats.tier(tier_idx + 1).cascade_keys_resubmitted += len(batch)
            self._send_cascade(tier_idx, batch, None)

    def _drop_cascades(self, tier_idx: int, keys: list[Key], reason: CascadeDrop) -> None:
        if not keys:
            return
        self.stats.tier(tier_idx + 1).cascade_dropped(reason, len(keys))
        log.warning(
            "cascade_dropped",
            tier=self.tiers[tier_idx].name,
            reason=reason.value,
            count=len(keys),
            keys=[k.hex() for k in keys],
        )

    def flush_cascade_backlogs(self) -> None:
        """Make every backlog key due now, backoff or not (before a ``reset_cache``)."""
        for tier in self.tiers:
            for entry in tier.backlog.values():
                entry.not_before = 0.0
            tier.backlog_due_at = 0.0

    def cascade_backlog(self, online_only: bool = False) -> int:
        """Keys waiting in the cascade backlogs (of the online tiers only, if asked)."""
        return sum(len(t.backlog) for t in self.tiers if t.online or not online_only)

    def _submit(self, job: TransferJob) -> None:
        job.job_id = self.next_job_id()
        job.submitted_at = self._clock()
        self._jobs[job.job_id] = job
        self.stats.tier(job.tier + 1).job_submitted(job.kind)
        self._outbox.append(job)

    # ---- step end -------------------------------------------------------------------------

    def end_step(self) -> list[int]:
        """Submit queued promotions (one job per (tier, request)), retry parked cascades,
        send each probed tier's batch of unknown keys (one probe job per tier per step), and
        time out probes that went unanswered. Returns the ids of the probes timed out."""
        self._flush_promotions()
        self._retry_parked_cascades()
        self._retry_backlogs()
        for i, tier in enumerate(self.tiers):
            if tier.has_queued_probes():
                keys = tier.verdicts.take_queued()
                if keys:
                    self._submit(TransferJob(0, i, JobKind.PROBE, keys, [], None))
        return self.expire_probes()

    def _flush_promotions(self, only_req: str | None = None) -> None:
        for tier_idx, by_request in enumerate(self._pending_promotions):
            req_ids = [only_req] if only_req is not None else list(by_request)
            for req_id in req_ids:
                pending = by_request.pop(req_id, None)
                if pending is None:
                    continue
                self._submit(
                    TransferJob(0, tier_idx, JobKind.PROMOTION, pending.keys, pending.slots, req_id)
                )

    def expire_probes(self) -> list[int]:
        """Fail probe jobs older than probe_timeout_s (their keys resolve to MISS)."""
        now = self._clock()
        expired = [
            job.job_id
            for job in self._jobs.values()
            if job.kind is JobKind.PROBE and now - job.submitted_at >= self.probe_timeout_s
        ]
        for job_id in expired:
            log.warning("probe_timed_out", job_id=job_id, timeout_s=self.probe_timeout_s)
            self._apply(self._jobs[job_id], TransferResult(job_id, False))
        return expired

    def take_submissions(self) -> list[TransferJob]:
        """Jobs created since the last call, in creation order, for the transport to send."""
        out, self._outbox = self._outbox, []
        return out

    def take_touched(self, tier_name: str) -> list[Key]:
        return self.tiers[self.tier_index(tier_name)].take_touched()

    def take_events(self) -> list[Evicted]:
        """Evictions from the primary tier since the last call."""
        out, self._events = self._events, []
        return out

    # ---- results --------------------------------------------------------------------------

    def apply_result(self, tier_name: str, result: TransferResult) -> TransferJob:
        """Apply a tier's result. Unknown job id or a job of another tier -> error, no change."""
        job = self._jobs.get(result.job_id)
        if job is None:
            raise UnknownJob(f"unknown job {result.job_id}")
        if self.tiers[job.tier].name != tier_name:
            raise WrongTier(
                f"job {result.job_id} belongs to tier {self.tiers[job.tier].name!r}, "
                f"not {tier_name!r}"
            )
        self._apply(job, result)
        return job

    def apply_progress(self, tier_name: str, job_id: int, keys: Iterable[Key]) -> list[Key]:
        """Keys of an unfinished promotion whose slots are complete: they become ready (HIT) at
        once, before the job's result, which then leaves them as they are whatever it says.
        Keys not in the job, or already landed, are ignored; progress for a job already
        finished (its result came first) or for a job that is not a promotion changes nothing.
        Returns the keys made ready."""
        job = self._jobs.get(job_id)
        if job is None or job.kind is not JobKind.PROMOTION:
            return []
        if self.tiers[job.tier].name != tier_name:
            raise WrongTier(
                f"job {job_id} belongs to tier {self.tiers[job.tier].name!r}, not {tier_name!r}"
            )
        wanted = set(job.keys) - job.landed
        fresh = [k for k in dict.fromkeys(keys) if k in wanted]
        if not fresh:
            return []
        job.landed.update(fresh)
        return self._promotion_landed(job, fresh)

    def fail_worker_jobs(self, tier_name: str) -> list[int]:
        """The tier's worker died: every job in flight on it fails (promotions free their slots,
        cascades unpin, probes resolve to MISS). Returns the failed job ids."""
        tier_idx = self.tier_index(tier_name)
        failed = [job for job in self._jobs.values() if job.tier == tier_idx]
        for job in failed:
            self._apply(job, TransferResult(job.job_id, False))
        return [job.job_id for job in failed]

    def jobs_of_tier(self, tier_name: str) -> list[int]:
        tier_idx = self.tier_index(tier_name)
        return [job.job_id for job in self._jobs.values() if job.tier == tier_idx]

    def reset_tier_index(self, tier_name: str) -> None:
        """A tier's worker (re)started and will announce its whole index again."""
        self.tiers[self.tier_index(tier_name)].index.clear()

    def apply_index_update(
        self, tier_name: str, added: Iterable[Key], removed: Iterable[Key]
    ) -> None:
        self.tiers[self.tier_index(tier_name)].apply_index_update(added, removed)

    def _apply(self, job: TransferJob, result: TransferResult) -> None:
        ok, failed = _split_outcome(job.keys, result.success, result.successful_keys)
        if ok is None:
            log.error(
                "job_result_rejected",
                job_id=job.job_id,
                tier=self.tiers[job.tier].name,
                error="successful_keys is not a subset of the job's keys",
            )
            ok, failed = [], list(job.keys)
        del self._jobs[job.job_id]
        tier = self.tiers[job.tier]
        stats = self.stats.tier(job.tier + 1)
        stats.job_finished(job.kind, bool(ok) and not failed, len(ok), result.transfer_time_s)
        absent = set(result.absent_keys).intersection(failed) if failed else set()
        if job.kind is JobKind.PROBE:
            unanswered = [k for k in failed if k not in absent]
            waiting = tier.probe_done(ok, absent, unanswered)
            for key, req_ids in waiting.items():
                for req_id in req_ids:
                    if self._is_active(req_id):
                        tier.mark_request_miss(req_id, [key], MissReason.PROBE_FAILED)
        elif job.kind is JobKind.CASCADE:
            tier.inflight_cascade_keys -= len(job.keys)
            self.primary.unpin(job.keys)
            tier.stored(ok)
            full = set(result.full_keys).intersection(failed) if failed else set()
            self._cascade_done(job.tier, ok, failed, full)
        else:
            self._complete_promotion(job, tier, ok, failed, absent)

    def _is_active(self, req_id: str) -> bool:
        state = self._requests.get(req_id)
        return state is not None and not state.is_finished

    def _complete_promotion(
        self,
        job: TransferJob,
        tier: SecondaryTier,
        ok: list[Key],
        failed: list[Key],
        absent: set[Key],
    ) -> None:
        """Keys that landed early (``apply_progress``) stay ready, whatever the result says."""
        if job.landed:
            ok = [k for k in ok if k not in job.landed]
            failed = [k for k in failed if k not in job.landed]
        self.primary.complete_write(failed, False)
        req_id = job.req_id if job.req_id is not None and self._is_active(job.req_id) else None
        if failed:
            tier.load_failed(failed, absent, req_id)
        self._promotion_landed(job, ok)

    def _promotion_landed(self, job: TransferJob, keys: list[Key]) -> list[Key]:
        """Make promoted keys ready and protect them for their request until it reads them.
        They count as promoted by their tier now, whether the job's result came or not."""
        self.stats.tier(job.tier + 1).promoted_keys_ok += len(keys)
        landed = self.primary.complete_write(keys, True)
        self._writes_landed(landed)
        self._landed.update(landed)
        self.stats.promoted_keys += len(landed)
        req_id = job.req_id if job.req_id is not None and self._is_active(job.req_id) else None
        if req_id is None:
            return landed
        state = self._requests[req_id]
        room = self.unread_promotion_cap - self._unread_total
        protect = [k for k in landed if k not in state.unread][: max(room, 0)]
        if protect:
            self.primary.pin(protect)
            state.unread.update(protect)
            self._unread_total += len(protect)
        return landed

    def _release_unread(self, state: RequestState) -> None:
        if state.unread:
            self.primary.unpin(state.unread)
            self._unread_total -= len(state.unread)
            state.unread.clear()

    def _record_evictions(self, evicted: list[Key]) -> None:
        if evicted:
            self._landed.difference_update(evicted)
            self.stats.tier(0).evictions += len(evicted)
            self._events.append(Evicted(evicted))
            for tier_idx, tier in enumerate(self.tiers):
                gone = [k for k in evicted if tier.backlog.pop(k, None) is not None]
                self._drop_cascades(tier_idx, gone, CascadeDrop.EVICTED)

    # ---- warm restart ---------------------------------------------------------------------

    def adopt(self, entries: Sequence[tuple[Key, int]]) -> None:
        """Enter blocks found in the pool, oldest first, each at its exact slot, as in-flight
        writes awaiting verification (HIT_PENDING, not evictable). Only before any other use of
        the primary tier (ValueError otherwise, see ``PrimaryIndex.adopt``)."""
        self.primary.adopt(entries)
        self._adopting = dict(entries)

    def adopting(self) -> list[tuple[Key, int]]:
        """(key, slot) of the adopted blocks still awaiting verification."""
        return list(self._adopting.items())

    def complete_adoption(
        self, keys: Iterable[Key], ok_keys: Collection[Key]
    ) -> tuple[list[Key], list[Key]]:
        """Finish the verification of adopted ``keys``: those in ``ok_keys`` become ready (HIT),
        the others are freed (MISS). Keys no longer awaiting verification (``reset_cache``
        since) are ignored. Ready keys are cascaded to every tier that does not hold them.
        Returns (ready, dropped)."""
        ok = set(ok_keys)
        ready: list[Key] = []
        dropped: list[Key] = []
        for key in keys:
            if self._adopting.pop(key, None) is not None:
                (ready if key in ok else dropped).append(key)
        self.primary.complete_write(ready, True)
        self._writes_landed(ready)
        self.primary.complete_write(dropped, False)
        if ready:
            for tier_idx in range(len(self.tiers)):
                self._submit_cascade(tier_idx, ready, None)
        return ready, dropped

    def take_invalidated_slots(self) -> list[int]:
        """Slots freed or handed to a new key since the last call (empty unless
        ``track_slot_invalidations``)."""
        return self.primary.take_invalidated_slots()

    # ---- whole-cache operations -----------------------------------------------------------

    def has_pending_work(self) -> bool:
        now = self._clock()
        return bool(
            self._jobs
            or self._outbox
            or any(self._pending_promotions)
            or self._parked_requests
            or any(t.has_queued_probes() for t in self.tiers)
            or any(t.online and t.backlog and now >= t.backlog_due_at for t in self.tiers)
        )

    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    def reset_cache(self) -> None:
        """Empty the primary tier. The caller first lets every in-flight job finish (or fails it);
        queued promotions are dropped, pending store counts zeroed, finished requests finalised,
        active requests kept usable. Secondary tiers keep their data; the keys still in a
        cascade backlog are given up as evicted (``flush_cascade_backlogs`` first lets the
        online tiers take them)."""
        if self._jobs:
            raise JobsInFlight(f"{len(self._jobs)} jobs still in flight")
        for tier_idx, tier in enumerate(self.tiers):
            left = list(tier.backlog)
            tier.backlog.clear()
            self._drop_cascades(tier_idx, left, CascadeDrop.EVICTED)
        self._outbox.clear()
        for by_request in self._pending_promotions:
            by_request.clear()
        self._unread_total = 0
        for req_id, state in list(self._requests.items()):
            state.pending_primary_stores = 0
            state.parked_cascade_keys.clear()
            state.unread.clear()
            self._parked_requests.discard(req_id)
            state.pending_deadlines.clear()
            state.expired.clear()
            self._maybe_finalize(req_id)
        self._waiters.clear()
        self._landed.clear()
        self._adopting.clear()
        self.primary.reset()

    def snapshot(self) -> dict[str, Any]:
        """Gauges and counters for status and metrics."""
        return {
            "slots": self.primary.num_slots,
            "used_slots": len(self.primary),
            "pinned_slots": self.primary.pinned_count(),
            "writing_slots": self.primary.writing_count(),
            "unverified_slots": len(self._adopting),
            "unread_promotion_pins": self._unread_total,
            "jobs_in_flight": len(self._jobs),
            "cascade_backlog": self.cascade_backlog(),
            "requests": len(self._requests),
            "tiers": {
                t.name: {
                    "indexed_keys": len(t.index),
                    "verdicts": len(t.verdicts),
                    "tracked_requests": t.tracked_requests(),
                    "online": t.online,
                    "cascade_backlog": len(t.backlog),
                }
                for t in self.tiers
            },
            **self.stats.as_dict(),
        }


def _split_outcome(
    keys: Sequence[Key], success: bool, successful_keys: Collection[Key] | None
) -> tuple[list[Key] | None, list[Key]]:
    """(ok, failed) per the TransferResult rules; ok is None when successful_keys is not a subset."""
    if success:
        return list(keys), []
    if not successful_keys:
        return [], list(keys)
    wanted = set(successful_keys)
    if not wanted.issubset(keys):
        return None, []
    return [k for k in keys if k in wanted], [k for k in keys if k not in wanted]
