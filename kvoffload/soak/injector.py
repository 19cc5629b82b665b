"""The soak's fault injector: a seeded schedule of faults played against a running service.

``plan_faults`` spreads faults evenly over the run, in rounds that each hold every kind once
(seeded shuffle), so a run of ``len(kinds)`` faults or more injects every kind. ``Injector``
(a thread) plays the plan one fault at a time and waits for the recovery of each (plus
``MIN_GAP_S``) before the next:

- ``kill_worker``: SIGKILL a random worker (pid from the manager's status); a new pid must
  come back;
- ``stop_worker``: SIGSTOP a random worker until the manager has dropped it (heartbeat
  timeout: the manager kills it) or a bound passes, then SIGCONT it if it still exists;
  outcome ``killed_by_manager`` or ``resumed``; the worker must be back;
- ``kill_manager``: SIGKILL the manager (pid from the supervisor); a new manager must answer
  with every worker re-announced;
- ``kill_client``: SIGKILL a random engine mid-request and start a replacement;
- ``s3_outage``: stop the object store server, keep it down a few seconds, start it again.

Disk I/O faults (fail / delay / corrupt fractions) are not events: the soak service runs with a
``[faults]`` section for its whole life. Each played fault is a ``FaultRecord``; a missing
recovery is a violation.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil
import structlog

from kvoffload.soak.clients import EnginePool
from kvoffload.testing.service import ServiceHarness

log = structlog.get_logger()

FAULT_KINDS = ("kill_worker", "stop_worker", "kill_manager", "kill_client", "s3_outage")
MIN_GAP_S = 1.0
"""Least time between the end of one fault's recovery and the next fault."""
EXIT_GRACE_S = 5.0
"""How long a worker the manager killed may take to leave before the injector calls it alive."""
WINDOW_KINDS = frozenset({"kill_manager"})
"""Faults during which a client call may time out or a job may get no result."""


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    kind: str


