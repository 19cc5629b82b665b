"""Store/load throughput of the disk tier against raw ``dd`` on the same directory.

Three parts (``--parts``), all writing JSON to ``--out`` and printing a table:

* ``worker``: the disk worker's backend (``DiskBackend.run_job``, as the worker's job threads
  call it) with ``--jobs-in-flight`` cascade jobs of ``--keys-per-job`` blocks at once from a
  real shared-memory host pool, its writes on ``--write-threads`` writer threads, until the slab
  files are fdatasync'ed ("store until on disk"); then the same blocks again under new keys into
  the now full store (every put evicts: the steady state); then cold promotions of the stored
  keys, jobs in flight the same way. Each round also runs ``dd oflag=direct conv=fsync`` and
  ``dd iflag=direct`` of the same total with the block size as ``bs``, next to it (the order
  alternates by round), and the ratios are taken per round; medians over ``--rounds``.
* ``store``: ``DiskStore`` put/get on ``--threads`` threads of its own, for each I/O mode:
  ``direct`` (O_DIRECT, every load is cold) and ``buffered`` (page cache; store time excludes
  writeback, ``store_flushed_gbps`` adds the fdatasync of every slab file; ``load_warm`` reads
  right after writing, ``load_cold`` after ``posix_fadvise(DONTNEED)``), against
  ``dd bs=1M oflag=direct conv=fsync`` / ``iflag=direct`` before and after.
* ``split``: the cost of one put and one get on one thread, split into its parts (the one
  ``pwritev`` of header page and payload, checksum, header encode, Python/lock overhead; the
  former two-write pattern alongside for reference), for each block size; the largest part is
  named as the bottleneck.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from kvoffload.config import Config, DiskConfig, PoolConfig
from kvoffload.memory.blockformat import (
    PAGE_BYTES,
    BlockHeader,
    deployment_fingerprint,
    payload_checksum,
)
from kvoffload.memory.pool import HostPool
from kvoffload.wire.protocol import Job, JobKind
from workers.disk import DiskStore
from workers.disk.rawio import O_DIRECT, page_buffer, probe_direct_io
from workers.disk.worker import DiskBackend
from workers.faults import FaultInjector

SLOTS_PER_THREAD = 16


def make_slots(count: int, block_bytes: int, fill: bool) -> tuple[mmap.mmap, list[memoryview]]:
    """``count`` page-aligned slots in one anonymous mapping, pre-faulted (random bytes if ``fill``)."""
    area = mmap.mmap(-1, count * block_bytes)
    view = memoryview(area)
    slots = [view[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
    for s in slots:
        s[:] = os.urandom(block_bytes) if fill else bytes(block_bytes)
    return area, slots


def bench_key(index: int) -> bytes:
    return b"bench-" + index.to_bytes(8, "big")


def timed_parallel(threads: int, count: int, op: Callable[[int, int], object]) -> float:
    """Run ``op(thread, index)`` for every index in 0..count split across ``threads``; wall seconds."""

    def run(thread: int) -> None:
        for index in range(thread, count, threads):
            op(thread, index)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(run, t) for t in range(threads)]:
            future.result()
    return time.perf_counter() - start


def flush_and_evict(directory: Path, evict: bool) -> float:
    """fdatasync every slab file under ``directory`` (and drop its cached pages if ``evict``);
    seconds taken."""
    start = time.perf_counter()
    for path in sorted(directory.rglob("slab-*.kvs")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def run_cell(
    workdir: Path,
    block_bytes: int,
    count: int,
    threads: int,
    mode: str,
    sources: list[memoryview],
    dests: list[memoryview],
) -> dict:
    root = workdir / f"store-{mode}-{block_bytes}-{threads}"
    fingerprint = deployment_fingerprint(block_bytes, "bench")
    record = PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
    store = DiskStore(root, block_bytes, fingerprint, count * record, direct_io=mode == "direct")
    store.open()
    gib = count * block_bytes / 1e9
    cell: dict = {"block_kib": block_bytes >> 10, "mode": mode, "threads": threads, "blocks": count}
    try:
        put_s = timed_parallel(
            threads, count, lambda t, i: store.put(bench_key(i), sources[i % len(sources)])
        )

        def load(t: int, i: int) -> None:
            store.get(bench_key(i), dests[t * SLOTS_PER_THREAD + i % SLOTS_PER_THREAD])

        cell["store_gbps"] = gib / put_s
        cell["put_us"] = put_s / count * 1e6 * threads
        if mode == "buffered":
            flush_s = flush_and_evict(store.directory, evict=False)
            cell["store_flushed_gbps"] = gib / (put_s + flush_s)
            warm_s = timed_parallel(threads, count, load)
            cell["load_warm_gbps"] = gib / warm_s
            flush_and_evict(store.directory, evict=True)
        cold_s = timed_parallel(threads, count, load)
        cell["load_cold_gbps"] = gib / cold_s
        cell["get_cold_us"] = cold_s / count * 1e6 * threads
    finally:
        store.close()
        shutil.rmtree(root)
    return cell


def run_jobs(
    backend: DiskBackend,
    kind: JobKind,
    first_key: int,
    count: int,
    slot_base: int,
    jobs_in_flight: int,
    keys_per_job: int,
) -> float:
    """Blocks ``first_key``..+``count`` as jobs of ``keys_per_job`` keys, ``jobs_in_flight`` at a
    time on as many threads (as the worker's job threads run them); thread ``t`` uses the pool
    slots from ``slot_base + t * keys_per_job``. Wall seconds; RuntimeError if a key failed."""
    starts = iter(range(first_key, first_key + count, keys_per_job))
    lock = threading.Lock()
    job_ids = itertools.count(1)

    def job_thread(thread: int) -> None:
        slots = list(
            range(slot_base + thread * keys_per_job, slot_base + (thread + 1) * keys_per_job)
        )
        while True:
            with lock:
                start = next(starts, None)
                job_id = next(job_ids)
            if start is None:
                return
            keys = [
                bench_key(i) for i in range(start, min(start + keys_per_job, first_key + count))
            ]
            job = Job(job_id=job_id, kind=kind, keys=keys, slots=slots[: len(keys)])
            outcome = backend.run_job(job)
            if outcome.cleanup is not None:
                outcome.cleanup()
            if outcome.ok_keys != keys:
                raise RuntimeError(f"{kind} job failed: {outcome.error}")

    begin = time.perf_counter()
    with ThreadPoolExecutor(jobs_in_flight) as pool:
        for future in [pool.submit(job_thread, t) for t in range(jobs_in_flight)]:
            future.result()
    return time.perf_counter() - begin


def worker_round(
    workdir: Path,
    pool: HostPool,
    count: int,
    jobs_in_flight: int,
    keys_per_job: int,
    write_threads: int,
    dd_first: bool,
) -> dict:
    """One round of the ``worker`` part for one block size (see the module docstring)."""
    block_bytes = pool.block_bytes
    record = PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
    root = workdir / f"worker-{block_bytes}"
    cfg = Config(
        pool=PoolConfig(num_slots=pool.num_slots, block_bytes=block_bytes, layout_id="bench"),
        disk=DiskConfig(root=str(root), capacity_bytes=count * record, write_threads=write_threads),
    )
    gb = count * block_bytes / 1e9
    in_flight = jobs_in_flight * keys_per_job
    out: dict = {}
    if dd_first:
        out.update(dd_same_total(workdir, block_bytes, count))
    backend = DiskBackend(cfg)
    backend.start(pool, FaultInjector())
    try:
        store_s = run_jobs(backend, JobKind.CASCADE, 0, count, 0, jobs_in_flight, keys_per_job)
        store_s += flush_and_evict(root, evict=False)
        evicting_s = run_jobs(
            backend, JobKind.CASCADE, count, count, 0, jobs_in_flight, keys_per_job
        )
        evicting_s += flush_and_evict(root, evict=True)
        load_s = run_jobs(
            backend, JobKind.PROMOTION, count, count, in_flight, jobs_in_flight, keys_per_job
        )
    finally:
        backend.close()
        shutil.rmtree(root)
    if not dd_first:
        out.update(dd_same_total(workdir, block_bytes, count))
    out.update(
        store_gbps=gb / store_s,
        store_evicting_gbps=gb / evicting_s,
        load_cold_gbps=gb / load_s,
    )
    out["store_ratio"] = out["store_gbps"] / out["dd_write_gbps"]
    out["store_evicting_ratio"] = out["store_evicting_gbps"] / out["dd_write_gbps"]
    out["load_ratio"] = out["load_cold_gbps"] / out["dd_read_gbps"]
    return out


def worker_cell(
    workdir: Path,
    block_bytes: int,
    total_bytes: int,
    rounds: int,
    jobs_in_flight: int,
    keys_per_job: int,
    write_threads: int,
) -> dict:
    """The ``worker`` part for one block size: every round, then medians."""
    count = max(jobs_in_flight * keys_per_job, total_bytes // block_bytes)
    in_flight = jobs_in_flight * keys_per_job
    name = f"/kvoffload-bench-disk-{os.getpid()}"
    pool = HostPool.create(name, 2 * in_flight, block_bytes)
    try:
        for slot in range(in_flight):
            pool.slot(slot)[:] = os.urandom(block_bytes)
        results = [
            worker_round(
                workdir, pool, count, jobs_in_flight, keys_per_job, write_threads, r % 2 == 0
            )
            for r in range(rounds)
        ]
    finally:
        pool.close()
        pool.unlink()
    return {
        "block_kib": block_bytes >> 10,
        "blocks": count,
        "jobs_in_flight": jobs_in_flight,
        "keys_per_job": keys_per_job,
        "write_threads": write_threads,
        "rounds": results,
        "median": {k: statistics.median(r[k] for r in results) for k in results[0]},
    }


def dd_same_total(workdir: Path, block_bytes: int, count: int) -> dict:
    """``dd`` direct write (with fsync) and read of ``count`` blocks of ``block_bytes``."""
    path = workdir / "dd-same-total.bin"
    try:
        write = dd_gbps(
            [
                "if=/dev/zero",
                f"of={path}",
                f"bs={block_bytes}",
                f"count={count}",
                "oflag=direct",
                "conv=fsync",
            ]
        )
        read = dd_gbps([f"if={path}", "of=/dev/null", f"bs={block_bytes}", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return {"dd_write_gbps": write, "dd_read_gbps": read}


def dd_gbps(args: list[str]) -> float:
    """Run dd; GB/s from the byte count and seconds it reports."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"^(\d+) bytes.*copied, ([\d.]+) s", done.stderr, re.M)
    if match is None:
        raise RuntimeError(f"unexpected dd output: {done.stderr!r}")
    return int(match.group(1)) / float(match.group(2)) / 1e9


def dd_baseline(workdir: Path, total_mib: int) -> dict:
    path = workdir / "dd-baseline.bin"
    try:
        write = dd_gbps(
            [
                "if=/dev/zero",
                f"of={path}",
                "bs=1M",
                f"count={total_mib}",
                "oflag=direct",
                "conv=fsync",
            ]
        )
        read = dd_gbps([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return {"dd_direct_write_gbps": write, "dd_direct_read_gbps": read}


def per_record_costs(
    workdir: Path,
    block_bytes: int,
    count: int,
    sources: list[memoryview],
    dests: list[memoryview],
    rounds: int = 8,
) -> dict:
    """Microseconds per record on one thread, O_DIRECT when available. Each round covers a fresh
    chunk of records several ways, back to back so that all see the same disk conditions: the
    raw syscall pattern of a put (one pwritev of header page + payload), the former two-write
    pattern (payload pwrite, then header-page pwrite) for reference, and that of a get (one
    preadv of header page + payload) on a fallocated file, then store puts and gets. Checksum
    and header encode are timed alone. Every record is written once before the rounds (the
    steady state: no first write into an unwritten extent), and the two write patterns take
    turns going first. Figures are medians over rounds; what a put or get costs beyond its parts
    is Python, lock and index overhead."""
    fingerprint = deployment_fingerprint(block_bytes, "bench")
    direct = probe_direct_io(workdir) and block_bytes % PAGE_BYTES == 0
    record = PAGE_BYTES + -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
    chunk = max(1, count // rounds)
    n, m = len(sources), len(dests)
    page = page_buffer()
    clock = time.perf_counter
    names = (
        "record_pwritev_us",
        "two_pwrites_us",
        "record_preadv_us",
        "put_us",
        "get_us",
        "checksum_us",
        "header_encode_us",
    )
    samples: dict[str, list[float]] = {name: [] for name in names}

    def per_call(name: str, first: int, fn: Callable[[int], object]) -> None:
        start = clock()
        for i in range(first, first + chunk):
            fn(i)
        samples[name].append((clock() - start) / chunk * 1e6)

    def two_pwrites(i: int) -> None:
        os.pwrite(fd, sources[i % n], i * record + PAGE_BYTES)
        os.pwrite(fd, page, i * record)

    raw_path = workdir / "raw-records.bin"
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | (O_DIRECT if direct else 0), 0o600)
    store = DiskStore(
        workdir / "store-parts", block_bytes, fingerprint, rounds * chunk * record, direct_io=direct
    )
    store.open()
    try:
        for i in range(rounds * chunk):
            os.pwritev(fd, [page, sources[i % n]], i * record)
            store.put(bench_key(i), sources[i % n])
        for r in range(rounds):
            first = r * chunk
            if r % 2:
                per_call("two_pwrites_us", first, two_pwrites)
            per_call(
                "record_pwritev_us",
                first,
                lambda i: os.pwritev(fd, [page, sources[i % n]], i * record),
            )
            if r % 2 == 0:
                per_call("two_pwrites_us", first, two_pwrites)
            per_call("put_us", first, lambda i: store.put(bench_key(i), sources[i % n]))
            per_call(
                "record_preadv_us", first, lambda i: os.preadv(fd, [page, dests[i % m]], i * record)
            )
            per_call("get_us", first, lambda i: store.get(bench_key(i), dests[i % m]))
            per_call("checksum_us", first, lambda i: payload_checksum(sources[i % n]))
            per_call(
                "header_encode_us",
                first,
                lambda i: BlockHeader(bench_key(i), block_bytes, i, fingerprint, i).encode(),
            )
    finally:
        os.close(fd)
        raw_path.unlink(missing_ok=True)
        store.close()
        shutil.rmtree(workdir / "store-parts")
    costs = {name: statistics.median(values) for name, values in samples.items()}

    put_parts = {
        "record write syscall": costs["record_pwritev_us"],
        "xxh3 checksum": costs["checksum_us"],
        "header encode": costs["header_encode_us"],
    }
    put_parts["python, lock and index overhead"] = max(
        0.0, costs["put_us"] - sum(put_parts.values())
    )
    get_parts = {
        "record read syscall": costs["record_preadv_us"],
        "xxh3 checksum": costs["checksum_us"],
    }
    get_parts["python, lock, header decode overhead"] = max(
        0.0, costs["get_us"] - sum(get_parts.values())
    )
    put_top = max(put_parts, key=put_parts.__getitem__)
    get_top = max(get_parts, key=get_parts.__getitem__)
    put_cpu = max(0.0, costs["put_us"] - costs["record_pwritev_us"])
    get_cpu = max(0.0, costs["get_us"] - costs["record_preadv_us"])
    return {
        "block_kib": block_bytes >> 10,
        "direct_io": direct,
        "records": rounds * chunk,
        "rounds": rounds,
        **{k: round(v, 2) for k, v in costs.items()},
        "put_parts_us": {k: round(v, 2) for k, v in put_parts.items()},
        "get_parts_us": {k: round(v, 2) for k, v in get_parts.items()},
        "put_bottleneck": (
            f"{'device write' if costs['record_pwritev_us'] >= put_cpu else 'CPU'}: one pwritev "
            f"{costs['record_pwritev_us']:.1f} of {costs['put_us']:.1f} us (the two-write pattern "
            f"takes {costs['two_pwrites_us']:.1f} us); CPU (checksum, encode, Python) "
            f"{put_cpu:.1f} us; largest part: {put_top}"
        ),
        "get_bottleneck": (
            f"{'device read' if costs['record_preadv_us'] >= get_cpu else 'CPU'}: one preadv "
            f"{costs['record_preadv_us']:.1f} of {costs['get_us']:.1f} us; CPU (checksum, "
            f"header decode, Python) {get_cpu:.1f} us; largest part: {get_top}"
        ),
    }


def print_table(result: dict) -> None:
    for cell in result.get("worker", []):
        med = cell["median"]
        print(
            f"{cell['block_kib']:>5} KiB worker, {cell['jobs_in_flight']} jobs x "
            f"{cell['keys_per_job']} keys in flight, {cell['write_threads']} writers: store "
            f"{med['store_gbps']:.2f} GB/s = {med['store_ratio']:.2f} x dd "
            f"{med['dd_write_gbps']:.2f}; evicting {med['store_evicting_ratio']:.2f} x dd; "
            f"cold load {med['load_cold_gbps']:.2f} GB/s = {med['load_ratio']:.2f} x dd "
            f"{med['dd_read_gbps']:.2f} (medians of {len(cell['rounds'])} rounds)"
        )
    base = result.get("baseline")
    if base is not None:
        print(
            f"dd direct write {base['before']['dd_direct_write_gbps']:.2f}/"
            f"{base['after']['dd_direct_write_gbps']:.2f} GB/s, read "
            f"{base['before']['dd_direct_read_gbps']:.2f}/"
            f"{base['after']['dd_direct_read_gbps']:.2f} GB/s (before/after)"
        )
        print(
            f"{'block':>7} {'mode':>8} {'thr':>3} {'store':>7} {'flushed':>7} {'warm':>7}"
            f" {'cold':>7}  GB/s"
        )
    for cell in result.get("cells", []):
        rates = " ".join(
            f"{cell[name]:7.2f}" if name in cell else f"{'-':>7}"
            for name in ("store_gbps", "store_flushed_gbps", "load_warm_gbps", "load_cold_gbps")
        )
        print(f"{cell['block_kib']:>4}KiB {cell['mode']:>8} {cell['threads']:>3} {rates}")
    for parts in result.get("per_record", []):
        print(f"{parts['block_kib']} KiB put: {parts['put_bottleneck']}")
        print(f"{parts['block_kib']} KiB get: {parts['get_bottleneck']}")


PARTS = ("worker", "store", "split")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--dir", help="directory on the disk to measure (default: a new temporary one)"
    )
    parser.add_argument(
        "--total-mib", type=int, default=512, help="bytes per cell (and per dd run)"
    )
    parser.add_argument(
        "--sizes-kib", default="64,256,1024,4096", help="comma list of block sizes in KiB"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the worker part")
    parser.add_argument("--jobs-in-flight", type=int, default=4, help="worker part")
    parser.add_argument("--keys-per-job", type=int, default=8, help="worker part")
    parser.add_argument(
        "--write-threads",
        type=int,
        default=DiskConfig().write_threads,
        help="worker part: the disk worker's writer threads",
    )
    parser.add_argument("--threads", default="1,4", help="store part: comma list of threads")
    parser.add_argument(
        "--modes", default="direct,buffered", help="store part: comma list of direct, buffered"
    )
    parser.add_argument(
        "--parts-records", type=int, default=2000, help="split part: records per block size"
    )
    parser.add_argument("--out", default="results/bench_disk.json")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    sizes = [int(s) << 10 for s in args.sizes_kib.split(",")]
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    thread_counts = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
    total = args.total_mib << 20
    workdir = Path(tempfile.mkdtemp(prefix="kvoffload-bench-disk-", dir=args.dir))
    try:
        if "direct" in modes and not probe_direct_io(workdir):
            print(f"O_DIRECT is not supported in {workdir}; skipping direct mode", file=sys.stderr)
            modes.remove("direct")
        result: dict = {
            "config": {
                "dir": str(workdir),
                "total_mib": args.total_mib,
                "sizes_kib": [s >> 10 for s in sizes],
                "parts": parts,
                "rounds": args.rounds,
                "jobs_in_flight": args.jobs_in_flight,
                "keys_per_job": args.keys_per_job,
                "write_threads": args.write_threads,
                "threads": thread_counts,
                "modes": modes,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
            },
        }
        if "worker" in parts:
            result["worker"] = []
            for block_bytes in sizes:
                cell = worker_cell(
                    workdir,
                    block_bytes,
                    total,
                    args.rounds,
                    args.jobs_in_flight,
                    args.keys_per_job,
                    args.write_threads,
                )
                result["worker"].append(cell)
                print(json.dumps({"block_kib": cell["block_kib"], **cell["median"]}), flush=True)
        if "store" in parts:
            result["baseline"] = {"before": dd_baseline(workdir, args.total_mib)}
            result["cells"] = []
        if "store" in parts or "split" in parts:
            if "split" in parts:
                result["per_record"] = []
            for block_bytes in sizes:
                count = max(max(thread_counts) * SLOTS_PER_THREAD, total // block_bytes)
                _src_area, sources = make_slots(min(count, 64), block_bytes, fill=True)
                _dst_area, dests = make_slots(
                    max(thread_counts) * SLOTS_PER_THREAD, block_bytes, fill=False
                )
                for mode in modes if "store" in parts else []:
                    for threads in thread_counts:
                        cell = run_cell(workdir, block_bytes, count, threads, mode, sources, dests)
                        result["cells"].append(cell)
                        print(json.dumps(cell), flush=True)
                if "split" in parts:
                    records = min(count, args.parts_records)
                    result["per_record"].append(
                        per_record_costs(workdir, block_bytes, records, sources, dests)
                    )
        if "store" in parts:
            result["baseline"]["after"] = dd_baseline(workdir, args.total_mib)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
