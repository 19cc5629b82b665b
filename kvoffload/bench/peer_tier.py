"""The peer tier on loopback: a prefix promoted from another node's pool and disk, against the
object tier's promotion of the same blocks from a local SeaweedFS and a local disk promotion,
all in the same run, with CURVE on. JSON out (``cells``, as ``bench peer``'s).

Three services on this machine: A (pool, disk, the object tier, serving its blocks to its
followers), B (following A: its peer tier only) and C (the object tier only, on A's bucket).
Each round stores two prefixes of ``--blocks`` blocks on A, waits until they reached A's disk
and the bucket and B indexed them, and empties A's pool; then, each timed from the lookup to
the last block a HIT in the loading node's pool:

- ``local disk``: A loads prefix 1 from its own disk (which also brings it into A's pool);
- ``peer pool``: B loads prefix 1 from A's pool;
- ``peer disk``: B loads prefix 2, which A holds on its disk only;
- ``object``: C loads prefix 1 from the bucket.

Then single blocks from A's pool to B, for p50 and p99 (``--samples``), and the CPU time the
two peer workers spent per MiB moved during the peer-pool loads. A local SeaweedFS is the floor
of S3: a real bucket adds 10 to 50 ms to each first byte.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvoffload.bench.cells import Cell
from kvoffload.bench.service import engine_store
from kvoffload.testing.helpers import wait_until
from kvoffload.testing.peers import fleet
from kvoffload.testing.s3server import S3Server, object_section
from kvoffload.testing.service import ServiceHarness, service_pool
from kvoffload.tiering import LookupResult

SUITE = "peer-tier"
BUCKET = "kvoffload-bench-peer"
S3_FLOOR_NOTE = (
    "a local SeaweedFS is the floor of S3: a real bucket adds 10-50 ms to each first byte"
)


class Nodes:
    """A, B and C (module docstring), started in ``root``; ``stop`` stops them."""

    def __init__(self, root: Path, block_bytes: int, slots: int, s3: S3Server) -> None:
        a, b = fleet(root, ["a", "b"])
        pool = {"num_slots": slots, "block_bytes": block_bytes}
        disk = {"capacity_bytes": (slots + 16) * (block_bytes + 4096) * 4}
        objects = object_section(s3, BUCKET, "bench")
        self.started: list[ServiceHarness] = []
        self.a = self._start(
            root / "a", {"pool": pool, "disk": disk, "object": objects, **a.sections(follows=[])}
        )
        self.b = self._start(
            root / "b",
            {"pool": pool, "disk": {"enabled": False}, **b.sections(follows=[a], serve=False)},
        )
        self.c = self._start(
            root / "c", {"pool": pool, "disk": {"enabled": False}, "object": objects}
        )

    def _start(self, home: Path, sections: dict[str, Any]) -> ServiceHarness:
        harness = ServiceHarness(home, sections, watch=False)
        self.started.append(harness)
        return harness.start()

    def stop(self) -> None:
        for harness in self.started:
            harness.stop()


def store(service: ServiceHarness, keys: list[bytes], block_bytes: int, seed: int) -> None:
    rows = np.random.default_rng(seed).integers(
        0, 256, size=(len(keys), block_bytes), dtype=np.uint8
    )
    with service.client("bench-writer", timeout_s=30) as client, service_pool(client) as pool:
        client.new_request("w")
        engine_store(client, "w", keys, pool, rows, wait=True)
        client.finish_request("w")


def load_s(service: ServiceHarness, keys: list[bytes], req: str) -> float:
    """Seconds from the lookup to every key a HIT (pinned) in ``service``'s pool."""
    with service.client("bench-reader", timeout_s=30) as client:
        client.new_request(req)
        left = list(keys)
        pinned: list[bytes] = []
        start = time.perf_counter()
        while left:
            outcome = client.lookup(req, left, pin=True, wait_ms=5000)
            hits = [k for k, r in zip(left, outcome.results, strict=False) if r is LookupResult.HIT]
            if LookupResult.MISS in outcome.results:
                raise RuntimeError(f"{req}: a MISS ({outcome})")
            pinned += hits
            left = [k for k in left if k not in set(hits)]
        elapsed = time.perf_counter() - start
        client.complete_load(req, pinned)
        client.finish_request(req)
    return elapsed


def peer_stats(service: ServiceHarness) -> Any:
    return service.status().workers["peer"].stats.medium


def cpu_s(pid: int | None) -> float:
    """Seconds on a CPU of ``pid``'s threads so far, to the nanosecond (the scheduler's own
    account in ``/proc/<pid>/task/*/schedstat``; ``cpu_times`` counts 10 ms clock ticks, which a
    16 MiB prefix moved in 20 ms cannot resolve), or the ticks where schedstat is absent."""
    if pid is None:
        return 0.0
    total_ns = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total_ns += int((task / "schedstat").read_text().split()[0])
    except FileNotFoundError:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    return total_ns / 1e9


def settle(nodes: Nodes, indexed: int) -> None:
    """Until A's cascades to its disk and the bucket landed and B indexes ``indexed`` keys."""
    a = nodes.a
    wait_until(
        lambda: (
            a.status().tiering.tiers["disk"].cascade_backlog == 0
            and a.status().tiering.tiers["object"].cascade_backlog == 0
            and a.status().tiering.tiers["disk"].dirty_keys == 0
            and a.status().tiering.tiers["object"].dirty_keys == 0
        ),
        timeout_s=120,
        what="A's cascades",
    )
    wait_until(lambda: peer_stats(nodes.b).keys_indexed >= indexed, timeout_s=60, what="B's index")


