"""A real kvoffload service run by an in-process ``Supervisor``, for soak runs and fault tests.

``ServiceHarness`` writes a TOML config (soak defaults overlaid by the caller's sections),
starts the supervisor (manager, cpu, disk and object workers as real processes), and calls
``Supervisor.watch_once`` from a watcher thread so crashed children are restarted while the
caller injects faults. Contract:

- signals go only to live children of this process (``signal_child`` checks the parent pid),
  i.e. processes the in-process supervisor started and the manager reports by pid;
- ``status`` never raises: None while the manager does not answer (it is thread-safe);
- ``stop`` stops the watcher, then the supervisor (drain, stop children, unlink the pool and
  run files), and returns what the run left behind (``Leftovers``).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import structlog

from ..client import KVOffloadClient, KVOffloadError
from ..config import Config, load_config
from ..supervisor import Supervisor

log = structlog.get_logger()

BLOCK_BYTES = 65536
DISK_RECORD_BYTES = BLOCK_BYTES + 4096
WATCH_INTERVAL_S = 0.05

SOAK_DEFAULTS: dict[str, dict[str, Any]] = {
    "service": {
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.5,
        "request_lease_s": 3.0,
        "hit_pending_deadline_s": 5.0,
        "log_level": "info",
    },
    "pool": {"num_slots": 128, "block_bytes": BLOCK_BYTES},
    "cpu": {"threads": 2},
    "disk": {
        "enabled": True,
        "capacity_bytes": 96 * DISK_RECORD_BYTES,
        "read_threads": 2,
        "write_threads": 1,
    },
    "object": {
        "verdict_timeout_s": 2.0,
        "request_timeout_s": 2.0,
        "max_retries": 1,
        "io_threads": 4,
    },
    "supervisor": {
        "restart_backoff_initial_s": 0.2,
        "restart_backoff_max_s": 2.0,
        "drain_timeout_s": 5.0,
    },
}


def merge_sections(base: dict[str, dict], extra: dict[str, dict] | None) -> dict[str, dict]:
    """``base`` with each section of ``extra`` laid over it, key by key (copies, no aliasing)."""
    merged = {name: dict(table) for name, table in base.items()}
    for name, table in (extra or {}).items():
        merged.setdefault(name, {}).update(table)
    return merged


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """TOML text of flat sections (scalars and arrays only)."""
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
        lines.append("")
    return "\n".join(lines)


@dataclass
class Leftovers:
    """What a stopped run left: shm segments and runtime files naming its run id, and
    processes it started that are still alive."""

    shm: list[str] = field(default_factory=list)
    runtime_files: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.shm or self.runtime_files or self.processes)


def shm_names_containing(text: str) -> list[str]:
    """Entries of /dev/shm whose name contains ``text``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if text in n)
    except FileNotFoundError:
        return []


