"""The supervisor: creates the run directory and the host pool, starts the manager, the tier
workers and the configured engines, restarts crashed workers (and the manager) with backoff,
and on SIGTERM/SIGINT drains, stops every child and removes every segment and socket it made.

Before it creates anything it checks the set-up (``kvoffload.runtime.preflight``): one that
cannot run is refused with ``StartRefused`` and leaves nothing behind. A child that cannot start
for a reason a restart cannot fix (exit code ``EXIT_FATAL``, or a program that cannot be run)
is tried ``FATAL_START_BOUND`` times in a row, then the service stops with that reason
(``failure``); other exits keep their backoff restarts.

The supervisor owns the pool and its slot header table: both outlive manager and worker
restarts, so a restarted manager rebuilds its primary index from the headers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import structlog

from kvoffload.config import Config, resolve_runtime_dir
from kvoffload.memory.pool import HostPool
from kvoffload.memory.slottable import SlotTable
from kvoffload.runtime.childenv import worker_environment
from kvoffload.runtime.preflight import SHM_DIR, StartRefused, check_shm_space, check_startup
from kvoffload.runtime.rundir import RunDir, RunDirError, cleanup_stale
from kvoffload.runtime.runspec import (
    EXIT_FATAL,
    EXIT_REFUSED,
    FATAL_REASON_ENV,
    RunSpec,
    write_runspec,
)
from kvoffload.wire.tenant_ids import TENANT_KEY_ENV, tenant_key

log = structlog.get_logger()

WORKER_MODULES = {
    "cpu": "workers.cpu",
    "disk": "workers.disk",
    "peer": "workers.peer",
    "object": "workers.object",
}
HEALTHY_AFTER_S = 30.0
KILL_REAP_S = 5.0
"""How long ``stop`` waits for a SIGKILLed child to be reaped before it removes the segments
anyway (a process stuck in the kernel may not die at once)."""
FATAL_START_BOUND = 3
"""Start failures in a row that a restart cannot fix (``EXIT_FATAL``) before the service stops."""


@dataclass(frozen=True)
class StartFailure:
    """Why the service stopped: ``child`` could not start, ``attempts`` times, for ``reason``."""

    child: str
    reason: str
    attempts: int

    def __str__(self) -> str:
        what = self.child if self.child == "manager" else f"{self.child} worker"
        return f"the {what} cannot start ({self.attempts} attempts): {self.reason}"


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool
    env: dict[str, str] = field(default_factory=dict)
    affinity: tuple[int, ...] = ()
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    fatal_starts: int = 0
    """Start failures in a row that a restart cannot fix."""
    reason_file: Path | None = None
    engine: bool = False
    """An ``[[engines]]`` entry: its exit codes are its own (only a clean exit ends it)."""
    """Where the child writes why it cannot start (``EXIT_FATAL``)."""
    spawn_error: str = ""
    """Why the last attempt to run its program failed ("" when it ran)."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    def __init__(self, cfg: Config, log_path: Path | None = None) -> None:
        """``log_path``: where children's stdout/stderr go (default: inherited)."""
        self.cfg = cfg
        self.log_path = log_path
        self.rundir: RunDir | None = None
        self.pool: HostPool | None = None
        self.slot_table: SlotTable | None = None
        self.spec: RunSpec | None = None
        self.children: dict[str, Child] = {}
        self.failure: StartFailure | None = None
        """Set when a child could not start ``FATAL_START_BOUND`` times; the service stops."""
        self._stop_requested = False

    # ---- start ----------------------------------------------------------------------------

    def start(self) -> RunSpec:
        """Check the set-up, then create the run directory and the pool and start the children.
        StartRefused (nothing left behind) when the set-up cannot run."""
        base = resolve_runtime_dir(self.cfg)
        check_startup(self.cfg, base)
        if self.cfg.tenants and tenant_key() is None:
            log.warning(
                "tenant_ids_unkeyed",
                hint=f"tenant ids are guessable from tenant names; set {TENANT_KEY_ENV}",
            )
        removed = cleanup_stale(base)
        if removed:
            log.info("stale_runs_removed", removed=removed)
        try:
            return self._start(base)
        except BaseException as exc:
            self.stop(quiet=True)
            if isinstance(exc, RunDirError):
                raise StartRefused(
                    "service.runtime_dir", str(base), str(exc), "choose another directory"
                ) from None
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                check_shm_space(self.cfg)  # StartRefused naming the free space, if short now
                raise StartRefused(
                    "pool.num_slots",
                    self.cfg.pool.num_slots,
                    f"the host pool could not be allocated in {SHM_DIR}: {exc.strerror}",
                    f"lower pool.num_slots or pool.block_bytes, or make {SHM_DIR} larger",
                ) from None
            raise

    def _start(self, base: Path) -> RunSpec:
        disk_root = os.path.abspath(self.cfg.disk.root) if self.cfg.disk.enabled else ""
        self.rundir = RunDir.create(base, disk_root=disk_root)
        pool_name = self.rundir.shm_name("pool")
        self.rundir.record_shm(pool_name)
        self.pool = HostPool.create(pool_name, self.cfg.pool.num_slots, self.cfg.pool.block_bytes)
        slot_table_name = ""
        if self.cfg.pool.slot_headers:
            slot_table_name = self.rundir.shm_name("slots")
            self.rundir.record_shm(slot_table_name)
            self.slot_table = SlotTable.create(slot_table_name, self.cfg.pool.num_slots)
        client_endpoint = self.cfg.service.client_endpoint or self.rundir.endpoint("client")
        self.spec = RunSpec(
            run_id=self.rundir.run_id,
            job_endpoint=self.rundir.endpoint("jobs"),
            client_endpoint=client_endpoint,
            pool_name=pool_name,
            config=self.cfg.to_toml_dict(redact_secrets=False),
            slot_table_name=slot_table_name,
        )
        spec_path = self.rundir.file_path("runspec.json")
        write_runspec(spec_path, self.spec)
        self._plan_children(spec_path, client_endpoint)
        for child in self.children.values():
            if child.restart:
                child.reason_file = self.rundir.file_path(f"{child.name}-fatal")
            if not self._spawn(child):
                engine = child.name.removeprefix("engine")
                setting = f"engines[{engine}].command" if engine != child.name else child.name
                raise StartRefused(setting, child.argv, self._fatal_reason(child), "fix the path")
        log.info(
            "service_started",
            run_id=self.spec.run_id,
            client_endpoint=client_endpoint,
            pool=pool_name,
            slots=self.cfg.pool.num_slots,
            block_bytes=self.cfg.pool.block_bytes,
            children={c.name: c.pid for c in self.children.values()},
        )
        return self.spec

    def _plan_children(self, spec_path: Path, client_endpoint: str) -> None:
        py = sys.executable
        spec_arg = ["--spec", str(spec_path)]
        cfg = self.cfg
        self._add(
            Child(
                "manager",
                [py, "-m", "kvoffload.server", *spec_arg],
                True,
                affinity=cfg.supervisor.cpu_affinity,
            )
        )
        self._add(
            Child(
                "cpu",
                [py, "-m", WORKER_MODULES["cpu"], *spec_arg],
                True,
                affinity=cfg.cpu.cpu_affinity,
            )
        )
        for name, enabled, cores in (
            ("disk", cfg.disk.enabled, cfg.disk.cpu_affinity),
            ("peer", cfg.peer.enabled, cfg.peer.cpu_affinity),
            ("object", cfg.object.enabled, cfg.object.cpu_affinity),
        ):
            if enabled:
                self._add(
                    Child(name, [py, "-m", WORKER_MODULES[name], *spec_arg], True, affinity=cores)
                )
        for i, engine in enumerate(cfg.engines):
            env = {**engine.env, "KVOFFLOAD_ENDPOINT": client_endpoint}
            self._add(
                Child(f"engine{i}", list(engine.command), engine.restart, env=env, engine=True)
            )

    def _add(self, child: Child) -> None:
        self.children[child.name] = child

    def _spawn(self, child: Child) -> bool:
        """Start ``child``; False when its program cannot be run (the reason is in its
        reason file, or logged for a child without one)."""
        env = {**os.environ, **child.env}
        if child.name in WORKER_MODULES:
            env = worker_environment(env)
        child.spawn_error = ""
        if child.reason_file is not None:
            env[FATAL_REASON_ENV] = str(child.reason_file)
            child.reason_file.unlink(missing_ok=True)
        out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 - the child keeps it; closed after Popen
        try:
            child.proc = subprocess.Popen(
                child.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        except OSError as exc:
            child.spawn_error = f"cannot run {child.argv[0]}: {exc.strerror}"
            log.error("child_spawn_failed", child=child.name, reason=child.spawn_error)
            child.proc = None
            child.restart_at = None
            return False
        finally:
            if out is not None:
                out.close()
        child.started_at = time.monotonic()
        child.restart_at = None
        if child.affinity:
            try:
                psutil.Process(child.proc.pid).cpu_affinity(list(child.affinity))
            except (psutil.Error, AttributeError, ValueError) as exc:
                log.warning("cpu_affinity_failed", child=child.name, error=str(exc))
        log.info(
            "child_started", child=child.name, child_pid=child.proc.pid, restarts=child.restarts
        )
        return True

    # ---- watch ----------------------------------------------------------------------------

    def run_forever(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            while not self._stop_requested:
                self.watch_once()
                time.sleep(0.05)
        finally:
            self.stop()
        return EXIT_REFUSED if self.failure is not None else 0

    def _on_signal(self, signum, _frame) -> None:
        log.info("supervisor_signal", signal=signal.Signals(signum).name)
        self._stop_requested = True

    def watch_once(self) -> None:
        """Reap exited children and restart the restartable ones when their backoff is over."""
        now = time.monotonic()
        for child in self.children.values():
            if child.restart_at is not None:
                if now >= child.restart_at and not self._restart(child, now):
                    return
                continue
            if child.proc is None:
                continue
            code = child.proc.poll()
            if code is None:
                if now - child.started_at > HEALTHY_AFTER_S:
                    child.backoff_s = 0.0
                    child.fatal_starts = 0
                continue
            self._log_exit(child, code)
            if child.name == "manager":
                self._fence_workers()
            if not child.restart or code == (0 if child.engine else EXIT_REFUSED):
                child.proc = None
                continue
            fatal = code == EXIT_FATAL and not child.engine
            child.fatal_starts = child.fatal_starts + 1 if fatal else 0
            if self._give_up(child):
                return
            self._schedule_restart(child, now)

    def _schedule_restart(self, child: Child, now: float) -> None:
        sup = self.cfg.supervisor
        child.backoff_s = (
            sup.restart_backoff_initial_s
            if child.backoff_s == 0
            else min(child.backoff_s * 2, sup.restart_backoff_max_s)
        )
        child.restart_at = now + child.backoff_s

    def _restart(self, child: Child, now: float) -> bool:
        """Start ``child`` again; False when it could not be run and the service gives up."""
        child.restarts += 1
        if self._spawn(child):
            return True
        child.fatal_starts += 1
        if self._give_up(child):
            return False
        self._schedule_restart(child, now)
        return True

    def _give_up(self, child: Child) -> bool:
        """After ``FATAL_START_BOUND`` start failures of ``child`` in a row that a restart
        cannot fix: log it as one event, keep the reason in ``failure`` and stop the service."""
        if child.fatal_starts < FATAL_START_BOUND:
            return False
        self.failure = StartFailure(child.name, self._fatal_reason(child), child.fatal_starts)
        log.error(
            "service_stopped_start_failure",
            child=child.name,
            reason=self.failure.reason,
            attempts=child.fatal_starts,
        )
        child.proc = None
        self._stop_requested = True
        return True

    @staticmethod
    def _fatal_reason(child: Child) -> str:
        if child.spawn_error:
            return child.spawn_error
        try:
            if child.reason_file is not None:
                return child.reason_file.read_text().strip() or "no reason given"
        except OSError:
            pass
        return "no reason given"

    def _fence_workers(self) -> None:
        """The manager died: kill every tier worker before a new manager hands out slots. A copy
        the old manager started could otherwise still land in a slot the new one has given to
        another key. The workers are restarted with their usual backoff; the pool is kept."""
        fenced = []
        for child in self.children.values():
            if (
                child.name in WORKER_MODULES
                and child.proc is not None
                and child.proc.poll() is None
            ):
                child.proc.kill()
                child.proc.wait()
                fenced.append(child.name)
        if fenced:
            log.warning("workers_fenced_after_manager_exit", workers=fenced)

    def _log_exit(self, child: Child, code: int) -> None:
        fields = {"child": child.name, "child_pid": child.pid, "exit_code": code}
        if code < 0:
            fields["signal"] = signal.Signals(-code).name
        if child.engine:
            (log.info if code == 0 else log.warning)("child_exited", **fields)
        elif child.restart and code == EXIT_REFUSED:
            log.error("child_refused_to_start", **fields)
        elif child.restart and code == EXIT_FATAL:
            log.error("child_cannot_start", reason=self._fatal_reason(child), **fields)
        elif child.restart:
            log.error("child_exited", **fields)
        else:
            log.info("child_exited", **fields)

    def child_pid(self, name: str) -> int | None:
        child = self.children.get(name)
        return None if child is None else child.pid

    # ---- stop -----------------------------------------------------------------------------

    def stop(self, quiet: bool = False) -> None:
        """Drain through the manager, stop every child, unlink the pool and run files
        (``quiet``: without logging it, after a refused start).

        Bounded: the manager gets ``drain_timeout_s + stop_grace_s`` after its SIGTERM, then
        every other child one common ``stop_grace_s`` after theirs; a child still running then
        is SIGKILLed. The segments and run files are removed even if a killed child cannot be
        reaped."""
        sup = self.cfg.supervisor
        manager = self.children.get("manager")
        if manager is not None:
            _terminate([manager], sup.drain_timeout_s + sup.stop_grace_s)
        _terminate([c for c in self.children.values() if c is not manager], sup.stop_grace_s)
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()
            self.pool = None
        if self.slot_table is not None:
            self.slot_table.close()
            self.slot_table.unlink()
            self.slot_table = None
        if self.rundir is not None:
            self.rundir.remove()
            self.rundir = None
        if not quiet:
            log.info("service_stopped")


def _terminate(children: list[Child], grace_s: float) -> None:
    """SIGTERM the running ``children``, give them ``grace_s`` together, SIGKILL the ones
    still running and reap them (at most ``KILL_REAP_S`` each)."""
    running = [(c, c.proc) for c in children if c.proc is not None and c.proc.poll() is None]
    for _, proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for child, proc in running:
        if proc.poll() is not None:
            continue
        log.error("child_killed_after_grace", child=child.name, child_pid=proc.pid, grace_s=grace_s)
        proc.kill()
        try:
            proc.wait(KILL_REAP_S)
        except subprocess.TimeoutExpired:
            log.error("child_not_reaped", child=child.name, child_pid=proc.pid)
