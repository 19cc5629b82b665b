"""The supervisor: creates the run directory and the host pool, starts the manager, the tier
workers and the configured engines, restarts crashed workers (and the manager) with backoff,
and on SIGTERM/SIGINT drains, stops every child and removes every segment and socket it made.

The supervisor owns the pool and its slot header table: both outlive manager and worker
restarts, so a restarted manager rebuilds its primary index from the headers.
"""

from __future__ import annotations

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
from kvoffload.runtime.rundir import RunDir, cleanup_stale
from kvoffload.runtime.runspec import EXIT_REFUSED, RunSpec, write_runspec

log = structlog.get_logger()

WORKER_MODULES = {"cpu": "workers.cpu", "disk": "workers.disk", "object": "workers.object"}
HEALTHY_AFTER_S = 30.0
KILL_REAP_S = 5.0
"""How long ``stop`` waits for a SIGKILLed child to be reaped before it removes the segments
anyway (a process stuck in the kernel may not die at once)."""


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
        self._stop_requested = False

    # ---- start ----------------------------------------------------------------------------

    def start(self) -> RunSpec:
        base = resolve_runtime_dir(self.cfg)
        removed = cleanup_stale(base)
        if removed:
            log.info("stale_runs_removed", removed=removed)
        self.rundir = RunDir.create(base)
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
            self._spawn(child)
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
        if cfg.disk.enabled:
            self._add(
                Child(
                    "disk",
                    [py, "-m", WORKER_MODULES["disk"], *spec_arg],
                    True,
                    affinity=cfg.disk.cpu_affinity,
                )
            )
        if cfg.object.enabled:
            self._add(
                Child(
                    "object",
                    [py, "-m", WORKER_MODULES["object"], *spec_arg],
                    True,
                    affinity=cfg.object.cpu_affinity,
                )
            )
        for i, engine in enumerate(cfg.engines):
            env = {**engine.env, "KVOFFLOAD_ENDPOINT": client_endpoint}
            self._add(Child(f"engine{i}", list(engine.command), False, env=env))

    def _add(self, child: Child) -> None:
        self.children[child.name] = child

    def _spawn(self, child: Child) -> None:
        env = {**os.environ, **child.env}
        out = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            child.proc = subprocess.Popen(
                child.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
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
        return 0

    def _on_signal(self, signum, _frame) -> None:
        log.info("supervisor_signal", signal=signal.Signals(signum).name)
        self._stop_requested = True

    def watch_once(self) -> None:
        """Reap exited children and restart the restartable ones when their backoff is over."""
        now = time.monotonic()
        initial = self.cfg.supervisor.restart_backoff_initial_s
        ceiling = self.cfg.supervisor.restart_backoff_max_s
        for child in self.children.values():
            if child.proc is None:
                continue
            code = child.proc.poll()
            if code is None:
                if now - child.started_at > HEALTHY_AFTER_S:
                    child.backoff_s = 0.0
                continue
            if child.restart_at is None:
                self._log_exit(child, code)
                if child.name == "manager":
                    self._fence_workers()
                if not child.restart or code == EXIT_REFUSED:
                    child.proc = None
                    continue
                child.backoff_s = (
                    initial if child.backoff_s == 0 else min(child.backoff_s * 2, ceiling)
                )
                child.restart_at = now + child.backoff_s
            elif now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)

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
        if child.restart and code == EXIT_REFUSED:
            log.error("child_refused_to_start", **fields)
        elif child.restart:
            log.error("child_exited", **fields)
        else:
            log.info("child_exited", **fields)

    def child_pid(self, name: str) -> int | None:
        child = self.children.get(name)
        return None if child is None else child.pid

    # ---- stop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain through the manager, stop every child, unlink the pool and run files.

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
        log.info("service_stopped")


def _terminate(children: list[Child], grace_s: float) -> None:
    """SIGTERM the running ``children``, give them ``grace_s`` together, SIGKILL the ones
    still running and reap them (at most ``KILL_REAP_S`` each)."""
    running = [(c, c.proc) for c in children if c.proc is not None and c.proc.poll() is None]
    for _, proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child, proc in running:
        if proc.poll() is not None:
            continue
        log.error("child_killed_after_grace", child=child.name, child_pid=proc.pid, grace_s=grace_s)
        proc.kill()
        try:
            proc.wait(KILL_REAP_S)
        except subprocess.TimeoutExpired:
            log.error("child_not_reaped", child=child.name, child_pid=proc.pid)
