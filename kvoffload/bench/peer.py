"""kvoffload against LMCache's storage backends (LocalCPUBackend, LocalDiskBackend, also with
``use_odirect``) on one store/load workload, in the same run, as ratios kvoffload / LMCache.

Per block size (256 KiB, 1 MiB, 4 MiB) and round, ``--mib`` of random bytes in an engine buffer
go to each store and back, in prefixes of ``--prefix-blocks`` blocks; loads are verified. The
kvoffload side runs here on its defaults (slot headers and checksums on); the LMCache side runs
``peer_lmcache.py`` under ``--peer-python`` (a virtualenv with LMCache; LMCache's pins do not
fit kvoffload's), and the rounds of the two sides alternate. Operations:
- host store / host load through the service (host pool + cpu worker) vs LocalCPUBackend, by
  device jobs (the cpu worker copies, one job per prefix) and by engine-side copies (the path
  of an engine that maps the pool, as the vLLM integration does: ``prepare_store``, copy with
  xxh3, ``complete_store``; a pinned lookup, copy, ``complete_load``; per prefix);
- store until on disk, one store request per prefix (service with its disk tier: until every
  block was cascaded) vs LocalCPUBackend + LocalDiskBackend, at equal durability: both through
  the page cache (``disk.io = "buffered"``, LMCache's default), and both followed by ``sync``
  (kvoffload on its default I/O, O_DIRECT);
- disk store library put (DiskStore, 4 threads like LMCache's disk writers) vs LMCache O_DIRECT;
- cold disk load, per prefix (host pool reset, so every block is promoted from disk), through
  the engine-side path: a pinned lookup held by the manager until blocks land, a verified
  copy of each landed block out of its pool slot, again for the rest; vs LMCache O_DIRECT
  ``batched_get_blocking`` per prefix;
- cold one-block disk load (p50 of ``LATENCY_LOADS`` single-block loads, same paths), in
  microseconds; its ratio is LMCache's time over kvoffload's;
- service to service: the engine-side host store and load and the cold one-block load again,
  against LMCache's multiprocess server in its own process (``peer_lmcache.py --side server``: its
  engine-driven transfers through shared memory, an L1 of host memory, an ``fs`` L2 with
  O_DIRECT), round trips included on both sides.
Each round also measures the machine's own limit for each cell's work (``kvoffload.bench.
limits``, ``LIMITS``), on the same block size, bytes and disk directory, so every cell carries
``limit_value`` and ``ratio_to_limit`` beside ``reference_value`` and ``ratio_to_reference``;
and the floor of the cold one-block load's own path (``kvoffload.bench.hops``, ``FLOORS``),
among that cell's ``others`` and printed with its medians after the table.
Before the first round the bench touches and frees ``WARM_MEMORY_BYTES`` of memory (a virtual
machine backs a guest page on its first touch, at about 1 GB/s; page-cache writes into such
pages would measure the hypervisor, not the disk path), and the two sides take turns going
first, round by round.
Writes JSON (cells: medians of the rounds, ratio = median of the per-round ratios) and prints
the ratio table. Skips, saying why, when LMCache cannot be imported by ``--peer-python``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
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

from kvoffload.bench.cells import Cell, ratio_table, size_label
from kvoffload.bench.hops import cold_chain
from kvoffload.bench.limits import measure_limits, serial
from kvoffload.bench.service import engine_load, engine_load_prefixes, engine_store_prefixes
from kvoffload.client import KVOffloadClient
from kvoffload.logs import configure_logging
from kvoffload.memory.blockformat import deployment_fingerprint
from kvoffload.memory.kvcache import SharedKVCache, unique_kv_name
from kvoffload.memory.pool import HostPool
from kvoffload.testing.helpers import keys_for
from kvoffload.testing.service import ServiceHarness
from workers.disk import DiskStore

SIZES = (256 << 10, 1 << 20, 4 << 20)
# (operation, kvoffload figure, LMCache figure, LMCache backend)
OPS = (
    ("host store, device jobs", "host_store", "cpu_store", "LocalCPUBackend"),
    ("host load, device jobs", "host_load", "cpu_load", "LocalCPUBackend"),
    ("host store, engine-side copies", "host_store_engine", "cpu_store", "LocalCPUBackend"),
    ("host load, engine-side copies", "host_load_engine", "cpu_load", "LocalCPUBackend"),
    (
        "store until on disk, page cache on both sides",
        "disk_store",
        "disk_store",
        "LocalDiskBackend",
    ),
    (
        "store until on disk, then sync on both sides",
        "disk_store_sync",
        "disk_store_sync",
        "LocalDiskBackend",
    ),
    ("disk store library put", "library_put", "disk_store_odirect", "LocalDiskBackend O_DIRECT"),
    (
        "cold disk load, per prefix, engine-side copies",
        "cold_load",
        "disk_load_odirect",
        "LocalDiskBackend O_DIRECT",
    ),
    (
        "host store, engine-side copies, service to service",
        "host_store_engine",
        "mp_store",
        "MP server",
    ),
    (
        "host load, engine-side copies, service to service",
        "host_load_engine",
        "mp_load",
        "MP server",
    ),
)
# (operation, kvoffload figure, LMCache figure, LMCache backend), in microseconds
LATENCY_OPS = (
    (
        "cold one-block disk load p50",
        "cold_load_one_us",
        "disk_load_one_odirect_us",
        "LocalDiskBackend O_DIRECT",
    ),
    (
        "cold one-block disk load p50, service to service",
        "cold_load_one_us",
        "mp_cold_load_one_us",
        "MP server, fs L2 O_DIRECT",
    ),
)
WRITERS = 4
LATENCY_LOADS = 32
HOLD_MS = 1000
WARM_MEMORY_BYTES = 4 << 30

Limit = Callable[[dict[str, Any], int, int], float]
"""The limit of a cell from the round's limit figures, the bytes of a round and the prefixes
it makes (GB/s; microseconds for the latency)."""


def _per_prefix(gbps: float, nbytes: int, prefixes: int, rtt_us: float) -> float:
    """``gbps`` over ``nbytes`` with one bare round trip of ``rtt_us`` per prefix added."""
    return nbytes / (nbytes / (gbps * 1e9) + prefixes * rtt_us * 1e-6) / 1e9


LIMITS: dict[str, tuple[str, Limit]] = {
    "host_store": ("one-pass copy + xxh3, every core", lambda f, b, p: f["copy_hash_gbps"]),
    "host_load": ("memcpy, every core", lambda f, b, p: f["memcpy_gbps"]),
    "host_store_engine": (
        "one-pass copy + xxh3, every core, plus one bare round trip per prefix",
        lambda f, b, p: _per_prefix(f["copy_hash_gbps"], b, p, f["zmq_rtt_us"]),
    ),
    "host_load_engine": (
        "one-pass copy + xxh3, every core, plus one bare round trip per prefix",
        lambda f, b, p: _per_prefix(f["copy_hash_gbps"], b, p, f["zmq_rtt_us"]),
    ),
    "disk_store": (
        "copy + xxh3, then a page-cache write, one after the other on the same cores",
        lambda f, b, p: serial(f["copy_hash_gbps"], f["disk_write_buffered_gbps"]),
    ),
    "disk_store_sync": (
        "the slower of copy + xxh3 and the best synced write at its best queue depth",
        lambda f, b, p: min(f["copy_hash_gbps"], f["disk_write_synced_gbps"]),
    ),
    "library_put": (
        "the slower of xxh3 and O_DIRECT writes at their best queue depth",
        lambda f, b, p: min(f["xxh3_gbps"], f["disk_write_direct_gbps"]),
    ),
    "cold_load": (
        "the slower of O_DIRECT reads at their best queue depth and copy + xxh3, plus one "
        "bare round trip per prefix",
        lambda f, b, p: _per_prefix(
            min(f["disk_read_direct_gbps"], f["copy_hash_gbps"]), b, p, f["zmq_rtt_us"]
        ),
    ),
    "cold_load_one_us": (
        "one cold O_DIRECT read of the block plus one bare round trip",
        lambda f, b, p: f["disk_read_one_us"] + f["zmq_rtt_us"],
    ),
}
"""Per kvoffload figure: what its limit is and how it follows from ``measure_limits``."""
FLOORS: dict[str, tuple[str, str]] = {
    "cold_load_one_us": ("the same hops and read, no service logic", "cold_chain_us"),
}
"""Per kvoffload figure: a floor measured in each round beside the limits (its name among the
cell's ``others``, its figure in the round's machine figures): ``cold_chain_us`` is
``kvoffload.bench.hops.cold_chain``'s p50."""


