"""The disk worker's backend: promotions and cascades between host-pool slots and a ``DiskStore``.

Jobs (``slots[i]`` co-indexed with ``keys[i]``):

- ``promotion``: ``store.get_many(keys, slots)``. Bytes land only in the job's own slots (reserved by
  the manager, not readable until the result arrives); a failed key may leave garbage there,
  which the manager never serves since it frees that slot. A key that landed has its slot
  header stamped (when slot headers are on) with the checksum the store just verified; each
  key is then reported landed with its digests (``report_landed``), so the manager serves it,
  and a waiting client hears of it (a ``LandingTarget``), while the rest of the job is still
  being read. A job's keys are read in chunks of consecutive keys (records that lie one after
  another on disk in one read), the chunks in parallel on its job thread and the backend's
  ``disk.read_threads`` reader threads, and reported in job order.
- ``delete``: ``store.delete(key)`` (no slots): room the manager makes for a tenant's share,
  or a tenant drop.
- ``cascade``: ``store.put(key, slot)``; the slot is only read. The record carries the
  checksum of the slot's header when it names the key (taken when the bytes landed in the pool,
  so the check is end to end and the slot is not hashed again), else one taken here. A job's
  keys are written one after another on its job thread, in job order, so they lie in
  consecutive records that a promotion reads back together; cascades run at once, one a job
  thread.

Per-key outcomes: a corrupt or absent copy fails the key, reports it removed and, for a
promotion, lists it in the outcome's ``absent_keys``; a transient
read error fails the key and keeps it indexed; ENOSPC/EDQUOT or ``StoreFull`` fail the key
(the store reports ``degraded`` until a put succeeds) and are listed in ``full_keys``; keys
evicted by a put are reported removed (the store logs each eviction), keys stored are
reported added.

Index changes: each job notes the keys it may have changed in its ``cleanup``, which the
framework runs on the main thread just before it publishes the job's result.
``take_index_changes`` reports each noted key as added or removed by what the store holds at
that moment, so the manager's last word on a key always follows the result that asserted it.

Fault injection (``FaultInjector``, through the store's fault hook): every store operation
counts toward ``crash_after_ops`` and may be delayed; the data-path operations in
``FAILING_OPS`` fail with an injected EIO for ``fail_fraction`` of calls; a ``corrupt_fraction``
of cascaded keys are written from a private copy in which one byte is flipped after the store
computed the checksum, so the stored copy is indexed but fails its checksum when read.
"""

from __future__ import annotations

import errno
import json
import mmap
import threading
from collections import Counter
from collections.abc import Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import BlockChecksum, CorruptBlock, deployment_fingerprint
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.runspec import FatalStartError
from kvoffload.wire.protocol import Job, JobKind, KVHandle
from kvoffload.wire.status import DiskWorkerStats
from workers.backend import INDEX_BATCH_KEYS, BackendOutcome
from workers.disk.errors import LayoutError, StoreFull, TransientIOError
from workers.disk.fanout import fan_out
from workers.disk.slab import DiskStore
from workers.faults import FaultInjector
from workers.jobs import REPORT_BYTES, LandedBatch
from workers.slotheaders import SlotHeaders

log = get_logger(tier="disk")

