"""The disk worker: ``DiskBackend`` in process on real files and a real shared-memory pool
(round trip and restart, corruption, transient errors, ENOSPC, capacity eviction, configured
faults), then end to end through ``kvoffload serve`` with a kill -9 of the disk worker."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.config import Config, DiskConfig, PoolConfig
from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    deployment_fingerprint,
)
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.memory.pool import HostPool
from kvoffload.testing.helpers import random_kv_cache, wait_until
from kvoffload.tiering import LookupResult
from kvoffload.wire.protocol import FaultSpec, JobKind
from kvoffload.wire.status import DiskWorkerStats, WorkerStatus
from tests.workers.disk.jobs import run
from workers.backend import Backend
from workers.disk.rawio import probe_direct_io
from workers.disk.worker import DiskBackend
from workers.faults import FaultInjector

BLOCK = 16384
RECORD = 4096 + BLOCK
SLOTS = 32
LAYOUT_ID = "disk-worker-test"
FP = deployment_fingerprint(BLOCK, LAYOUT_ID)


class ScriptedFaults(FaultInjector):
    """Fails chosen (op, key) store operations once each with the given errno."""

    def __init__(self) -> None:
        super().__init__()
        self.once: dict[tuple[str, bytes], int] = {}

    def maybe_fail(self, op: str, key: bytes = b"") -> None:
        code = self.once.pop((op, key), None)
        if code is not None:
            raise OSError(code, f"scripted {op} failure")


@pytest.fixture
def start_backend(tmp_path: Path, pool: HostPool):
    """Factory: a started DiskBackend on ``tmp_path/"disk"`` (closed at teardown)."""
    started: list[DiskBackend] = []

    def start(
        faults: FaultInjector | None = None, capacity_records: int = 64, **disk: Any
    ) -> DiskBackend:
        cfg = Config(
            pool=PoolConfig(num_slots=SLOTS, block_bytes=BLOCK, layout_id=LAYOUT_ID),
            disk=DiskConfig(
                root=str(tmp_path / "disk"), capacity_bytes=capacity_records * RECORD, **disk
            ),
        )
        backend = DiskBackend(cfg)
        backend.start(pool, faults or FaultInjector())
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.close()


def fill(pool: HostPool, slots, seed: int) -> list[bytes]:
    """Random bytes into ``slots``; returns what each slot now holds."""
    rng = np.random.default_rng(seed)
    out = []
    for slot in slots:
        pool.slot_array(slot)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)
        out.append(pool.slot(slot).tobytes())
    return out


def slot_bytes(pool: HostPool, slots) -> list[bytes]:
    return [pool.slot(s).tobytes() for s in slots]


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def find_payload(root: Path, key: bytes) -> tuple[Path, int]:
    """(slab file, offset of the payload) of ``key``'s record, found by decoding headers."""
    for path in sorted((root / FP.hex()).glob("slab-*.kvs")):
        raw = path.read_bytes()
        for offset in range(0, len(raw), RECORD):
            try:
                header = decode_header(raw[offset : offset + HEADER_SIZE], FP)
            except CorruptBlock:
                continue
            if header.key == key:
                return path, offset + 4096
    raise AssertionError(f"no record for {key!r}")


def test_backend_protocol_cascade_promote_and_restart(
    start_backend, pool: HostPool, tmp_path: Path
) -> None:
    backend = start_backend()
    assert isinstance(backend, Backend) and backend.capabilities == [
        JobKind.PROMOTION,
        JobKind.CASCADE,
        JobKind.DELETE,
    ]
    keys = keys_of("k", 8)
    originals = fill(pool, range(8), seed=1)
    done = run(backend, JobKind.CASCADE, keys, list(range(8)))
    assert done.ok_keys == keys and done.nbytes == 8 * BLOCK and not done.error
    assert slot_bytes(pool, range(8)) == originals  # a cascade only reads its slots
    assert backend.take_index_changes() == (keys, [])
    assert backend.take_index_changes() == ([], [])

    untouched = fill(pool, range(16, SLOTS), seed=2)
    done = run(backend, JobKind.PROMOTION, keys, list(range(8, 16)))
    assert done.ok_keys == keys and done.nbytes == 8 * BLOCK
    assert slot_bytes(pool, range(8, 16)) == originals
    assert slot_bytes(pool, range(16, SLOTS)) == untouched  # only the job's slots are written
    stats = backend.stats()
    assert stats.used_bytes == 8 * RECORD and stats.capacity_bytes == 64 * RECORD
    assert stats.bytes_written == stats.bytes_read == 8 * BLOCK and stats.degraded is False
    backend.close()

    restarted = start_backend()
    batches = list(restarted.initial_index())
    assert sorted(k for batch in batches for k in batch) == sorted(keys)
    assert restarted.take_index_changes() == ([], [])
    fill(pool, range(16, 24), seed=3)
    done = run(restarted, JobKind.PROMOTION, keys, list(range(16, 24)))
    assert done.ok_keys == keys
    assert slot_bytes(pool, range(16, 24)) == originals