@contextlib.contextmanager
def peer_service(
    block_bytes: int, num_slots: int, disk: bool, disk_bytes: int, io: str = "auto"
) -> Iterator[KVOffloadClient]:
    """A service in a temp directory: host pool + cpu worker, and the disk tier if ``disk``
    (with ``disk.io`` = ``io``); yields a client of it."""
    sections = {
        "service": {"log_level": "warning"},
        "pool": {"block_bytes": block_bytes, "num_slots": num_slots, "unread_promotion_cap": 1.0},
        "disk": {"enabled": disk, "capacity_bytes": disk_bytes, "io": io},
    }
    with (
        ServiceHarness(None, sections, defaults={}, watch=False) as service,
        service.client("peer", timeout_s=60.0, landing=True) as client,
    ):
        yield client


def register_engine(client: KVOffloadClient, kv: SharedKVCache, n: int, disk: bool) -> None:
    """Register the engine's KV cache and wait until the cpu worker has it mapped (one block
    stored from block 0 and loaded into block ``n``, which is zeroed again; with a ``disk``
    tier, until that block is on disk too; then the pool emptied), as an engine registers its
    cache once at start, before serving."""
    client.register_kv(kv.handle("bench"))
    client.new_request("warm")
    key = b"warm-up".ljust(32, b".")
    device_jobs(client, "warm", [key], range(1), True, 1)
    device_jobs(client, "warm", [key], range(n, n + 1), False, 1)
    kv.tensors[0][n] = 0
    if disk:
        wait_on_disk(client, 1)
    client.finish_request("warm")
    client.reset_cache()


