"""The LMCache service side of ``kvoffload bench peer``: one round of the store/load workload
against LMCache's multiprocess server (``lmcache.v1.multiprocess.server``, its own process),
JSON on stdout.

Run by the python of a virtualenv that has LMCache (``--peer-python``), as a file: it imports
LMCache, torch, pyzmq and the standard library only, never kvoffload. Per block size it starts
one server on the CPU (``engine_driven`` transfers through its POSIX shared memory, an L1 of
host memory, and an ``fs`` L2 adapter with ``O_DIRECT`` in a fresh directory), registers a KV
cache of one layer ``[2, blocks, 16 tokens, heads, 128]`` fp16 whose block is one LMCache
chunk (``blocks_in_chunk`` 1), and, block bytes random:
- ``mp_store``: one store per prefix of ``--prefix-blocks`` blocks (each its own session), each
  awaited, as the engine-side stores of kvoffload;
- ``mp_load``: per prefix a lookup, the prefetch status awaited, a retrieve into other blocks
  of the cache, the session ended; verified;
- ``mp_cold_load_one_us``: ``LATENCY_LOADS`` blocks also stored one by one (LMCache's chunk
  keys chain their prefix, so a block inside a prefix has no key of its own), then, once every
  block reached the L2 and the server's L1 was cleared, the p50 of their one-block loads
  (lookup, which prefetches from the L2, the status awaited, retrieve), in microseconds;
  verified.
Figures are GB/s (10^9 bytes/s) of block bytes moved, unless named ``_us``. The server's
start and the registration are not timed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TOKENS_PER_BLOCK = 16
HEAD_DIM = 128
LATENCY_LOADS = 32
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, shm_name: str, l1_gb: float, l2_dir: str, log: Any) -> Any:
    adapter = {"type": "fs", "base_path": l2_dir, "use_odirect": True}
    argv = [sys.executable, "-m", "lmcache.v1.multiprocess.server"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(TOKENS_PER_BLOCK)]
    argv += ["--supported-transfer-mode", "engine_driven", "--shm-name", shm_name]
    argv += ["--l1-size-gb", f"{l1_gb:.3f}", "--no-l1-use-lazy", "--eviction-policy", "LRU"]
    argv += ["--disable-observability", "--l2-adapter", json.dumps(adapter)]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def run_size(block: int, n: int, prefix: int, directory: str) -> dict[str, float]:
    import torch
    import zmq
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    torch.set_num_threads(1)
    heads = block // (2 * TOKENS_PER_BLOCK * HEAD_DIM * 2)
    if heads * 2 * TOKENS_PER_BLOCK * HEAD_DIM * 2 != block:
        raise ValueError(f"a block of {block} bytes is no whole number of fp16 heads")
    nbytes = n * block
    blocks = 2 * n + 1  # block 0 unused (vLLM's null block), then sources, then loads
    kv = torch.zeros((2, blocks, TOKENS_PER_BLOCK, heads, HEAD_DIM), dtype=torch.float16)
    kv.view(torch.int16)[:, 1 : n + 1].copy_(
        torch.randint(-(2**15), 2**15, (2, n, TOKENS_PER_BLOCK, heads, HEAD_DIM), dtype=torch.int16)
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
                    engine_group_id=0, layer_indices=(0,), tokens_per_block=TOKENS_PER_BLOCK
                )
            ],
            engine_type=EngineType.VLLM,
        )
        sessions = iter(range(1, 1 << 30))

        def key(first: int, count: int, rid: str) -> Any:
            tokens = tuple(range(first * TOKENS_PER_BLOCK, (first + count) * TOKENS_PER_BLOCK))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma list of block sizes in bytes")
    parser.add_argument("--mib", type=int, required=True, help="bytes per size, MiB")
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--dir", help="directory for the server's L2 (default: a temp dir)")
    args = parser.parse_args(argv)
    _quiet()
    import lmcache

    results: dict[str, Any] = {"lmcache_version": getattr(lmcache, "__version__", "?")}
    for block in (int(s) for s in args.sizes.split(",")):
        directory = tempfile.mkdtemp(prefix="lmcache-peer-mp-", dir=args.dir)
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
