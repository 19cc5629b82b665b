"""The disk worker's writers and parallel readers: a cascade's keys are written one after another
on its job thread into consecutive records while cascades run at once, a promotion's keys read
at once on its job thread and the reader threads, results and recency stay in job order, and
concurrent cascades, promotions and evictions keep every stored record correct (real files and
a real shared-memory pool)."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvoffload.config import Config, DiskConfig, PoolConfig
from kvoffload.memory.pool import HostPool
from kvoffload.wire.protocol import FaultSpec, Job, JobKind
from tests.workers.disk.jobs import run
from workers.disk.fanout import fan_out
from workers.disk.worker import DiskBackend
from workers.faults import FaultInjector

BLOCK = 16384
RECORD = 4096 + BLOCK
SLOTS = 32


class SlowOps(FaultInjector):
    """Holds every store operation ``op`` for ``hold_s`` and records how many were held at
    once."""

    def __init__(self, op: str, hold_s: float) -> None:
        super().__init__()
        self.op = op
        self.hold_s = hold_s
        self.held = 0
        self.most = 0
        self.order: list[bytes] = []
        self._count_lock = threading.Lock()

    def maybe_fail(self, op: str, key: bytes = b"") -> None:
        if op != self.op:
            return
        with self._count_lock:
            self.held += 1
            self.most = max(self.most, self.held)
            self.order.append(key)
        time.sleep(self.hold_s)
        with self._count_lock:
            self.held -= 1


@pytest.fixture
def start_backend(tmp_path: Path, pool: HostPool):
    started: list[DiskBackend] = []

    def start(
        faults: FaultInjector, capacity_records: int, write_threads: int, read_threads: int = 4
    ) -> DiskBackend:
        cfg = Config(
            pool=PoolConfig(num_slots=SLOTS, block_bytes=BLOCK, layout_id="writers-test"),
            disk=DiskConfig(
                root=str(tmp_path / "disk"),
                capacity_bytes=capacity_records * RECORD,
                write_threads=write_threads,
                read_threads=read_threads,
            ),
        )
        backend = DiskBackend(cfg)
        backend.start(pool, faults)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.close()


def payload_for(key: bytes, version: int) -> bytes:
    """8-byte version, then bytes seeded by (key, version)."""
    seed = int.from_bytes(
        hashlib.blake2b(key + version.to_bytes(8, "little"), digest_size=8).digest(), "little"
    )
    return version.to_bytes(8, "little") + np.random.default_rng(seed).bytes(BLOCK - 8)


def assert_self_consistent(key: bytes, data: bytes) -> None:
    version = int.from_bytes(data[:8], "little")
    assert data == payload_for(key, version), f"bytes of {key!r} are not a version ever written"


def test_cascades_write_their_keys_in_order_into_consecutive_records_while_running_at_once(
    start_backend, pool: HostPool
) -> None:
    faults = SlowOps("write_record", hold_s=0.05)
    backend = start_backend(faults, capacity_records=64, write_threads=2)
    jobs = [[b"c%d-%d" % (job, i) for i in range(6)] for job in range(2)]
    for slot, key in enumerate(itertools.chain(*jobs)):
        pool.slot(slot)[:] = payload_for(key, 1)
    with ThreadPoolExecutor(2) as threads:
        outcomes = list(
            threads.map(
                lambda job: run(
                    backend, JobKind.CASCADE, jobs[job], list(range(job * 6, job * 6 + 6))
                ),
                range(2),
            )
        )
    assert [done.ok_keys for done in outcomes] == jobs and not any(d.error for d in outcomes)
    assert faults.most == 2, f"{faults.most} writes at once, not one per cascade"
    for keys in jobs:
        assert [k for k in faults.order if k in keys] == keys, "a cascade writes in job order"
    store = backend._require_store()
    for keys in jobs:
        records = [store._index.record_of(key) for key in keys]
        first = records[0]
        assert first is not None
        assert records == list(range(first, first + 6)), (
            f"records {records} do not follow each other"
        )
    assert store.keys()[-6:] in jobs, "recency follows job order"
    added, removed = backend.take_index_changes()
    assert sorted(added) == sorted(itertools.chain(*jobs)) and removed == []
    for job, keys in enumerate(jobs):
        dests = list(range(16 + job * 6, 22 + job * 6))
        assert run(backend, JobKind.PROMOTION, keys, dests).ok_keys == keys
        for slot, key in zip(dests, keys, strict=True):
            assert pool.slot(slot).tobytes() == payload_for(key, 1)


def test_a_promotion_reads_its_keys_in_parallel_and_reports_in_job_order(
    start_backend, pool: HostPool
) -> None:
    faults = SlowOps("read", hold_s=0.1)
    backend = start_backend(faults, capacity_records=16, write_threads=2, read_threads=3)
    keys = [b"r-%d" % i for i in range(6)]
    for slot, key in enumerate(keys):
        pool.slot(slot)[:] = payload_for(key, 1)
    assert run(backend, JobKind.CASCADE, keys, list(range(6))).ok_keys == keys
    backend.take_index_changes()
    backend._require_store().delete(keys[4])
    done = run(backend, JobKind.PROMOTION, keys, list(range(8, 14)))
    assert faults.most == 4, f"{faults.most} reads at once, not the job thread and 3 readers"
    assert done.ok_keys == keys[:4] + keys[5:] and done.absent_keys == [keys[4]]
    assert backend.take_index_changes() == ([], [keys[4]])
    for slot, key in enumerate(keys, start=8):
        if key != keys[4]:
            assert pool.slot(slot).tobytes() == payload_for(key, 1)


def test_one_block_promotions_run_inline_unless_the_disk_is_slowed_on_purpose(
    start_backend,
) -> None:
    faults = FaultInjector()
    backend = start_backend(faults, capacity_records=16, write_threads=2)

    def job(kind: JobKind, count: int) -> Job:
        keys = [b"i-%d" % i for i in range(count)]
        return Job(job_id=1, kind=kind, keys=keys, slots=list(range(count)))

    assert backend.runs_inline(job(JobKind.PROMOTION, 1))
    assert not backend.runs_inline(job(JobKind.PROMOTION, 2))
    assert not backend.runs_inline(job(JobKind.CASCADE, 1))
    faults.replace(FaultSpec(delay_s=0.5, delay_fraction=0.1))
    assert not backend.runs_inline(job(JobKind.PROMOTION, 1))


def test_parallel_writers_keep_every_record_correct_under_concurrent_jobs_and_evictions(
    start_backend, pool: HostPool
) -> None:
    capacity = 10
    backend = start_backend(FaultInjector(), capacity_records=capacity, write_threads=4)
    key_space = [b"key-%d" % i for i in range(24)]
    errors: list[BaseException] = []
    versions = itertools.count(1)

    def job_thread(number: int) -> None:
        sources = list(range(number * 8, number * 8 + 4))
        dests = list(range(number * 8 + 4, number * 8 + 8))
        rng = np.random.default_rng(number)
        try:
            for _ in range(15):
                keys = [key_space[i] for i in rng.choice(len(key_space), 4, replace=False)]
                for slot, key in zip(sources, keys, strict=True):
                    pool.slot(slot)[:] = payload_for(key, next(versions))
                done = run(backend, JobKind.CASCADE, keys, sources)
                assert set(done.ok_keys) <= set(keys)
                assert done.ok_keys == [k for k in keys if k in done.ok_keys], "job order"
                done = run(backend, JobKind.PROMOTION, keys, dests)
                for slot, key in zip(dests, keys, strict=True):
                    if key in done.ok_keys:
                        assert_self_consistent(key, pool.slot(slot).tobytes())
                    else:
                        assert "absent" in done.error or "transient" in done.error, done.error
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=job_thread, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    store = backend._require_store()
    stored = store.keys()
    assert 0 < len(stored) <= capacity
    assert store.used_bytes == len(stored) * RECORD <= store.capacity_bytes
    added, removed = backend.take_index_changes()
    assert sorted(added) == sorted(stored)
    assert sorted(removed) == sorted(set(key_space) - set(stored))
    for start in range(0, len(stored), 4):
        keys = stored[start : start + 4]
        dests = list(range(len(keys)))
        assert run(backend, JobKind.PROMOTION, keys, dests).ok_keys == keys
        for slot, key in zip(dests, keys, strict=True):
            assert_self_consistent(key, pool.slot(slot).tobytes())


def test_fan_out_yields_in_order_and_starts_nothing_after_an_error() -> None:
    started: list[int] = []

    def run(index: int) -> int:
        started.append(index)
        time.sleep(0.002 * (index % 4))
        if index == 5:
            raise ValueError("boom")
        return index * index

    with ThreadPoolExecutor(2) as helpers:
        assert list(fan_out(12, lambda i: i * i, helpers, 2)) == [i * i for i in range(12)]
        got: list[int] = []
        with pytest.raises(ValueError):
            for result in fan_out(40, run, helpers, 2):
                got.append(result)
        assert got == [0, 1, 4, 9, 16]
        count = len(started)
        time.sleep(0.05)
        assert len(started) == count < 40