def prefixes(n: int, size: int) -> list[range]:
    return [range(first, min(n, first + size)) for first in range(0, n, size)]


def device_jobs(
    client: KVOffloadClient, req: str, keys: list[bytes], blocks: range, store: bool, prefix: int
) -> None:
    """One store (or load) request per prefix, all in flight; wait for every job."""
    call = client.store if store else client.load
    jobs = []
    for part in prefixes(len(keys), prefix):
        job = call(req, [keys[i] for i in part], [blocks[i] for i in part], "bench")
        if job.job_id is not None:
            jobs.append(job.job_id)
    for job_id, done in client.wait(jobs, timeout_s=600).items():
        if not done.success:
            raise RuntimeError(f"job {job_id} failed: {done.error}")


def wait_on_disk(client: KVOffloadClient, total: int) -> None:
    """Until ``total`` keys in all were cascaded to the disk tier."""
    deadline = time.monotonic() + 600
    while client.status().tiering.per_tier["disk"].cascaded_keys_ok < total:
        if time.monotonic() > deadline:
            raise TimeoutError("cascades to disk did not finish")
        time.sleep(0.002)


def cold_load(
    client: KVOffloadClient,
    pool: HostPool,
    req: str,
    keys: list[bytes],
    out: np.ndarray,
    prefix: int,
) -> None:
    """Per prefix, the engine-side load path (``bench.service.engine_load``): a pinned lookup
    that starts the prefix's promotions and tells of each block as it lands, a copy of each
    landed block verified against its checksum, ``complete_load``; the next prefix's lookup
    is sent before this one's blocks are waited for (``engine_load_prefixes``), so the disk
    reads ahead."""
    batches = [[keys[i] for i in part] for part in prefixes(len(keys), prefix)]
    engine_load_prefixes(client, req, batches, pool, out, HOLD_MS)


