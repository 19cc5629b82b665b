"""A real kvoffload service in a temp directory, for tests, soak runs and benchmarks: one
harness, two ways to launch it.

``ServiceHarness`` writes a TOML config (the caller's defaults overlaid by its sections) and
starts the service in one of two ways (``Launch``):

- ``IN_PROCESS``: a ``Supervisor`` in this process (manager and workers as real child
  processes), with ``Supervisor.watch_once`` called from a watcher thread (unless ``watch`` is
  off) so crashed children are restarted while the caller injects faults. The soak and the
  benchmarks use this.
- ``SERVE``: ``kvoffload serve`` as a child process, exactly what an operator runs (graceful
  SIGTERM, exit code, ``[[engines]]``). Process-level tests use this (``serve_harness``).

Contract, both ways:

- signals go only to live descendants of this process (``signal_child`` checks the ancestry),
  i.e. processes the service started and the manager reports by pid;
- ``status`` returns the typed ``ManagerStatus`` and raises when the manager does not answer;
  ``poll_status`` never raises: the status as plain data, or None while the manager does not
  answer (it is thread-safe);
- ``stop`` stops the service (drain, stop children, unlink the pool and run files) and returns
  what the run left behind (``Leftovers``, with the ``kvoffload serve`` exit code in SERVE);
- ``services`` starts any number of harnesses and, at its end, stops them and asserts that
  none left anything behind.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import structlog

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.config import Config, load_config
from kvoffload.config.toml import to_toml as to_toml
from kvoffload.memory.blockformat import disk_record_bytes
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.rundir import live_runs
from kvoffload.runtime.supervisor import Supervisor
from kvoffload.wire.status import ManagerStatus, WorkerStatus

log = structlog.get_logger()

BLOCK_BYTES = 65536
DISK_RECORD_BYTES = disk_record_bytes(BLOCK_BYTES)
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


def merge_sections(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """``base`` with each table of ``extra`` laid over it, key by key (copies, no aliasing); an
    array of tables in ``extra`` replaces the base's."""
    merged: dict[str, Any] = {
        name: [dict(e) for e in table] if isinstance(table, list) else dict(table)
        for name, table in base.items()
    }
    for name, table in (extra or {}).items():
        if isinstance(table, list):
            merged[name] = [dict(entry) for entry in table]
        else:
            merged.setdefault(name, {}).update(table)
    return merged


@dataclass
class Leftovers:
    """What a stopped run left: shm segments and runtime files naming its run id, and
    processes it started that are still alive."""

    shm: list[str] = field(default_factory=list)
    runtime_files: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    exit_code: int | None = None
    """``kvoffload serve``'s exit status (SERVE); None in process."""

    @property
    def clean(self) -> bool:
        return not (self.shm or self.runtime_files or self.processes)


def shm_names_containing(text: str) -> list[str]:
    """Entries of /dev/shm whose name contains ``text``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if text in n)
    except FileNotFoundError:
        return []


class Launch(enum.StrEnum):
    """How ``ServiceHarness`` runs the service (see the module docstring)."""

    IN_PROCESS = "in_process"
    SERVE = "serve"


def log_events_in(path: Path) -> list[dict]:
    """The JSON log events (one object a line) in the log file at ``path``."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


