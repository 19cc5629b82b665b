"""DiskStore contract tests on real files: round trips, layouts, corruption, kill -9, capacity
and pinning, injected ENOSPC/EIO, threads, and the O_DIRECT probe."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    deployment_fingerprint,
)
from kvoffload.testing.helpers import REPO_ROOT
from workers.disk import FAULT_OPS, DiskStore, LayoutError, StoreFull, TransientIOError
from workers.disk import slab as slab_module
from workers.disk.layout import CLEAN_FILE
from workers.disk.rawio import probe_direct_io

BLOCK = 16384
FP = deployment_fingerprint(BLOCK, "test-layout")
OTHER_FP = deployment_fingerprint(BLOCK, "other-layout")
RECORD = 4096 + BLOCK


def payload_for(key: bytes, version: int = 0, size: int = BLOCK) -> bytes:
    """Deterministic block content: 8-byte version, then bytes seeded by (key, version)."""
    seed = int.from_bytes(
        hashlib.blake2b(key + version.to_bytes(8, "little"), digest_size=8).digest(), "little"
    )
    return version.to_bytes(8, "little") + np.random.default_rng(seed).bytes(size - 8)


def assert_self_consistent(key: bytes, data: bytes) -> None:
    version = int.from_bytes(data[:8], "little")
    assert data == payload_for(key, version, len(data)), (
        f"bytes of {key!r} are not a version ever written"
    )


def slot(data: bytes | None = None, size: int = BLOCK) -> mmap.mmap:
    """A page-aligned stand-in for a host-pool slot."""
    buf = mmap.mmap(-1, size)
    if data is not None:
        buf[:] = data
    return buf


def read(store: DiskStore, key: bytes) -> bytes:
    dst = slot(size=store.block_bytes)
    store.get(key, dst)
    return dst[:]


def find_record(store: DiskStore, key: bytes) -> tuple[Path, int]:
    """(slab file, header offset) of key's record, found by decoding header pages on disk."""
    for path in sorted(store.directory.glob("slab-*.kvs")):
        raw = path.read_bytes()
        for offset in range(0, len(raw), store.record_size):
            try:
                header = decode_header(raw[offset : offset + HEADER_SIZE], FP)
            except CorruptBlock:
                continue
            if header.key == key:
                return path, offset
    raise AssertionError(f"no record for {key!r}")


def flip_payload_bit(store: DiskStore, key: bytes, at: int, mask: int) -> None:
    """Flip the bits ``mask`` of byte ``at`` of ``key``'s stored payload, on disk."""
    path, offset = find_record(store, key)
    with open(path, "r+b") as f:
        f.seek(offset + 4096 + at)
        byte = f.read(1)
        f.seek(offset + 4096 + at)
        f.write(bytes([byte[0] ^ mask]))


