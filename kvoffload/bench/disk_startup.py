"""Start-up of a large disk tier: how long the restart scan of N blocks takes, and how soon
the first batch of keys can be announced to the manager. JSON out.

Fills a fresh directory with ``--blocks`` records (4 KiB blocks by default), closes it, drops
the slab files from the page cache (posix_fadvise DONTNEED), reopens it and times ``open()``
(the header scan) and the first ``on_batch`` callback. The manager keeps answering lookups
during the scan (disk keys become HITs batch by batch), so the scan time bounds how long the
disk tier is partly unknown after a restart, not how long lookups block.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

from kvoffload.memory.blockformat import deployment_fingerprint, disk_record_bytes
from workers.disk import DiskStore


def drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("slab-*.kvs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    parser.add_argument("--out", default="results/bench_disk_startup.json")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvo-startup-", dir=args.dir))
    fingerprint = deployment_fingerprint(args.block_bytes, "bench")
    capacity = (args.blocks + 16) * disk_record_bytes(args.block_bytes)
    area = mmap.mmap(-1, args.block_bytes)
    slot = memoryview(area)
    store = DiskStore(root, args.block_bytes, fingerprint, capacity, direct_io=False)
    store.open()
    t0 = time.perf_counter()
    for i in range(args.blocks):
        slot[:8] = i.to_bytes(8, "little")
        store.put(i.to_bytes(8, "little") * 4, slot)
    fill_s = time.perf_counter() - t0
    store.close()
    drop_page_cache(root)

    first_batch_at: list[float] = []
    announced = 0

    def on_batch(keys: list[bytes]) -> None:
        nonlocal announced
        if not first_batch_at:
            first_batch_at.append(time.perf_counter())
        announced += len(keys)

    reopened = DiskStore(root, args.block_bytes, fingerprint, capacity)
    t0 = time.perf_counter()
    reopened.open(on_batch=on_batch)
    scan_s = time.perf_counter() - t0
    result = {
        "blocks": args.blocks,
        "block_bytes": args.block_bytes,
        "direct_io": reopened.direct_io,
        "fill_s": fill_s,
        "scan_s": scan_s,
        "scan_blocks_per_s": args.blocks / scan_s,
        "first_batch_after_s": first_batch_at[0] - t0 if first_batch_at else None,
        "keys_announced": announced,
        "keys_indexed": len(reopened.keys()),
    }
    reopened.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    for path in sorted(root.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    root.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
