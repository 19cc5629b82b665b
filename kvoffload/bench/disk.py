"""Store/load throughput of the disk tier's DiskStore against raw ``dd`` on the same directory.

For each block size and thread count, a fresh store receives ``--total-mib`` of blocks from
page-aligned source slots (put), then they are loaded back into page-aligned destination slots
(get, which verifies header and checksum). Two I/O modes:

* ``direct``: O_DIRECT (the probe must succeed); every load is cold by construction.
* ``buffered``: page cache. Store time excludes writeback; ``store_flushed_gbps`` adds the
  fdatasync of every slab file. ``load_warm`` reads right after writing (page-cache hot),
  ``load_cold`` after ``posix_fadvise(DONTNEED)`` on the slab files.

The raw baseline is ``dd bs=1M oflag=direct conv=fsync`` / ``iflag=direct`` of the same total,
measured before and after the store runs. For the smallest block size the per-record cost of
a put and a get is split into its parts (checksum, header encode, payload and header syscalls,
Python/lock overhead) on one thread; the largest part is named as the bottleneck.
Writes JSON to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from kvoffload.blockformat import BlockHeader, deployment_fingerprint, payload_checksum
from workers.disk import DiskStore
from workers.disk.rawio import O_DIRECT, PAGE_SIZE, page_buffer, probe_direct_io

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


def timed_parallel(threads: int, count: int, op: Callable[[int, int], None]) -> float:
    """Run ``op(thread, index)`` for every index in 0..count split across ``threads``; wall seconds."""

    def run(thread: int) -> None:
        for index in range(thread, count, threads):
            op(thread, index)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(run, t) for t in range(threads)]:
            future.result()
    return time.perf_counter() - start


def slab_files(store: DiskStore) -> list[Path]:
    return sorted(store.directory.glob("slab-*.kvs"))


def flush_and_evict(store: DiskStore, evict: bool) -> float:
    """fdatasync every slab file (and drop its cached pages if ``evict``); seconds taken."""
    start = time.perf_counter()
    for path in slab_files(store):
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
    record = PAGE_SIZE + -(-block_bytes // PAGE_SIZE) * PAGE_SIZE
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
            flush_s = flush_and_evict(store, evict=False)
            cell["store_flushed_gbps"] = gib / (put_s + flush_s)
            warm_s = timed_parallel(threads, count, load)
            cell["load_warm_gbps"] = gib / warm_s
            flush_and_evict(store, evict=True)
        cold_s = timed_parallel(threads, count, load)
        cell["load_cold_gbps"] = gib / cold_s
        cell["get_cold_us"] = cold_s / count * 1e6 * threads
    finally:
        store.close()
        shutil.rmtree(root)
    return cell


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
    chunk of records four ways, back to back so that all see the same disk conditions: the raw
    syscall pattern of a put (payload pwrite, then header-page pwrite, each timed alone) and of a
    get (one preadv of header page + payload) on a fallocated file, then store puts and gets.
    Checksum and header encode are timed alone. Figures are medians over rounds; what a put or get
    costs beyond its parts is Python, lock and index overhead."""
    fingerprint = deployment_fingerprint(block_bytes, "bench")
    direct = probe_direct_io(workdir) and block_bytes % PAGE_SIZE == 0
    record = PAGE_SIZE + -(-block_bytes // PAGE_SIZE) * PAGE_SIZE
    chunk = max(1, count // rounds)
    n, m = len(sources), len(dests)
    page = page_buffer()
    clock = time.perf_counter
    samples: dict[str, list[float]] = {
        name: []
        for name in (
            "payload_pwrite_us",
            "header_pwrite_us",
            "record_preadv_us",
            "put_us",
            "get_us",
            "checksum_us",
            "header_encode_us",
        )
    }

    def per_call(name: str, first: int, fn: Callable[[int], object]) -> None:
        start = clock()
        for i in range(first, first + chunk):
            fn(i)
        samples[name].append((clock() - start) / chunk * 1e6)

    raw_path = workdir / "raw-records.bin"
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | (O_DIRECT if direct else 0), 0o600)
    store = DiskStore(
        workdir / "store-parts", block_bytes, fingerprint, rounds * chunk * record, direct_io=direct
    )
    store.open()
    try:
        os.posix_fallocate(fd, 0, rounds * chunk * record)
        for r in range(rounds):
            first = r * chunk
            payload_s = header_s = 0.0
            for i in range(first, first + chunk):
                t0 = clock()
                os.pwrite(fd, sources[i % n], i * record + PAGE_SIZE)
                t1 = clock()
                os.pwrite(fd, page, i * record)
                payload_s += t1 - t0
                header_s += clock() - t1
            samples["payload_pwrite_us"].append(payload_s / chunk * 1e6)
            samples["header_pwrite_us"].append(header_s / chunk * 1e6)
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
        "payload write syscall": costs["payload_pwrite_us"],
        "header page write syscall": costs["header_pwrite_us"],
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
    syscalls = costs["payload_pwrite_us"] + costs["header_pwrite_us"]
    put_cpu = max(0.0, costs["put_us"] - syscalls)
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
            f"{'device writes' if syscalls >= put_cpu else 'CPU'}: two synchronous pwrites per put "
            f"(payload {costs['payload_pwrite_us']:.1f} us + header page "
            f"{costs['header_pwrite_us']:.1f} us) = {syscalls:.1f} of {costs['put_us']:.1f} us; "
            f"CPU (checksum, encode, Python) {put_cpu:.1f} us; largest part: {put_top}"
        ),
        "get_bottleneck": (
            f"{'device read' if costs['record_preadv_us'] >= get_cpu else 'CPU'}: one preadv "
            f"{costs['record_preadv_us']:.1f} of {costs['get_us']:.1f} us; CPU (checksum, "
            f"header decode, Python) {get_cpu:.1f} us; largest part: {get_top}"
        ),
    }


