"""The floor of a cold one-block load: the landing path's hops and its read, and nothing else.

A one-block cold load through the service crosses three processes (docs/design/cold-loads.md):
the client's lookup to the manager, the manager's job to the disk worker, the worker's read of
the record into a pool slot and its notice through the client's pipe, then the client's
verified copy out of the slot. ``cold_chain`` runs the same hops with the service's logic
taken out:

- a *relay* process stands for the manager: a ZeroMQ ROUTER for the caller and a DEALER to the
  reader over ipc; it forwards each record number to the reader and answers the caller;
- a *reader* process stands for the disk worker: one ``preadv`` of the record into a POSIX
  shared-memory slot (``O_DIRECT`` where the file system takes it), the record's xxh3, and a
  16-byte notice (record, digest) written into the caller's FIFO;
- the caller waits for the answer and the notice, copies the slot out and checks the digest.

No messages are decoded, no index is kept, nothing is pinned or released: the p50 of such
loads is what the disk, the kernel, ZeroMQ and three Python interpreters cost on this path on
this machine, and the service's one-block cold load minus it is the cost of the service's own
logic. Loads run back to back, as ``bench peer`` times the service's.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import xxhash
import zmq

from kvoffload.bench.limits import (
    O_DIRECT,
    PAGE,
    disk_read_limits,
    print_figures,
    zmq_rtt_us,
)

NOTICE = struct.Struct("<QQ")
"""A reader's notice: the record read and the xxh3 of its bytes."""
RECORD = struct.Struct("<Q")
STOP = b"stop"
FILE_BYTES = 64 << 20
"""Bytes of records written for a chain by default (``O_DIRECT`` reads bypass the page cache,
so a record read again is still read from the disk)."""
WARM_UP_LOADS = 20
"""Loads run before the timed ones (the processes' first calls)."""
ANSWER_TIMEOUT_MS = 10_000
"""How long the caller waits for the relay's answer and the reader's notice of one load."""


