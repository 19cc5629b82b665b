"""The machine's own limits for the bytes a benchmark cell moves, measured in the same run.

Every figure is the best this machine reached for that work, whatever the method, so a cell's
``ratio_to_limit`` (its performance over the limit's) says how far kvoffload is from the
hardware, not from another program:

- ``memcpy``: copies of ``block``-byte blocks between two page-aligned buffers larger than the
  caches, on 1 thread and on every core; also in a child process whose glibc uses
  non-temporal stores for copies from 256 KiB up (``NONTEMPORAL_TUNABLE``), the better counted;
- ``xxh3``: xxh3_64 of every block, every core;
- ``copy_hash``: one pass that copies each block and hashes it (a chunk at a time, hashing the
  chunk just copied while it is in the cache), every core; with non-temporal stores the copied
  source chunk is hashed;
- ``disk_write_direct``: O_DIRECT writes of ``block`` bytes at the best queue depth of
  ``QUEUE_DEPTHS`` (threads writing distinct records of one file at once), into a file whose
  blocks are allocated and written (the fast case) and into a fresh preallocated one, the best;
- ``disk_write_buffered``: buffered writes into the page cache (no sync) at the best depth;
- ``disk_write_synced``: buffered writes then one fdatasync, and O_DIRECT writes then one
  fdatasync, the better: bytes made durable per second;
- ``disk_read_direct``: cold O_DIRECT reads at the best queue depth;
- ``disk_read_one_us``: p50 of one cold O_DIRECT read of one block (queue depth 1);
- ``zmq_rtt_us``: p50 of a bare ZeroMQ DEALER -> ROUTER echo round trip to another process over
  ipc, one at a time with a pause between (its threads wake from idle, as a service call's do).

GB/s are 10^9 bytes per second of block bytes; ``--json`` prints them for one block size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

PAGE = 4096
QUEUE_DEPTHS = (1, 2, 4, 8, 16)
NONTEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x40000"
"""glibc's memcpy switches to non-temporal stores from this size up (256 KiB; by default only
from a share of the last-level cache, far above a KV block)."""
CHUNK = 256 << 10
"""Bytes copied then hashed at a time by ``copy_hash`` (stays in L2 between the two)."""
REPEATS = 3
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, touched byte array of ``nbytes`` (anonymous mapping)."""
    area = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    area[:] = 1
    return area


