"""A small verifying engine for fault and security tests (single thread, one process).

``ProbeEngine`` owns a client and a shm KV cache registered with the service. Blocks hold
``expected_block(key)``; ``store`` copies them into the service, ``load`` brings keys back
into poisoned device blocks and returns the keys whose bytes differ (must be empty), and
``lookup_ready`` waits out HIT_PENDING/RETRY. ``services`` is a context manager that starts
``ServiceHarness``es and, on exit, stops them and asserts nothing was left behind.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvoffload import protocol as p
from kvoffload.memory.kvcache import SharedKVCache, unique_kv_name
from kvoffload.soak.blocks import POISON, expected_block
from kvoffload.soak.service import ServiceHarness

_names = itertools.count()


def probe_keys(prefix: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys."""
    return [f"{prefix}/{i}".encode().ljust(32, b".") for i in range(n)]


class ProbeEngine:
    def __init__(
        self,
        harness: ServiceHarness,
        name: str = "probe",
        blocks: int = 32,
        timeout_s: float = 10.0,
    ) -> None:
        self.client = harness.client(name, timeout_s=timeout_s)
        self.block_bytes = self.client.info.block_bytes
        self.kv = SharedKVCache.create(unique_kv_name(), blocks, [self.block_bytes])
        self.handle_id = f"{name}-{next(_names)}"
        self.client.register_kv(self.kv.handle(self.handle_id))
        self._reqs = itertools.count()

    def new_request(self) -> str:
        req = f"req{next(self._reqs)}"
        self.client.new_request(req)
        return req

    def store(
        self, req: str, keys: list[bytes], wait_s: float = 20.0
    ) -> p.DeviceJobFinished | None:
        """Write each key's block into device blocks 0.. and store them; the job's result."""
        for block, key in enumerate(keys):
            self.kv.tensors[0][block] = expected_block(key, self.block_bytes)
        accepted = self.client.store(req, keys, list(range(len(keys))), self.handle_id)
        if accepted.job_id is None:
            return None
        return self.client.wait([accepted.job_id], timeout_s=wait_s)[accepted.job_id]

    def load(
        self, req: str, keys: list[bytes], wait_s: float = 20.0
    ) -> tuple[p.DeviceJobFinished, list[bytes]]:
        """Load keys into poisoned device blocks 0..; (result, keys reported loaded whose
        bytes are wrong)."""
        self.kv.tensors[0][: len(keys)] = POISON
        job_id = self.client.load(req, keys, list(range(len(keys))), self.handle_id).job_id
        if job_id is None:
            raise RuntimeError(f"a load of {len(keys)} keys was accepted without a job")
        done = self.client.wait([job_id], timeout_s=wait_s)[job_id]
        loaded = set(keys) if done.success else set(done.successful_keys or ())
        wrong = [
            key
            for block, key in enumerate(keys)
            if key in loaded
            and not np.array_equal(self.kv.tensors[0][block], expected_block(key, self.block_bytes))
        ]
        return done, wrong

    def lookup_ready(self, req: str, keys: list[bytes], within_s: float = 15.0):
        """The first lookup outcome that does not have to wait."""
        deadline = time.monotonic() + within_s
        while True:
            outcome = self.client.lookup(req, keys)
            if not outcome.must_wait or time.monotonic() > deadline:
                return outcome
            self.client.end_step()
            time.sleep(0.01)

    def close(self) -> None:
        self.client.close()
        self.kv.close()
        self.kv.unlink()

    def __enter__(self) -> ProbeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def services(workdir: Path) -> Iterator[Callable[..., ServiceHarness]]:
    """Yields ``start(curve_keys=None, **sections)``; every service started is stopped at exit, and a run that
    left a segment, a runtime file or a process raises AssertionError."""
    started: list[ServiceHarness] = []

    def start(
        curve_keys: tuple[bytes, bytes, bytes] | None = None, **sections: dict
    ) -> ServiceHarness:
        harness = ServiceHarness(Path(workdir) / f"service{len(started)}", sections, curve_keys)
        started.append(harness)
        return harness.start()

    try:
        yield start
    finally:
        leftovers = [h.stop() for h in started]
    dirty = [left for left in leftovers if not left.clean]
    assert not dirty, f"runs left things behind: {dirty}"


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """True as soon as ``predicate()`` holds, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