def engine_copies(
    client: KVOffloadClient,
    pool: HostPool,
    keys: list[bytes],
    rows: np.ndarray,
    prefix: int,
    store: bool,
) -> None:
    """Store ``rows`` (one per key) or load ``keys`` (all in the pool) into them by engine-side
    copies, one prefix at a time, the next prefix's call to the manager in flight while one
    is copied (``engine_store_prefixes``: ``prepare_store``, copy with xxh3,
    ``complete_store``; ``engine_load_prefixes``: a pinned lookup, verified copies,
    ``complete_load``); the last completion is awaited, so every block is acknowledged when
    this returns."""
    batches = [[keys[j] for j in part] for part in prefixes(len(keys), prefix)]
    if store:
        engine_store_prefixes(client, "host", batches, pool, rows)
    else:
        engine_load_prefixes(client, "host", batches, pool, rows)


def cold_load_one_us(
    client: KVOffloadClient, pool: HostPool, req: str, keys: list[bytes], out: np.ndarray
) -> float:
    """p50 in microseconds of one-block cold loads (``keys``: on disk only), one at a time."""
    times = []
    for i, key in enumerate(keys):
        start = time.perf_counter()
        engine_load(client, req, [key], pool, out[i : i + 1], HOLD_MS)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def kvoffload_round(
    block: int, n: int, prefix: int, salt: str, directory: Path
) -> dict[str, float]:
    """One round of the kvoffload side for one block size; GB/s per operation."""
    kv = SharedKVCache.create(unique_kv_name(), 2 * n, [block])
    try:
        return measure(kv, block, n, prefix, salt, directory)
    finally:
        kv.close()
        kv.unlink()


def measure(
    kv: SharedKVCache, block: int, n: int, prefix: int, salt: str, directory: Path
) -> dict[str, float]:
    nbytes = n * block
    out: dict[str, float] = {}
    rows = kv.tensors[0]
    rows[:n] = np.random.default_rng(block).integers(0, 256, size=(n, block), dtype=np.uint8)
    rows[n:] = 0  # an engine's KV cache is allocated (and zeroed) before it is registered
    src, dst = range(n), range(n, 2 * n)

    def timed(name: str, fn: Any) -> None:
        start = time.perf_counter()
        fn()
        out[name] = nbytes / (time.perf_counter() - start) / 1e9

    def verify() -> None:
        if not np.array_equal(rows[:n], rows[n:]):
            raise AssertionError("a load returned other bytes")
        rows[n:] = 0

    with peer_service(block, n + 64, False, 0) as client:
        register_engine(client, kv, n, disk=False)
        client.new_request("host")
        keys = keys_for(f"{salt}-host", n)
        timed("host_store", lambda: device_jobs(client, "host", keys, src, True, prefix))
        timed("host_load", lambda: device_jobs(client, "host", keys, dst, False, prefix))
        verify()
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            client.reset_cache()
            stores, loads = rows[:n], rows[n:]
            timed(
                "host_store_engine",
                lambda: engine_copies(client, pool, keys, stores, prefix, store=True),
            )
            timed(
                "host_load_engine",
                lambda: engine_copies(client, pool, keys, loads, prefix, store=False),
            )
            verify()
        finally:
            pool.close()
    disk_bytes = 3 * n * (block + 8192)

    def until_on_disk(client: KVOffloadClient, batch: list[bytes], sync: bool) -> None:
        before = client.status().tiering.per_tier["disk"].cascaded_keys_ok
        device_jobs(client, "disk", batch, src, True, prefix)
        wait_on_disk(client, before + len(batch))
        if sync:
            os.sync()

    with peer_service(block, n + 64, True, disk_bytes, io="buffered") as client:
        register_engine(client, kv, n, disk=True)
        client.new_request("disk")
        buffered = keys_for(f"{salt}-buffered", n)
        timed("disk_store", lambda: until_on_disk(client, buffered, False))
    with peer_service(block, n + 64, True, disk_bytes) as client:
        register_engine(client, kv, n, disk=True)
        client.new_request("disk")
        keys = keys_for(f"{salt}-sync", n)
        timed("disk_store_sync", lambda: until_on_disk(client, keys, True))
        client.finish_request("disk")
        client.reset_cache()
        client.new_request("cold")
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            timed("cold_load", lambda: cold_load(client, pool, "cold", keys, rows[n:], prefix))
            verify()
            client.reset_cache()
            one = keys[: min(n, LATENCY_LOADS)]
            out["cold_load_one_us"] = cold_load_one_us(client, pool, "cold", one, rows[n:])
            if not np.array_equal(rows[: len(one)], rows[n : n + len(one)]):
                raise AssertionError("a one-block cold load returned other bytes")
            client.finish_request("cold")
        finally:
            pool.close()
    out["library_put"] = library_put(block, n, rows, directory)
    return out


