"""PUT/GET throughput of the object tier: S3BlockStore against the S3 clients, in the same run.

Clients, all against the same S3 server (a SeaweedFS started here, kvoffload/testing/s3server.py, or
``--endpoint``):
- ``boto3``: plain boto3, tuned;
- ``obstore``: plain obstore ``S3Store`` on its defaults (signed payload), the reference;
- ``obstore-unsigned``: obstore with the client settings S3BlockStore uses (unsigned payload, same
  timeouts and pool): s3blockstore against it is the cost of the wrapper alone;
- ``s3blockstore``: S3BlockStore from and into page-aligned host slots, including header build,
  checksum, verification and copies.
Plain clients move ``HEADER_SIZE + block`` bytes from a prebuilt buffer, and a GET ends with the
response in memory.

Method: per block size and thread count every client is built once and warmed up. Each round PUTs
then GETs ``--count`` objects per client; within a phase the clients take turns in batches of
``--batch`` objects (the order rotating), so load from elsewhere on the machine hits them alike.
A client's MB/s in a round is its bytes over its summed batch wall time; its ratio to the
reference is taken per round, and the median over ``--rounds`` rounds is reported (``ratios``),
with each client's process CPU time per object. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import boto3
import obstore
from botocore.config import Config
from obstore.store import S3Store

from kvoffload.memory.blockformat import HEADER_SIZE, deployment_fingerprint
from workers.object import S3BlockStore

SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
OPS = ("put", "get")
REFERENCE = "obstore"


class Runner(Protocol):
    name: str

    def put(self, index: int) -> None: ...

    def get(self, index: int) -> None: ...

    def close(self) -> None: ...


class Boto3Runner:
    """Plain boto3, tuned: pooled connections, no retries, no request checksums, path style."""

    name = "boto3"

    def __init__(self, cfg: dict, block_bytes: int, threads: int) -> None:
        self.bucket = cfg["bucket"]
        self.client = boto3.client(
            "s3",
            endpoint_url=cfg["endpoint"],
            aws_access_key_id=cfg["access_key"],
            aws_secret_access_key=cfg["secret_key"],
            region_name=cfg["region"],
            config=Config(
                max_pool_connections=threads,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path"},
                connect_timeout=5,
                read_timeout=30,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self.body = os.urandom(HEADER_SIZE + block_bytes)

    def put(self, index: int) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"bench/boto3/{index}", Body=self.body)

    def get(self, index: int) -> None:
        response = self.client.get_object(Bucket=self.bucket, Key=f"bench/boto3/{index}")
        with response["Body"] as body:
            data = body.read()
        assert len(data) == len(self.body)

    def close(self) -> None:
        self.client.close()


def _s3_store(cfg: dict, **options: Any) -> S3Store:
    """A plain obstore S3Store on the bench bucket, path-style, with these client options."""
    return S3Store(
        cfg["bucket"],
        endpoint=cfg["endpoint"],
        access_key_id=cfg["access_key"],
        secret_access_key=cfg["secret_key"],
        region=cfg["region"],
        virtual_hosted_style_request=False,
        **options,
    )


class ObstoreRunner:
    """Plain obstore S3Store on its defaults, no retries."""

    name = "obstore"

    def __init__(self, cfg: dict, block_bytes: int, threads: int) -> None:
        self.store = _s3_store(
            cfg,
            client_options={"allow_http": True, "timeout": timedelta(seconds=30)},
            retry_config={"max_retries": 0},
        )
        self.body = os.urandom(HEADER_SIZE + block_bytes)

    def put(self, index: int) -> None:
        obstore.put(self.store, f"bench/{self.name}/{index}", self.body)

    def get(self, index: int) -> None:
        data = obstore.get(self.store, f"bench/{self.name}/{index}").bytes()
        assert len(data) == len(self.body)

    def close(self) -> None:
        pass


class UnsignedObstoreRunner(ObstoreRunner):
    """obstore with S3BlockStore's client settings: unsigned payload, its timeouts and pool."""

    name = "obstore-unsigned"

    def __init__(self, cfg: dict, block_bytes: int, threads: int) -> None:
        self.store = _s3_store(
            cfg,
            unsigned_payload=True,
            client_options={
                "allow_http": True,
                "timeout": timedelta(seconds=30),
                "connect_timeout": timedelta(seconds=2),
                "pool_max_idle_per_host": str(threads),
            },
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=30)},
        )
        self.body = os.urandom(HEADER_SIZE + block_bytes)


