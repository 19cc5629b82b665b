"""PUT/GET throughput of the object tier: S3BlockStore vs plain boto3 vs plain obstore.

Each cell PUTs ``--count`` objects of one block size with 1 or N client threads, then GETs them
back, against the same S3 server: a SeaweedFS started here (kvoffload/soak/s3server.py) or ``--endpoint``.
Plain clients move ``HEADER_SIZE + block`` bytes from a prebuilt buffer and read into a fresh
buffer; S3BlockStore moves the same bytes from and into page-aligned host slots, including header
build, checksum and copy. Writes JSON to ``--out``.
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
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import boto3
import obstore
from botocore.config import Config
from obstore.store import S3Store

from kvoffload.blockformat import HEADER_SIZE, deployment_fingerprint
from workers.object import S3BlockStore

SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


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


class ObstoreRunner:
    """Plain obstore S3Store, no retries."""

    name = "obstore"

    def __init__(self, cfg: dict, block_bytes: int, threads: int) -> None:
        self.store = S3Store(
            cfg["bucket"],
            endpoint=cfg["endpoint"],
            access_key_id=cfg["access_key"],
            secret_access_key=cfg["secret_key"],
            region=cfg["region"],
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "timeout": timedelta(seconds=30)},
            retry_config={"max_retries": 0},
        )
        self.body = os.urandom(HEADER_SIZE + block_bytes)

    def put(self, index: int) -> None:
        obstore.put(self.store, f"bench/obstore/{index}", self.body)

    def get(self, index: int) -> None:
        data = obstore.get(self.store, f"bench/obstore/{index}").bytes()
        assert len(data) == len(self.body)

    def close(self) -> None:
        pass


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


RUNNERS = {cls.name: cls for cls in (Boto3Runner, ObstoreRunner, BlockStoreRunner)}


def timed_phase(op, count: int, threads: int) -> dict:
    """Run op(0..count-1) on `threads` threads; MB/s over wall time and p50 latency in ms."""
    latencies: list[float] = []

    def one(index: int) -> None:
        start = time.perf_counter()
        op(index)
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, range(count)))
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 4), "p50_ms": round(statistics.median(latencies) * 1000, 2)}


def run_cell(runner_cls, cfg: dict, size_name: str, threads: int, count: int) -> dict:
    block_bytes = SIZES[size_name]
    runner = runner_cls(cfg, block_bytes, threads)
    try:
        runner.put(0)
        runner.get(0)
        put = timed_phase(runner.put, count, threads)
        get = timed_phase(runner.get, count, threads)
    finally:
        runner.close()
    megabytes = count * (HEADER_SIZE + block_bytes) / 1e6
    return {
        "client": runner_cls.name,
        "block": size_name,
        "threads": threads,
        "count": count,
        "put_mb_s": round(megabytes / put["wall_s"], 1),
        "get_mb_s": round(megabytes / get["wall_s"], 1),
        "put_p50_ms": put["p50_ms"],
        "get_p50_ms": get["p50_ms"],
    }


def print_table(cells: list[dict]) -> None:
    print(
        f"{'client':<13}{'block':<8}{'thr':>4}{'PUT MB/s':>10}{'GET MB/s':>10}{'PUT p50':>9}{'GET p50':>9}"
    )
    for c in cells:
        print(
            f"{c['client']:<13}{c['block']:<8}{c['threads']:>4}{c['put_mb_s']:>10}{c['get_mb_s']:>10}"
            f"{c['put_p50_ms']:>9}{c['get_p50_ms']:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--count", type=int, default=64, help="objects per cell")
    parser.add_argument("--out", default="results/bench_object.json")
    args = parser.parse_args(argv)

    server = None
    tmp = None
    if args.endpoint is None:
        from kvoffload.soak.s3server import S3Server

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
                for client in args.clients.split(","):
                    cell = run_cell(RUNNERS[client], cfg, size_name, threads, args.count)
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    finally:
        if server is not None:
            server.stop()
            tmp.cleanup()
    result = {
        "endpoint": "seaweedfs (started by the script)" if server is not None else endpoint,
        "cpus": os.cpu_count(),
        "cells": cells,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(cells)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
