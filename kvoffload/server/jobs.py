"""The manager's job channel: worker hellos, heartbeats and index updates, device jobs tracked
from submission to the event delivered to their client, and tier-job results handed to the
tiering library."""

from __future__ import annotations

import time

import structlog

from kvoffload.server.handles import KVHandles
from kvoffload.server.sessions import ClientSession
from kvoffload.server.state import CPU_WORKER, DeviceJob, ManagerState
from kvoffload.server.workers import WorkerState
from kvoffload.tiering import TransferResult
from kvoffload.tiering.types import TieringError
from kvoffload.wire import protocol as p

log = structlog.get_logger()


class WorkerChannel:
    def __init__(self, state: ManagerState, handles: KVHandles) -> None:
        self.state = state
        self.handles = handles

    def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("bad_worker_frame", parts=len(frames))
            return
        identity, frame = frames
        name = identity.decode(errors="replace")
        try:
            msg = p.decode_worker_message(frame)
        except p.ProtocolError as exc:
            log.warning("bad_worker_message", worker=name, error=str(exc))
            return
        if self.state.metrics is not None:
            self.state.metrics.worker_message(name, msg)
        now = time.monotonic()
        if isinstance(msg, p.WorkerHello):
            self._on_hello(name, msg, now)
            return
        worker = self.state.registry.seen(name, now)
        if worker is None:
            log.warning("message_from_unknown_worker", worker=name, kind=type(msg).__name__)
            self.state.send_worker(name, p.Control(p.ControlAction.HELLO))
            return
        if isinstance(msg, p.JobDone):
            self._on_job_done(worker, msg)
        elif isinstance(msg, p.JobProgress):
            self._on_job_progress(worker, msg)
        elif isinstance(msg, p.IndexUpdate):
            if name != CPU_WORKER:
                self.state.tiering.apply_index_update(name, msg.added, msg.removed)
                if msg.complete:
                    self.state.tiering.set_tier_online(name, True)
            worker.index_complete = worker.index_complete or msg.complete
        elif isinstance(msg, p.Heartbeat):
            if msg.degraded != worker.degraded:
                log.warning("worker_degraded" if msg.degraded else "worker_recovered", worker=name)
            worker.degraded = msg.degraded
            worker.inflight = msg.inflight
            worker.stats = msg.stats

    def submit_device_job(
        self, session: ClientSession, scoped: str, req_id: str, kind: p.JobKind, job: p.Job
    ) -> int:
        """Track and send a device job; if it cannot be sent it finishes at once as failed
        (its event still reaches the client exactly once)."""
        state = self.state
        job.job_id = state.tiering.next_job_id()
        state.device_jobs[job.job_id] = DeviceJob(
            session.identity, scoped, req_id, kind, list(job.keys)
        )
        session.device_jobs.add(job.job_id)
        worker = state.registry.live(CPU_WORKER)
        if worker is not None and state.send_worker(CPU_WORKER, job):
            worker.jobs.add(job.job_id)
        else:
            self._finish_device_job(job.job_id, False, None, "worker_unreachable")
        return job.job_id

    def kill_silent_workers(self, now: float) -> None:
        """Kill the workers whose heartbeat is overdue and fail their jobs."""
        for worker in self.state.registry.kill_silent(now):
            self._fail_worker(worker.name, "heartbeat_timeout")

    def shutdown_workers(self) -> None:
        for name in list(self.state.registry.workers):
            self.state.send_worker(name, p.Control(p.ControlAction.SHUTDOWN))

    def _fail_worker(self, name: str, reason: str) -> None:
        """Every job in flight on the worker fails: tier jobs through the tiering library, device
        jobs through complete_store/complete_load with a failure event to their client."""
        state = self.state
        failed_tier_jobs: list[int] = []
        if name == CPU_WORKER:
            for job_id in list(state.device_jobs):
                self._finish_device_job(job_id, False, None, reason)
            if state.warm is not None:
                state.warm.verify_lost()
        else:
            state.tiering.set_tier_online(name, False)
            failed_tier_jobs = state.fail_tier_jobs(name)
        log.error("worker_jobs_failed", worker=name, reason=reason, tier_jobs=len(failed_tier_jobs))

    def _on_hello(self, name: str, hello: p.WorkerHello, now: float) -> None:
        state = self.state
        if hello.version != p.PROTOCOL_VERSION:
            reason = f"protocol version {hello.version} != manager's {p.PROTOCOL_VERSION}"
        elif name != hello.worker or name not in state.worker_names:
            reason = f"unknown worker {name!r}; expected one of {sorted(state.worker_names)}"
        else:
            reason = ""
        if reason:
            log.error("worker_refused", worker=name, reason=reason)
            state.send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, False, reason))
            return
        known = state.registry.live(name)
        if known is not None and known.pid == hello.pid:
            known.last_seen = now
            state.send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, True))
            return
        previous = state.registry.hello(name, hello.pid, hello.medium, hello.capabilities, now)
        if previous is not None:
            log.warning("worker_restarted", worker=name, old_pid=previous.pid, new_pid=hello.pid)
            self._fail_worker(name, "worker_restarted")
        if name != CPU_WORKER:
            state.tiering.set_tier_online(name, False)
            state.tiering.reset_tier_index(name)
        state.send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, True))
        if name == CPU_WORKER:
            self.handles.attach_all(hello.capabilities)
            self._send_verify_jobs()
        log.info("worker_connected", worker=name, worker_pid=hello.pid, medium=hello.medium)

    def _send_verify_jobs(self) -> None:
        """Ask the cpu worker to verify the blocks adopted from the slot headers (warm restart)."""
        warm = self.state.warm
        if warm is None:
            return
        worker = self.state.registry.live(CPU_WORKER)
        for job in warm.verify_jobs():
            if worker is None or not self.state.send_worker(CPU_WORKER, job):
                warm.verify_lost()
                return
            worker.jobs.add(job.job_id)

    def _on_job_done(self, worker: WorkerState, done: p.JobDone) -> None:
        state = self.state
        worker.jobs.discard(done.job_id)
        if done.job_id in state.device_jobs and worker.name == CPU_WORKER:
            self._finish_device_job(done.job_id, done.success, done.successful_keys, done.error)
            return
        if state.warm is not None and worker.name == CPU_WORKER and state.warm.owns(done.job_id):
            state.warm.verify_done(done.job_id, done.success, done.successful_keys)
            return
        try:
            state.apply_tier_result(
                worker.name,
                TransferResult(
                    done.job_id,
                    done.success,
                    done.successful_keys,
                    done.transfer_s,
                    done.absent_keys,
                    done.full_keys,
                    done.removed,
                ),
            )
        except TieringError as exc:
            log.warning(
                "job_result_rejected", worker=worker.name, job_id=done.job_id, error=str(exc)
            )
            return
        if not done.success:
            log.warning("tier_job_failed", tier=worker.name, job_id=done.job_id, error=done.error)
        state.dispatch_tier_jobs()

    def _on_job_progress(self, worker: WorkerState, progress: p.JobProgress) -> None:
        """Keys of a running promotion that landed: HIT before the job's result."""
        try:
            self.state.apply_tier_progress(worker.name, progress.job_id, progress.keys)
        except TieringError as exc:
            log.warning(
                "job_progress_rejected", worker=worker.name, job_id=progress.job_id, error=str(exc)
            )

    def _finish_device_job(
        self, job_id: int, success: bool, successful_keys: list[bytes] | None, error: str
    ) -> None:
        state = self.state
        job = state.device_jobs.pop(job_id)
        try:
            if job.kind is p.JobKind.DEVICE_STORE:
                state.tiering.complete_store(job.scoped_req, job.keys, success, successful_keys)
            else:
                state.tiering.complete_load(job.keys)
        except TieringError as exc:
            log.error("device_job_result_rejected", job_id=job_id, error=str(exc))
            success, successful_keys, error = False, None, f"{exc.code}: {exc}"
        state.dispatch_tier_jobs()
        session = state.sessions.get(job.identity)
        if session is None:
            return
        session.device_jobs.discard(job_id)
        ok = None if success else list(successful_keys or [])
        session.events.append(p.DeviceJobFinished(job_id, job.req_id, job.kind, success, ok, error))
        state.answer_poll(session)