def print_table(result: dict) -> None:
    base = result["baseline"]
    print(
        f"dd direct write {base['before']['dd_direct_write_gbps']:.2f}/{base['after']['dd_direct_write_gbps']:.2f}"
        f" GB/s, read {base['before']['dd_direct_read_gbps']:.2f}/{base['after']['dd_direct_read_gbps']:.2f}"
        " GB/s (before/after)"
    )
    print(
        f"{'block':>7} {'mode':>8} {'thr':>3} {'store':>7} {'flushed':>7} {'warm':>7} {'cold':>7}  GB/s"
    )
    for cell in result["cells"]:
        rates = " ".join(
            f"{cell[name]:7.2f}" if name in cell else f"{'-':>7}"
            for name in ("store_gbps", "store_flushed_gbps", "load_warm_gbps", "load_cold_gbps")
        )
        print(f"{cell['block_kib']:>4}KiB {cell['mode']:>8} {cell['threads']:>3} {rates}")
    parts = result["per_record"]
    print(f"{parts['block_kib']} KiB put: {parts['put_bottleneck']}")
    print(f"{parts['block_kib']} KiB get: {parts['get_bottleneck']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", help="directory on the disk to measure (default: a new temporary one)"
    )
    parser.add_argument(
        "--total-mib", type=int, default=512, help="bytes per cell (and per dd run)"
    )
    parser.add_argument(
        "--sizes-kib", default="64,256,1024,4096", help="comma list of block sizes in KiB"
    )
    parser.add_argument("--threads", default="1,4", help="comma list of thread counts")
    parser.add_argument("--modes", default="direct,buffered", help="comma list of direct, buffered")
    parser.add_argument(
        "--parts-records", type=int, default=2000, help="records for the per-record split"
    )
    parser.add_argument("--out", default="results/bench_disk.json")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    sizes = [int(s) << 10 for s in args.sizes_kib.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
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
                "threads": thread_counts,
                "modes": modes,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "kernel": platform.release(),
                "python": platform.python_version(),
            },
            "baseline": {"before": dd_baseline(workdir, args.total_mib)},
            "cells": [],
        }
        total = args.total_mib << 20
        for block_bytes in sizes:
            count = max(max(thread_counts) * SLOTS_PER_THREAD, total // block_bytes)
            _src_area, sources = make_slots(min(count, 64), block_bytes, fill=True)
            _dst_area, dests = make_slots(
                max(thread_counts) * SLOTS_PER_THREAD, block_bytes, fill=False
            )
            for mode in modes:
                for threads in thread_counts:
                    cell = run_cell(workdir, block_bytes, count, threads, mode, sources, dests)
                    result["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
            if block_bytes == min(sizes):
                result["per_record"] = per_record_costs(
                    workdir, block_bytes, min(count, args.parts_records), sources, dests
                )
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
