"""Running a tier worker's jobs: validation, a bounded pool of job threads, release, results.

A valid ``Job`` is queued for the job threads (loads, promotions and probes before stores and
cascades), or run on the worker's main thread at once when its backend ``runs_inline`` it and
it is urgent, alone (no other message waits behind it) and no other urgent job is in flight,
so concurrent loads keep the job threads' parallelism; an invalid one, or any job while the
worker drains, is refused at once with a failed ``JobDone``. A job thread runs
``backend.run_job`` and hands the outcome back to the worker's main thread, which calls its
``release``: only after that returned is the job's one ``JobDone`` queued (a result is never
early, docs/design/tiering.md). A release that raises keeps the job tracked (logged as
``job_release_failed``) and is retried at the next turn; secondary ``cleanup`` then runs best
effort. Job threads never touch the manager's socket: results, and the keys a promotion
reports landed (``report_landed``), go through deques, and ``wake`` rouses the main loop. A
promotion with a ``LandingTarget`` also tells its client of each landed key straight from the
thread that runs it (``workers.landing``), and, once the backend's work is over, which of its
keys failed (``Landed.final``).
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from kvoffload.logs import get_logger
from kvoffload.wire.protocol import Job, JobDone, JobProgress, LandingTarget
from kvoffload.wire.status import WorkerLoopStats
from workers.backend import DEVICE_KINDS, SLOT_KINDS, URGENT_KINDS, Backend, BackendOutcome
from workers.faults import FaultInjector, InjectedFault
from workers.landing import LandingNotifier

log = get_logger()

_STOP_PRIORITY = 2  # after every queued job (priorities 0 and 1)
_job_context = threading.local()


def report_landed(keys: list[bytes], checksums: list[list[int]] | None = None) -> None:
    """Called by a backend from the job thread running a promotion: the slots of ``keys`` are
    complete (bytes verified, header stamped) and the job will not touch them again.
    ``checksums``: co-indexed, each block's digests as a reader verifies them
    (``BlockChecksum.digests``). The worker sends the keys in a ``JobProgress`` before the
    job's result (unless the result is sent in the same turn), so the manager serves them
    while the rest of the job is still running, and, with ``checksums``, tells the job's
    waiting client (``LandingTarget``) at once. The job's outcome still lists them as ok.
    Does nothing outside a job thread."""
    report = getattr(_job_context, "report", None)
    if report is not None and keys:
        report(keys, checksums)


REPORT_BYTES = 4 << 20
"""Blocks of a promotion reported landed together (about this many bytes; the first alone):
a report costs the worker, the manager and a waiting client a message and a wake-up each,
which at 64 KiB blocks cost more than their reads. Cold loads of 16-block prefixes of 256 KiB
spent 552 µs of CPU per block in the three processes with 4 MiB against 683 µs with 1 MiB
(two reports a prefix instead of five; at 1 MiB blocks the two were within 2%)."""


class LandedBatch:
    """A promotion's landed keys, reported (``report_landed``) the first at once, then in
    batches of ``size``, and what is left at ``flush``."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._keys: list[bytes] = []
        self._digests: list[list[int]] = []
        self._first = True

    def add(self, key: bytes, digests: list[int]) -> None:
        self._keys.append(key)
        self._digests.append(digests)
        if self._first or len(self._keys) >= self._size:
            self._first = False
            self.flush()

    def flush(self) -> None:
        if self._keys:
            report_landed(self._keys, self._digests)
            self._keys, self._digests = [], []


class _JobLanding:
    """What a promotion's waiting client was told: keys landed so far, then the failed ones."""

    def __init__(self, job: Job, target: LandingTarget, notifier: LandingNotifier) -> None:
        self._target = target
        self._notifier = notifier
        self._slot_of = dict(zip(job.keys, job.slots, strict=True))
        self._keys = job.keys
        self._told: set[bytes] = set()
        self._final_sent = False

    def landed(self, keys: list[bytes], checksums: list[list[int]] | None) -> None:
        """Tell the client of ``keys``; the notice that tells the job's last key is also its
        final one (nothing is left to fail), which saves the client a message."""
        if checksums is None:
            return  # a block its reader cannot verify is not told: the client asks the manager
        self._told.update(keys)
        self._final_sent = len(self._told) == len(self._slot_of)
        self._notifier.landed(
            self._target, keys, [self._slot_of[k] for k in keys], checksums, self._final_sent
        )

    def over(self, outcome: BackendOutcome) -> None:
        """The backend's work is over: the keys neither landed nor told are failed; landed
        keys not told (no checksums) are left to the client's next lookup. Sends nothing when
        the last landed notice was final."""
        if self._final_sent:
            return
        ok = set(outcome.ok_keys)
        self._notifier.over(
            self._target, [k for k in self._keys if k not in ok and k not in self._told]
        )