class ServiceHarness:
    """One supervised service. ``workdir`` holds the config, the disk tier and the log; the
    runtime dir is a short fresh directory under the system temp dir (AF_UNIX path limit)."""

    def __init__(
        self,
        workdir: Path,
        sections: dict[str, dict] | None = None,
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        """``curve_keys``: (client public, client secret, server public) for a tcp:// endpoint."""
        self.curve_keys = curve_keys
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="kvrun-"))
        base = merge_sections(
            SOAK_DEFAULTS,
            {
                "service": {"runtime_dir": str(self.runtime_dir)},
                "disk": {"root": str(self.workdir / "disk")},
            },
        )
        self.sections = merge_sections(base, sections)
        if not self.sections.get("object", {}).get("enabled"):
            self.sections.pop("object", None)
        self.config_path = self.workdir / "kvoffload.toml"
        self.config_path.write_text(to_toml(self.sections))
        self.cfg: Config = load_config(self.config_path, env={})
        self.log_path = self.workdir / "service.log"
        self.supervisor = Supervisor(self.cfg, log_path=self.log_path)
        self.endpoint = ""
        self.job_endpoint = ""
        self.run_id = ""
        self.spawned_pids: set[int] = set()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._status_lock = threading.Lock()
        self._status_client: KVOffloadClient | None = None

    @property
    def worker_names(self) -> list[str]:
        names = ["cpu"]
        if self.cfg.disk.enabled:
            names.append("disk")
        if self.cfg.object.enabled:
            names.append("object")
        return names

    # ---- start and watch ------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 60.0) -> ServiceHarness:
        """Start the supervisor and its watcher; return once every worker's index is in."""
        spec = self.supervisor.start()
        self.endpoint = spec.client_endpoint
        self.job_endpoint = spec.job_endpoint
        self.run_id = spec.run_id
        self._note_children()
        self._watcher = threading.Thread(target=self._watch, name="soak-watch", daemon=True)
        self._watcher.start()
        self.wait_workers(self.worker_names, timeout_s=ready_timeout_s)
        return self

    def _note_children(self) -> None:
        for child in list(self.supervisor.children.values()):
            if child.pid is not None:
                self.spawned_pids.add(child.pid)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self.supervisor.watch_once()
            except Exception:
                log.exception("soak_watch_failed")
            self._note_children()

    # ---- clients and status ---------------------------------------------------------------

    def client(
        self, name: str = "soak", timeout_s: float = 5.0, connect_within_s: float = 30.0
    ) -> KVOffloadClient:
        """A connected client; retries while the manager does not answer."""
        deadline = time.monotonic() + connect_within_s
        while True:
            try:
                return KVOffloadClient(
                    self.endpoint, timeout_s=timeout_s, name=name, curve_keys=self.curve_keys
                )
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def status(self, timeout_s: float = 2.0) -> dict | None:
        """The manager's status as plain data (for invariants and JSON reports), or None when
        it does not answer within ``timeout_s``."""
        with self._status_lock:
            try:
                if self._status_client is None:
                    self._status_client = KVOffloadClient(
                        self.endpoint,
                        timeout_s=timeout_s,
                        name="soak-status",
                        curve_keys=self.curve_keys,
                    )
                return msgspec.to_builtins(self._status_client.status())
            except (TimeoutError, KVOffloadError):
                self._drop_status_client()
                return None

    def _drop_status_client(self) -> None:
        client, self._status_client = self._status_client, None
        if client is not None:
            client.close()

    def wait_status(
        self, predicate: Callable[[dict], bool], timeout_s: float, interval_s: float = 0.1
    ) -> dict | None:
        """The first status for which ``predicate`` holds, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status is not None and predicate(status):
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(interval_s)

    def wait_workers(self, names, timeout_s: float = 30.0, exclude_pids=()) -> dict:
        """Status once every named worker is connected with its index announced and a pid not
        in ``exclude_pids``; TimeoutError otherwise."""
        excluded = set(exclude_pids)

        def ready(status: dict) -> bool:
            workers = status["workers"]
            return all(
                n in workers and workers[n]["index_complete"] and workers[n]["pid"] not in excluded
                for n in names
            )

        status = self.wait_status(ready, timeout_s)
        if status is None:
            raise TimeoutError(
                f"workers {list(names)} not ready in {timeout_s} s; see {self.log_path}"
            )
        return status

    # ---- processes ------------------------------------------------------------------------

    def manager_pid(self) -> int | None:
        return self.supervisor.child_pid("manager")

    def worker_pid(self, name: str) -> int | None:
        """The pid the manager reports for worker ``name`` (None if not connected)."""
        status = self.status()
        worker = (status or {}).get("workers", {}).get(name)
        return None if worker is None else worker["pid"]

    def is_own_child(self, pid: int) -> bool:
        """True when ``pid`` is a live (not zombie) child of this process."""
        try:
            proc = psutil.Process(pid)
            return proc.ppid() == os.getpid() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def signal_child(self, pid: int | None, sig: signal.Signals) -> bool:
        """Send ``sig`` to ``pid`` if it is a live child of this process; True if sent."""
        if pid is None or not self.is_own_child(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        log.info("soak_signal_sent", target_pid=pid, signal=signal.Signals(sig).name)
        return True

    def rss_bytes(self, pid: int | None) -> int | None:
        if pid is None:
            return None
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None

    def restarts(self) -> dict[str, int]:
        """Restarts the supervisor performed, per child."""
        return {name: child.restarts for name, child in self.supervisor.children.items()}

    # ---- stop -----------------------------------------------------------------------------

    def stop(self) -> Leftovers:
        """Stop everything and report leftovers; removes the runtime dir when it is clean."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._status_lock:
            self._drop_status_client()
        self.supervisor.stop()
        left = self.leftovers()
        if left.clean:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return left

    def leftovers(self) -> Leftovers:
        files = []
        if self.run_id and self.runtime_dir.is_dir():
            files = sorted(p.name for p in self.runtime_dir.iterdir() if self.run_id in p.name)
        return Leftovers(
            shm=shm_names_containing(self.run_id) if self.run_id else [],
            runtime_files=files,
            processes=sorted(pid for pid in self.spawned_pids if self.is_own_child(pid)),
        )

    def __enter__(self) -> ServiceHarness:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