def one_round(nodes: Nodes, block_bytes: int, blocks: int, tag: str) -> dict[str, Any]:
    first = [f"{tag}-p1-{i}".encode().ljust(32, b".") for i in range(blocks)]
    second = [f"{tag}-p2-{i}".encode().ljust(32, b".") for i in range(blocks)]
    indexed = peer_stats(nodes.b).keys_indexed
    store(nodes.a, first, block_bytes, 1)
    store(nodes.a, second, block_bytes, 2)
    settle(nodes, indexed + 2 * blocks)
    with nodes.a.client("bench-admin") as admin:
        admin.reset_cache()
    local_disk = load_s(nodes.a, first, f"{tag}-a")
    a_pid, b_pid = nodes.a.worker_pid("peer"), nodes.b.worker_pid("peer")
    cpu_a, cpu_b = cpu_s(a_pid), cpu_s(b_pid)
    peer_pool = load_s(nodes.b, first, f"{tag}-b1")
    cpu_a, cpu_b = cpu_s(a_pid) - cpu_a, cpu_s(b_pid) - cpu_b
    peer_disk = load_s(nodes.b, second, f"{tag}-b2")
    obj = load_s(nodes.c, first, f"{tag}-c")
    mib = blocks * block_bytes / 2**20
    return {
        "local_disk_s": local_disk,
        "peer_pool_s": peer_pool,
        "peer_disk_s": peer_disk,
        "object_s": obj,
        "holder_cpu_s_per_mib": cpu_a / mib,
        "requester_cpu_s_per_mib": cpu_b / mib,
    }


def one_block_latencies(nodes: Nodes, block_bytes: int, samples: int, tag: str) -> list[float]:
    keys = [f"{tag}-one-{i}".encode().ljust(32, b".") for i in range(samples)]
    indexed = peer_stats(nodes.b).keys_indexed
    store(nodes.a, keys, block_bytes, 3)
    settle(nodes, indexed + samples)
    return [load_s(nodes.b, [key], f"{tag}-one-{i}") for i, key in enumerate(keys)]


def cells_for(block_bytes: int, blocks: int, rounds: list[dict], one: list[float]) -> list[Cell]:
    mb = blocks * block_bytes / 1e6

    def rate(name: str) -> float:
        return mb / statistics.median(r[name] for r in rounds) / 1e3  # GB/s

    obj = rate("object_s")
    others = {"local_disk_gb_s": rate("local_disk_s"), "object_gb_s": obj}
    p50 = statistics.median(one) * 1e6
    p99 = float(np.percentile(one, 99)) * 1e6
    holder = statistics.median(r["holder_cpu_s_per_mib"] for r in rounds) * 1e3
    requester = statistics.median(r["requester_cpu_s_per_mib"] for r in rounds) * 1e3
    return [
        Cell(
            SUITE,
            f"prefix of {blocks} from a peer's pool",
            block_bytes,
            "bytes",
            rate("peer_pool_s"),
            "GB/s",
            reference="object tier promotion (local SeaweedFS)",
            reference_value=obj,
            others={
                **others,
                "holder_cpu_ms_per_mib": holder,
                "requester_cpu_ms_per_mib": requester,
            },
            chart=True,
        ),
        Cell(
            SUITE,
            f"prefix of {blocks} from a peer's disk",
            block_bytes,
            "bytes",
            rate("peer_disk_s"),
            "GB/s",
            reference="object tier promotion (local SeaweedFS)",
            reference_value=obj,
            others=others,
        ),
        Cell(
            SUITE,
            "one block from a peer's pool, p50",
            block_bytes,
            "bytes",
            p50,
            "us",
            higher_is_better=False,
            others={"p99_us": p99},
        ),
    ]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="256K,1M", help="block sizes, comma separated")
    parser.add_argument("--blocks", type=int, default=16, help="blocks of a prefix")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=30, help="single-block loads")
    parser.add_argument("--out", default="results/bench_peer_tier.json")
    args = parser.parse_args(argv)
    cells: list[Cell] = []
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-peer-tier-") as tmp:
        s3 = S3Server(Path(tmp) / "s3")
        s3.start()
        try:
            s3.create_bucket(BUCKET)
            for size_text in args.sizes.split(","):
                block_bytes = parse_size(size_text)
                slots = max(64, 4 * args.blocks + args.samples + 8)
                nodes = Nodes(Path(tmp) / f"nodes-{block_bytes}", block_bytes, slots, s3)
                try:
                    rounds = [
                        one_round(nodes, block_bytes, args.blocks, f"r{i}")
                        for i in range(args.rounds)
                    ]
                    one = one_block_latencies(nodes, block_bytes, args.samples, "lat")
                finally:
                    nodes.stop()
                raw[str(block_bytes)] = {"rounds": rounds, "one_block_s": one}
                cells += cells_for(block_bytes, args.blocks, rounds, one)
                for cell in cells[-3:]:
                    print(json.dumps(cell.to_json()))
        finally:
            s3.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "suite": SUITE,
                "cpus": os.cpu_count(),
                "note": S3_FLOOR_NOTE,
                "curve": True,
                "cells": [c.to_json() for c in cells],
                "raw": raw,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
