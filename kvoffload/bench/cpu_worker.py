"""Throughput of the cpu worker's copies (device_store / device_load over a shm KV cache),
against a single-thread ``np.copyto`` of whole blocks measured in the same run.

The backend is driven in-process: ``CpuBackend.run_job`` called from 1 thread and from
``--threads`` threads (as the worker's job threads would). With ``--process`` the same jobs also
go through a real ``python -m workers.cpu`` process and a minimal manager (a zmq ROUTER here),
with up to ``--window`` jobs outstanding. Slots and device blocks are visited in a strided
order over working sets larger than the last-level cache, so copies are cold.

    python scripts/bench_cpu_worker.py [--sizes 64K,256K,1M,4M] [--mib 256] [--process]
                                       [--out FILE]

Writes JSON (default results/bench_cpu_worker.json): per block size, min/median/max GB/s
(10^9 bytes/s, bytes copied once) of each measurement and the ratios to memcpy.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import zmq

from kvoffload.logs import configure_logging
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.runspec import RunSpec
from kvoffload.wire.protocol import (
    PROTOCOL_VERSION,
    AttachKV,
    Control,
    ControlAction,
    HelloAck,
    Job,
    JobDone,
    JobKind,
    WorkerHello,
    decode_worker_message,
    encode,
)
from workers.cpu import CpuBackend
from workers.faults import FaultInjector

KEYS_PER_JOB = 16
STRIDE = 7919  # prime: consecutive copies land far apart


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def order(n: int, salt: int) -> list[int]:
    return [(k * STRIDE + salt) % n for k in range(n)]


def summarize(samples: list[float]) -> dict[str, float]:
    return {
        "min": round(min(samples), 3),
        "median": round(statistics.median(samples), 3),
        "max": round(max(samples), 3),
    }


def bench_memcpy(pool: HostPool, src: np.ndarray, reps: int) -> list[float]:
    """Single-thread whole-block np.copyto from a page-aligned source into pool slots."""
    n = pool.num_slots
    samples = []
    for rep in range(reps):
        slots, blocks = order(n, rep), order(n, rep * 31 + 5)
        start = time.perf_counter()
        for slot, block in zip(slots, blocks, strict=True):
            np.copyto(pool.slot_array(slot), src[block])
        samples.append(n * pool.block_bytes / (time.perf_counter() - start) / 1e9)
    return samples


def jobs_for(kind: JobKind, n: int, rep: int) -> list[Job]:
    slots, blocks = order(n, rep), order(n, rep * 31 + 5)
    jobs = []
    for first in range(0, n, KEYS_PER_JOB):
        count = min(KEYS_PER_JOB, n - first)
        jobs.append(
            Job(
                job_id=first,
                kind=kind,
                keys=[i.to_bytes(16, "big") for i in range(first, first + count)],
                slots=slots[first : first + count],
                device_blocks=blocks[first : first + count],
                handle_id="bench",
            )
        )
    return jobs


def bench_backend(
    backend: CpuBackend, kind: JobKind, n: int, block_bytes: int, threads: int, reps: int
) -> list[float]:
    def run(job: Job) -> None:
        outcome = backend.run_job(job)
        if len(outcome.ok_keys) != len(job.keys):
            raise RuntimeError(f"job {job.job_id} failed: {outcome.error}")
        if outcome.release is not None:
            outcome.release()

    samples = []
    with ThreadPoolExecutor(threads) as executor:
        for rep in range(reps):
            jobs = jobs_for(kind, n, rep)
            start = time.perf_counter()
            if threads == 1:
                for job in jobs:
                    run(job)
            else:
                list(executor.map(run, jobs))
            samples.append(n * block_bytes / (time.perf_counter() - start) / 1e9)
    return samples


class WorkerProcess:
    """A ``workers.cpu`` process attached to ``pool`` and ``kv``, driven over a ROUTER."""

    def __init__(self, pool: HostPool, kv: SharedKVCache, threads: int, directory: Path) -> None:
        endpoint = f"ipc://{directory}/jobs.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        spec = RunSpec(
            run_id="bench",
            job_endpoint=endpoint,
            client_endpoint=f"ipc://{directory}/client.sock",
            pool_name=pool.name,
            config={
                "pool": {"num_slots": pool.num_slots, "block_bytes": pool.block_bytes},
                "cpu": {"threads": threads},
                "service": {"log_level": "warning"},
            },
        )
        spec_path = directory / "spec.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cpu", "--spec", str(spec_path)]
        )
        self.identity = b""
        while not self.identity:
            identity, frame = self.sock.recv_multipart()
            if isinstance(decode_worker_message(frame), WorkerHello):
                self.identity = identity
        self.send(HelloAck(version=PROTOCOL_VERSION, accepted=True))
        self.send(AttachKV(handle=kv.handle("bench")))

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([self.identity, encode(msg)])

    def run(self, jobs: list[Job], window: int) -> None:
        """Send ``jobs`` keeping at most ``window`` outstanding; wait for every JobDone."""
        next_job, done = 0, 0
        while done < len(jobs):
            while next_job < len(jobs) and next_job - done < window:
                self.send(jobs[next_job])
                next_job += 1
            _, frame = self.sock.recv_multipart()
            msg = decode_worker_message(frame)
            if isinstance(msg, JobDone):
                if not msg.success:
                    raise RuntimeError(f"job {msg.job_id} failed: {msg.error}")
                done += 1

    def close(self) -> None:
        self.send(Control(action=ControlAction.SHUTDOWN))
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.sock.close()
            self.ctx.term()


def bench_process(
    worker: WorkerProcess, kind: JobKind, n: int, block_bytes: int, window: int, reps: int
) -> list[float]:
    samples = []
    for rep in range(reps):
        jobs = jobs_for(kind, n, rep)
        for i, job in enumerate(jobs):
            job.job_id = rep * len(jobs) + i
        start = time.perf_counter()
        worker.run(jobs, window)
        samples.append(n * block_bytes / (time.perf_counter() - start) / 1e9)
    return samples


def bench_size(
    block_bytes: int, working_set: int, threads: int, reps: int, process_window: int
) -> dict:
    n = max(8, working_set // block_bytes)
    row = block_bytes // 2
    pool = HostPool.create(f"/kvoffload-bench-{uuid.uuid4().hex[:12]}", n, block_bytes)
    kv = SharedKVCache.create(None, n, [row, row])
    source = mmap.mmap(-1, n * block_bytes)
    try:
        src = np.frombuffer(source, dtype=np.uint8).reshape(n, block_bytes)
        src[:] = 1  # pre-fault
        for j in range(len(kv.tensors)):
            kv.tensors[j][:] = 2
        backend = CpuBackend()
        backend.start(pool, FaultInjector())
        backend.attach_kv(kv.handle("bench"))
        bench_backend(backend, JobKind.DEVICE_STORE, n, block_bytes, 1, 1)  # warm-up
        memcpy = summarize(bench_memcpy(pool, src, reps))
        rates: dict[str, dict[str, float]] = {"memcpy_1thread_gbps": memcpy}
        for kind in (JobKind.DEVICE_STORE, JobKind.DEVICE_LOAD):
            for t in sorted({1, threads}):
                name = f"{kind}_{t}thread_gbps"
                rates[name] = summarize(bench_backend(backend, kind, n, block_bytes, t, reps))
        backend.close()
        if process_window:
            with tempfile.TemporaryDirectory(prefix="kvb-") as directory:
                worker = WorkerProcess(pool, kv, threads, Path(directory))
                try:
                    for kind in (JobKind.DEVICE_STORE, JobKind.DEVICE_LOAD):
                        rates[f"{kind}_process_gbps"] = summarize(
                            bench_process(worker, kind, n, block_bytes, process_window, reps)
                        )
                finally:
                    worker.close()
        result: dict[str, object] = {"block_bytes": block_bytes, "blocks": n, **rates}
        result["ratio_to_memcpy"] = {
            key.removesuffix("_gbps"): round(value["median"] / memcpy["median"], 3)
            for key, value in rates.items()
            if key.startswith("device_")
        }
        del src
        return result
    finally:
        source.close()
        kv.close()
        kv.unlink()
        pool.close()
        pool.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,256K,1M,4M", help="block sizes, comma separated")
    parser.add_argument("--mib", type=int, default=256, help="working set per buffer, MiB")
    parser.add_argument("--threads", type=int, default=4, help="job threads (as cpu.threads)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--process", action="store_true", help="also through a worker process")
    parser.add_argument("--window", type=int, default=8, help="outstanding jobs with --process")
    parser.add_argument("--out", default="results/bench_cpu_worker.json")
    args = parser.parse_args(argv)
    configure_logging(proc="bench", level="warning")
    results = []
    for size in args.sizes.split(","):
        block_bytes = parse_size(size)
        window = args.window if args.process else 0
        result = bench_size(block_bytes, args.mib << 20, args.threads, args.reps, window)
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {
        "benchmark": "cpu_worker",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "keys_per_job": KEYS_PER_JOB,
        "threads": args.threads,
        "process_window": args.window if args.process else None,
        "working_set_mib": args.mib,
        "reps": args.reps,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