FAILING_OPS = frozenset({"allocate", "write_record", "fsync", "read"})
"""Store operations that injected failures may hit (``clear`` and ``scan`` are left alone:
failing them would only strand records until the next start)."""
SPACE_OPS = frozenset({"allocate", "write_record"})
"""Store operations where an injected full disk (``enospc_fraction``) fires, as ENOSPC would."""
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_UNUSABLE_DIRECTORY = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST}
)
"""Errors of opening ``disk.root`` that a restart cannot fix."""
READ_CHUNKS_PER_THREAD = 1
"""A promotion's chunks per reading thread: larger reads of adjacent records (a 16 x 256 KiB
cold prefix read 1.01 GB/s with two chunks a thread, 1.05-1.11 with one)."""
READ_CHUNK_BYTES = 1 << 20
"""Payload bytes of a promotion's largest chunk (one thread reads it, in runs of at most
``READ_RUN_BYTES``)."""
GONE_REASONS = frozenset({"absent", "corrupt"})
"""Promotion failures that confirm the store no longer holds the key (reported absent)."""
FULL_REASONS = frozenset({"store_full", "no_space"})
"""Cascade failures for lack of room (reported full: the manager does not retry them)."""
DIRECT_IO: dict[str, bool | None] = {"auto": None, "direct": True, "buffered": False}
"""``DiskStore``'s ``direct_io`` per ``disk.io`` setting."""
_COUNTERS = (
    "bytes_read",
    "bytes_written",
    "keys_promoted",
    "keys_cascaded",
    "corrupt_blocks",
    "absent_keys",
    "transient_errors",
    "enospc_errors",
    "store_full",
    "write_errors",
    "injected_corruptions",
    "keys_evicted",
    "keys_deleted",
)