@pytest.fixture
def open_store(tmp_path: Path):
    """Factory: open a DiskStore under tmp_path/"store" (closed at teardown)."""
    stores: list[DiskStore] = []

    def make(
        capacity_records: int = 64, fingerprint: bytes = FP, block_bytes: int = BLOCK, **kwargs
    ) -> DiskStore:
        record = 4096 + -(-block_bytes // 4096) * 4096
        store = DiskStore(
            tmp_path / "store", block_bytes, fingerprint, capacity_records * record, **kwargs
        )
        store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_round_trip_then_reopen(open_store) -> None:
    store = open_store(records_per_slab=8)
    keys = [os.urandom(32) for _ in range(20)]
    blocks = {key: os.urandom(BLOCK) for key in keys}
    for key in keys:
        assert store.put(key, slot(blocks[key])) == []
    for key in reversed(keys):
        assert read(store, key) == blocks[key]
    store.close()

    announced: list[bytes] = []
    reopened = DiskStore(store.directory.parent, BLOCK, FP, 64 * RECORD)
    reopened.open(on_batch=announced.extend, batch_size=7)
    try:
        assert json.loads((store.directory / "layout.json").read_text())["records_per_slab"] == 8
        assert sorted(announced) == sorted(keys)
        assert reopened.keys() == keys
        for key in keys:
            assert read(reopened, key) == blocks[key]
    finally:
        reopened.close()


def test_on_batch_receives_bounded_batches(open_store) -> None:
    store = open_store(records_per_slab=4)
    for i in range(10):
        store.put(b"k%d" % i, slot(payload_for(b"k%d" % i)))
    store.close()
    batches: list[list[bytes]] = []
    reopened = DiskStore(store.directory.parent, BLOCK, FP, 64 * RECORD)
    reopened.open(on_batch=batches.append, batch_size=3)
    reopened.close()
    assert all(1 <= len(batch) <= 3 for batch in batches)
    assert sorted(k for batch in batches for k in batch) == sorted(b"k%d" % i for i in range(10))


def test_other_fingerprint_sees_nothing_and_leaves_data_alone(open_store) -> None:
    first = open_store()
    for i in range(5):
        first.put(b"a%d" % i, slot(payload_for(b"a%d" % i)))
    first.close()

    second = open_store(fingerprint=OTHER_FP)
    assert second.keys() == []
    assert second.directory != first.directory
    second.put(b"b0", slot(payload_for(b"b0")))
    second.close()

    again = open_store()
    assert sorted(again.keys()) == [b"a%d" % i for i in range(5)]
    for i in range(5):
        assert read(again, b"a%d" % i) == payload_for(b"a%d" % i)


def test_incompatible_layout_or_second_opener_is_refused(open_store, tmp_path: Path) -> None:
    store = open_store()
    with pytest.raises(LayoutError):
        DiskStore(tmp_path / "store", BLOCK, FP, 64 * RECORD).open()
    store.close()
    with pytest.raises(LayoutError):
        DiskStore(tmp_path / "store", BLOCK * 2, FP, 64 * RECORD * 2).open()


def test_flipped_payload_byte_is_corrupt_and_dropped(open_store) -> None:
    store = open_store()
    keys = [b"k%d" % i for i in range(3)]
    for key in keys:
        store.put(key, slot(payload_for(key)))
    flip_payload_bit(store, keys[1], 1234, 0x01)

    with pytest.raises(CorruptBlock):
        read(store, keys[1])
    assert not store.contains(keys[1])
    with pytest.raises(KeyError):
        read(store, keys[1])
    for key in (keys[0], keys[2]):
        assert read(store, key) == payload_for(key)
    store.close()
    reopened = open_store()
    assert sorted(reopened.keys()) == [keys[0], keys[2]]


def test_torn_record_is_never_served(open_store) -> None:
    store = open_store()
    keys = [b"k%d" % i for i in range(3)]
    for key in keys:
        store.put(key, slot(payload_for(key)))
    path, offset = find_record(store, keys[0])
    store.close()
    with open(path, "r+b") as f:
        f.seek(offset + 4096 + BLOCK // 2)
        f.write(bytes(BLOCK // 2))

    reopened = open_store()
    if reopened.contains(keys[0]):
        with pytest.raises(CorruptBlock):
            read(reopened, keys[0])
    assert not reopened.contains(keys[0])
    for key in keys[1:]:
        assert read(reopened, key) == payload_for(key)


def crash_after_puts_main(root: str, count: int) -> None:
    """Child process: put keys k0..k<count-1> into a store of 64 records, then SIGKILL itself
    without closing it."""
    store = DiskStore(root, BLOCK, FP, 64 * RECORD)
    store.open()
    for i in range(count):
        key = b"k%d" % i
        store.put(key, slot(payload_for(key)))
    os.kill(os.getpid(), signal.SIGKILL)


def tear_payload_tail(store: DiskStore, key: bytes) -> tuple[Path, int]:
    """Zero the second half of ``key``'s payload on disk, as a write torn after its header
    page and the first half of its payload would leave a fresh record; (slab, header offset)."""
    path, offset = find_record(store, key)
    with open(path, "r+b") as f:
        f.seek(offset + 4096 + BLOCK // 2)
        f.write(bytes(BLOCK // 2))
    return path, offset


def test_torn_single_write_is_dropped_by_the_scan_after_a_crash(open_store, tmp_path: Path) -> None:
    root = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(Path(__file__).parent)]))
    code = f"from test_slab import crash_after_puts_main; crash_after_puts_main({str(root)!r}, 3)"
    child = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL
    unopened = DiskStore(root, BLOCK, FP, 64 * RECORD)
    assert not (unopened.directory / CLEAN_FILE).exists()
    path, offset = tear_payload_tail(unopened, b"k1")

    with capture_logs() as logs:
        store = open_store()
    assert sorted(store.keys()) == [b"k0", b"k2"], "a torn record must not be indexed"
    lost = [e["keys"] for e in logs if e["event"] == "disk_scan_corrupt_blocks"]
    assert lost == [[b"k1".hex()]], "the key the scan dropped is named in the log"
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(HEADER_SIZE) == bytes(HEADER_SIZE), "its header page is cleared"
    for key in (b"k0", b"k2"):
        assert read(store, key) == payload_for(key)
    store.close()
    assert (store.directory / CLEAN_FILE).exists()

    tear_payload_tail(store, b"k2")
    reopened = open_store()
    assert not (store.directory / CLEAN_FILE).exists()
    assert reopened.contains(b"k2"), "after a clean close the scan trusts the header pages"
    with pytest.raises(CorruptBlock):
        read(reopened, b"k2")
    assert reopened.keys() == [b"k0"]


def test_close_marks_clean_only_when_no_record_can_be_torn(open_store) -> None:
    failing = {"on": False}

    def hook(op: str, key: bytes) -> None:
        if failing["on"] and op in ("write_record", "clear") and key == b"bad":
            raise OSError(errno.EIO, "injected")

    store = open_store(fault_hook=hook)
    store.put(b"bad", slot(payload_for(b"bad", 1)))
    store.close()
    assert (store.directory / CLEAN_FILE).exists()

    store = open_store(fault_hook=hook)
    failing["on"] = True
    with pytest.raises(OSError):
        store.put(b"bad", slot(payload_for(b"bad", 2)))
    store.close()
    assert not (store.directory / CLEAN_FILE).exists(), "a stale header may be over a torn payload"
    reopened = open_store()
    assert reopened.keys() == [b"bad"]
    assert read(reopened, b"bad") == payload_for(b"bad", 1)


def test_unreadable_garbage_header_is_cleared_at_open(open_store) -> None:
    store = open_store()
    store.put(b"good", slot(payload_for(b"good")))
    path, offset = find_record(store, b"good")
    store.close()
    with open(path, "r+b") as f:
        f.seek(offset + store.record_size)
        f.write(b"\xff" * 200)

    reopened = open_store()
    assert reopened.keys() == [b"good"]
    with open(path, "rb") as f:
        f.seek(offset + store.record_size)
        assert f.read(200) == bytes(200)


CRASH_CAPACITY = 48
CRASH_KEYS = 80


def crash_writer_main(root: str, direct_io: str, kill_op: str, kill_at: int, parent: int) -> None:
    """Child process: put versions of CRASH_KEYS keys; SIGKILL itself at the kill_at-th call of
    fault op kill_op (or wait for the parent's SIGKILL when kill_op is "none"). Writes are
    fdatasync'ed only when kill_op is "fsync". Stops if the parent process goes away."""
    calls = {"n": 0}

    def hook(op: str, key: bytes) -> None:
        if op == kill_op:
            calls["n"] += 1
            if calls["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    store = DiskStore(
        root,
        BLOCK,
        FP,
        CRASH_CAPACITY * RECORD,
        records_per_slab=16,
        durability="fsync" if kill_op == "fsync" else "none",
        direct_io=None if direct_io == "probe" else False,
        fault_hook=hook,
    )
    store.open()
    src = slot()
    for version in range(1, 200_000):
        if os.getppid() != parent:
            return
        key = b"key-%d" % (version % CRASH_KEYS)
        src[:] = payload_for(key, version)
        store.put(key, src)
        if version == 60:
            print("ready", flush=True)


@pytest.mark.parametrize(
    "direct_io, kill_op, kill_at",
    [
        ("probe", "none", 0),
        ("off", "none", 0),
        ("probe", "write_record", 70),
        ("probe", "write_record", 95),
        ("off", "write_record", 130),
        ("probe", "fsync", 41),
        ("off", "allocate", 2),
    ],
)
def test_kill_9_leaves_only_complete_blocks(
    tmp_path: Path, direct_io: str, kill_op: str, kill_at: int
) -> None:
    root = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(Path(__file__).parent)]))
    code = (
        f"from test_slab import crash_writer_main; "
        f"crash_writer_main({str(root)!r}, {direct_io!r}, {kill_op!r}, {kill_at}, {os.getpid()})"
    )
    for round_number in range(2):
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
        try:
            if kill_op == "none":
                assert b"ready\n" in iter(child.stdout.readline, b"")
                time.sleep(0.05 + 0.1 * round_number)
                child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            child.kill()
            child.wait()
            child.stdout.close()

        store = DiskStore(root, BLOCK, FP, CRASH_CAPACITY * RECORD, records_per_slab=16)
        store.open()
        try:
            keys = store.keys()
            assert 0 < len(keys) <= CRASH_CAPACITY
            for key in keys:
                assert_self_consistent(key, read(store, key))
        finally:
            store.close()


def test_capacity_and_lru_order(open_store) -> None:
    store = open_store(capacity_records=4, records_per_slab=3)
    for key in (b"a", b"b", b"c", b"d"):
        assert store.put(key, slot(payload_for(key))) == []
    assert store.used_bytes == store.capacity_bytes == 4 * RECORD
    store.touch([b"a", b"absent"])
    assert store.put(b"e", slot(payload_for(b"e"))) == [b"b"]
    read(store, b"c")
    assert store.put(b"f", slot(payload_for(b"f"))) == [b"d"]
    assert store.put(b"g", slot(payload_for(b"g"))) == [b"a"]
    assert store.keys() == [b"e", b"c", b"f", b"g"]
    assert store.used_bytes <= store.capacity_bytes
    assert store.put(b"c", slot(payload_for(b"c", 2))) == []
    assert read(store, b"c") == payload_for(b"c", 2)
    for key in (b"e", b"f", b"g"):
        assert read(store, key) == payload_for(key)
    assert sum(p.stat().st_size for p in store.directory.glob("slab-*.kvs")) <= store.capacity_bytes


class BlockingReads:
    """Fault hook that parks reads of chosen keys until released."""

    def __init__(self, *keys: bytes) -> None:
        self.keys = set(keys)
        self.entered = {key: threading.Event() for key in keys}
        self.release = threading.Event()

    def __call__(self, op: str, key: bytes) -> None:
        if op == "read" and key in self.keys:
            self.entered[key].set()
            assert self.release.wait(10)


def start_read(store: DiskStore, key: bytes, hook: BlockingReads) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["data"] = read(store, key)
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert hook.entered[key].wait(10)
    return thread, outcome


def test_pinned_block_is_not_evicted_and_store_full(open_store) -> None:
    hook = BlockingReads(b"a", b"d")
    store = open_store(capacity_records=2, fault_hook=hook)
    store.put(b"a", slot(payload_for(b"a")))
    store.put(b"b", slot(payload_for(b"b")))
    reader_a, outcome_a = start_read(store, b"a", hook)
    store.touch([b"b"])
    assert store.keys() == [b"a", b"b"]
    assert store.put(b"c", slot(payload_for(b"c"))) == [b"b"]
    assert store.put(b"d", slot(payload_for(b"d"))) == [b"c"]
    reader_d, outcome_d = start_read(store, b"d", hook)
    with pytest.raises(StoreFull):
        store.put(b"e", slot(payload_for(b"e")))
    assert sorted(store.keys()) == [b"a", b"d"]
    hook.release.set()
    reader_a.join(10)
    reader_d.join(10)
    assert outcome_a == {"data": payload_for(b"a")}
    assert outcome_d == {"data": payload_for(b"d")}
    assert store.put(b"e", slot(payload_for(b"e"))) == [b"a"]
    assert store.used_bytes <= store.capacity_bytes


def test_overwrite_while_read_keeps_reader_and_newest_wins(open_store) -> None:
    hook = BlockingReads(b"a")
    store = open_store(capacity_records=3, fault_hook=hook)
    store.put(b"a", slot(payload_for(b"a", 1)))
    reader, outcome = start_read(store, b"a", hook)
    assert store.put(b"a", slot(payload_for(b"a", 2))) == []
    assert store.used_bytes == 2 * RECORD
    hook.keys.clear()
    assert read(store, b"a") == payload_for(b"a", 2)
    hook.release.set()
    reader.join(10)
    assert outcome == {"data": payload_for(b"a", 1)}
    assert store.used_bytes == RECORD
    store.close()
    reopened = open_store(capacity_records=3)
    assert reopened.keys() == [b"a"]
    assert read(reopened, b"a") == payload_for(b"a", 2)


def test_newest_generation_wins_when_old_copy_was_not_cleared(open_store) -> None:
    hook = BlockingReads(b"a")
    failing_clears: list[bytes] = []

    def faults(op: str, key: bytes) -> None:
        hook(op, key)
        if op == "clear" and key == b"a":
            failing_clears.append(key)
            raise OSError(errno.EIO, "injected")

    store = open_store(capacity_records=3, fault_hook=faults)
    store.put(b"a", slot(payload_for(b"a", 1)))
    reader, _ = start_read(store, b"a", hook)
    store.put(b"a", slot(payload_for(b"a", 2)))
    hook.release.set()
    reader.join(10)
    assert failing_clears == [b"a"]
    store.close()

    reopened = open_store(capacity_records=3)
    assert reopened.keys() == [b"a"]
    assert read(reopened, b"a") == payload_for(b"a", 2)
    assert reopened.used_bytes == RECORD


@pytest.mark.parametrize("failing_op", ["write_record", "allocate"])
def test_enospc_fails_put_marks_degraded_until_a_put_succeeds(open_store, failing_op: str) -> None:
    def hook(op: str, key: bytes) -> None:
        if op == failing_op and key == b"full":
            raise OSError(errno.ENOSPC, "No space left on device")

    store = open_store(records_per_slab=1, fault_hook=hook)
    store.put(b"ok", slot(payload_for(b"ok")))
    used = store.used_bytes
    with pytest.raises(OSError) as raised:
        store.put(b"full", slot(payload_for(b"full")))
    assert raised.value.errno == errno.ENOSPC
    assert store.degraded
    assert not store.contains(b"full")
    assert store.used_bytes == used
    store.put(b"later", slot(payload_for(b"later")))
    assert not store.degraded
    store.close()

    reopened = open_store(records_per_slab=1)
    assert sorted(reopened.keys()) == [b"later", b"ok"]
    assert reopened.used_bytes == 2 * RECORD


def test_transient_read_errors_keep_the_block(open_store) -> None:
    failures = {"left": 0, "errno": errno.EIO}

    def hook(op: str, key: bytes) -> None:
        if op == "read" and failures["left"]:
            failures["left"] -= 1
            raise OSError(failures["errno"], os.strerror(failures["errno"]))

    store = open_store(fault_hook=hook)
    store.put(b"k", slot(payload_for(b"k")))
    for code in (errno.EIO, errno.EMFILE, errno.EINTR):
        failures.update(left=1, errno=code)
        with pytest.raises(TransientIOError) as raised:
            read(store, b"k")
        assert isinstance(raised.value, OSError) and raised.value.errno == code
        assert store.contains(b"k")
        assert read(store, b"k") == payload_for(b"k")


def test_repeated_eio_drops_the_block(open_store) -> None:
    def hook(op: str, key: bytes) -> None:
        if op == "read" and key == b"bad":
            raise OSError(errno.EIO, "Input/output error")

    store = open_store(fault_hook=hook)
    store.put(b"bad", slot(payload_for(b"bad")))
    for _ in range(2):
        with pytest.raises(TransientIOError):
            read(store, b"bad")
    with pytest.raises(CorruptBlock):
        read(store, b"bad")
    assert not store.contains(b"bad")


def test_threads_put_and_get_concurrently(open_store) -> None:
    store = open_store(capacity_records=64, records_per_slab=8)
    errors: list[BaseException] = []

    def worker(thread_number: int) -> None:
        try:
            src = slot()
            for i in range(40):
                own = b"t%d-%d" % (thread_number, i % 12)
                src[:] = payload_for(own, i)
                store.put(own, src)
                assert read(store, own) == payload_for(own, i)
                shared = b"shared-%d" % (i % 3)
                src[:] = payload_for(shared, thread_number * 1000 + i)
                store.put(shared, src)
                with contextlib.suppress(KeyError):
                    assert_self_consistent(shared, read(store, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert sorted(store.keys()) == sorted(
        [b"t%d-%d" % (n, i) for n in range(4) for i in range(12)]
        + [b"shared-%d" % i for i in range(3)]
    )
    assert store.used_bytes == len(store.keys()) * RECORD
    for key in sorted(store.keys()):
        assert_self_consistent(key, read(store, key))


def test_direct_io_reports_the_probe_and_can_be_turned_off(open_store, tmp_path: Path) -> None:
    store = open_store()
    assert store.direct_io == probe_direct_io(store.directory)
    if _filesystem_type(tmp_path) == "ext4":
        assert store.direct_io
    store.put(b"aligned", slot(payload_for(b"aligned")))
    store.put(b"from-bytes", payload_for(b"from-bytes"))
    into = bytearray(BLOCK)
    store.get(b"aligned", into)
    assert bytes(into) == payload_for(b"aligned")
    assert read(store, b"from-bytes") == payload_for(b"from-bytes")
    store.close()

    buffered = open_store(direct_io=False)
    assert not buffered.direct_io
    assert read(buffered, b"aligned") == payload_for(b"aligned")
    buffered.put(b"buffered", slot(payload_for(b"buffered")))
    buffered.close()
    assert read(open_store(), b"buffered") == payload_for(b"buffered")


def test_unaligned_block_size_uses_buffered_io(open_store) -> None:
    size = 10000
    fingerprint = deployment_fingerprint(size, "test-layout")
    with pytest.raises(ValueError):
        DiskStore(Path("unused"), size, fingerprint, 10 * 16384, direct_io=True)
    store = open_store(block_bytes=size, fingerprint=fingerprint)
    assert not store.direct_io
    assert store.record_size == 4096 + 12288
    store.put(b"odd", slot(payload_for(b"odd", size=size), size=size))
    store.close()
    reopened = open_store(block_bytes=size, fingerprint=fingerprint)
    assert read(reopened, b"odd") == payload_for(b"odd", size=size)


def test_delete_and_fsync_durability(open_store) -> None:
    store = open_store(durability="fsync")
    for key in (b"keep", b"drop"):
        store.put(key, slot(payload_for(key)))
    assert store.delete(b"drop")
    assert not store.delete(b"drop")
    assert store.used_bytes == RECORD
    store.close()
    reopened = open_store()
    assert reopened.keys() == [b"keep"]
    assert read(reopened, b"keep") == payload_for(b"keep")


def test_fault_hook_sees_every_documented_op(open_store) -> None:
    seen: list[tuple[str, bytes]] = []

    def hook(op: str, key: bytes) -> None:
        seen.append((op, key))

    store = open_store(durability="fsync", fault_hook=hook)
    store.put(b"a", slot(payload_for(b"a")))
    store.put(b"a", slot(payload_for(b"a", 1)))
    read(store, b"a")
    store.delete(b"a")
    store.put(b"b", slot(payload_for(b"b")))
    store.close()
    open_store(fault_hook=hook)
    assert {op for op, _ in seen} == set(FAULT_OPS)
    assert {key for op, key in seen if op != "scan"} == {b"a", b"b"}


def test_argument_checks(open_store) -> None:
    store = open_store()
    for bad_key in (b"", b"x" * 65, "text"):
        with pytest.raises(ValueError):
            store.put(bad_key, slot())
    with pytest.raises(ValueError):
        store.put(b"k", slot(size=BLOCK * 2))
    with pytest.raises(ValueError):
        store.get(b"k", payload_for(b"k"))
    with pytest.raises(KeyError):
        read(store, b"absent")
    with pytest.raises(ValueError):
        DiskStore(Path("unused"), BLOCK, FP, RECORD - 1)
    with pytest.raises(ValueError):
        DiskStore(Path("unused"), BLOCK, FP, RECORD, durability="sometimes")


def _filesystem_type(path: Path) -> str:
    best, fstype = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mount_point, kind = line.split()[1:3]
        inside = (
            mount_point == "/"
            or str(path) == mount_point
            or str(path).startswith(mount_point + "/")
        )
        if inside and len(mount_point) > len(best):
            best, fstype = mount_point, kind
    return fstype


def test_the_store_is_private_root_and_directory_0700_and_files_0600(tmp_path: Path) -> None:
    root = tmp_path / "data" / "disk"
    store = DiskStore(root, BLOCK, FP, 8 * RECORD)
    store.open()
    try:
        store.put(b"k" * 16, slot(payload_for(b"k" * 16)))
        assert mode(root) == 0o700 and mode(store.directory) == 0o700
        files = [
            store.directory / "layout.json",
            store.directory / "lock",
            *store.directory.glob("slab-*.kvs"),
        ]
        assert len(files) == 3 and [mode(f) for f in files] == [0o600] * 3
    finally:
        store.close()
    os.chmod(store.directory, 0o755)
    os.chmod(store.directory / "layout.json", 0o644)
    reopened = DiskStore(root, BLOCK, FP, 8 * RECORD)
    reopened.open()
    try:
        assert mode(store.directory) == 0o700 and mode(store.directory / "layout.json") == 0o600
    finally:
        reopened.close()


def mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def _counting_reads(monkeypatch) -> list[int]:
    """The sizes of the store's positional reads from now on (the real reads still run)."""
    sizes: list[int] = []
    real = slab_module.preadv_all

    def counted(fd: int, bufs, offset: int, total: int) -> int:
        sizes.append(total)
        return real(fd, bufs, offset, total)

    monkeypatch.setattr(slab_module, "preadv_all", counted)
    return sizes


def test_get_many_reads_adjacent_records_together_and_answers_each_key(
    open_store, monkeypatch
) -> None:
    store = open_store(records_per_slab=8)
    keys = [b"run-%d" % i for i in range(12)]
    for key in keys:
        store.put(key, slot(payload_for(key)))
    assert store.delete(keys[5])
    reads = _counting_reads(monkeypatch)
    asked = [*keys, b"never-stored"]
    dsts = [slot() for _ in asked]

    outcomes = store.get_many(asked, dsts)

    # records 0-4 and 6-7 in the first slab file, 8-11 in the second: one read each
    assert reads == [5 * RECORD, 2 * RECORD, 4 * RECORD]
    for key, dst, outcome in zip(asked, dsts, outcomes, strict=True):
        if key in (keys[5], b"never-stored"):
            assert isinstance(outcome, KeyError)
        else:
            assert not isinstance(outcome, Exception) and outcome.key == key
            assert dst[:] == payload_for(key)


def test_get_many_drops_only_the_corrupt_record_of_a_run(open_store) -> None:
    store = open_store()
    keys = [b"c-%d" % i for i in range(4)]
    for key in keys:
        store.put(key, slot(payload_for(key)))
    flip_payload_bit(store, keys[2], 99, 0x10)
    dsts = [slot() for _ in keys]

    with capture_logs() as logs:
        outcomes = store.get_many(keys, dsts)

    assert isinstance(outcomes[2], CorruptBlock)
    assert [e["key"] for e in logs if e["event"] == "disk_block_corrupt"] == [keys[2].hex()]
    assert sorted(store.keys()) == sorted(k for k in keys if k != keys[2])
    for index in (0, 1, 3):
        assert dsts[index][:] == payload_for(keys[index])


def test_a_failed_run_read_is_retried_key_by_key(open_store, monkeypatch) -> None:
    failing = {"key": b"f-1", "left": 1}

    def hook(op: str, key: bytes) -> None:
        if op == "read" and key == failing["key"] and failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EIO, "injected")

    store = open_store(fault_hook=hook)
    keys = [b"f-%d" % i for i in range(3)]
    for key in keys:
        store.put(key, slot(payload_for(key)))
    reads = _counting_reads(monkeypatch)
    dsts = [slot() for _ in keys]

    outcomes = store.get_many(keys, dsts)

    assert reads == [RECORD] * 3, "the run's read did not start; each key was read on its own"
    assert all(not isinstance(o, Exception) for o in outcomes)
    assert [d[:] for d in dsts] == [payload_for(k) for k in keys]

    failing["left"] = 2
    outcomes = store.get_many(keys, dsts)
    assert isinstance(outcomes[1], TransientIOError)
    assert not isinstance(outcomes[0], Exception) and not isinstance(outcomes[2], Exception)
    assert store.contains(keys[1]), "a transient error keeps the block"