def test_a_delete_job_removes_its_keys_and_counts_those_the_store_held(
    start_backend, pool: HostPool
) -> None:
    backend = start_backend()
    keys = keys_of("d", 4)
    fill(pool, range(4), seed=4)
    run(backend, JobKind.CASCADE, keys, list(range(4)))
    backend.take_index_changes()
    done = run(backend, JobKind.DELETE, [*keys[:2], b"never-stored"], [])
    assert done.ok_keys == [*keys[:2], b"never-stored"] and done.removed == 2
    assert backend.take_index_changes() == ([], [*keys[:2], b"never-stored"])
    assert sorted(k for batch in backend.initial_index() for k in batch) == sorted(keys[2:])
    assert backend.stats().keys_deleted == 2


@pytest.mark.parametrize("io", ["auto", "direct", "buffered"])
def test_the_io_setting_chooses_direct_or_buffered_io(
    start_backend, pool: HostPool, tmp_path: Path, io: str
) -> None:
    (tmp_path / "probe").mkdir()
    supported = probe_direct_io(tmp_path / "probe")
    if io == "direct" and not supported:
        with pytest.raises(OSError):
            start_backend(io=io)
        return
    backend = start_backend(io=io)
    stats = backend.stats()
    assert isinstance(stats, DiskWorkerStats)
    assert stats.direct_io == (supported and io != "buffered")
    keys = keys_of("io", 2)
    written = fill(pool, [0, 1], seed=5)
    assert run(backend, JobKind.CASCADE, keys, [0, 1]).ok_keys == keys
    pool.slot_array(0)[:] = 0
    pool.slot_array(1)[:] = 0
    assert run(backend, JobKind.PROMOTION, keys, [0, 1]).ok_keys == keys
    assert slot_bytes(pool, [0, 1]) == written


