"""The cpu worker: device <-> pool copies in-process, then the real ``python -m workers.cpu``
process against a fake manager (copies, partial success, kill -9 and restart, CUDA IPC)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

import torch  # noqa: E402

from kvoffload.memory.cuda_host import cuda_device_count  # noqa: E402
from kvoffload.memory.kvcache import SharedKVCache  # noqa: E402
from kvoffload.testing.helpers import REPO_ROOT  # noqa: E402
from kvoffload.wire.protocol import (  # noqa: E402
    AttachKV,
    CudaIpcFields,
    DetachKV,
    FaultSpec,
    Heartbeat,
    IndexUpdate,
    Job,
    JobDone,
    KVHandle,
    TensorSpec,
)
from kvoffload.wire.status import CpuWorkerStats  # noqa: E402
from tests.workers.conftest import write_spec  # noqa: E402
from workers.backend import AttachRefused  # noqa: E402
from workers.cpu import UNKNOWN_HANDLE, CpuBackend  # noqa: E402
from workers.faults import FaultInjector  # noqa: E402

KiB = 1024
ROW = 64 * KiB
BLOCK = 2 * ROW
IDENTITY = b"cpu"


def fill_random(cache: SharedKVCache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for rows in cache.tensors:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)


@pytest.fixture
def kv_cache():
    cache = SharedKVCache.create(None, 16, [ROW, ROW])
    fill_random(cache, 1)
    yield cache
    cache.close()
    cache.unlink()


@pytest.fixture
def backend(make_pool, kv_cache):
    pool = make_pool(8, BLOCK)
    cpu = CpuBackend()
    cpu.start(pool, FaultInjector())
    cpu.attach_kv(kv_cache.handle("h"))
    yield cpu, pool
    cpu.close()


def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + bytes([i]) * 15 for i in range(n)]


def device_job(
    job_id: int, kind: str, slots: list[int], blocks: list[int], handle_id: str = "h"
) -> Job:
    return Job(
        job_id=job_id,
        kind=kind,
        keys=keys_of(len(slots)),
        slots=slots,
        device_blocks=blocks,
        handle_id=handle_id,
    )


# ---- in-process copies -------------------------------------------------------------------------


def test_device_store_writes_concatenated_rows_into_slots(backend, kv_cache):
    cpu, pool = backend
    job = device_job(1, "device_store", slots=[2, 5, 0, 7], blocks=[3, 0, 9, 15])
    outcome = cpu.run_job(job)
    assert outcome.ok_keys == job.keys and outcome.error == ""
    assert outcome.nbytes == 4 * BLOCK
    outcome.release()
    for slot, block in zip(job.slots, job.device_blocks, strict=True):
        assert pool.slot_array(slot).tobytes() == kv_cache.block(block)
    assert not pool.slot_array(1).any()


def test_device_load_copies_slots_into_other_blocks(backend, kv_cache):
    cpu, pool = backend
    cpu.run_job(device_job(1, "device_store", slots=[0, 1, 2], blocks=[4, 5, 6])).release()
    expected = [kv_cache.block(b) for b in (4, 5, 6)]
    outcome = cpu.run_job(device_job(2, "device_load", slots=[0, 1, 2], blocks=[10, 12, 11]))
    outcome.release()
    assert outcome.ok_keys == keys_of(3)
    assert [kv_cache.block(b) for b in (10, 12, 11)] == expected
    assert kv_cache.block(13) != expected[0]


def test_bad_device_block_fails_only_that_key(backend, kv_cache):
    cpu, pool = backend
    job = device_job(1, "device_store", slots=[0, 1, 2, 3], blocks=[1, 16, -1, 2])
    outcome = cpu.run_job(job)
    outcome.release()
    assert outcome.ok_keys == [job.keys[0], job.keys[3]]
    assert outcome.nbytes == 2 * BLOCK
    assert outcome.error.startswith("2 of 4 keys failed")
    assert pool.slot_array(0).tobytes() == kv_cache.block(1)
    assert pool.slot_array(3).tobytes() == kv_cache.block(2)
    assert not pool.slot_array(1).any() and not pool.slot_array(2).any()


def test_unknown_handle_fails_the_job(backend):
    cpu, pool = backend
    outcome = cpu.run_job(device_job(1, "device_load", slots=[0], blocks=[0], handle_id="nope"))
    assert outcome.ok_keys == [] and outcome.error == UNKNOWN_HANDLE and outcome.release is None


def test_attach_refuses_a_geometry_mismatch(backend, kv_cache):
    cpu, pool = backend
    wrong = KVHandle(
        handle_id="w",
        kind="shm",
        num_blocks=16,
        tensors=[TensorSpec(row_bytes=ROW)],
        shm_name=kv_cache.name,
    )
    with pytest.raises(AttachRefused, match="pool's blocks"):
        cpu.attach_kv(wrong)
    with pytest.raises(AttachRefused):
        cpu.attach_kv(
            KVHandle(
                handle_id="x", kind="rdma", num_blocks=16, tensors=kv_cache.handle("x").tensors
            )
        )
    missing = kv_cache.handle("m")
    missing.shm_name = "/kvoffload-kv-missing"
    with pytest.raises(AttachRefused):
        cpu.attach_kv(missing)
    for handle_id in ("w", "x", "m"):
        assert (
            cpu.run_job(device_job(1, "device_store", [0], [0], handle_id)).error == UNKNOWN_HANDLE
        )


def test_detach_unmaps_only_after_the_holding_job_is_released(backend):
    cpu, pool = backend
    attached = cpu._handles["h"]
    outcome = cpu.run_job(device_job(1, "device_store", slots=[0], blocks=[0]))
    cpu.detach_kv("h")
    assert not attached._cache.closed
    assert cpu.run_job(device_job(2, "device_store", [1], [1])).error == UNKNOWN_HANDLE
    outcome.release()
    outcome.release()  # a retried release is a no-op
    assert attached._cache.closed
    assert cpu.stats().kv_handles == 0


def test_injected_faults_fail_keys(make_pool, kv_cache):
    pool = make_pool(4, BLOCK)
    cpu = CpuBackend()
    cpu.start(pool, FaultInjector(FaultSpec(fail_fraction=0.5, seed=3)))
    cpu.attach_kv(kv_cache.handle("h"))
    try:
        outcome = cpu.run_job(device_job(1, "device_store", [0, 1, 2, 3] * 4, list(range(16))))
        outcome.release()
        assert 0 < len(outcome.ok_keys) < 16
        assert cpu.stats().keys_failed == 16 - len(outcome.ok_keys)
    finally:
        cpu.close()


# ---- the worker process ------------------------------------------------------------------------


def start_cpu_worker(manager, spawn, short_dir, pool, config=None):
    worker = spawn("workers.cpu", write_spec(short_dir, manager.endpoint, pool, config))
    identity, hello = manager.accept_hello()
    assert identity == IDENTITY and hello.pid == worker.pid
    manager.wait_for(IndexUpdate, lambda m: m.complete and not m.added)
    return worker, hello


def test_cpu_worker_process_store_load_and_partial(manager, make_pool, spawn, short_dir, kv_cache):
    pool = make_pool(8, BLOCK)
    worker, hello = start_cpu_worker(manager, spawn, short_dir, pool)
    assert hello.worker == "cpu" and hello.medium == "device"
    assert {"device_store", "device_load", "shm"} <= set(hello.capabilities)

    manager.send(IDENTITY, AttachKV(handle=kv_cache.handle("h")))
    manager.send(IDENTITY, device_job(1, "device_store", slots=[0, 1, 2, 3], blocks=[8, 9, 10, 11]))
    done = manager.wait_job_dones([1])[1]
    assert done.success and done.nbytes == 4 * BLOCK and done.transfer_s > 0
    assert [pool.slot_array(s).tobytes() for s in range(4)] == [
        kv_cache.block(b) for b in (8, 9, 10, 11)
    ]

    expected = [kv_cache.block(b) for b in (8, 9, 10, 11)]
    manager.send(IDENTITY, device_job(2, "device_load", slots=[0, 1, 2, 3], blocks=[0, 1, 99, 3]))
    done = manager.wait_job_dones([2])[2]
    assert not done.success and done.successful_keys == [keys_of(4)[i] for i in (0, 1, 3)]
    assert [kv_cache.block(b) for b in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]

    wrong = KVHandle(
        handle_id="w",
        kind="shm",
        num_blocks=16,
        tensors=[TensorSpec(row_bytes=ROW)],
        shm_name=kv_cache.name,
    )
    manager.send(IDENTITY, AttachKV(handle=wrong))
    manager.send(IDENTITY, device_job(3, "device_store", [4], [0], handle_id="w"))
    manager.send(IDENTITY, DetachKV(handle_id="h"))
    manager.send(IDENTITY, device_job(4, "device_store", [4], [0], handle_id="h"))
    dones = manager.wait_job_dones([3, 4])
    assert dones[3].error == UNKNOWN_HANDLE and dones[4].error == UNKNOWN_HANDLE
    assert [
        e["handle_id"] for e in worker.log_events() if e.get("event") == "kv_attach_refused"
    ] == ["w"]

    heartbeat = manager.wait_for(
        Heartbeat,
        lambda m: isinstance(m.stats.medium, CpuWorkerStats) and m.stats.medium.bytes_loaded > 0,
    )
    assert isinstance(heartbeat.stats.medium, CpuWorkerStats)
    assert heartbeat.stats.medium.bytes_stored == 4 * BLOCK
    assert heartbeat.stats.medium.bytes_loaded == 3 * BLOCK
    maps = Path(f"/proc/{worker.pid}/maps").read_text()
    assert "libtorch" not in maps, "the cpu worker loaded torch without a cuda_ipc handle"


def test_kill_9_mid_batch_then_a_restarted_worker_uses_the_same_pool(
    manager, make_pool, spawn, short_dir
):
    row = 512 * KiB
    pool = make_pool(32, 2 * row)
    with SharedKVCache.create(None, 64, [row, row]) as cache:
        fill_random(cache, 2)
        worker, first = start_cpu_worker(manager, spawn, short_dir, pool)
        manager.send(IDENTITY, AttachKV(handle=cache.handle("big")))
        jobs = 100
        for job_id in range(jobs):
            blocks = [(job_id + i) % 64 for i in range(32)]
            manager.send(
                IDENTITY, device_job(job_id, "device_store", list(range(32)), blocks, "big")
            )
        manager.wait_for(JobDone)
        worker.proc.send_signal(signal.SIGKILL)
        assert worker.wait() == -signal.SIGKILL
        manager.pump(0.2)
        assert len(manager.job_dones()) < jobs

        restarted, second = start_cpu_worker(manager, spawn, short_dir, pool)
        assert second.pid != first.pid
        manager.send(IDENTITY, AttachKV(handle=cache.handle("big")))
        manager.send(IDENTITY, device_job(1000, "device_store", [0, 31], [40, 41], "big"))
        assert manager.wait_job_dones([1000])[1000].success
        assert pool.slot_array(0).tobytes() == cache.block(40)
        assert pool.slot_array(31).tobytes() == cache.block(41)


def fake_cuda_handle(handle_id: str, blocks: int = 16) -> KVHandle:
    """A well-formed cuda_ipc handle whose IPC memory handles name nothing."""
    ipc = {
        "size": [blocks, ROW // 2],
        "stride": [ROW // 2, 1],
        "tensor_offset": 0,
        "dtype": "torch.float16",
        "device": 0,
        "handle": b"\x01" * 64,
        "storage_size_bytes": blocks * ROW,
        "storage_offset_bytes": 0,
        "ref_counter_handle": b"\x02" * 16,
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
    }
    return KVHandle(
        handle_id, "cuda_ipc", blocks, [TensorSpec(row_bytes=ROW, ipc=CudaIpcFields(**ipc))] * 2
    )


@pytest.mark.skipif(cuda_device_count() > 0, reason="needs a machine without a CUDA device")
def test_a_cuda_handle_without_cuda_is_refused_at_once_and_heartbeats_never_stop(
    manager, make_pool, spawn, short_dir
):
    pool = make_pool(8, BLOCK)
    worker, hello = start_cpu_worker(manager, spawn, short_dir, pool)
    assert "cuda_ipc" not in hello.capabilities, "a worker without a CUDA device offers cuda_ipc"
    manager.wait_for(Heartbeat)
    sent_at = time.monotonic()
    for job_id in range(3):
        manager.send(IDENTITY, AttachKV(handle=fake_cuda_handle("gpu")))
        manager.send(IDENTITY, device_job(job_id, "device_store", [0], [0], "gpu"))
    beats = heartbeat_arrivals(manager, 2.0)
    dones = manager.wait_job_dones([0, 1, 2], timeout_s=5)
    assert all(d.error == UNKNOWN_HANDLE for d in dones.values())
    gaps = [
        b - a for a, b in zip([sent_at, *beats], beats, strict=False)
    ]  # each beat after the one before
    assert len(beats) >= 10 and max(gaps) < 0.5, f"heartbeat gaps {gaps}"
    refused = [e for e in worker.log_events() if e.get("event") == "kv_attach_refused"]
    assert len(refused) == 3 and "no CUDA device" in refused[0]["error"]
    assert "libtorch" not in Path(f"/proc/{worker.pid}/maps").read_text()


def heartbeat_arrivals(manager, seconds: float) -> list[float]:
    """Arrival times of the heartbeats the fake manager receives during ``seconds``."""
    arrivals: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = len(manager.messages(Heartbeat))
        manager.pump(0.01)
        arrivals += [time.monotonic()] * (len(manager.messages(Heartbeat)) - before)
    return arrivals


CUDA_PRODUCER = textwrap.dedent(
    """
    import sys, time, torch, msgspec
    from kvoffload.memory.kvcache import cuda_kv_handle
    torch.manual_seed(0)
    k = torch.randint(-100, 100, (16, 8, 4096), dtype=torch.int16, device="cuda")
    v = torch.randn(16, 128, 256, dtype=torch.float16, device="cuda")
    handle = cuda_kv_handle("gpu", [k, v])
    sys.stdout.buffer.write(msgspec.json.encode(handle) + b"\\n"); sys.stdout.flush()
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "dump":
            b = int(cmd[1])
            row = torch.cat([t[b].reshape(-1).view(torch.uint8) for t in (k, v)])
            sys.stdout.write(row.cpu().numpy().tobytes().hex() + "\\n"); sys.stdout.flush()
        elif cmd[0] == "quit":
            break
    """
)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_store_and_load(manager, make_pool, spawn, short_dir):
    """The engine (a separate producer process: CUDA IPC cannot open a handle in its own
    process) shares two CUDA tensors; the cpu worker copies blocks to the pool and back."""
    import msgspec

    pool = make_pool(8, BLOCK)
    producer = subprocess.Popen(
        [sys.executable, "-c", CUDA_PRODUCER],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        handle = msgspec.json.decode(producer.stdout.readline(), type=KVHandle)
        assert [t.row_bytes for t in handle.tensors] == [ROW, ROW]

        def device_block(b: int) -> bytes:
            producer.stdin.write(f"dump {b}\n")
            producer.stdin.flush()
            return bytes.fromhex(producer.stdout.readline().strip())

        worker, hello = start_cpu_worker(manager, spawn, short_dir, pool)
        assert "cuda_ipc" in hello.capabilities
        manager.send(IDENTITY, AttachKV(handle=handle))
        manager.send(IDENTITY, device_job(1, "device_store", [0, 1, 2], [3, 7, 15], "gpu"))
        assert manager.wait_job_dones([1], timeout_s=60)[1].success
        assert [pool.slot_array(s).tobytes() for s in range(3)] == [
            device_block(b) for b in (3, 7, 15)
        ]

        manager.send(IDENTITY, device_job(2, "device_load", [0, 1, 2], [0, 1, 16], "gpu"))
        done = manager.wait_job_dones([2], timeout_s=60)[2]
        assert not done.success and done.successful_keys == keys_of(3)[:2]
        assert [device_block(b) for b in (0, 1)] == [pool.slot_array(s).tobytes() for s in (0, 1)]
        manager.send(IDENTITY, DetachKV(handle_id="gpu"))
        manager.pump(0.2)
    finally:
        if producer.poll() is None:
            producer.stdin.write("quit\n")
            producer.stdin.close()
            producer.wait(timeout=30)
