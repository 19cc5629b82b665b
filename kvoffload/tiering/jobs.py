"""Tier jobs in flight, from their submission to the one result each gets.

Every job gets its id from one increasing counter (device jobs of the service included, see
``TieringLedger.next_job_id``) and stays in the table until its one result is applied: from
its tier (``apply``, with ``progress`` reports of a promotion before), from ``fail_tier`` when
the tier's worker dies, or from ``expire_probes``. A result goes to the part that made the job:
probes to their tier's verdicts, cascades to ``Cascades``, promotions to ``Promotions``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from kvoffload.logs import get_logger
from kvoffload.tiering.cascades import Cascades
from kvoffload.tiering.deadlines import PendingDeadlines
from kvoffload.tiering.promotions import Promotions
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import (
    Key,
    RequestState,
    TransferJob,
    TransferResult,
    UnknownJob,
    WrongTier,
)
from kvoffload.wire.vocab import JobKind, MissReason

log = get_logger()


class JobListener(Protocol):
    """Who owns ``DELETE`` jobs and hears of every job's result (tenants, ``tenants.tenancy``)."""

    def deleted(
        self, job: TransferJob, ok: list[Key], failed: list[Key], result: TransferResult
    ) -> None: ...

    def finished(self, job: TransferJob) -> None: ...


class _NoJobListener:
    def deleted(
        self, job: TransferJob, ok: list[Key], failed: list[Key], result: TransferResult
    ) -> None:
        return None

    def finished(self, job: TransferJob) -> None:
        return None


NO_JOB_LISTENER: JobListener = _NoJobListener()


class TierJobs:
    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        stats: TieringStats,
        clock: Callable[[], float],
        *,
        first_job_id: int,
        probe_timeout_s: float,
        cascades: Cascades,
        promotions: Promotions,
        deadlines: PendingDeadlines,
        active: Callable[[str | None], RequestState | None],
        listener: JobListener = NO_JOB_LISTENER,
    ) -> None:
        """``active``: a request's state while it has not finished, else None; ``listener``:
        where a ``DELETE`` job's result goes, and who hears of every result once applied."""
        self.tiers = tiers
        self.stats = stats
        self.probe_timeout_s = probe_timeout_s
        self.cascades = cascades
        self.promotions = promotions
        self.deadlines = deadlines
        self._active = active
        self._clock = clock
        self._next_id = first_job_id
        self._jobs: dict[int, TransferJob] = {}
        self._listener = listener

    def __len__(self) -> int:
        return len(self._jobs)

    def next_id(self) -> int:
        job_id = self._next_id
        self._next_id += 1
        return job_id

    def add(self, job: TransferJob) -> None:
        """A new job: it gets its id and submission time."""
        job.job_id = self.next_id()
        job.submitted_at = self._clock()
        self._jobs[job.job_id] = job
        self.stats.job_submitted(job.tier + 1, job.kind)

    def of_tier(self, tier_idx: int) -> list[TransferJob]:
        return [job for job in self._jobs.values() if job.tier == tier_idx]

    # ---- results --------------------------------------------------------------------------

    def apply(self, tier_name: str, result: TransferResult) -> TransferJob:
        """Apply a tier's result. Unknown job id or a job of another tier -> error, no change."""
        job = self._jobs.get(result.job_id)
        if job is None:
            raise UnknownJob(f"unknown job {result.job_id}")
        self._check_tier(job, tier_name)
        self._apply(job, result)
        return job

    def progress(self, tier_name: str, job_id: int, keys: Iterable[Key]) -> list[Key]:
        """Keys of an unfinished promotion whose slots are complete: they become ready (HIT) at
        once, before the job's result, which then leaves them as they are whatever it says.
        Keys not in the job, or already landed, are ignored; progress for a job already
        finished (its result came first) or for a job that is not a promotion changes nothing.
        Returns the keys made ready."""
        job = self._jobs.get(job_id)
        if job is None or job.kind is not JobKind.PROMOTION:
            return []
        self._check_tier(job, tier_name)
        wanted = set(job.keys) - job.landed
        fresh = [k for k in dict.fromkeys(keys) if k in wanted]
        if not fresh:
            return []
        job.landed.update(fresh)
        landed = self.promotions.landed(job, fresh, self._active(job.req_id))
        self.deadlines.landed(landed)
        return landed

    def fail_tier(self, tier_idx: int) -> list[int]:
        """The tier's worker died: every job in flight on it fails (promotions free their slots,
        cascades unpin, probes resolve to MISS). Returns the failed job ids."""
        failed = self.of_tier(tier_idx)
        for job in failed:
            self._apply(job, TransferResult(job.job_id, False))
        return [job.job_id for job in failed]

    def expire_probes(self) -> list[int]:
        """Fail probe jobs older than ``probe_timeout_s`` (their keys resolve to MISS)."""
        now = self._clock()
        expired = [
            job
            for job in self._jobs.values()
            if job.kind is JobKind.PROBE and now - job.submitted_at >= self.probe_timeout_s
        ]
        for job in expired:
            log.warning("probe_timed_out", job_id=job.job_id, timeout_s=self.probe_timeout_s)
            self._apply(job, TransferResult(job.job_id, False))
        return [job.job_id for job in expired]

    def _check_tier(self, job: TransferJob, tier_name: str) -> None:
        if self.tiers[job.tier].name != tier_name:
            raise WrongTier(
                f"job {job.job_id} belongs to tier {self.tiers[job.tier].name!r}, not {tier_name!r}"
            )

    def _apply(self, job: TransferJob, result: TransferResult) -> None:
        ok, failed = split_outcome(job.keys, result.success, result.successful_keys)
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
        self.stats.job_finished(
            job.tier + 1, job.kind, bool(ok) and not failed, len(ok), result.transfer_time_s
        )
        absent = set(result.absent_keys).intersection(failed) if failed else set()
        if job.kind is JobKind.PROBE:
            unanswered = [k for k in failed if k not in absent]
            waiting = tier.probe_done(ok, absent, unanswered)
            for key, req_ids in waiting.items():
                for req_id in req_ids:
                    if self._active(req_id) is not None:
                        tier.mark_request_miss(req_id, [key], MissReason.PROBE_FAILED)
        elif job.kind is JobKind.CASCADE:
            full = set(result.full_keys).intersection(failed) if failed else set()
            self.cascades.done(job, ok, failed, full)
        elif job.kind is JobKind.DELETE:
            self._listener.deleted(job, ok, failed, result)
        else:
            state = self._active(job.req_id)
            self.deadlines.landed(self.promotions.complete(job, tier, ok, failed, absent, state))
        self._listener.finished(job)

    def in_flight(self) -> list[TransferJob]:
        return list(self._jobs.values())


def split_outcome(
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
