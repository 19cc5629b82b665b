"""The LMCache side of ``kvoffload bench peer``: one round of the store/load workload on
LMCache's storage backends, in-process, JSON on stdout.

Run by the python of a virtualenv that has LMCache (``--peer-python``), as a file: it imports
LMCache, torch and the standard library only, never kvoffload. For each block size, ``--mib`` of
random bytes in a page-aligned engine buffer are stored and loaded back block by block:
- ``cpu_store``/``cpu_load``: LocalCPUBackend, allocate + copy from the engine buffer + put;
  get + copy into a second engine buffer (verified);
- ``disk_store``/``disk_store_sync``: the same puts, then LocalDiskBackend puts (buffered, its
  default) until every key is on disk; the second also runs ``sync``;
- ``disk_store_odirect``: LocalDiskBackend with ``use_odirect`` until every key is on disk;
- ``disk_load_odirect``: one ``batched_get_blocking`` per prefix of ``--prefix-blocks`` blocks
  from the O_DIRECT files (cold by construction), copied into the engine buffer and verified;
- ``disk_load_one_odirect_us``: p50 of ``LATENCY_LOADS`` one-block ``batched_get_blocking``
  calls and copies, in microseconds.
Figures are GB/s (10^9 bytes/s) of block bytes moved, unless named ``_us``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

TOKENS = 256  # LMCache's chunk size: a block is one chunk of [2, 1, TOKENS, width] bytes
LATENCY_LOADS = 32


def _quiet() -> None:
    logging.disable(logging.WARNING)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_size(block: int, n: int, prefix: int, directory: str) -> dict[str, float]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    torch.set_num_threads(1)  # one copy thread, as the engine-side copies of kvoffload
    shape = torch.Size([2, 1, TOKENS, block // (2 * TOKENS)])
    nbytes = n * block
    areas = [mmap.mmap(-1, size) for size in (nbytes, nbytes, 3 * nbytes)]
    engine, dst, pool = (torch.frombuffer(a, dtype=torch.uint8) for a in areas)
    engine = engine.view(n, block)
    dst = dst.view(n, block)
    engine.copy_(torch.randint(0, 256, (n, block), dtype=torch.uint8))
    dst.zero_()
    pool.zero_()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    out: dict[str, float] = {}
    backends: list[Any] = []

    def backend(odirect: bool, path: str) -> tuple[Any, Any]:
        config = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": TOKENS,
                "local_cpu": True,
                "max_local_cpu_size": 3 * nbytes / 2**30,
                "local_disk": f"file://{path}",
                "max_local_disk_size": 4 * nbytes / 2**30,
                "extra_config": {"use_odirect": odirect},
            }
        )
        allocator = TensorMemoryAllocator(pool, align_bytes=4096)
        cpu = LocalCPUBackend(config, memory_allocator=allocator)
        disk = LocalDiskBackend(config, loop, cpu)
        backends.extend([disk, cpu])
        return cpu, disk

    def keys(salt: int) -> list[Any]:
        return [CacheEngineKey("bench", 1, 0, salt * 1_000_000 + i, torch.uint8) for i in range(n)]

    def put_cpu(cpu: Any, batch: list[Any]) -> list[Any]:
        objs = []
        for i, key in enumerate(batch):
            obj = cpu.allocate(shape, torch.uint8, MemoryFormat.KV_2LTD)
            obj.tensor.view(-1).copy_(engine[i])
            cpu.submit_put_task(key, obj)
            objs.append(obj)
        return objs

    def until_on_disk(disk: Any, batch: list[Any], objs: list[Any]) -> None:
        for key, obj in zip(batch, objs, strict=True):
            disk.submit_put_task(key, obj)
        deadline = time.monotonic() + 600
        while not all(disk.contains(k) for k in batch):
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache disk puts did not finish")
            time.sleep(0.0005)

    def release(cpu: Any, batch: list[Any], objs: list[Any]) -> None:
        for key, obj in zip(batch, objs, strict=True):
            obj.ref_count_down()
            cpu.remove(key)

    cpu, disk = backend(False, os.path.join(directory, "buffered"))
    batch = keys(1)
    start = time.perf_counter()
    objs = put_cpu(cpu, batch)
    out["cpu_store"] = _gbps(nbytes, time.perf_counter() - start)
    start = time.perf_counter()
    for i, key in enumerate(batch):
        obj = cpu.get_blocking(key)
        dst[i].copy_(obj.tensor.view(-1))
        obj.ref_count_down()
    out["cpu_load"] = _gbps(nbytes, time.perf_counter() - start)
    if not torch.equal(engine, dst):
        raise AssertionError("LocalCPUBackend returned other bytes")
    release(cpu, batch, objs)
    for name, salt, sync in (("disk_store", 2, False), ("disk_store_sync", 3, True)):
        batch = keys(salt)
        start = time.perf_counter()
        objs = put_cpu(cpu, batch)
        until_on_disk(disk, batch, objs)
        if sync:
            os.sync()
        out[name] = _gbps(nbytes, time.perf_counter() - start)
        release(cpu, batch, objs)

    cpu, disk = backend(True, os.path.join(directory, "odirect"))
    batch = keys(4)
    start = time.perf_counter()
    objs = put_cpu(cpu, batch)
    until_on_disk(disk, batch, objs)
    out["disk_store_odirect"] = _gbps(nbytes, time.perf_counter() - start)
    release(cpu, batch, objs)
    dst.zero_()
    start = time.perf_counter()
    for first in range(0, n, prefix):
        loaded = disk.batched_get_blocking(batch[first : first + prefix])
        for i, obj in enumerate(loaded, start=first):
            dst[i].copy_(obj.tensor.view(-1))
            obj.ref_count_down()
    out["disk_load_odirect"] = _gbps(nbytes, time.perf_counter() - start)
    if not torch.equal(engine, dst):
        raise AssertionError("LocalDiskBackend returned other bytes")
    dst.zero_()
    times = []
    for i, key in enumerate(batch[:LATENCY_LOADS]):
        start = time.perf_counter()
        (obj,) = disk.batched_get_blocking([key])
        dst[i].copy_(obj.tensor.view(-1))
        obj.ref_count_down()
        times.append(time.perf_counter() - start)
    out["disk_load_one_odirect_us"] = statistics.median(times) * 1e6
    count = len(times)
    if not torch.equal(engine[:count], dst[:count]):
        raise AssertionError("LocalDiskBackend returned other bytes for one block")
    for b in backends:
        b.close()
    loop.call_soon_threadsafe(loop.stop)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma list of block sizes in bytes")
    parser.add_argument("--mib", type=int, required=True, help="bytes per size, MiB")
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--dir", help="directory for the disk backend (default: a temp dir)")
    args = parser.parse_args(argv)
    _quiet()
    import lmcache

    results: dict[str, Any] = {"lmcache_version": getattr(lmcache, "__version__", "?")}
    for block in (int(s) for s in args.sizes.split(",")):
        directory = tempfile.mkdtemp(prefix="lmcache-peer-", dir=args.dir)
        try:
            n = max(args.prefix_blocks, (args.mib << 20) // block)
            results[str(block)] = run_size(block, n, args.prefix_blocks, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