def validate_job(job: Job, num_slots: int, kinds: Iterable[str]) -> str:
    """Why ``job`` must not run ("" when it may): unsupported kind, slots or device blocks not
    co-indexed with keys, a slot outside the pool, a device job without a handle."""
    if job.kind not in kinds:
        return f"unsupported_kind: {job.kind!r}"
    if job.kind in SLOT_KINDS:
        if len(job.slots) != len(job.keys):
            return f"invalid_job: {len(job.slots)} slots for {len(job.keys)} keys"
        bad = [s for s in job.slots if not 0 <= s < num_slots]
        if bad:
            return f"slot_out_of_range: {bad[:4]} not in [0, {num_slots})"
    if job.kind in DEVICE_KINDS:
        if len(job.device_blocks) != len(job.keys):
            return f"invalid_job: {len(job.device_blocks)} device blocks for {len(job.keys)} keys"
        if not job.handle_id:
            return "invalid_job: no handle_id"
    return ""


def job_done_of(job: Job, outcome: BackendOutcome, transfer_s: float) -> JobDone:
    """The one result of ``job``: success when every key succeeded; otherwise the succeeded
    keys (as the backend listed them, None when none), the failed keys confirmed absent or
    refused for lack of room, and an error summary. Keys the backend reports that are not in
    the job are dropped (logged)."""
    wanted = set(job.keys)
    ok = [key for key in outcome.ok_keys if key in wanted]
    done = set(ok)
    absent = [key for key in outcome.absent_keys if key in wanted and key not in done]
    full = [key for key in outcome.full_keys if key in wanted and key not in done]
    if len(ok) != len(outcome.ok_keys):
        log.error(
            "job_outcome_foreign_keys", job_id=job.job_id, count=len(outcome.ok_keys) - len(ok)
        )
    success = wanted.issubset(ok)
    return JobDone(
        job_id=job.job_id,
        success=success,
        successful_keys=None if success or not ok else ok,
        transfer_s=transfer_s,
        nbytes=outcome.nbytes,
        error="" if success else (outcome.error or "failed"),
        absent_keys=absent,
        full_keys=full,
        removed=outcome.removed,
    )


@dataclass
class PendingRelease:
    """A job whose backend work is over and whose release may still be pending."""

    job: Job
    outcome: BackendOutcome
    transfer_s: float
    release_attempts: int = 0