class DiskBackend:
    """The disk tier's ``Backend`` (see the module docstring). Built from the whole config;
    ``start`` opens the store at ``disk.root``."""

    name = "disk"
    medium = "storage"

    def __init__(self, cfg: Config) -> None:
        self.capabilities = [JobKind.PROMOTION, JobKind.CASCADE, JobKind.DELETE]
        self._cfg = cfg
        self._pool: HostPool | None = None
        self._headers: SlotHeaders | None = None
        self._store: DiskStore | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._faults = FaultInjector()
        self._lock = threading.Lock()
        self._changed: dict[bytes, None] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._local = threading.local()

    # ---- lifecycle -------------------------------------------------------------------------

    def job_threads(self, cfg: Config) -> int:
        """Read and write threads together: a promotion reads on its job thread and the
        backend's reader threads, a cascade writes on its job thread."""
        return cfg.disk.read_threads + cfg.disk.write_threads

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        return cfg.disk.cpu_affinity

    def use_slot_headers(self, headers: SlotHeaders) -> None:
        """Stamp the slot of every key a promotion lands."""
        self._headers = headers

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        """Open the store (scanning its header pages). LayoutError if the directory belongs to
        another deployment geometry or another process holds it."""
        disk, block_bytes = self._cfg.disk, self._cfg.pool.block_bytes
        if pool.block_bytes != block_bytes:
            raise ValueError(f"pool blocks are {pool.block_bytes} bytes, config says {block_bytes}")
        self._pool = pool
        self._faults = faults
        store = DiskStore(
            disk.root,
            block_bytes,
            deployment_fingerprint(block_bytes, self._cfg.pool.layout_id),
            disk.capacity_bytes,
            durability=disk.durability,
            direct_io=DIRECT_IO[disk.io],
            fault_hook=self._on_store_op,
        )
        setting = f"disk.root = {json.dumps(disk.root)}"
        try:
            store.open()
        except LayoutError as exc:
            raise FatalStartError(
                f"{setting}: {exc}; stop the other store or service using it, or give this "
                "service another disk.root"
            ) from exc
        except OSError as exc:
            if exc.errno not in _UNUSABLE_DIRECTORY:
                raise
            raise FatalStartError(
                f"{setting}: {exc.strerror}: {exc.filename}; point disk.root at a directory "
                "this user can write"
            ) from exc
        self._store = store
        self._readers = ThreadPoolExecutor(disk.read_threads, thread_name_prefix="disk-read")
        log.info(
            "disk_backend_started",
            root=str(store.directory),
            capacity_bytes=store.capacity_bytes,
            used_bytes=store.used_bytes,
            direct_io=store.direct_io,
            durability=disk.durability,
        )

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown()
        if self._store is not None:
            self._store.close()

    def initial_index(self) -> Iterable[list[bytes]]:
        keys = self._require_store().keys()
        return (keys[i : i + INDEX_BATCH_KEYS] for i in range(0, len(keys), INDEX_BATCH_KEYS))

    # ---- jobs ------------------------------------------------------------------------------

    def run_job(self, job: Job) -> BackendOutcome:
        if job.kind == JobKind.DELETE:
            return self._delete(job)
        if job.kind not in (JobKind.PROMOTION, JobKind.CASCADE):
            return BackendOutcome(ok_keys=[], error=f"unsupported_kind: {job.kind!r}")
        promote = job.kind == JobKind.PROMOTION
        pool = self._require_pool()
        ok: list[bytes] = []
        absent: list[bytes] = []
        full: list[bytes] = []
        changed: list[bytes] = []
        evicted: list[bytes] = []
        failures: Counter[str] = Counter()
        first_error = ""
        landed = self._promote_all(job, changed)  # started by a promotion only
        report = LandedBatch(max(1, REPORT_BYTES // pool.block_bytes))
        try:
            written = [] if promote else self._cascade_all(job, changed, evicted)
            for index, key in enumerate(job.keys):
                if promote:
                    failure, digests = next(landed)
                    if not failure:
                        report.add(key, digests)
                else:
                    failure = written[index]
                if failure:
                    reason = failure.split(":", 1)[0]
                    failures[reason] += 1
                    first_error = first_error or failure
                    if promote and reason in GONE_REASONS:
                        absent.append(key)
                    elif not promote and reason in FULL_REASONS:
                        full.append(key)
                else:
                    ok.append(key)
            report.flush()
        except BaseException:
            landed.close()  # waits for the job's reads
            self._note_changed(changed)  # the job fails as a whole; still report what it changed
            raise
        finally:
            self._count("keys_evicted", len(evicted))
        nbytes = len(ok) * pool.block_bytes
        self._count("bytes_read" if job.kind == JobKind.PROMOTION else "bytes_written", nbytes)
        self._count("keys_promoted" if job.kind == JobKind.PROMOTION else "keys_cascaded", len(ok))
        error = ""
        if failures:
            error = f"{sum(failures.values())} of {len(job.keys)} keys failed ({dict(failures)}), first: {first_error}"
            log.warning(
                "disk_keys_failed",
                job_id=job.job_id,
                kind=job.kind,
                keys=len(job.keys),
                failures=dict(failures),
                error=first_error,
            )
        return BackendOutcome(
            ok_keys=ok,
            nbytes=nbytes,
            error=error,
            absent_keys=absent,
            full_keys=full,
            cleanup=lambda: self._note_changed(changed),
        )

    def runs_inline(self, job: Job) -> bool:
        """A one-block promotion (one read of a local file), unless injected faults delay the
        store's operations: a slowed disk's reads stay on the job threads."""
        return job.kind == JobKind.PROMOTION and len(job.keys) == 1 and not self._faults.delays

    def _delete(self, job: Job) -> BackendOutcome:
        """Remove the job's keys (the manager made room for a tenant, or dropped one): every
        key is then absent, so every key succeeds; ``removed`` counts those the store held."""
        store = self._require_store()
        removed = sum(store.delete(key) for key in job.keys)
        self._count("keys_deleted", removed)
        changed = list(job.keys)
        return BackendOutcome(
            ok_keys=list(job.keys), removed=removed, cleanup=lambda: self._note_changed(changed)
        )

    def _promote_chunk(
        self, job: Job, start: int, stop: int, changed: list[bytes]
    ) -> list[tuple[str, list[int]]]:
        """Read keys ``start:stop`` of ``job`` into their pool slots (one ``get_many``: adjacent
        records in one read) and stamp their headers; for each, ("", the block's digests as a
        reader checks them) on success, else ("<reason>: <detail>", [])."""
        store = self._require_store()
        pool = self._require_pool()
        keys, slots = job.keys[start:stop], job.slots[start:stop]
        outcomes: list[tuple[str, list[int]]] = []
        got = store.get_many(keys, [pool.slot(slot) for slot in slots])
        for key, slot, header in zip(keys, slots, got, strict=True):
            if isinstance(header, CorruptBlock):
                self._count("corrupt_blocks")
                changed.append(key)
                outcomes.append((f"corrupt: {header}", []))
            elif isinstance(header, KeyError):
                self._count("absent_keys")
                changed.append(key)
                outcomes.append(("absent: not stored", []))
            elif isinstance(header, TransientIOError):
                self._count("transient_errors")
                outcomes.append((f"transient: {header}", []))
            elif self._headers is not None:
                outcomes.append(
                    ("", self._headers.stamp(slot, key, job.job_id, header.block_checksum))
                )
            else:
                outcomes.append(("", header.block_checksum.digests(pool.slot(slot))))
        return outcomes

    def _promote_all(
        self, job: Job, changed: list[bytes]
    ) -> Generator[tuple[str, list[int]], None, None]:
        """Read the job's keys in chunks of consecutive keys (``_chunks``), in parallel on this
        thread and up to ``disk.read_threads`` reader threads (shared by every job), and yield
        each key's outcome (``_promote_chunk``) in job order, each as soon as its chunk and the
        chunks before it have landed; ``changed`` receives the keys in job order. Every read
        of the job has returned before the generator ends, raises or is closed; an exception
        of one read is raised in its turn."""
        chunks = self._chunks(len(job.keys), self._cfg.disk.read_threads, READ_CHUNKS_PER_THREAD)
        per_chunk: list[list[bytes]] = [[] for _ in chunks]
        if len(chunks) == 1:  # nothing to read in parallel: no hand-off to a reader thread
            outcomes = self._promote_chunk(job, *chunks[0], per_chunk[0])
            changed.extend(per_chunk[0])
            yield from outcomes
            return

        def read(index: int) -> list[tuple[str, list[int]]]:
            return self._promote_chunk(job, *chunks[index], per_chunk[index])

        readers = self._require_readers()
        taken = 0
        try:
            with closing(fan_out(len(chunks), read, readers, self._cfg.disk.read_threads)) as got:
                for outcomes in got:
                    changed.extend(per_chunk[taken])
                    taken += 1
                    yield from outcomes
        finally:
            for keys in per_chunk[taken:]:
                changed.extend(keys)

    def _chunks(self, count: int, helpers: int, per_thread: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of the chunks of consecutive keys ``count`` keys are read in, one
        thread a chunk: one key first, then each chunk twice the one before, up to
        ``READ_CHUNK_BYTES`` and small enough that each of the ``helpers`` threads and the
        job's own get about ``per_thread`` (the first keys land at once, the rest in few
        reads)."""
        block_bytes = self._require_pool().block_bytes
        most = max(1, min(READ_CHUNK_BYTES // block_bytes, count // (per_thread * (helpers + 1))))
        chunks: list[tuple[int, int]] = []
        start, size = 0, 1
        while start < count:
            chunks.append((start, min(count, start + size)))
            start, size = chunks[-1][1], min(most, size * 2)
        return chunks

    def _cascade_all(self, job: Job, changed: list[bytes], evicted: list[bytes]) -> list[str]:
        """Write the job's keys one after another on this thread, in job order, so their
        records follow each other on disk and a promotion of the prefix reads them back in few
        reads (keys written by several threads at once interleave their records). Writes run
        in parallel across cascade jobs, one job a job thread. Returns each key's
        ``_cascade_one`` outcome in job order; ``changed`` and ``evicted`` receive the keys in
        job order, and the stored keys are touched in job order."""
        pool = self._require_pool()
        outcomes: list[str] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            stamped = None if self._headers is None else self._headers.checksum_of(slot, key)
            outcomes.append(self._cascade_one(key, pool.slot(slot), stamped, changed, evicted))
        self._require_store().touch(k for k, f in zip(job.keys, outcomes, strict=True) if not f)
        return outcomes

    def _cascade_one(
        self,
        key: bytes,
        src: memoryview,
        stamped: BlockChecksum | None,
        changed: list[bytes],
        evicted: list[bytes],
    ) -> str:
        """Write ``src`` under ``key``; "" on success, else "<reason>: <detail>". ``stamped``:
        the checksum of the slot's header, stored instead of hashing the slot again (end to end:
        a slot whose bytes changed after they landed fails its check when read back); None:
        hashed here. The key is noted as changed either way: a failed put may have dropped its
        previous copy. Keys the put evicted to make room are added to ``evicted`` (and noted as
        changed)."""
        store = self._require_store()
        changed.append(key)
        payload: memoryview | mmap.mmap = src
        if self._faults.should_corrupt():
            self._count("injected_corruptions")
            payload = self._corrupting_copy(src)
        dropped: list[bytes] = []
        try:
            store.put(key, payload, dropped, stamped)
        except StoreFull as exc:
            self._count("store_full")
            return f"store_full: {exc}"
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                self._count("enospc_errors")
                return f"no_space: {exc}"
            self._count("write_errors")
            return f"write_error: {exc}"
        finally:
            self._local.corrupt = None
            changed.extend(dropped)
            evicted.extend(dropped)
        return ""

    def _corrupting_copy(self, src: memoryview) -> mmap.mmap:
        """A page-aligned private copy of ``src``; the next ``write_record`` op of this thread
        flips one of its bytes (after the store computed the checksum)."""
        buf = getattr(self._local, "buffer", None)
        if buf is None:
            buf = self._local.buffer = mmap.mmap(-1, len(src))
        buf[:] = src
        self._local.corrupt = buf
        return buf

    def _on_store_op(self, op: str, key: bytes) -> None:
        """The store's fault hook (runs before each of its I/O operations)."""
        faults = self._faults
        faults.count_op()
        faults.maybe_delay()
        if op in FAILING_OPS:
            faults.maybe_fail(op, key)
        if op in SPACE_OPS:
            faults.maybe_full(op, key)
        buf = getattr(self._local, "corrupt", None)
        if op == "write_record" and buf is not None:
            self._local.corrupt = None
            buf[len(buf) // 2] ^= 0xFF
            log.warning("disk_payload_corrupted_on_purpose", key=key.hex())

    # ---- index -----------------------------------------------------------------------------

    def _note_changed(self, keys: list[bytes]) -> None:
        with self._lock:
            self._changed.update(dict.fromkeys(keys))

    def take_index_changes(self) -> tuple[list[bytes], list[bytes]]:
        with self._lock:
            keys, self._changed = list(self._changed), {}
        if not keys:
            return [], []
        store = self._require_store()
        added: list[bytes] = []
        removed: list[bytes] = []
        for key in keys:
            (added if store.contains(key) else removed).append(key)
        return added, removed

    def touch(self, keys: list[bytes]) -> None:
        self._require_store().touch(keys)

    # ---- state -----------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """True while the store's last put failed for lack of space."""
        return self._store is not None and self._store.degraded

    def stats(self) -> DiskWorkerStats:
        store = self._require_store()
        with self._lock:
            counters = dict(self._counters)
        return DiskWorkerStats(
            used_bytes=store.used_bytes,
            capacity_bytes=store.capacity_bytes,
            direct_io=store.direct_io,
            degraded=store.degraded,
            **counters,
        )

    def attach_kv(self, handle: KVHandle) -> None:
        """The disk worker never touches an engine's KV cache."""

    def detach_kv(self, handle_id: str) -> None:
        """See ``attach_kv``."""

    # ---- helpers ---------------------------------------------------------------------------

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _require_store(self) -> DiskStore:
        if self._store is None:
            raise RuntimeError("DiskBackend.start was not called")
        return self._store

    def _require_readers(self) -> ThreadPoolExecutor:
        if self._readers is None:
            raise RuntimeError("DiskBackend.start was not called")
        return self._readers

    def _require_pool(self) -> HostPool:
        if self._pool is None:
            raise RuntimeError("DiskBackend.start was not called")
        return self._pool