def library_put(block: int, n: int, rows: np.ndarray, directory: Path) -> float:
    """DiskStore.put of every block from the engine buffer, ``WRITERS`` threads; GB/s."""
    root = Path(tempfile.mkdtemp(prefix="kvo-peer-put-", dir=directory))
    store = DiskStore(
        root, block, deployment_fingerprint(block, "bench"), n * (block + 8192), direct_io=None
    )
    store.open()
    try:
        views = [memoryview(rows[i]) for i in range(n)]
        start = time.perf_counter()
        with ThreadPoolExecutor(WRITERS) as pool:
            list(pool.map(lambda i: store.put(i.to_bytes(8, "big") * 4, views[i]), range(n)))
        return n * block / (time.perf_counter() - start) / 1e9
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def lmcache_round(
    python: str, sizes: list[int], mib: int, prefix: int, directory: Path
) -> dict[str, Any]:
    """One round of the LMCache side (``peer_lmcache.py``): its backends in-process, then its
    multiprocess server; their figures merged per block size."""
    script = Path(__file__).with_name("peer_lmcache.py")
    merged: dict[str, Any] = {}
    for side in ("backends", "server"):
        argv = [python, str(script), "--sizes", ",".join(map(str, sizes)), "--mib", str(mib)]
        argv += ["--prefix-blocks", str(prefix), "--dir", str(directory), "--side", side]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the LMCache side ({side}) failed: {done.stderr.strip()[-2000:]}")
        for key, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return merged


def lmcache_missing(python: str) -> str | None:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('lmcache') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    except OSError as exc:
        return f"cannot run {python}: {exc}"
    if not found:
        return f"LMCache is not installed for {python} (the peer extra, in a virtualenv of its own)"
    return None


def peer_cell(
    op: str,
    ours: str,
    theirs: str,
    backend: str,
    size: int,
    samples: dict[str, list[dict[str, Any]]],
    throughput: bool,
) -> Cell:
    """One cell from the rounds' samples: medians of both sides, of the limit, and of the
    per-round ratios of performance (GB/s ours / theirs; for a latency in microseconds, their
    time / ours), to LMCache and to the round's limit."""
    rounds = zip(samples["kvoffload"], samples["lmcache"], samples["limits"], strict=True)
    triples = [(k[str(size)][ours], t[str(size)][theirs], m[str(size)][ours]) for k, t, m in rounds]

    def performance(value: float, other: float) -> float:
        return value / other if throughput else other / value

    others = {}
    if ours in FLOORS:
        name, figure = FLOORS[ours]
        others[name] = statistics.median(m[str(size)][figure] for m in samples["machine"])

    return Cell(
        suite="peer",
        metric=op,
        size=size,
        size_unit="bytes",
        value=statistics.median(k for k, _, _ in triples),
        unit="GB/s" if throughput else "us",
        higher_is_better=throughput,
        reference=f"LMCache {backend}",
        reference_value=statistics.median(t for _, t, _ in triples),
        ratio_to_reference=statistics.median(performance(k, t) for k, t, _ in triples),
        limit=LIMITS[ours][0],
        limit_value=statistics.median(m for _, _, m in triples),
        ratio_to_limit=statistics.median(performance(k, m) for k, _, m in triples),
        others=others,
        chart=throughput,
    )