class ServiceHarness:
    """One service. ``workdir`` holds the config, the disk tier and the log; the runtime dir is
    a short fresh directory under the system temp dir (AF_UNIX path limit)."""

    def __init__(
        self,
        workdir: Path | None,
        sections: dict[str, Any] | None = None,
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
        *,
        defaults: dict[str, Any] = SOAK_DEFAULTS,
        launch: Launch = Launch.IN_PROCESS,
        log_path: Path | None = None,
        watch: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """``sections`` are laid over ``defaults`` table by table (``defaults={}``: the config
        schema's own defaults); ``curve_keys``: (client public, client secret, server public)
        for a tcp:// endpoint (IN_PROCESS only). ``workdir`` None: a fresh temp directory,
        removed by ``stop``. ``log_path``: where the service logs (default: ``workdir``'s
        service.log). ``watch``: restart crashed children (IN_PROCESS). ``env``: the
        environment of ``kvoffload serve`` (SERVE; default: this process's)."""
        self.curve_keys = curve_keys
        self.launch = launch
        self.watch = watch
        self.env = env
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kvsvc-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="kvrun-"))
        base = merge_sections(
            defaults,
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
        self.log_path = log_path or self.workdir / "service.log"
        self.supervisor: Supervisor | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.job_endpoint = ""
        self.run_id = ""
        self._spawned: dict[int, psutil.Process] = {}
        """Every process the service started, kept by identity (pid and start time): one
        orphaned by a dead parent still counts as left behind."""
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._status_lock = threading.Lock()
        self._status_client: KVOffloadClient | None = None

    @property
    def worker_names(self) -> list[str]:
        names = ["cpu"]
        if self.cfg.disk.enabled:
            names.append("disk")
        if self.cfg.peer.enabled:
            names.append("peer")
        if self.cfg.object.enabled:
            names.append("object")
        return names

    @property
    def supervisor_pid(self) -> int:
        """The process supervising the manager and workers: ``kvoffload serve`` or this one."""
        return self.serve.pid if self.serve is not None else os.getpid()

    # ---- start and watch ------------------------------------------------------------------

    def start(
        self, ready_timeout_s: float = 60.0, wait_for: tuple[str, ...] | None = None
    ) -> ServiceHarness:
        """Start the service; return once the index of every worker (of ``wait_for``, when
        given) is in. A start that fails stops what it started (``stop``) before it raises:
        no process, segment or runtime file of the run is left."""
        try:
            if self.launch == Launch.SERVE:
                self._start_serve(ready_timeout_s)
            else:
                self._start_in_process()
            self.wait_workers(wait_for or self.worker_names, timeout_s=ready_timeout_s)
            self._note_children()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_in_process(self) -> None:
        self.supervisor = Supervisor(self.cfg, log_path=self.log_path)
        spec = self.supervisor.start()
        self.endpoint = spec.client_endpoint
        self.job_endpoint = spec.job_endpoint
        self.run_id = spec.run_id
        self._note_children()
        if self.watch:
            self._watcher = threading.Thread(target=self._watch, name="service-watch", daemon=True)
            self._watcher.start()

    def _start_serve(self, timeout_s: float) -> None:
        with open(self.log_path, "ab") as log_file:
            self.serve = subprocess.Popen(
                [sys.executable, "-m", "kvoffload.cli", "serve", "--config", str(self.config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        self._spawned[self.serve.pid] = psutil.Process(self.serve.pid)
        deadline = time.monotonic() + timeout_s
        while not (runs := [r for r in live_runs(self.runtime_dir) if r.pid == self.serve.pid]):
            if self.serve.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"kvoffload serve exited with {self.serve.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvoffload serve did not start; see {self.log_path}")
            time.sleep(0.05)
        self.run_id = runs[0].run_id
        self.endpoint = f"ipc://{self.runtime_dir / (self.run_id + '-client.sock')}"
        self.job_endpoint = f"ipc://{self.runtime_dir / (self.run_id + '-jobs.sock')}"

    def _note_children(self) -> None:
        pids = []
        if self.supervisor is not None:
            pids = [c.pid for c in list(self.supervisor.children.values()) if c.pid is not None]
        if self.serve is not None:
            with _quiet_psutil():
                pids = [c.pid for c in psutil.Process(self.serve.pid).children(recursive=True)]
        for pid in pids:
            if pid not in self._spawned:
                with _quiet_psutil():
                    self._spawned[pid] = psutil.Process(pid)

    def _watch(self) -> None:
        assert self.supervisor is not None
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self.supervisor.watch_once()
            except Exception:
                log.exception("service_watch_failed")
            self._note_children()

    # ---- clients and status ---------------------------------------------------------------

    def client(
        self,
        name: str = "harness",
        timeout_s: float = 5.0,
        connect_within_s: float = 30.0,
        landing: bool = False,
    ) -> KVOffloadClient:
        """A connected client (taking ``Landed`` notices with ``landing``); retries while the
        manager does not answer."""
        deadline = time.monotonic() + connect_within_s
        while True:
            try:
                return KVOffloadClient(
                    self.endpoint,
                    timeout_s=timeout_s,
                    name=name,
                    curve_keys=self.curve_keys,
                    landing=landing,
                )
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def status(self, timeout_s: float = 10.0) -> ManagerStatus:
        """The manager's status; raises (TimeoutError, KVOffloadError) when it does not answer."""
        with self.client("status", timeout_s=timeout_s) as c:
            return c.status()

    def poll_status(self, timeout_s: float = 2.0) -> dict | None:
        """The manager's status as plain data (for invariants and JSON reports), or None when
        it does not answer within ``timeout_s``."""
        with self._status_lock:
            try:
                if self._status_client is None:
                    self._status_client = KVOffloadClient(
                        self.endpoint,
                        timeout_s=timeout_s,
                        name="harness-status",
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
        """The first ``poll_status`` for which ``predicate`` holds, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.poll_status()
            if status is not None and predicate(status):
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(interval_s)

    def wait_workers(
        self, names, timeout_s: float = 30.0, exclude_pids=()
    ) -> dict[str, WorkerStatus]:
        """The workers once every named one is connected with its index announced and a pid not
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
        return msgspec.convert(status, ManagerStatus).workers

    def log_events(self) -> list[dict]:
        """The JSON log events the service's processes wrote so far."""
        return log_events_in(self.log_path)

    # ---- processes ------------------------------------------------------------------------

    def manager_pid(self) -> int | None:
        """The manager's pid (None while there is none, or, in SERVE, it does not answer)."""
        if self.supervisor is not None:
            return self.supervisor.child_pid("manager")
        status = self.poll_status()
        return None if status is None else status["pid"]

    def worker_pid(self, name: str) -> int | None:
        """The pid the manager reports for worker ``name`` (None if not connected)."""
        status = self.poll_status()
        worker = (status or {}).get("workers", {}).get(name)
        return None if worker is None else worker["pid"]

    def is_own_child(self, pid: int) -> bool:
        """True when ``pid`` is a live (not zombie) descendant of this process."""
        with _quiet_psutil():
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE and any(
                parent.pid == os.getpid() for parent in proc.parents()
            )
        return False

    def signal_child(self, pid: int | None, sig: signal.Signals) -> bool:
        """Send ``sig`` to ``pid`` if it is a live descendant of this process; True if sent."""
        if pid is None or not self.is_own_child(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        log.info("harness_signal_sent", target_pid=pid, signal=signal.Signals(sig).name)
        return True

    def rss_bytes(self, pid: int | None) -> int | None:
        if pid is None:
            return None
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None

    def restarts(self) -> dict[str, int]:
        """Restarts the in-process supervisor performed, per child (empty in SERVE)."""
        if self.supervisor is None:
            return {}
        return {name: child.restarts for name, child in self.supervisor.children.items()}

    # ---- stop -----------------------------------------------------------------------------

    def stop(self, timeout_s: float = 30.0) -> Leftovers:
        """Stop everything and report leftovers; removes the runtime dir when it is clean (and
        a workdir it made itself in any case). SERVE: SIGTERM to ``kvoffload serve`` (SIGKILL
        after ``timeout_s``)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._status_lock:
            self._drop_status_client()
        exit_code = None
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.serve is not None:
            self._note_children()
            if self.serve.poll() is None:
                self.serve.send_signal(signal.SIGTERM)
                try:
                    self.serve.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.serve.kill()
                    self.serve.wait()
            exit_code = self.serve.returncode
        left = self.leftovers()
        left.exit_code = exit_code
        if left.clean:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return left

    def leftovers(self) -> Leftovers:
        files = []
        if self.run_id and self.runtime_dir.is_dir():
            files = sorted(p.name for p in self.runtime_dir.iterdir() if self.run_id in p.name)
        return Leftovers(
            shm=shm_names_containing(self.run_id) if self.run_id else [],
            runtime_files=files,
            processes=sorted(pid for pid, proc in self._spawned.items() if _alive(proc)),
        )

    def __enter__(self) -> ServiceHarness:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(proc: psutil.Process) -> bool:
    """Still running (the same process, not a reused pid) and not a zombie."""
    with _quiet_psutil():
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


@contextlib.contextmanager
def _quiet_psutil() -> Iterator[None]:
    """A process that exits while being inspected is simply not there."""
    with contextlib.suppress(psutil.Error):
        yield


@contextlib.contextmanager
def service_pool(client: KVOffloadClient) -> Iterator[HostPool]:
    """The host pool of the service ``client`` is connected to, attached in this process (the
    service owns it: it is closed on exit, never unlinked)."""
    info = client.info
    pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
    try:
        yield pool
    finally:
        pool.close()


TEST_DEFAULTS: dict[str, dict[str, Any]] = {
    "service": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "log_level": "info"},
    "pool": {"num_slots": 64, "block_bytes": 65536},
    "disk": {"enabled": False, "capacity_bytes": 67108864},
    "supervisor": {"restart_backoff_initial_s": 0.2, "drain_timeout_s": 5.0},
}
"""The process-level tests' service: small pool, disk tier off, quick heartbeats."""


def serve_harness(
    home: Path,
    workers: tuple[str, ...] = ("cpu",),
    extra_config: str = "",
    service_options: str = "",
    num_slots: int = 64,
    block_bytes: int = 65536,
    env: dict[str, str] | None = None,
) -> ServiceHarness:
    """A (not yet started) ``kvoffload serve`` with ``workers``. ``service_options``: extra
    ``key = value`` lines of the [service] table; ``extra_config``: TOML whose leading keys
    belong to [supervisor], then any tables (``[faults]``, ``[object]``, ``[[engines]]``).
    ``env``: the environment of ``kvoffload serve`` (default: this process's)."""
    sections = tomllib.loads(f"[service]\n{service_options}\n[supervisor]\n{extra_config}\n")
    sections["pool"] = {"num_slots": num_slots, "block_bytes": block_bytes}
    sections.setdefault("disk", {})["enabled"] = "disk" in workers
    return ServiceHarness(home, sections, defaults=TEST_DEFAULTS, launch=Launch.SERVE, env=env)


def sections_harness(
    home: Path, curve_keys: tuple[bytes, bytes, bytes] | None = None, **sections: Any
) -> ServiceHarness:
    """A (not yet started) in-process service on ``SOAK_DEFAULTS`` with ``sections`` over them."""
    return ServiceHarness(home, sections, curve_keys)


@contextlib.contextmanager
def services(
    workdir: Path, make: Callable[..., ServiceHarness] = sections_harness
) -> Iterator[Callable[..., ServiceHarness]]:
    """Yields ``start(*args, **kwargs)``: ``make(<a fresh directory under workdir>, *args,
    **kwargs)``, started. Every service started is stopped at exit, and a run that left a
    segment, a runtime file or a process raises AssertionError."""
    started: list[ServiceHarness] = []

    def start(*args: Any, **kwargs: Any) -> ServiceHarness:
        harness = make(Path(workdir) / f"service{len(started)}", *args, **kwargs)
        started.append(harness)
        return harness.start()

    try:
        yield start
    finally:
        leftovers = [harness.stop() for harness in started]
    dirty = [left for left in leftovers if not left.clean]
    assert not dirty, f"runs left things behind: {dirty}"