class BlockStoreRunner:
    """S3BlockStore: page-aligned source/destination slots, header, checksum, verification."""

    name = "s3blockstore"

    def __init__(self, cfg: dict, block_bytes: int, threads: int) -> None:
        self.store = S3BlockStore(
            endpoint=cfg["endpoint"],
            bucket=cfg["bucket"],
            prefix="bench/blockstore",
            access_key_id=cfg["access_key"],
            secret_access_key=cfg["secret_key"],
            region=cfg["region"],
            block_bytes=block_bytes,
            fingerprint=deployment_fingerprint(block_bytes, "bench"),
            request_timeout_s=30.0,
            io_threads=threads,
        )
        self.pool = mmap.mmap(-1, block_bytes * (threads + 1))
        self.pool[:block_bytes] = os.urandom(block_bytes)
        self.block_bytes = block_bytes
        self.free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(1, threads + 1):
            self.free_slots.put(slot)

    def _slot(self, index: int) -> memoryview:
        return memoryview(self.pool)[index * self.block_bytes : (index + 1) * self.block_bytes]

    def put(self, index: int) -> None:
        with self._slot(0) as src:
            self.store.put(index.to_bytes(8, "big"), src)

    def get(self, index: int) -> None:
        slot = self.free_slots.get()
        try:
            with self._slot(slot) as dst:
                self.store.get(index.to_bytes(8, "big"), dst)
        finally:
            self.free_slots.put(slot)

    def close(self) -> None:
        self.store.close()
        self.pool.close()


RUNNERS: dict[str, Callable[[dict, int, int], Runner]] = {
    cls.name: cls for cls in (Boto3Runner, ObstoreRunner, UnsignedObstoreRunner, BlockStoreRunner)
}


