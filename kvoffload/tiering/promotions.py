"""Promotions: keys found in a secondary tier brought into primary slots for a request.

A lookup queues the key with the slot reserved for it; at step end (or when the request
finishes) the queue becomes one ``TransferJob`` per (tier, request). Keys land early
(``TieringLedger.apply_progress``) or with the job's result; a failed key's slot is freed. A
landed key stays pinned for its request until the request loads it or finishes, within
``unread_cap`` slots over all requests, so a promotion is not evicted before it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import Key, LandingTag, RequestState, TransferJob
from kvoffload.wire.vocab import JobKind


@dataclass(slots=True)
class QueuedPromotion:
    """Keys queued for one (tier, request) in this step, with their reserved slots."""

    keys: list[Key] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class Promotions:
    def __init__(
        self,
        num_tiers: int,
        primary: PrimaryIndex,
        stats: TieringStats,
        submit: Callable[[TransferJob], None],
        unread_cap: int,
    ) -> None:
        self.primary = primary
        self.stats = stats
        self.unread_cap = unread_cap
        self.unread_total = 0
        self._submit = submit
        self._queued: list[dict[str, QueuedPromotion]] = [{} for _ in range(num_tiers)]
        self._landed: set[Key] = set()

    def queue(self, tier_idx: int, req_id: str, key: Key, slot: int) -> None:
        """Promote ``key`` from the tier into ``slot`` (reserved) for the request."""
        queued = self._queued[tier_idx].setdefault(req_id, QueuedPromotion())
        queued.keys.append(key)
        queued.slots.append(slot)

    def has_queued(self) -> bool:
        return any(self._queued)

    def flush(
        self, only_req: str | None = None, landing: LandingTag | None = None
    ) -> list[TransferJob]:
        """Submit the queued promotions (of one request only, if given): one job per
        (tier, request), each carrying ``landing``. Returns the jobs submitted."""
        jobs = []
        for tier_idx, by_request in enumerate(self._queued):
            req_ids = [only_req] if only_req is not None else list(by_request)
            for req_id in req_ids:
                queued = by_request.pop(req_id, None)
                if queued is None:
                    continue
                job = TransferJob(
                    0,
                    tier_idx,
                    JobKind.PROMOTION,
                    queued.keys,
                    queued.slots,
                    req_id,
                    landing=landing,
                )
                self._submit(job)
                jobs.append(job)
        return jobs

    def complete(
        self,
        job: TransferJob,
        tier: SecondaryTier,
        ok: list[Key],
        failed: list[Key],
        absent: Collection[Key],
        state: RequestState | None,
    ) -> list[Key]:
        """A promotion's result (``state``: its request, None unless still active). Keys that
        landed early stay ready, whatever the result says. Returns the keys made ready."""
        if job.landed:
            ok = [k for k in ok if k not in job.landed]
            failed = [k for k in failed if k not in job.landed]
        self.primary.complete_write(failed, False)
        if failed:
            tier.load_failed(failed, absent, state.ctx.req_id if state is not None else None)
        return self.landed(job, ok, state)

    def landed(self, job: TransferJob, keys: list[Key], state: RequestState | None) -> list[Key]:
        """Make promoted keys ready and protect them for their request (``state``, None unless
        still active) until it reads them. They count as promoted by their tier now, whether
        the job's result came or not. Returns the keys made ready."""
        self.stats.tier(job.tier + 1).promoted_keys_ok += len(keys)
        landed = self.primary.complete_write(keys, True)
        self._landed.update(landed)
        self.stats.promoted_keys += len(landed)
        if state is None:
            return landed
        room = self.unread_cap - self.unread_total
        protect = [k for k in landed if k not in state.unread][: max(room, 0)]
        if protect:
            self.primary.pin(protect)
            state.unread.update(protect)
            self.unread_total += len(protect)
        return landed

    def read(self, state: RequestState, keys: Iterable[Key]) -> None:
        """The request pinned these keys for a load: their unread pins go, and a promoted key
        counts as consumed."""
        if not state.unread and not self._landed:
            return
        for key in keys:
            if key in state.unread:
                state.unread.discard(key)
                self.unread_total -= 1
                self.primary.unpin([key])
            if key in self._landed:
                self._landed.discard(key)
                self.stats.promoted_keys_consumed += 1

    def release_unread(self, state: RequestState) -> None:
        """The request finished: its promoted keys not read yet are no longer protected."""
        if state.unread:
            self.primary.unpin(state.unread)
            self.unread_total -= len(state.unread)
            state.unread.clear()

    def evicted(self, keys: Iterable[Key]) -> None:
        self._landed.difference_update(keys)

    def reset(self) -> None:
        """The primary tier is emptied: queued promotions are dropped and no pin is left (the
        caller clears each request's ``unread``)."""
        for by_request in self._queued:
            by_request.clear()
        self.unread_total = 0
        self._landed.clear()