def cold_chain(
    directory: Path, block: int, loads: int = 300, records: int | None = None
) -> dict[str, Any]:
    """Time ``loads`` one-block loads of ``block`` bytes through the chain, each of a record
    drawn at random from ``records`` (default: ``FILE_BYTES`` worth, 16 at least) written to a
    file in ``directory`` and evicted from the page cache. Returns ``chain_p50_us`` and ``chain_p10_us``, ``loads``, ``block_bytes``, and
    ``direct`` (whether the reads were ``O_DIRECT``). RuntimeError if a notice tells another
    record, a copy does not match its digest, the reader closes its pipe (it died) or a
    process does not answer within ``ANSWER_TIMEOUT_MS``; the processes, the shared-memory
    slot and every file are gone when it returns or raises."""
    records = records or max(16, FILE_BYTES // block)
    work = Path(tempfile.mkdtemp(prefix="kvo-chain-", dir=directory))
    slot_name = f"/kvo-chain-{uuid.uuid4().hex[:16]}"
    children: list[subprocess.Popen[bytes]] = []
    ctx = zmq.Context()
    caller = ctx.socket(zmq.DEALER)
    slot: posix_ipc.SharedMemory | None = None
    notices = -1
    try:
        data = work / "records"
        _write_records(data, block, records)
        slot = posix_ipc.SharedMemory(slot_name, posix_ipc.O_CREX, size=block)
        slot_map = mmap.mmap(slot.fd, block)
        slot.close_fd()
        fifo = work / "notices"
        os.mkfifo(fifo, 0o600)
        notices = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        relay_in, relay_out = f"ipc://{work}/relay-in", f"ipc://{work}/relay-out"
        children.append(_spawn("relay", relay_in, relay_out))
        children.append(_spawn("reader", relay_out, str(data), slot_name, str(fifo), str(block)))
        caller.connect(relay_in)
        out = np.frombuffer(mmap.mmap(-1, block), dtype=np.uint8)
        source = np.frombuffer(slot_map, dtype=np.uint8)
        waiter = select.poll()
        waiter.register(notices, select.POLLIN)
        rng = random.Random(block)
        times = []
        for index in range(WARM_UP_LOADS + loads):
            record = rng.randrange(records)
            start = time.perf_counter()
            caller.send(RECORD.pack(record))
            if not caller.poll(ANSWER_TIMEOUT_MS):
                raise RuntimeError("the chain's relay did not answer")
            caller.recv()
            if not waiter.poll(ANSWER_TIMEOUT_MS):
                raise RuntimeError("the chain's reader sent no notice")
            notice = os.read(notices, NOTICE.size)
            if len(notice) != NOTICE.size:
                raise RuntimeError("the chain's reader sent no notice: it closed its pipe")
            told, digest = NOTICE.unpack(notice)
            np.copyto(out, source)
            if told != record or xxhash.xxh3_64_intdigest(out.data) != digest:
                raise RuntimeError(f"record {record}: the notice or the copy does not match")
            if index >= WARM_UP_LOADS:
                times.append(time.perf_counter() - start)
        caller.send(STOP)
        for child in children:
            child.wait(ANSWER_TIMEOUT_MS / 1000)
        times.sort()
        return {
            "block_bytes": block,
            "loads": loads,
            "direct": _direct(data, block),
            "chain_p50_us": statistics.median(times) * 1e6,
            "chain_p10_us": times[len(times) // 10] * 1e6,
        }
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        caller.close(linger=0)
        ctx.term()
        if notices >= 0:
            os.close(notices)
        if slot is not None:
            with contextlib.suppress(posix_ipc.ExistentialError):
                slot.unlink()
        shutil.rmtree(work, ignore_errors=True)


def _write_records(path: Path, block: int, records: int) -> None:
    """``records`` blocks of random bytes, synced and dropped from the page cache."""
    rng = np.random.default_rng(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for record in range(records):
            os.pwrite(fd, rng.integers(0, 256, block, dtype=np.uint8).data, record * block)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct(path: Path, block: int) -> bool:
    """Whether ``path`` opens with ``O_DIRECT`` (and ``block`` is whole pages)."""
    if not O_DIRECT or block % PAGE:
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | O_DIRECT))
    except OSError:
        return False
    return True


def _spawn(role: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvoffload.bench.hops", "--serve", role, *args])


def _relay(endpoint_in: str, endpoint_out: str) -> None:
    """Forward each record number from the caller to the reader and answer the caller at once;
    forward ``STOP`` and return."""
    ctx = zmq.Context()
    callers = ctx.socket(zmq.ROUTER)
    callers.bind(endpoint_in)
    reader = ctx.socket(zmq.DEALER)
    reader.bind(endpoint_out)
    poller = zmq.Poller()
    poller.register(callers, zmq.POLLIN)
    poller.register(reader, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if callers in ready:
                identity, frame = callers.recv_multipart()
                reader.send(frame)
                if frame == STOP:
                    return
                callers.send_multipart([identity, b"ok"])
            if reader in ready:
                reader.recv()
    finally:
        callers.close(linger=0)
        reader.close(linger=1000)
        ctx.term()


def _reader(endpoint: str, path: str, slot_name: str, fifo: str, block: int) -> None:
    """Read each record asked for into the slot, tell the caller through its FIFO, then report
    to the relay (as a disk worker reports to the manager); return on ``STOP``."""
    ctx = zmq.Context()
    relay = ctx.socket(zmq.DEALER)
    relay.connect(endpoint)
    slot = posix_ipc.SharedMemory(slot_name)
    slot_map = mmap.mmap(slot.fd, block)
    slot.close_fd()
    direct = _direct(Path(path), block)
    data = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    notices = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        while (frame := relay.recv()) != STOP:
            (record,) = RECORD.unpack(frame)
            if os.preadv(data, [slot_map], record * block) != block:
                raise RuntimeError(f"record {record}: short read")
            os.write(notices, NOTICE.pack(record, xxhash.xxh3_64_intdigest(slot_map)))
            os.sched_yield()
            relay.send(b"done")
    finally:
        os.close(notices)
        os.close(data)
        slot_map.close()
        relay.close(linger=0)
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256 << 10, help="block bytes")
    parser.add_argument("--loads", type=int, default=300)
    parser.add_argument("--dir", help="directory on the disk to read from (default: temp dir)")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        role, *rest = args.serve
        if role == "relay":
            _relay(*rest)
        else:
            endpoint, path, slot_name, fifo, block = rest
            _reader(endpoint, path, slot_name, fifo, int(block))
        return 0
    directory = Path(args.dir or tempfile.gettempdir())
    figures = cold_chain(directory, args.size, args.loads)
    figures.update(disk_read_limits(directory, args.size, 64 * args.size))
    figures["zmq_rtt_us"] = zmq_rtt_us()
    print_figures(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
