"""A store burst against a running service, and the check that every acknowledged block
came back: shared by the write-back tests and the burst benchmark (``kvoffload.bench.burst``).

``store_burst`` writes blocks the way an engine that maps the pool does (``prepare_store``,
the block's bytes into its slot, ``complete_store``), batch after batch, as fast as the service
takes them. A batch answered ``no_space`` is a refusal: it is counted and, within
``retry_for_s``, tried again. Only a completed store is an acknowledgement.

``settle`` waits until no tier job is in flight and no cascade waits; ``recover`` empties the
host pool (``reset_cache``) and brings each acknowledged block back on its own, comparing every
byte with ``soak.blocks.expected_block``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.memory.pool import HostPool
from kvoffload.soak.blocks import expected_block
from kvoffload.testing.service import ServiceHarness
from kvoffload.wire.vocab import ErrorCode

_requests = itertools.count()


@dataclass
class BurstOutcome:
    """What a burst did: the keys acknowledged, in order; the ``no_space`` answers and the
    keys of the batches given up after them; the seconds from the first store to the last
    acknowledgement, and the seconds spent waiting between a refusal and its retry."""

    acked: list[bytes] = field(default_factory=list)
    refusals: int = 0
    refused_keys: list[bytes] = field(default_factory=list)
    elapsed_s: float = 0.0
    waited_s: float = 0.0


class DirectWriter:
    """A client that maps the service's host pool and stores into it itself."""

    def __init__(self, harness: ServiceHarness, name: str = "burst", timeout_s: float = 10.0):
        self.client: KVOffloadClient = harness.client(name, timeout_s=timeout_s)
        info = self.client.info
        self.block_bytes = info.block_bytes
        self.pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        self._blocks: dict[bytes, np.ndarray] = {}

    def block(self, key: bytes) -> np.ndarray:
        found = self._blocks.get(key)
        if found is None:
            found = self._blocks[key] = expected_block(key, self.block_bytes)
        return found

    def new_request(self) -> str:
        req = f"burst-{next(_requests)}"
        self.client.new_request(req)
        return req

    def store_burst(
        self,
        keys: list[bytes],
        batch: int = 16,
        retry_for_s: float = 10.0,
        retry_interval_s: float = 0.001,
        between=None,
    ) -> BurstOutcome:
        """Store ``keys`` in batches of ``batch``, one request per batch (see the module
        docstring). ``between(i)`` runs before batch ``i`` (a fault, a sample)."""
        for key in keys:
            self.block(key)  # the bytes are made before the clock starts
        out = BurstOutcome()
        started = time.perf_counter()
        for i, first in enumerate(range(0, len(keys), batch)):
            if between is not None:
                between(i)
            chunk = keys[first : first + batch]
            req = self.new_request()
            try:
                given_up_at = time.perf_counter() + retry_for_s
                while True:
                    try:
                        slots = self.client.prepare_store(req, chunk)
                        break
                    except KVOffloadError as exc:
                        if exc.code != ErrorCode.NO_SPACE:
                            raise
                        out.refusals += 1
                        if time.perf_counter() >= given_up_at:
                            slots = None
                            break
                        t0 = time.perf_counter()
                        time.sleep(retry_interval_s)
                        out.waited_s += time.perf_counter() - t0
                if slots is None:
                    out.refused_keys += chunk
                    continue
                for key, slot in zip(slots.keys, slots.slots, strict=True):
                    self.pool.slot_array(slot)[:] = self.block(key)
                if slots.keys:
                    self.client.complete_store(req, slots.keys)
                out.acked += slots.keys
            finally:
                self.client.finish_request(req)
        out.elapsed_s = time.perf_counter() - started
        return out

    def recover(self, keys: list[bytes], wait_ms: int = 2000) -> tuple[list[bytes], list[bytes]]:
        """``reset_cache``, then bring each key back alone and compare its bytes; returns
        (keys that did not come back, keys that came back with wrong bytes)."""
        self.client.reset_cache()
        missing: list[bytes] = []
        wrong: list[bytes] = []
        req = self.new_request()
        try:
            for key in keys:
                deadline = time.monotonic() + wait_ms / 1000
                while True:
                    outcome = self.client.lookup(req, [key], pin=True, wait_ms=wait_ms)
                    if not outcome.must_wait or time.monotonic() > deadline:
                        break
                if not outcome.ready_prefix:
                    missing.append(key)
                    continue
                try:
                    slot = outcome.slots[0]
                    if not np.array_equal(self.pool.slot_array(slot), self.block(key)):
                        wrong.append(key)
                finally:
                    self.client.complete_load(req, [key])
        finally:
            self.client.finish_request(req)
        return missing, wrong

    def close(self) -> None:
        self.client.close()
        self.pool.close()

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def settled(status: dict) -> bool:
    """No tier job in flight, no cascade waiting, every worker's index announced."""
    tiering = status["tiering"]
    return (
        tiering["jobs_in_flight"] == 0
        and tiering["cascade_backlog"] == 0
        and all(w["index_complete"] for w in status["workers"].values())
    )


def settle(harness: ServiceHarness, timeout_s: float = 30.0, interval_s: float = 0.005):
    """The first status with ``settled`` (None after ``timeout_s``) and when it was seen
    (``time.perf_counter``)."""
    status = harness.wait_status(settled, timeout_s, interval_s)
    return status, time.perf_counter()