def test_corrupt_and_torn_copies_fail_and_are_removed_transient_keeps(
    start_backend, pool: HostPool, tmp_path: Path
) -> None:
    faults = ScriptedFaults()
    backend = start_backend(faults)
    keys = keys_of("c", 3)
    originals = fill(pool, range(3), seed=4)
    assert run(backend, JobKind.CASCADE, keys, [0, 1, 2]).ok_keys == keys
    backend.take_index_changes()
    path, payload = find_payload(tmp_path / "disk", keys[1])
    with open(path, "r+b") as f:
        f.seek(payload + 777)
        byte = f.read(1)
        f.seek(payload + 777)
        f.write(bytes([byte[0] ^ 0x10]))
    path, payload = find_payload(tmp_path / "disk", keys[2])
    with open(path, "r+b") as f:
        f.seek(payload + BLOCK // 2)
        f.write(os.urandom(BLOCK // 2))

    done = run(backend, JobKind.PROMOTION, keys, [8, 9, 10])
    assert done.ok_keys == [keys[0]] and done.nbytes == BLOCK and "corrupt" in done.error
    assert done.absent_keys == [keys[1], keys[2]]
    assert pool.slot(8).tobytes() == originals[0]
    assert backend.take_index_changes() == ([], [keys[1], keys[2]])
    assert backend.stats().corrupt_blocks == 2
    done = run(backend, JobKind.PROMOTION, [keys[1]], [9])
    assert done.ok_keys == [] and "absent" in done.error and done.absent_keys == [keys[1]]
    assert backend.take_index_changes() == ([], [keys[1]])

    faults.once[("read", keys[0])] = errno.EIO
    fill(pool, [11], seed=5)
    done = run(backend, JobKind.PROMOTION, [keys[0]], [11])
    assert done.ok_keys == [] and "transient" in done.error and done.absent_keys == []
    assert backend.take_index_changes() == ([], [])
    assert backend.stats().transient_errors == 1
    done = run(backend, JobKind.PROMOTION, [keys[0]], [11])
    assert done.ok_keys == [keys[0]] and pool.slot(11).tobytes() == originals[0]


def test_enospc_fails_keys_and_degrades_until_a_put_succeeds(start_backend, pool: HostPool) -> None:
    faults = ScriptedFaults()
    backend = start_backend(faults)
    keys = keys_of("s", 2)
    originals = fill(pool, [0, 1], seed=6)
    for key in keys:
        faults.once[("write_record", key)] = errno.ENOSPC
    done = run(backend, JobKind.CASCADE, keys, [0, 1])
    assert done.ok_keys == [] and "no_space" in done.error
    assert done.full_keys == keys, "keys refused for lack of room are reported as such"
    assert backend.degraded is True
    stats = backend.stats()
    assert stats.degraded is True and stats.enospc_errors == 2 and stats.used_bytes == 0
    added, removed = backend.take_index_changes()
    assert added == [] and sorted(removed) == sorted(keys)

    done = run(backend, JobKind.CASCADE, keys, [0, 1])
    assert done.ok_keys == keys and backend.degraded is False and backend.stats().degraded is False
    assert backend.take_index_changes() == (keys, [])
    assert run(backend, JobKind.PROMOTION, keys, [2, 3]).ok_keys == keys
    assert slot_bytes(pool, [2, 3]) == originals


def test_capacity_eviction_reports_removed_keys(start_backend, pool: HostPool) -> None:
    backend = start_backend(capacity_records=8)
    first = keys_of("e", 8)
    fill(pool, range(8), seed=7)
    assert run(backend, JobKind.CASCADE, first, list(range(8))).ok_keys == first
    assert backend.take_index_changes() == (first, [])
    backend.touch([first[0]])
    more = keys_of("f", 3)
    originals = fill(pool, range(8, 11), seed=8)
    assert run(backend, JobKind.CASCADE, more, [8, 9, 10]).ok_keys == more
    added, removed = backend.take_index_changes()
    assert sorted(added) == sorted(more) and sorted(removed) == sorted(first[1:4])
    assert backend.stats().keys_evicted == 3
    stats = backend.stats()
    assert stats.used_bytes <= stats.capacity_bytes == 8 * RECORD
    done = run(backend, JobKind.PROMOTION, [first[1], first[0], more[2]], [12, 13, 14])
    assert done.ok_keys == [first[0], more[2]]
    assert pool.slot(14).tobytes() == originals[2]
    assert backend.take_index_changes() == ([], [first[1]])


def test_a_failed_put_still_reports_the_key_it_evicted(start_backend, pool: HostPool) -> None:
    faults = ScriptedFaults()
    backend = start_backend(faults, capacity_records=2)
    first = keys_of("v", 2)
    fill(pool, range(3), seed=9)
    assert run(backend, JobKind.CASCADE, first, [0, 1]).ok_keys == first
    backend.take_index_changes()
    late = keys_of("w", 1)
    faults.once[("write_record", late[0])] = errno.EIO
    done = run(backend, JobKind.CASCADE, late, [2])
    assert done.ok_keys == [] and done.full_keys == [] and "write_error" in done.error
    added, removed = backend.take_index_changes()
    assert added == [] and sorted(removed) == sorted([first[0], late[0]]), "the victim is gone too"
    assert backend.stats().keys_evicted == 1


def test_configured_corruption_and_failures(start_backend, pool: HostPool) -> None:
    faults = FaultInjector(FaultSpec(corrupt_fraction=1.0))
    backend = start_backend(faults)
    key = b"corrupted-on-purpose"
    original = fill(pool, [0], seed=9)[0]
    assert run(backend, JobKind.CASCADE, [key], [0]).ok_keys == [key]
    assert pool.slot(0).tobytes() == original  # the pool slot is never the one corrupted
    assert backend.take_index_changes() == ([key], [])
    done = run(backend, JobKind.PROMOTION, [key], [1])
    assert done.ok_keys == [] and "corrupt" in done.error
    assert backend.take_index_changes() == ([], [key])

    faults.replace(FaultSpec(fail_fraction=1.0))
    done = run(backend, JobKind.CASCADE, [key], [0])
    assert done.ok_keys == [] and "write_error" in done.error and not backend.degraded
    faults.replace(FaultSpec(enospc_fraction=1.0))
    done = run(backend, JobKind.CASCADE, [key], [0])
    assert done.ok_keys == [] and "no_space" in done.error and backend.degraded
    assert backend.stats().enospc_errors == 1
    faults.replace(FaultSpec())
    assert run(backend, JobKind.CASCADE, [key], [0]).ok_keys == [key] and not backend.degraded
    assert (
        run(backend, JobKind.PROMOTION, [key], [1]).ok_keys == [key]
        and pool.slot(1).tobytes() == original
    )


# ---- end to end ------------------------------------------------------------------------------

SERVICE_BLOCK = 65536


def disk_indexed(service) -> int:
    return service.status().tiering.tiers["disk"].indexed_keys


def disk_worker_after(service, promoted: int) -> WorkerStatus | None:
    """The disk worker's status once its heartbeat counts ``promoted`` promoted keys."""
    disk = service.status().workers["disk"]
    medium = disk.stats.medium
    return (
        disk if isinstance(medium, DiskWorkerStats) and medium.keys_promoted >= promoted else None
    )


def clear_blocks(kv: SharedKVCache, blocks: list[int]) -> None:
    for tensor in kv.tensors:
        tensor[blocks] = 0


def promote_and_load(
    client, kv: SharedKVCache, req: str, keys: list[bytes], blocks: list[int]
) -> None:
    """A fresh request finds ``keys`` only on disk (HIT_PENDING), waits for HIT, loads them."""
    clear_blocks(kv, blocks)
    client.new_request(req)
    first = client.lookup(req, keys)
    assert first.results == [LookupResult.HIT_PENDING] * len(keys), first

    def all_hit():
        client.end_step()
        outcome = client.lookup(req, keys)
        assert set(outcome.results) <= {LookupResult.HIT, LookupResult.HIT_PENDING}, outcome
        return outcome.results == [LookupResult.HIT] * len(keys)

    wait_until(all_hit, what="promotions from disk")
    accepted = client.load(req, keys, blocks, "kv")
    assert client.wait([accepted.job_id])[accepted.job_id].success
    client.finish_request(req)


def test_end_to_end_through_the_service_with_worker_kill(start_service) -> None:  # noqa: F811
    service = start_service(workers=("cpu", "disk"))
    kv = random_kv_cache(32, [SERVICE_BLOCK // 2, SERVICE_BLOCK // 2], seed=10)
    try:
        keys = [f"disk-e2e-{i}".encode().ljust(16, b".") for i in range(8)]
        originals = [kv.block(i) for i in range(8)]
        with service.client("engine") as c:
            c.register_kv(kv.handle("kv"))
            c.new_request("writer")
            accepted = c.store("writer", keys, list(range(8)), "kv")
            assert c.wait([accepted.job_id])[accepted.job_id].success
            c.finish_request("writer")
            wait_until(lambda: disk_indexed(service) == 8, what="cascade to disk")
            c.reset_cache()
            promote_and_load(c, kv, "reader-1", keys, list(range(16, 24)))
            assert [kv.block(b) for b in range(16, 24)] == originals
            disk = wait_until(lambda: disk_worker_after(service, 8), what="disk stats")
            assert disk.stats.medium.used_bytes >= 8 * SERVICE_BLOCK and not disk.degraded

            old_pid = disk.pid
            os.kill(old_pid, signal.SIGKILL)
            service.wait_workers(["disk"], exclude_pids=[old_pid])
            wait_until(lambda: disk_indexed(service) == 8, what="re-announced disk index")
            c.reset_cache()
            promote_and_load(c, kv, "reader-2", keys, list(range(24, 32)))
            assert [kv.block(b) for b in range(24, 32)] == originals
    finally:
        kv.close()
        kv.unlink()
    assert service.stop().exit_code == 0
    assert not [
        n for n in os.listdir("/dev/shm") if service.run_id in n or kv.name.lstrip("/") in n
    ]
