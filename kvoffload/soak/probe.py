"""A small verifying engine for fault and security tests (single thread, one process).

``ProbeEngine`` owns a client and a shm KV cache registered with the service. Blocks hold
``expected_block(key)``; ``store`` copies them into the service, ``load`` brings keys back
into poisoned device blocks and returns the keys whose bytes differ (must be empty), and
``lookup_ready`` waits out HIT_PENDING/RETRY. Services come from
``kvoffload.testing.service.services``, keys from ``kvoffload.testing.helpers.keys_for``.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from kvoffload.memory.kvcache import SharedKVCache, unique_kv_name
from kvoffload.soak.blocks import POISON, expected_block
from kvoffload.testing.service import ServiceHarness
from kvoffload.wire import protocol as p

_names = itertools.count()


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

    def assert_round_trip(self, keys: list[bytes]) -> None:
        """Store ``keys`` in a new request, wait until they are ready and load them back:
        AssertionError unless every step succeeds and every byte comes back."""
        req = self.new_request()
        stored = self.store(req, keys)
        assert stored is not None and stored.success, stored
        assert self.lookup_ready(req, keys).ready_prefix == len(keys)
        done, wrong = self.load(req, keys)
        assert done.success and wrong == [], (done, wrong)

    def close(self) -> None:
        self.client.close()
        self.kv.close()
        self.kv.unlink()

    def __enter__(self) -> ProbeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