def plan_faults(
    seed: int,
    duration_s: float,
    kinds: tuple[str, ...],
    warmup_s: float = 2.0,
    cooldown_s: float = 2.0,
    spacing_s: float = 3.0,
) -> list[PlannedFault]:
    """Faults at even times from ``warmup_s`` to ``duration_s - cooldown_s``, about
    ``spacing_s`` apart but never fewer than ``len(kinds)``; kinds in seeded-shuffled rounds."""
    if not kinds:
        return []
    rng = random.Random(seed)
    span = max(0.0, duration_s - warmup_s - cooldown_s)
    count = max(len(kinds), int(span // spacing_s) + 1)
    order: list[str] = []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    step = span / (count - 1) if count > 1 else 0.0
    return [
        PlannedFault(round(warmup_s + i * step, 3), kind) for i, kind in enumerate(order[:count])
    ]


@dataclass
class FaultRecord:
    kind: str
    t_start: float
    target: str = ""
    outcome: str = ""
    t_end: float | None = None
    recovery_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class InjectorState:
    records: list[FaultRecord] = field(default_factory=list)
    violations: list[dict] = field(default_factory=list)


class Injector(threading.Thread):
    """Plays ``plan`` against ``harness`` (see the module docstring). ``s3`` is an object with
    ``stop()`` and ``start()`` (the test S3 server) or None."""

    def __init__(
        self,
        harness: ServiceHarness,
        engines: EnginePool,
        plan: list[PlannedFault],
        seed: int,
        s3=None,
        recovery_timeout_s: float = 30.0,
        outage_s: float = 3.0,
    ) -> None:
        super().__init__(name="soak-injector", daemon=True)
        self.harness = harness
        self.engines = engines
        self.plan = plan
        self.s3 = s3
        self.rng = random.Random(seed ^ 0x5EED)
        self.recovery_timeout_s = recovery_timeout_s
        self.outage_s = outage_s
        self.state = InjectorState()
        self._halt = threading.Event()
        self._actions = {
            "kill_worker": self._kill_worker,
            "stop_worker": self._stop_worker,
            "kill_manager": self._kill_manager,
            "kill_client": self._kill_client,
            "s3_outage": self._s3_outage,
        }

    def halt(self) -> None:
        """Play no further fault (the one in progress completes)."""
        self._halt.set()

    def run(self) -> None:
        started = time.monotonic()
        ready_at = started
        for planned in self.plan:
            due = max(started + planned.at_s, ready_at)
            if self._halt.wait(max(0.0, due - time.monotonic())):
                return
            record = FaultRecord(planned.kind, time.monotonic())
            try:
                self._actions[planned.kind](record)
            except Exception as exc:
                log.exception("soak_fault_failed", kind=planned.kind)
                self._violation("fault_action_failed", fault=planned.kind, error=repr(exc))
                record.outcome = f"error: {exc!r}"
            record.t_end = record.t_end or time.monotonic()
            ready_at = time.monotonic() + MIN_GAP_S
            self.state.records.append(record)
            log.warning("soak_fault", **record.as_dict())

    def counts(self) -> dict[str, int]:
        out = {kind: 0 for kind in FAULT_KINDS}
        for record in self.state.records:
            if not record.outcome.startswith(("skipped", "error")):
                out[record.kind] += 1
        return out

    def windows(self) -> list[tuple[float, float]]:
        """(start, end) of the faults that excuse client timeouts."""
        return [
            (r.t_start, r.t_end or time.monotonic())
            for r in self.state.records
            if r.kind in WINDOW_KINDS
        ]

    def _violation(self, kind: str, **detail) -> None:
        self.state.violations.append({"kind": kind, **detail})

    # ---- recovery -------------------------------------------------------------------------

    def _await_workers(self, record: FaultRecord, names: list[str], exclude: set[int]) -> bool:
        """Wait until every named worker is back (pid not in ``exclude``); records the
        recovery time, or a ``no_recovery`` violation."""
        try:
            self.harness.wait_workers(
                names, timeout_s=self.recovery_timeout_s, exclude_pids=exclude
            )
        except TimeoutError as exc:
            record.outcome += " not_recovered"
            self._violation(
                "no_recovery", fault=record.kind, target=record.target, error=str(exc)[:300]
            )
            return False
        record.t_end = time.monotonic()
        record.recovery_s = round(record.t_end - record.t_start, 3)
        return True

    # ---- actions --------------------------------------------------------------------------

    def _pick_worker(self, record: FaultRecord) -> tuple[str, int | None]:
        name = self.rng.choice(self.harness.worker_names)
        pid = self.harness.worker_pid(name)
        record.target = f"{name}:{pid}"
        return name, pid

    def _kill_worker(self, record: FaultRecord) -> None:
        name, pid = self._pick_worker(record)
        if pid is None or not self.harness.signal_child(pid, signal.SIGKILL):
            record.outcome = "skipped: worker not running"
            return
        record.outcome = "killed"
        self._await_workers(record, [name], {pid})

    def _stop_worker(self, record: FaultRecord) -> None:
        name, pid = self._pick_worker(record)
        try:
            created = psutil.Process(pid).create_time() if pid else None
        except psutil.Error:
            created = None
        if pid is None or created is None or not self.harness.signal_child(pid, signal.SIGSTOP):
            record.outcome = "skipped: worker not running"
            return
        bound = self.harness.cfg.service.heartbeat_timeout_s + 5.0
        dropped = self.harness.wait_status(
            lambda s: s["workers"].get(name, {}).get("pid") != pid, bound
        )
        if not self._exits(pid, created, EXIT_GRACE_S if dropped is not None else 0.0):
            self.harness.signal_child(pid, signal.SIGCONT)
            record.outcome = "resumed"
            self._await_workers(record, [name], set())
        else:
            record.outcome = "killed_by_manager"
            self._await_workers(record, [name], {pid})

    def _exits(self, pid: int, created: float, timeout_s: float) -> bool:
        """True once the process is gone within ``timeout_s``: a killed process that was in an
        uninterruptible read, or is unmapping a large pool, outlives its SIGKILL for a while."""
        deadline = time.monotonic() + timeout_s
        while self._same_process(pid, created):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _same_process(self, pid: int, created: float) -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.create_time() == created and self.harness.is_own_child(pid)
        except psutil.Error:
            return False

    def _kill_manager(self, record: FaultRecord) -> None:
        pid = self.harness.manager_pid()
        record.target = f"manager:{pid}"
        if not self.harness.signal_child(pid, signal.SIGKILL):
            record.outcome = "skipped: manager not running"
            return
        record.outcome = "killed"
        deadline = time.monotonic() + self.recovery_timeout_s
        while self.harness.manager_pid() in (pid, None) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._await_workers(record, self.harness.worker_names, set()):
            record.target = f"manager:{pid}->{self.harness.manager_pid()}"

    def _kill_client(self, record: FaultRecord) -> None:
        killed = self.engines.kill_one(self.rng)
        record.target = killed or ""
        record.outcome = "killed" if killed else "skipped: no engine"

    def _s3_outage(self, record: FaultRecord) -> None:
        if self.s3 is None:
            record.outcome = "skipped: no local object store"
            return
        record.target = "s3"
        self.s3.stop()
        time.sleep(self.outage_s)
        self.s3.start()
        record.outcome = "restarted"
        if "object" in self.harness.worker_names:
            self._await_workers(record, ["object"], set())
