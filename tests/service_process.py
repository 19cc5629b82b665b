"""A real kvoffload service (``kvoffload serve`` as a subprocess) for process-level tests; the
``start_service`` fixture is registered in tests/conftest.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvoffload import protocol as p
from kvoffload.client import KVOffloadClient
from kvoffload.rundir import live_runs
from kvoffload.soak.probe import log_events_in


class Service:
    """A running supervisor with its manager and workers; ``stop()`` SIGTERMs it by pid."""

    def __init__(
        self,
        tmp: Path,
        extra_config: str = "",
        workers=("cpu",),
        service_options: str = "",
        num_slots: int = 64,
        block_bytes: int = 65536,
    ) -> None:
        """``service_options``: extra ``key = value`` lines of the [service] table;
        ``extra_config``: extra tables appended at the end."""
        self.base = tmp / "run"
        self.data = tmp / "data"
        self.config = tmp / "kvoffload.toml"
        self.workers = workers
        self.config.write_text(
            f"""
[service]
runtime_dir = "{self.base}"
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 3.0
log_level = "info"
{service_options}

[pool]
num_slots = {num_slots}
block_bytes = {block_bytes}

[disk]
enabled = {str("disk" in workers).lower()}
root = "{self.data / "disk"}"
capacity_bytes = 67108864

[supervisor]
restart_backoff_initial_s = 0.2
drain_timeout_s = 5.0
{extra_config}
"""
        )
        self.log_path = tmp / "service.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.cli", "serve", "--config", str(self.config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self) -> None:
        self.endpoint = self._wait_endpoint()
        self.wait_workers(self.workers)

    def _wait_endpoint(self, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runs = [r for r in live_runs(self.base) if r.pid == self.proc.pid]
            if runs:
                self.run_id = runs[0].run_id
                return f"ipc://{self.base / (self.run_id + '-client.sock')}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        raise TimeoutError("service did not start")

    def client(self, name: str = "test", timeout_s: float = 10.0) -> KVOffloadClient:
        deadline = time.monotonic() + 20
        while True:
            try:
                return KVOffloadClient(self.endpoint, timeout_s=timeout_s, name=name)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def status(self) -> p.ManagerStatus:
        with self.client("status") as c:
            return c.status()

    def wait_workers(self, names, timeout_s: float = 30.0, exclude_pids=()) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = self.status().workers
            if all(
                n in workers and workers[n].index_complete and workers[n].pid not in exclude_pids
                for n in names
            ):
                return workers
            time.sleep(0.1)
        raise TimeoutError(
            f"workers {names} not ready: {self.status().workers}\n{self.log_path.read_text()[-3000:]}"
        )

    def log_events(self) -> list[dict]:
        return log_events_in(self.log_path)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_service(tmp_path):
    started: list[Service] = []

    def start(**kw) -> Service:
        home = tmp_path / f"svc{len(started)}"
        home.mkdir()
        service = Service(home, **kw)
        started.append(service)
        service.wait_ready()
        return service

    yield start
    for service in started:
        service.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(port: int, ready=lambda families: True, timeout_s: float = 10.0) -> dict:
    """The manager's metrics endpoint parsed by prometheus_client: {family name: family}, once
    ``ready(families)`` holds (TimeoutError with the last text otherwise)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    text = ""
    while True:
        try:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
                .read()
                .decode()
            )
            families = {f.name: f for f in text_string_to_metric_families(text)}
            if ready(families):
                return families
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"metrics not ready:\n{text[-3000:]}")
        time.sleep(0.1)


def sample_value(
    families: dict, family: str, sample: str | None = None, **labels: str
) -> float | None:
    """The value of the one sample of ``family`` named ``sample`` (default: the family's own
    counter or gauge sample) with exactly these labels (histograms: plus ``le`` for buckets)."""
    for s in families[family].samples if family in families else ():
        if s.name == (sample or _own_sample(families[family])) and s.labels == labels:
            return s.value
    return None


def _own_sample(family) -> str:
    return family.name + "_total" if family.type == "counter" else family.name