class JobRunner:
    def __init__(
        self,
        backend: Backend,
        num_slots: int,
        faults: FaultInjector,
        threads: int,
        stats: WorkerLoopStats,
        send: Callable[[msgspec.Struct], None],
        wake: Callable[[], None],
        notifier: LandingNotifier | None = None,
    ) -> None:
        """``stats``: the worker's loop counters (jobs done, failed, refused, release and
        cleanup failures); ``send`` queues a message for the manager; ``wake`` rouses the
        worker's main loop from a job thread; ``notifier`` tells waiting clients of landed
        keys (None: jobs' ``landing`` is ignored)."""
        self._notifier = notifier
        self._backend = backend
        self._num_slots = num_slots
        self._faults = faults
        self._threads_wanted = threads
        self._kinds = frozenset(backend.capabilities)
        self._loop_stats = stats
        self._send = send
        self._wake = wake
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._finished: deque[PendingRelease] = deque()
        self._progress: deque[tuple[int, list[bytes]]] = deque()
        self._inflight: set[int] = set()
        self._urgent_inflight: set[int] = set()
        self._releasing: dict[int, PendingRelease] = {}

    @property
    def inflight(self) -> int:
        """Jobs accepted and not yet answered."""
        return len(self._inflight)

    @property
    def releasing(self) -> int:
        """Finished jobs whose release is still pending."""
        return len(self._releasing)

    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        for i in range(self._threads_wanted):
            thread = threading.Thread(target=self._run_jobs, name=f"job-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, join: bool) -> None:
        """Stop the job threads once the queued jobs ran (waiting for them when ``join``)."""
        for _ in self._threads:
            self._queue.put((_STOP_PRIORITY, next(self._seq), None))
        if join:
            for thread in self._threads:
                thread.join()

    def submit(self, job: Job, draining: bool, alone: bool) -> None:
        """Queue a job from the manager, run it on this thread now (see the module docstring;
        ``alone``: no other message from the manager waits behind it), or refuse it at once
        (draining, or invalid)."""
        if job.job_id in self._inflight:
            log.error("duplicate_job_id", job_id=job.job_id, kind=job.kind)
            return
        error = "draining" if draining else validate_job(job, self._num_slots, self._kinds)
        if error:
            self._loop_stats.jobs_refused += 1
            log.warning("job_refused", job_id=job.job_id, kind=job.kind, error=error)
            self._send(JobDone(job_id=job.job_id, success=False, error=error))
            return
        self._inflight.add(job.job_id)
        urgent = job.kind in URGENT_KINDS
        if urgent:
            inline = alone and not self._urgent_inflight and self._backend.runs_inline(job)
            self._urgent_inflight.add(job.job_id)
            if inline:
                self._run(job)  # its result goes out in this turn of the main loop
                return
        self._queue.put((0 if urgent else 1, next(self._seq), job))
        if urgent:
            # Let a job thread take it now instead of after this turn of the main loop (which
            # holds the GIL until it polls): a cold load waits on this hand-off.
            time.sleep(0)

    def _run_jobs(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            self._run(job)
            self._wake()

    def _run(self, job: Job) -> None:
        """Run ``job`` on this thread and queue its outcome for the main thread's release."""
        start = time.perf_counter()
        landing = (
            _JobLanding(job, job.landing, self._notifier)
            if job.landing is not None and self._notifier is not None
            else None
        )
        _job_context.report = functools.partial(self._note_progress, job.job_id, landing)
        try:
            outcome = self._backend.run_job(job)
        except Exception as exc:
            log.exception("job_crashed", job_id=job.job_id, kind=job.kind)
            outcome = BackendOutcome(ok_keys=[], error=f"internal_error: {exc!r}")
        finally:
            _job_context.report = None
        if landing is not None:
            landing.over(outcome)
        self._finished.append(PendingRelease(job, outcome, time.perf_counter() - start))

    def _note_progress(
        self,
        job_id: int,
        landing: _JobLanding | None,
        keys: list[bytes],
        checksums: list[list[int]] | None,
    ) -> None:
        if landing is not None:
            landing.landed(keys, checksums)
        self._progress.append((job_id, list(keys)))
        self._wake()

    def send_progress(self) -> None:
        """One ``JobProgress`` per job with the keys reported since the last turn, but for
        jobs whose result is about to be published (finished, nothing to release): their
        result carries those keys. Runs after ``collect_finished``, so a job's progress
        always leaves before its result."""
        landed: dict[int, list[bytes]] = {}
        while self._progress:
            job_id, keys = self._progress.popleft()
            landed.setdefault(job_id, []).extend(keys)
        for job_id, keys in landed.items():
            finished = self._releasing.get(job_id)
            if finished is not None and finished.outcome.release is None:
                continue
            self._send(JobProgress(job_id=job_id, keys=keys))

    def collect_finished(self) -> None:
        while self._finished:
            item = self._finished.popleft()
            self._releasing[item.job.job_id] = item

    def release_finished(self) -> None:
        """Release every finished job; publish those whose release succeeded."""
        for job_id, item in list(self._releasing.items()):
            if not self._release(item):
                continue
            del self._releasing[job_id]
            self._cleanup(item)
            self._publish(item)

    def _release(self, item: PendingRelease) -> bool:
        item.release_attempts += 1
        try:
            if self._faults.take_release_failure():
                raise InjectedFault("injected release failure")
            if item.outcome.release is not None:
                item.outcome.release()
        except Exception as exc:  # noqa: BLE001 - release is retried, the result kept
            self._loop_stats.release_failures += 1
            attempt = item.release_attempts
            if attempt & (attempt - 1) == 0:  # attempts 1, 2, 4, 8, ...: bounded log volume
                log.warning(
                    "job_release_failed", job_id=item.job.job_id, attempt=attempt, error=repr(exc)
                )
            return False
        if item.release_attempts > 1:
            log.info("job_released", job_id=item.job.job_id, attempts=item.release_attempts)
        return True

    def _cleanup(self, item: PendingRelease) -> None:
        if item.outcome.cleanup is None:
            return
        try:
            item.outcome.cleanup()
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            self._loop_stats.cleanup_failures += 1
            log.warning("job_cleanup_failed", job_id=item.job.job_id, error=repr(exc))

    def _publish(self, item: PendingRelease) -> None:
        job = item.job
        done = job_done_of(job, item.outcome, item.transfer_s)
        self._inflight.discard(job.job_id)
        self._urgent_inflight.discard(job.job_id)
        if done.success:
            self._loop_stats.jobs_done += 1
        else:
            self._loop_stats.jobs_failed += 1
        fields = dict(
            job_id=job.job_id,
            kind=job.kind,
            keys=len(job.keys),
            bytes=done.nbytes,
            duration_ms=round(item.transfer_s * 1000, 3),
        )
        if done.success:
            log.debug("job_done", **fields)
        else:
            ok = len(done.successful_keys or ())
            log.warning("job_failed", ok_keys=ok, error=done.error, **fields)
        self._send(done)
