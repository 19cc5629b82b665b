"""The manager's view of its tier workers: who is connected, alive, degraded, and what runs there."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import structlog

from kvoffload.wire.status import WorkerStats, WorkerStatus

log = structlog.get_logger()


@dataclass(slots=True)
class WorkerState:
    name: str
    pid: int
    medium: str
    capabilities: list[str]
    last_seen: float
    index_complete: bool = False
    degraded: bool = False
    inflight: int = 0
    stats: WorkerStats = field(default_factory=WorkerStats)
    jobs: set[int] = field(default_factory=set)
    incarnations: int = 1


class WorkerRegistry:
    """Connected workers by name. A worker is live from its accepted hello until its heartbeat
    times out or another hello with the same name arrives (a restarted incarnation)."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, WorkerState] = {}
        self.restarts_seen = 0

    def live(self, name: str) -> WorkerState | None:
        return self.workers.get(name)

    def hello(
        self, name: str, pid: int, medium: str, capabilities: list[str], now: float
    ) -> WorkerState | None:
        """Register a worker; returns the previous incarnation (whose jobs must fail) if any."""
        previous = self.workers.get(name)
        state = WorkerState(name, pid, medium, capabilities, now)
        if previous is not None:
            state.incarnations = previous.incarnations + 1
            self.restarts_seen += 1
        self.workers[name] = state
        return previous

    def seen(self, name: str, now: float) -> WorkerState | None:
        state = self.workers.get(name)
        if state is not None:
            state.last_seen = now
        return state

    def kill_silent(self, now: float) -> list[WorkerState]:
        """SIGKILL, remove and return the workers whose heartbeat is overdue; each is killed by
        pid (a process of this service that reported its own pid) so its supervisor restarts it."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for worker in dead:
            del self.workers[worker.name]
            log.error(
                "worker_heartbeat_timeout",
                worker=worker.name,
                worker_pid=worker.pid,
                silent_s=round(now - worker.last_seen, 3),
            )
            _kill_quietly(worker.pid)
        return dead

    def snapshot(self, now: float) -> dict[str, WorkerStatus]:
        return {
            w.name: WorkerStatus(
                pid=w.pid,
                medium=w.medium,
                alive=True,
                last_heartbeat_s=round(now - w.last_seen, 3),
                degraded=w.degraded,
                index_complete=w.index_complete,
                inflight=w.inflight,
                incarnation=w.incarnations,
                stats=w.stats,
            )
            for w in self.workers.values()
        }


def _kill_quietly(pid: int) -> None:
    if pid <= 1 or pid == os.getpid():
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.error("worker_kill_failed", worker_pid=pid, error=str(exc))
