"""Workers stamp slot headers only for bytes they completely wrote, and the cpu worker's verify
job accepts a slot only when its header names the key and matches its bytes (in process)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from kvoffload.config import Config, DiskConfig, PoolConfig
from kvoffload.memory.blockformat import deployment_fingerprint, payload_checksum
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.memory.slottable import SlotTable
from kvoffload.wire.protocol import Job, JobKind
from workers.cpu import CpuBackend
from workers.disk.worker import DiskBackend
from workers.faults import FaultInjector
from workers.slotheaders import SlotHeaders

ROW = 32 * 1024
BLOCK = 2 * ROW
SLOTS = 8
LAYOUT = "slot-header-test"
FP = deployment_fingerprint(BLOCK, LAYOUT)


def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + bytes([i]) * 15 for i in range(n)]


@pytest.fixture
def table():
    t = SlotTable.create(f"/kvoffload-shtest-{uuid.uuid4().hex[:12]}", SLOTS)
    yield t
    t.close()
    t.unlink()


@pytest.fixture
def cpu(make_pool, table):
    pool = make_pool(SLOTS, BLOCK)
    cache = SharedKVCache.create(None, 4, [ROW, ROW])
    rng = np.random.default_rng(3)
    for rows in cache.tensors:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    backend = CpuBackend()
    backend.use_slot_headers(SlotHeaders(SlotTable.attach(table.name, SLOTS), pool, FP))
    backend.start(pool, FaultInjector())
    backend.attach_kv(cache.handle("h"))
    yield backend, pool
    backend.close()
    cache.close()
    cache.unlink()


def store(backend: CpuBackend, job_id: int, keys: list[bytes], slots: list[int], blocks: list[int]):
    job = Job(
        job_id=job_id,
        kind=JobKind.DEVICE_STORE,
        keys=keys,
        slots=slots,
        device_blocks=blocks,
        handle_id="h",
    )
    outcome = backend.run_job(job)
    outcome.release()
    return outcome


def verify(backend: CpuBackend, keys: list[bytes], slots: list[int]) -> list[bytes]:
    return backend.run_job(Job(job_id=99, kind=JobKind.VERIFY, keys=keys, slots=slots)).ok_keys


def test_device_store_stamps_each_copied_slot_and_verify_accepts_it(cpu, table):
    backend, pool = cpu
    keys = keys_of(3)
    assert store(backend, 41, keys, [5, 0, 2], [0, 1, 9]).ok_keys == keys[:2], (
        "block 9 is out of range"
    )
    stamped = dict(table.read_all(FP))
    assert sorted(stamped) == [0, 5], "a failed copy must not be stamped"
    assert stamped[5].key == keys[0] and stamped[5].generation == 41
    assert stamped[5].checksum == payload_checksum(pool.slot_array(5))
    assert verify(backend, keys[:2], [5, 0]) == keys[:2]


def test_verify_rejects_a_changed_byte_another_key_and_an_unstamped_slot(cpu):
    backend, pool = cpu
    keys = keys_of(3)
    assert store(backend, 7, keys, [1, 2, 3], [0, 1, 2]).ok_keys == keys
    pool.slot_array(2)[1234] ^= 0x01
    wrong_key = b"x" * 16
    assert verify(backend, [keys[0], keys[1], wrong_key, keys[2]], [1, 2, 3, 4]) == [keys[0]]
    stats = backend.stats()
    assert (stats.slots_verified, stats.slots_verify_failed) == (1, 3)


def test_verify_without_slot_headers_accepts_nothing(make_pool):
    backend = CpuBackend()
    backend.start(make_pool(SLOTS, BLOCK), FaultInjector())
    outcome = backend.run_job(Job(job_id=1, kind=JobKind.VERIFY, keys=keys_of(1), slots=[0]))
    assert outcome.ok_keys == [] and outcome.error
    backend.close()


def test_disk_promotion_stamps_the_slot_with_the_verified_checksum(
    make_pool, table, tmp_path: Path
):
    pool = make_pool(SLOTS, BLOCK)
    cfg = Config(
        pool=PoolConfig(num_slots=SLOTS, block_bytes=BLOCK, layout_id=LAYOUT),
        disk=DiskConfig(root=str(tmp_path / "disk"), capacity_bytes=16 * (BLOCK + 4096)),
    )
    backend = DiskBackend(cfg)
    backend.use_slot_headers(SlotHeaders(SlotTable.attach(table.name, SLOTS), pool, FP))
    backend.start(pool, FaultInjector())
    try:
        key, absent = keys_of(2, b"d")
        pool.slot_array(0)[:] = np.random.default_rng(5).integers(0, 256, BLOCK, dtype=np.uint8)
        assert backend.run_job(
            Job(job_id=1, kind=JobKind.CASCADE, keys=[key], slots=[0])
        ).ok_keys == [key]
        assert table.read_all(FP) == [], "a cascade only reads its slot"
        outcome = backend.run_job(
            Job(job_id=77, kind=JobKind.PROMOTION, keys=[key, absent], slots=[3, 4])
        )
        assert outcome.ok_keys == [key]
        [(slot, header)] = table.read_all(FP)
        assert (slot, header.key, header.generation) == (3, key, 77)
        assert (
            header.checksum
            == payload_checksum(pool.slot_array(3))
            == payload_checksum(pool.slot_array(0))
        )
    finally:
        backend.close()


def test_disk_cascade_stores_the_stamped_checksum_so_later_changes_are_caught(
    make_pool, table, tmp_path: Path
):
    """A cascade writes the checksum its slot was stamped with when the bytes landed, not one of
    the bytes as they are now: a block whose slot changed in between is never served back."""
    pool = make_pool(SLOTS, BLOCK)
    cfg = Config(
        pool=PoolConfig(num_slots=SLOTS, block_bytes=BLOCK, layout_id=LAYOUT),
        disk=DiskConfig(root=str(tmp_path / "disk"), capacity_bytes=16 * (BLOCK + 4096)),
    )
    headers = SlotHeaders(SlotTable.attach(table.name, SLOTS), pool, FP)
    backend = DiskBackend(cfg)
    backend.use_slot_headers(headers)
    backend.start(pool, FaultInjector())
    try:
        stamped, changed, unstamped = keys_of(3, b"e")
        rng = np.random.default_rng(9)
        for slot in (0, 1, 2):
            pool.slot_array(slot)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)
        headers.stamp(0, stamped, 1)
        headers.stamp(1, changed, 1)
        pool.slot_array(1)[7] ^= 0xFF  # the slot's bytes change after they were stamped
        cascade = Job(
            job_id=2, kind=JobKind.CASCADE, keys=[stamped, changed, unstamped], slots=[0, 1, 2]
        )
        assert backend.run_job(cascade).ok_keys == [stamped, changed, unstamped]
        wanted = [payload_checksum(pool.slot_array(s)) for s in (0, 2)]
        outcome = backend.run_job(
            Job(
                job_id=3,
                kind=JobKind.PROMOTION,
                keys=[stamped, changed, unstamped],
                slots=[4, 5, 6],
            )
        )
        assert outcome.ok_keys == [stamped, unstamped]
        assert outcome.absent_keys == [changed], "the changed block is dropped as corrupt"
        assert [payload_checksum(pool.slot_array(s)) for s in (4, 6)] == wanted
    finally:
        backend.close()