def best_gbps(nbytes: int, run: Callable[[], None], repeats: int = REPEATS) -> float:
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def memory_limits(block: int, total: int) -> dict[str, float]:
    """memcpy (1 thread and every core), xxh3 and one-pass copy + xxh3 of ``block``-byte blocks
    over ``total`` bytes, in this process (its glibc's memcpy as configured)."""
    n = max(1, total // block)
    src, dst = aligned(n * block).reshape(n, block), aligned(n * block).reshape(n, block)
    src[:] = np.random.default_rng(0).integers(0, 256, size=src.shape, dtype=np.uint8)
    nbytes = n * block
    threads = cores()
    nontemporal = NONTEMPORAL_TUNABLE in os.environ.get("GLIBC_TUNABLES", "")

    def copy(share: range) -> None:
        for i in share:
            np.copyto(dst[i], src[i])

    def hash_(share: range) -> None:
        for i in share:
            xxhash.xxh3_64_intdigest(src[i])

    def copy_hash(share: range) -> None:
        for i in share:
            digest = xxhash.xxh3_64()
            for at in range(0, block, CHUNK):
                part_src, part_dst = src[i, at : at + CHUNK], dst[i, at : at + CHUNK]
                np.copyto(part_dst, part_src)
                digest.update((part_src if nontemporal else part_dst).data)

    with ThreadPoolExecutor(threads) as pool:

        def on(threads_: int, work: Callable[[range], None]) -> Callable[[], None]:
            return lambda: _run_shares(pool, threads_, n, work)

        return {
            "memcpy_1thread_gbps": best_gbps(nbytes, on(1, copy)),
            "memcpy_gbps": best_gbps(nbytes, on(threads, copy)),
            "xxh3_gbps": best_gbps(nbytes, on(threads, hash_)),
            "copy_hash_1thread_gbps": best_gbps(nbytes, on(1, copy_hash)),
            "copy_hash_gbps": best_gbps(nbytes, on(threads, copy_hash)),
        }


def _run_shares(
    pool: ThreadPoolExecutor, threads: int, n: int, work: Callable[[range], None]
) -> None:
    shares = [range(n * i // threads, n * (i + 1) // threads) for i in range(threads)]
    futures = [pool.submit(work, share) for share in shares[1:]]
    work(shares[0])
    for future in futures:
        future.result()


def memory_limits_nontemporal(block: int, total: int) -> dict[str, float] | None:
    """``memory_limits`` in a child process with ``NONTEMPORAL_TUNABLE``; None if it failed."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), NONTEMPORAL_TUNABLE]))
    argv = [sys.executable, "-m", "kvoffload.bench.limits", "--memory-only", "--json"]
    argv += ["--block", str(block), "--mib", str(max(1, total >> 20))]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def scratch_file(directory: Path, nbytes: int, written: bool) -> Iterator[str]:
    """A file of ``nbytes`` in ``directory``, preallocated (``written``: its blocks also written
    once and synced, so writes overwrite allocated blocks); removed afterwards."""
    fd, path = tempfile.mkstemp(prefix="kvo-limit-", dir=directory)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        if written:
            chunk = aligned(4 << 20)
            for at in range(0, nbytes, len(chunk)):
                os.pwrite(fd, chunk[: min(len(chunk), nbytes - at)].data, at)
            os.fdatasync(fd)
        os.close(fd)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _io_gbps(
    path: str, block: int, n: int, depth: int, flags: int, write: bool, sync: bool
) -> float:
    """Write (or read) ``n`` records of ``block`` bytes of ``path`` with ``depth`` threads at
    once, each its own records; with ``sync``, one fdatasync at the end counts."""
    buffers = [aligned(block) for _ in range(depth)]
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | flags)
    try:

        def work(share: range, buf: np.ndarray) -> None:
            for i in share:
                if write:
                    os.pwrite(fd, buf.data, i * block)
                else:
                    os.preadv(fd, [buf.data], i * block)

        shares = [range(i, n, depth) for i in range(depth)]
        start = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            for future in [pool.submit(work, s, b) for s, b in zip(shares, buffers, strict=True)]:
                future.result()
            if sync:
                os.fdatasync(fd)
        return n * block / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def disk_limits(directory: Path, block: int, total: int) -> dict[str, Any]:
    """The disk figures of the module docstring for ``block``-byte records over ``total``
    bytes, in ``directory``; each depth's best of ``REPEATS`` runs is kept (with its depth)."""
    n = max(QUEUE_DEPTHS[-1], total // block)
    nbytes = n * block
    direct = O_DIRECT and block % PAGE == 0
    out: dict[str, Any] = {}

    def best(name: str, figures: dict[int, float]) -> None:
        depth = max(figures, key=lambda d: figures[d])
        out[f"{name}_gbps"] = figures[depth]
        out[f"{name}_depth"] = depth

    def measure(path: str, flags: int, write: bool, sync: bool, evict: bool) -> dict[int, float]:
        figures = {}
        for depth in QUEUE_DEPTHS:
            runs = []
            for _ in range(REPEATS):
                if evict:
                    _evict(path)
                runs.append(_io_gbps(path, block, n, depth, flags, write, sync))
            figures[depth] = max(runs)
        return figures

    with scratch_file(directory, nbytes, written=True) as path:
        if direct:
            written = measure(path, O_DIRECT, True, False, False)
            best("disk_write_direct", written)
            best("disk_read_direct", measure(path, O_DIRECT, False, False, False))
            out["disk_read_one_us"] = _one_read_us(path, block, n)
        best("disk_write_buffered", measure(path, 0, True, False, True))
        synced = measure(path, 0, True, True, True)
        if direct:
            synced_direct = measure(path, O_DIRECT, True, True, False)
            synced = {d: max(v, synced_direct[d]) for d, v in synced.items()}
        best("disk_write_synced", synced)
        if not direct:
            best("disk_read_buffered_cold", measure(path, 0, False, False, True))
    if direct:
        with scratch_file(directory, nbytes, written=False) as path:
            fresh = measure(path, O_DIRECT, True, False, False)
        if max(fresh.values()) > out["disk_write_direct_gbps"]:
            best("disk_write_direct", fresh)
    return out


def disk_read_limits(directory: Path, block: int, total: int) -> dict[str, Any]:
    """Only the read figures of ``disk_limits`` (``disk_read_direct_gbps`` with its depth,
    ``disk_read_one_us``), for benchmarks that read back what they wrote; {} where the block
    size cannot be read with ``O_DIRECT``."""
    if not (O_DIRECT and block % PAGE == 0):
        return {}
    n = max(QUEUE_DEPTHS[-1], total // block)
    figures = {}
    with scratch_file(directory, n * block, written=True) as path:
        for depth in QUEUE_DEPTHS:
            figures[depth] = max(
                _io_gbps(path, block, n, depth, O_DIRECT, False, False) for _ in range(REPEATS)
            )
        one = _one_read_us(path, block, n)
    depth = max(figures, key=lambda d: figures[d])
    return {
        "disk_read_direct_gbps": figures[depth],
        "disk_read_direct_depth": depth,
        "disk_read_one_us": one,
    }


def _one_read_us(path: str, block: int, n: int, samples: int = 32) -> float:
    buf = aligned(block)
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    try:
        times = []
        for i in range(min(samples, n)):
            start = time.perf_counter()
            os.preadv(fd, [buf.data], ((i * 7919) % n) * block)
            times.append(time.perf_counter() - start)
            time.sleep(0.002)
        return statistics.median(times) * 1e6
    finally:
        os.close(fd)


def zmq_rtt_us(rounds: int = 200) -> float:
    """p50 of bare ZeroMQ round trips, each after a 1 ms pause (see the module docstring)."""
    from kvoffload.bench.service import EchoServer

    echo = EchoServer()
    try:
        samples = []
        for _ in range(rounds):
            time.sleep(0.001)
            samples.append(echo.round_trip(b"x" * 64))
        return statistics.median(samples[10:]) * 1e6
    finally:
        echo.close()


def measure_limits(
    block: int, total: int, directory: Path | None, nontemporal: bool = True
) -> dict[str, Any]:
    """Every limit for ``block``-byte blocks over ``total`` bytes (disk figures only with a
    ``directory``). Memory figures are the better of this process's glibc and, with
    ``nontemporal``, a child's with non-temporal stores (``*_nontemporal`` keys say which)."""
    figures: dict[str, Any] = {"block_bytes": block, "cores": cores()}
    memory = memory_limits(block, min(total, 256 << 20))
    other = memory_limits_nontemporal(block, min(total, 256 << 20)) if nontemporal else None
    for name, value in memory.items():
        alt = other.get(name, 0.0) if other else 0.0
        figures[name] = max(value, alt)
        figures[f"{name.removesuffix('_gbps')}_nontemporal"] = alt > value
    if directory is not None:
        figures.update(disk_limits(directory, block, total))
    figures["zmq_rtt_us"] = zmq_rtt_us()
    return figures


def serial(*rates: float) -> float:
    """The rate of doing each of several jobs, one after another, on the same bytes (and the
    same cores): 1 / sum(1 / rate)."""
    return 1.0 / sum(1.0 / r for r in rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=1 << 20, help="block bytes")
    parser.add_argument("--mib", type=int, default=128, help="bytes per measurement, MiB")
    parser.add_argument("--dir", help="directory on the disk to measure (default: none)")
    parser.add_argument("--memory-only", action="store_true", help="memory figures only")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = parser.parse_args(argv)
    total = args.mib << 20
    if args.memory_only:
        figures: dict[str, Any] = memory_limits(args.block, total)
    else:
        figures = measure_limits(args.block, total, Path(args.dir) if args.dir else None)
    print_figures(figures, args.json)
    return 0


def print_figures(figures: dict[str, Any], as_json: bool) -> None:
    """``figures`` on stdout: one JSON line, or one aligned line per figure."""
    if as_json:
        print(json.dumps(figures))
        return
    for name, value in figures.items():
        print(f"{name:<32} {value:.3f}" if isinstance(value, float) else f"{name:<32} {value}")


if __name__ == "__main__":
    sys.exit(main())
