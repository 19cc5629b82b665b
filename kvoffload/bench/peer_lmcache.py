"""The LMCache side of ``kvoffload bench peer``: one round of the store/load workload on
LMCache's storage backends, in-process (``--side backends``), or on its multiprocess server
(``--side server``), JSON on stdout.

Run by the python of a virtualenv that has LMCache (``--peer-python``), as a file: it imports
LMCache, torch, pyzmq and the standard library only, never kvoffload. For each block size, ``--mib`` of
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

With ``--side server``, the same workload against LMCache's multiprocess server
(``lmcache.v1.multiprocess.server``, its own process), started per block size on the CPU
(``engine_driven`` transfers through its POSIX shared memory, an L1 of host memory, an ``fs``
L2 adapter with ``O_DIRECT`` in a fresh directory), with a KV cache of one layer ``[2, blocks,
16 tokens, heads, 128]`` fp16 whose block is one LMCache chunk (``blocks_in_chunk`` 1):
- ``mp_store``: one store per prefix of ``--prefix-blocks`` blocks (each its own session), each
  awaited, as the engine-side stores of kvoffload;
- ``mp_load``: per prefix a lookup, the prefetch status awaited, a retrieve into other blocks
  of the cache, the session ended; verified;
- ``mp_cold_load_one_us``: ``LATENCY_LOADS`` blocks also stored one by one (LMCache's chunk
  keys chain their prefix, so a block inside a prefix has no key of its own), then, once every
  block reached the L2 and the server's L1 was cleared, the p50 of their one-block loads
  (lookup, which prefetches from the L2, the status awaited, retrieve), in microseconds;
  verified. The server's start and the registration are not timed.
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
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

TOKENS = 256  # LMCache's chunk size: a block is one chunk of [2, 1, TOKENS, width] bytes
LATENCY_LOADS = 32
SERVER_TOKENS = 16  # the server's chunk size and the KV cache's block: one block a chunk
HEAD_DIM = 128
RPC_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0
L2_TIMEOUT_S = 120.0
MODEL = "kvoffload-bench"


def _quiet() -> None:
    logging.disable(logging.WARNING)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, shm_name: str, l1_gb: float, l2_dir: str, log: Any) -> Any:
    adapter = {"type": "fs", "base_path": l2_dir, "use_odirect": True}
    argv = [sys.executable, "-m", "lmcache.v1.multiprocess.server"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(SERVER_TOKENS)]
    argv += ["--supported-transfer-mode", "engine_driven", "--shm-name", shm_name]
    argv += ["--l1-size-gb", f"{l1_gb:.3f}", "--no-l1-use-lazy", "--eviction-policy", "LRU"]
    argv += ["--disable-observability", "--l2-adapter", json.dumps(adapter)]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def run_size_server(block: int, n: int, prefix: int, directory: str) -> dict[str, float]:
    import torch
    import zmq
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    torch.set_num_threads(1)
    heads = block // (2 * SERVER_TOKENS * HEAD_DIM * 2)
    if heads * 2 * SERVER_TOKENS * HEAD_DIM * 2 != block:
        raise ValueError(f"a block of {block} bytes is no whole number of fp16 heads")
    nbytes = n * block
    blocks = 2 * n + 1  # block 0 unused (vLLM's null block), then sources, then loads
    kv = torch.zeros((2, blocks, SERVER_TOKENS, heads, HEAD_DIM), dtype=torch.float16)
    kv.view(torch.int16)[:, 1 : n + 1].copy_(
        torch.randint(-(2**15), 2**15, (2, n, SERVER_TOKENS, heads, HEAD_DIM), dtype=torch.int16)
    )
    kv_caches = {"layer.0": kv}
    sources = list(range(1, n + 1))
    loads = list(range(n + 1, 2 * n + 1))
    port = _free_port()
    shm_name = f"kvo-peer-lmc-{os.getpid()}-{block}"
    log_path = os.path.join(directory, "server.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed in the finally below
    l2_dir = os.path.join(directory, "l2")
    os.mkdir(l2_dir)
    server = start_server(port, shm_name, 2.5 * nbytes / 2**30 + 0.1, l2_dir, log)
    ctx = zmq.Context()
    client = None
    transfer = None
    out: dict[str, float] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    with open(log_path) as text:
                        tail = text.read()[-2000:]
                    raise RuntimeError(f"the LMCache server did not start: {tail}") from None
                time.sleep(0.2)
        client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=ctx)
        transfer = EngineDrivenTransferContext(1, client)
        transfer.register(
            kv_caches,
            MODEL,
            1,
            1,
            RPC_TIMEOUT_S,
            layout_hints={"kv_layout": "NHD"},
            engine_group_infos=[
                EngineGroupInfo(
                    engine_group_id=0, layer_indices=(0,), tokens_per_block=SERVER_TOKENS
                )
            ],
            engine_type=EngineType.VLLM,
        )
        sessions = iter(range(1, 1 << 30))

        def key(first: int, count: int, rid: str) -> Any:
            tokens = tuple(range(first * SERVER_TOKENS, (first + count) * SERVER_TOKENS))
            return IPCCacheServerKey(
                model_name=MODEL,
                world_size=1,
                worker_id=0,
                token_ids=tokens,
                start=0,
                end=len(tokens),
                request_id=rid,
                num_kv_readers=1,
            )

        def store(first: int, count: int) -> None:
            rid = f"s{next(sessions)}"
            ids = sources[first : first + count]
            ok = transfer.submit_store(rid, key(first, count, rid), kv_caches, [ids], None, 1)
            if not ok.result(timeout=RPC_TIMEOUT_S):
                raise RuntimeError(f"LMCache store of blocks {first}..{first + count} failed")
            client.end_session(rid).result(timeout=RPC_TIMEOUT_S)

        def load(first: int, count: int) -> None:
            rid = f"l{next(sessions)}"
            k = key(first, count, rid)
            client.lookup(k, 1).result(timeout=RPC_TIMEOUT_S)
            hits = client.wait_prefetch_status(rid, RPC_TIMEOUT_S).result(timeout=RPC_TIMEOUT_S)
            if hits != count:
                raise RuntimeError(f"LMCache found {hits} of {count} chunks")
            ids = loads[first : first + count]
            ok = transfer.submit_retrieve(rid, k, kv_caches, [ids], None, 1, skip_first_n_tokens=0)
            if not ok.result(timeout=RPC_TIMEOUT_S):
                raise RuntimeError(f"LMCache retrieve of blocks {first}..{first + count} failed")
            client.end_session(rid).result(timeout=RPC_TIMEOUT_S)

        def verify(count: int) -> None:
            bits = kv.view(torch.int16)  # bitwise: random fp16 bits hold NaNs
            if not torch.equal(bits[:, 1 : count + 1], bits[:, n + 1 : n + 1 + count]):
                raise AssertionError("the LMCache server returned other bytes")
            kv[:, n + 1 :].zero_()

        start = time.perf_counter()
        for first in range(0, n, prefix):
            store(first, min(prefix, n - first))
        out["mp_store"] = _gbps(nbytes, time.perf_counter() - start)
        start = time.perf_counter()
        for first in range(0, n, prefix):
            load(first, min(prefix, n - first))
        out["mp_load"] = _gbps(nbytes, time.perf_counter() - start)
        verify(n)
        count = min(n, LATENCY_LOADS)
        for i in range(count):  # LMCache's chunk keys chain a prefix: one-block keys of their own
            if i % prefix:
                store(i, 1)
        wait_in_l2(l2_dir, n + sum(1 for i in range(count) if i % prefix))
        client.clear(False).result(timeout=RPC_TIMEOUT_S)  # the L1 only: the L2 keeps them
        times = []
        for i in range(count):
            start = time.perf_counter()
            load(i, 1)
            times.append(time.perf_counter() - start)
        out["mp_cold_load_one_us"] = statistics.median(times) * 1e6
        verify(count)
        return out
    finally:
        if transfer is not None:
            try:
                transfer.unregister().result(timeout=RPC_TIMEOUT_S)
            finally:
                transfer.close()
        if client is not None:
            client.close()
        ctx.term()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        if os.path.exists(f"/dev/shm/{shm_name}"):
            os.unlink(f"/dev/shm/{shm_name}")


def wait_in_l2(directory: str, count: int) -> None:
    """Wait until the L2 directory holds ``count`` chunk files (the server writes its L2 in
    the background after a store returned; a file is complete once renamed from ``.tmp``)."""
    deadline = time.monotonic() + L2_TIMEOUT_S
    while True:
        held = sum(
            not name.endswith(".tmp") for _, _, files in os.walk(directory) for name in files
        )
        if held >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the LMCache L2 holds {held} of {count} chunks")
        time.sleep(0.05)


SIDES = {"backends": run_size, "server": run_size_server}
"""What ``--side`` runs per block size."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma list of block sizes in bytes")
    parser.add_argument("--mib", type=int, required=True, help="bytes per size, MiB")
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--dir", help="directory for the disk tiers (default: a temp dir)")
    parser.add_argument("--side", choices=sorted(SIDES), default="backends")
    args = parser.parse_args(argv)
    _quiet()
    import lmcache

    run = SIDES[args.side]
    results: dict[str, Any] = {"lmcache_version": getattr(lmcache, "__version__", "?")}
    for block in (int(s) for s in args.sizes.split(",")):
        directory = tempfile.mkdtemp(prefix=f"lmcache-peer-{args.side}-", dir=args.dir)
        try:
            n = max(args.prefix_blocks, (args.mib << 20) // block)
            results[str(block)] = run(block, n, args.prefix_blocks, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