def cell_limits(figures: dict[str, Any], block: int, n: int, prefix: int) -> dict[str, float]:
    """Each kvoffload figure's limit (``LIMITS``) from the machine's ``figures`` for this
    block size (``measure_limits``), for ``n`` blocks moved in prefixes of ``prefix``."""
    count = len(prefixes(n, prefix))
    return {name: limit(figures, n * block, count) for name, (_, limit) in LIMITS.items()}


def warm_memory(nbytes: int = WARM_MEMORY_BYTES) -> None:
    """Touch and free ``nbytes`` (at most half the available memory), 64 MiB at a time."""
    import psutil

    nbytes = min(nbytes, psutil.virtual_memory().available // 2)
    chunk = 64 << 20
    held = []
    for _ in range(nbytes // chunk):
        area = mmap.mmap(-1, chunk)
        np.frombuffer(area, dtype=np.uint8)[::4096] = 1
        held.append(area)
    for area in held:
        area.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block sizes, bytes")
    parser.add_argument("--mib", type=int, default=256, help="bytes per size and round, MiB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--peer-python", default=sys.executable, help="python with LMCache")
    parser.add_argument("--dir", help="directory for the disk stores (default: a temp dir)")
    parser.add_argument("--out", default="results/bench_peer.json")
    args = parser.parse_args(argv)
    prefix = args.prefix_blocks
    configure_logging("bench", "warning")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if (reason := lmcache_missing(args.peer_python)) is not None:
        out.write_text(json.dumps({"skipped": reason}, indent=2) + "\n")
        print(f"peer: skipped: {reason}")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    directory = Path(tempfile.mkdtemp(prefix="kvo-peer-", dir=args.dir))
    samples: dict[str, list[dict[str, Any]]] = {
        "kvoffload": [],
        "lmcache": [],
        "limits": [],
        "machine": [],
    }
    warm_memory()
    try:
        for round_no in range(args.rounds):
            counts = {size: max(prefix, (args.mib << 20) // size) for size in sizes}

            def ours(round_no: int = round_no, counts: dict[int, int] = counts) -> None:
                samples["kvoffload"].append(
                    {
                        str(size): kvoffload_round(size, n, prefix, f"r{round_no}", directory)
                        for size, n in counts.items()
                    }
                )

            def theirs() -> None:
                samples["lmcache"].append(
                    lmcache_round(args.peer_python, sizes, args.mib, prefix, directory)
                )

            for side in (ours, theirs) if round_no % 2 == 0 else (theirs, ours):
                side()
            machine = {
                str(size): measure_limits(size, n * size, directory)
                | {"cold_chain_us": cold_chain(directory, size)["chain_p50_us"]}
                for size, n in counts.items()
            }
            samples["machine"].append(machine)
            samples["limits"].append(
                {
                    str(size): cell_limits(machine[str(size)], size, n, prefix)
                    for size, n in counts.items()
                }
            )
            print(f"round {round_no + 1}/{args.rounds} done", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    cells = [
        peer_cell(op, ours, theirs, backend, size, samples, throughput)
        for table, throughput in ((OPS, True), (LATENCY_OPS, False))
        for op, ours, theirs, backend in table
        for size in sizes
    ]
    report = {
        "lmcache_version": samples["lmcache"][0].get("lmcache_version"),
        "peer_python": args.peer_python,
        "mib": args.mib,
        "rounds": args.rounds,
        "prefix_blocks": prefix,
        "samples_gbps": samples,
        "cells": [c.to_json() for c in cells],
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"median of {args.rounds} round(s)")
    print("\n".join(ratio_table(cells)))
    for cell in cells:
        if cell.metric == LATENCY_OPS[0][0]:
            print(latency_line(cell))
    return 0


def latency_line(cell: Cell) -> str:
    """A latency cell's medians in microseconds, with its limit and floors."""
    figures = [f"kvoffload {cell.value:.0f}", f"{cell.reference} {cell.reference_value:.0f}"]
    figures.append(f"limit ({cell.limit}) {cell.limit_value:.0f}")
    figures += [f"{name} {value:.0f}" for name, value in cell.others.items()]
    return f"{cell.metric} at {size_label(cell)}, us: " + "; ".join(figures)


if __name__ == "__main__":
    sys.exit(main())
