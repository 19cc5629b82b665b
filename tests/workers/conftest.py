"""Fixtures for worker tests: a host pool, a fake manager (a ROUTER on the job channel that
acks hellos, sends jobs and collects what workers send), run specs and worker subprocesses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvoffload.memory.pool import HostPool
from kvoffload.runtime.runspec import RunSpec
from kvoffload.testing.helpers import REPO_ROOT
from kvoffload.wire.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    HelloAck,
    JobDone,
    WorkerHello,
    decode_worker_message,
    encode,
)


class FakeManager:
    """The manager's side of the job channel, just enough for tests. Every message received
    is kept in ``received`` as (identity, message), in arrival order."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.received: list[tuple[bytes, Any]] = []
        self._taken: set[int] = set()

    def pump(self, timeout_s: float) -> int:
        """Receive for up to ``timeout_s`` (returns early after the first batch); count."""
        count = 0
        if self.sock.poll(timeout_s * 1000):
            while True:
                try:
                    identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.received.append((identity, decode_worker_message(frame)))
                count += 1
        return count

    def wait_for(
        self,
        cls: type,
        pred: Callable[[Any], bool] = lambda m: True,
        timeout_s: float = 10.0,
    ) -> Any:
        """The first not yet taken message of type ``cls`` matching ``pred`` (marked taken);
        AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, (_, msg) in enumerate(self.received):
                if i not in self._taken and isinstance(msg, cls) and pred(msg):
                    self._taken.add(i)
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {cls.__name__} within {timeout_s}s")
            self.pump(min(left, 0.05))

    def messages(self, cls: type) -> list[Any]:
        return [m for _, m in self.received if isinstance(m, cls)]

    def job_dones(self) -> dict[int, list[JobDone]]:
        out: dict[int, list[JobDone]] = {}
        for done in self.messages(JobDone):
            out.setdefault(done.job_id, []).append(done)
        return out

    def wait_job_dones(self, job_ids: list[int], timeout_s: float = 10.0) -> dict[int, JobDone]:
        """Wait until each id has a JobDone; returns the first per id."""
        deadline = time.monotonic() + timeout_s
        wanted = set(job_ids)
        while True:
            dones = self.job_dones()
            if wanted <= dones.keys():
                return {i: dones[i][0] for i in job_ids}
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"missing JobDone for {sorted(wanted - dones.keys())[:10]}")
            self.pump(min(left, 0.05))

    def accept_hello(
        self, accepted: bool = True, reason: str = "", timeout_s: float = 15.0
    ) -> tuple[bytes, WorkerHello]:
        deadline = time.monotonic() + timeout_s
        while True:
            for i, (identity, msg) in enumerate(self.received):
                if i not in self._taken and isinstance(msg, WorkerHello):
                    self._taken.add(i)
                    self.send(
                        identity,
                        HelloAck(version=PROTOCOL_VERSION, accepted=accepted, reason=reason),
                    )
                    return identity, msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no WorkerHello within {timeout_s}s")
            self.pump(min(left, 0.05))

    def send(self, identity: bytes, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([identity, encode(msg)])

    def send_raw(self, identity: bytes, *frames: bytes) -> None:
        self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory (ipc socket paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager(short_dir: Path) -> Iterator[FakeManager]:
    fake = FakeManager(f"ipc://{short_dir}/jobs.sock")
    yield fake
    fake.close()


@pytest.fixture
def make_pool() -> Iterator[Callable[[int, int], HostPool]]:
    """Create host pools with unique names; each is closed and unlinked at teardown."""
    pools: list[HostPool] = []

    def make(num_slots: int, block_bytes: int) -> HostPool:
        pool = HostPool.create(f"/kvoffload-wtest-{uuid.uuid4().hex[:12]}", num_slots, block_bytes)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        pool.unlink()


def write_spec(
    directory: Path, endpoint: str, pool: HostPool, config: dict[str, Any] | None = None
) -> Path:
    """A run spec for ``pool`` whose config merges ``config`` (section -> keys) over fast
    test settings."""
    sections: dict[str, dict[str, Any]] = {
        "service": {"heartbeat_interval_s": 0.05, "log_level": "debug"},
        "pool": {"num_slots": pool.num_slots, "block_bytes": pool.block_bytes},
        "supervisor": {"drain_timeout_s": 5.0},
    }
    for section, keys in (config or {}).items():
        sections.setdefault(section, {}).update(keys)
    spec = RunSpec(
        run_id="test",
        job_endpoint=endpoint,
        client_endpoint=f"ipc://{directory}/client.sock",
        pool_name=pool.name,
        config=sections,
    )
    path = directory / f"spec-{uuid.uuid4().hex[:8]}.json"
    path.write_bytes(msgspec.json.encode(spec))
    return path


class WorkerProcess:
    """A worker subprocess with its stderr (JSON log lines) captured in a file."""

    def __init__(
        self, module: str, spec: Path, log_path: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - the worker's log, closed when it stops
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--spec", str(spec), *args],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout_s: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_text().splitlines():
            try:
                events.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                continue
        return events

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def spawn(short_dir: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker subprocesses (``spawn(module, spec, *args, env=...)``); killed at teardown."""
    started: list[WorkerProcess] = []

    def start(
        module: str, spec: Path, *args: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        worker = WorkerProcess(
            module, spec, short_dir / f"worker-{len(started)}.log", *args, env=env
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