class Phase:
    """Summed wall time, process CPU time and per-object latencies of one client's turns in one
    round and op (turns never overlap, so the process CPU of a turn is that client's)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.latencies: list[float] = []

    def run(self, pool: ThreadPoolExecutor, op: Callable[[int], None], indices: range) -> None:
        def one(index: int) -> None:
            start = time.perf_counter()
            op(index)
            self.latencies.append(time.perf_counter() - start)

        start, cpu_start = time.perf_counter(), time.process_time()
        list(pool.map(one, indices))
        self.wall_s += time.perf_counter() - start
        self.cpu_s += time.process_time() - cpu_start


def run_cell(
    cfg: dict,
    clients: list[str],
    size_name: str,
    threads: int,
    count: int,
    batch: int,
    rounds: int,
) -> list[dict]:
    """Every client at one size and thread count, interleaved in batches; one dict per client."""
    block_bytes = SIZES[size_name]
    megabytes = count * (HEADER_SIZE + block_bytes) / 1e6
    runners = {name: RUNNERS[name](cfg, block_bytes, threads) for name in clients}
    per_round: dict[str, list[dict[str, Phase]]] = {name: [] for name in clients}
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for runner in runners.values():
                list(pool.map(runner.put, range(threads)))
                list(pool.map(runner.get, range(threads)))
            for round_index in range(rounds):
                phases = {name: {op: Phase() for op in OPS} for name in clients}
                for op in OPS:
                    for turn, first in enumerate(range(0, count, batch)):
                        shift = (round_index + turn) % len(clients)
                        for name in clients[shift:] + clients[:shift]:
                            phases[name][op].run(
                                pool,
                                getattr(runners[name], op),
                                range(first, min(first + batch, count)),
                            )
                for name in clients:
                    per_round[name].append(phases[name])
    finally:
        for runner in runners.values():
            runner.close()
    cells = []
    for name in clients:
        rounds_mb_s = [
            {op: round(megabytes / phases[op].wall_s, 1) for op in OPS}
            for phases in per_round[name]
        ]
        cell: dict[str, Any] = {"client": name, "block": size_name, "threads": threads}
        cell["count"] = count
        for op in OPS:
            cell[f"{op}_mb_s"] = round(statistics.median(r[op] for r in rounds_mb_s), 1)
            latencies = [lat for phases in per_round[name] for lat in phases[op].latencies]
            cell[f"{op}_p50_ms"] = round(statistics.median(latencies) * 1000, 2)
            cpu_s = statistics.median(phases[op].cpu_s for phases in per_round[name])
            cell[f"{op}_client_cpu_us"] = round(cpu_s / count * 1e6)
        cell["rounds_mb_s"] = rounds_mb_s
        cells.append(cell)
    return cells


def ratios(cells: list[dict], reference: str) -> list[dict]:
    """Per cell and client: median over rounds of (client MB/s / reference MB/s in that round)."""
    out = []
    refs = {(c["block"], c["threads"]): c for c in cells if c["client"] == reference}
    for cell in cells:
        ref = refs.get((cell["block"], cell["threads"]))
        if ref is None or cell["client"] == reference:
            continue
        row: dict[str, Any] = {
            "client": cell["client"],
            "reference": reference,
            "block": cell["block"],
            "threads": cell["threads"],
        }
        for op in OPS:
            per_round = [
                mine[op] / theirs[op]
                for mine, theirs in zip(cell["rounds_mb_s"], ref["rounds_mb_s"], strict=True)
            ]
            row[op] = round(statistics.median(per_round), 3)
            row[f"{op}_rounds"] = [round(r, 3) for r in per_round]
        out.append(row)
    return out


def print_tables(cells: list[dict], rows: list[dict]) -> None:
    print(
        f"{'client':<21}{'block':<8}{'thr':>4}{'PUT MB/s':>10}{'GET MB/s':>10}"
        f"{'PUT p50':>9}{'GET p50':>9}{'PUT cpu':>9}{'GET cpu':>9}"
    )
    for c in cells:
        print(
            f"{c['client']:<21}{c['block']:<8}{c['threads']:>4}{c['put_mb_s']:>10}"
            f"{c['get_mb_s']:>10}{c['put_p50_ms']:>9}{c['get_p50_ms']:>9}"
            f"{c['put_client_cpu_us']:>9}{c['get_client_cpu_us']:>9}"
        )
    print("(p50 in ms; cpu: client process CPU per object in us)")
    print(f"\nmedian per-round ratio to {REFERENCE}")
    print(f"{'client':<21}{'block':<8}{'thr':>4}{'PUT':>8}{'GET':>8}")
    for r in rows:
        print(f"{r['client']:<21}{r['block']:<8}{r['threads']:>4}{r['put']:>8}{r['get']:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--endpoint", help="existing S3 endpoint; default: start SeaweedFS here")
    parser.add_argument("--bucket", default="kvoffload-bench")
    parser.add_argument(
        "--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "kvoffload-bench")
    )
    parser.add_argument(
        "--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "kvoffload-bench-secret")
    )
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--threads", default="1,8", help="comma list of client thread counts")
    parser.add_argument(
        "--clients", default=",".join(RUNNERS), help=f"comma list of {sorted(RUNNERS)}"
    )
    parser.add_argument("--count", type=int, default=64, help="objects per client, op and round")
    parser.add_argument("--batch", type=int, default=16, help="objects per turn of one client")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; ratios are their median")
    parser.add_argument("--out", default="results/bench_object.json")
    args = parser.parse_args(argv)
    clients = args.clients.split(",")
    if REFERENCE not in clients:
        parser.error(f"--clients must include the reference {REFERENCE!r}")

    server = None
    tmp = None
    if args.endpoint is None:
        from kvoffload.testing.s3server import S3Server

        tmp = tempfile.TemporaryDirectory(prefix="bench-object-")
        server = S3Server(
            tmp.name, access_key=args.access_key, secret_key=args.secret_key, region=args.region
        )
        server.start()
        server.create_bucket(args.bucket)
        endpoint = server.endpoint
    else:
        endpoint = args.endpoint
    cfg = {
        "endpoint": endpoint,
        "bucket": args.bucket,
        "access_key": args.access_key,
        "secret_key": args.secret_key,
        "region": args.region,
    }
    cells = []
    try:
        for size_name in args.sizes.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                for cell in run_cell(
                    cfg, clients, size_name, threads, args.count, args.batch, args.rounds
                ):
                    cells.append(cell)
                    print(json.dumps({k: v for k, v in cell.items() if k != "rounds_mb_s"}))
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    rows = ratios(cells, REFERENCE)
    result = {
        "endpoint": "seaweedfs (started by the script)" if server is not None else endpoint,
        "cpus": os.cpu_count(),
        "method": {"count": args.count, "batch": args.batch, "rounds": args.rounds},
        "cells": cells,
        "ratios": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(cells, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
