"""The object worker's backend: probes, promotions and cascades against an S3-compatible bucket.

Jobs:
- ``probe``: one existence check of every key (concurrent HEADs). The outcome's ``ok_keys`` are
  the keys found, its ``absent_keys`` the others. Any store error (server down, breaker open,
  credentials revoked) fails the whole probe with no key found and none confirmed absent, so
  the manager resolves those verdicts to MISS only for the requests waiting on them.
- ``promotion``: GET of ``keys[i]`` into pool slot ``slots[i]``; ``cascade``: PUT of slot
  ``slots[i]`` under ``keys[i]``. Keys run concurrently on ``io_threads`` threads and fail one
  by one (absent, corrupt, transient, breaker open); the others still succeed. An absent or
  corrupt (and deleted) key is reported in ``absent_keys``. A GET that
  landed and released its slot stamps the slot's header (when slot headers are on) with the
  checksum the store just verified. A PUT stores the checksum of the slot's header when it
  names the key (end to end, and the slot is not hashed again), else one taken of the slot.
- ``delete``: removal of ``keys`` (no slots) and, with ``purge_tenant``, of every object under
  that tenant's name (a tenant drop). A key of a tenant (``Job.tenants``) is named under its
  tenant's id in every job (``naming``).

Slot release (a result is never early, docs/design/tiering.md): a PUT/GET whose slot views could not
be released raises ``ReleaseFailed``; its data outcome still counts, and its transfer joins the
job's pending list. The outcome's ``release`` retries every pending transfer and raises while one
still fails, so the framework publishes the job's result only once nothing touches the pool any
more. ``FaultInjector.take_release_failure`` is the store's release hook: the first N slot releases
after a ``release_failures`` fault spec fail.

Fault fail/delay fractions apply once per store operation (per key for GET/PUT, per job for a
probe) before the store is called. ``corrupt_fraction`` of the PUTs store the block with one
payload byte flipped after its checksum was computed (the pool slot is never altered), so a later
GET finds the copy corrupt and deletes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import CorruptBlock, deployment_fingerprint
from kvoffload.memory.pool import HostPool
from kvoffload.wire.protocol import Job, JobKind
from kvoffload.wire.status import ObjectWorkerStats
from kvoffload.wire.tenant_ids import NO_TENANT, key_check
from workers.backend import BackendOutcome, NoIndexBackend
from workers.faults import FaultInjector, InjectedFault
from workers.object.breaker import CLOSED, BreakerOpen, CircuitBreaker
from workers.object.errors import ObjectStoreError, ReleaseFailed
from workers.object.release import SlotTransfer
from workers.object.s3store import S3BlockStore
from workers.slotheaders import SlotHeaders

log = get_logger()

_COUNTERS = (
    "probes",
    "probe_failures",
    "keys_probed",
    "keys_found",
    "gets",
    "get_failures",
    "puts",
    "put_failures",
    "bytes_read",
    "bytes_written",
    "slot_release_failures",
    "injected_corruptions",
    "deletes",
    "delete_failures",
    "objects_deleted",
)


def store_from_config(
    cfg: Config,
    *,
    breaker: CircuitBreaker | None = None,
    release_hook: Callable[[], None] | None = None,
) -> S3BlockStore:
    """An ``S3BlockStore`` for ``[object]`` and the pool's block geometry (no network yet), with
    ``breaker`` or else one set by ``[object] breaker_*``. ValueError for an unusable prefix."""
    obj = cfg.object
    if breaker is None:
        breaker = CircuitBreaker(
            failure_threshold=obj.breaker_failure_threshold,
            base_cooldown_s=obj.breaker_cooldown_s,
            max_cooldown_s=obj.breaker_max_cooldown_s,
        )
    return S3BlockStore(
        endpoint=obj.endpoint,
        bucket=obj.bucket,
        prefix=obj.prefix,
        access_key_id=obj.access_key_id,
        secret_access_key=obj.secret_access_key,
        region=obj.region,
        block_bytes=cfg.pool.block_bytes,
        fingerprint=deployment_fingerprint(cfg.pool.block_bytes, cfg.pool.layout_id),
        request_timeout_s=obj.request_timeout_s,
        max_retries=obj.max_retries,
        io_threads=obj.io_threads,
        breaker=breaker,
        release_hook=release_hook,
    )


_GONE_REASONS = frozenset({"absent", "corrupt"})
"""Failure reasons of a GET that confirm the store does not hold a usable copy of the key."""


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "absent"
    if isinstance(exc, CorruptBlock):
        return "corrupt"
    return type(exc).__name__


class ObjectBackend(NoIndexBackend):
    """The object worker's ``Backend`` (see the module docstring). No index: the tier is probed.

    The store is built in ``__init__`` without any network call, so a caller can ``check`` it
    before the worker connects to the manager. ``breaker`` replaces the store's default.
    """

    name = "object"
    medium = "storage"

    def __init__(self, cfg: Config, *, breaker: CircuitBreaker | None = None) -> None:
        self.capabilities = [JobKind.PROBE, JobKind.PROMOTION, JobKind.CASCADE, JobKind.DELETE]
        self._faults = FaultInjector()
        self._store = store_from_config(cfg, breaker=breaker, release_hook=self._release_hook)
        self._io = ThreadPoolExecutor(
            max_workers=cfg.object.io_threads, thread_name_prefix="object-io"
        )
        self._pool: HostPool | None = None
        self._headers: SlotHeaders | None = None
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._pending_releases = 0

    @property
    def store(self) -> S3BlockStore:
        return self._store

    @property
    def degraded(self) -> bool:
        """True while the breaker is not closed (the store is failing or being re-probed)."""
        return self._store.breaker.state != CLOSED

    def check(self) -> None:
        """Verify endpoint, credentials and bucket (ObjectStoreConfigError naming the problem),
        then that the bucket's tenant ids are made with this node's key."""
        self._store.check()
        self._store.check_tenant_key(key_check())

    def _release_hook(self) -> None:
        if self._faults.take_release_failure():
            raise InjectedFault("injected slot release failure")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ---- Backend ------------------------------------------------------------------------------

    def job_threads(self, cfg: Config) -> int:
        return cfg.object.io_threads

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        return cfg.object.cpu_affinity

    def use_slot_headers(self, headers: SlotHeaders) -> None:
        """Stamp the slot of every key a promotion lands."""
        self._headers = headers

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        if pool.block_bytes != self._store.block_bytes:
            raise ValueError(
                f"pool blocks are {pool.block_bytes} bytes, the store's {self._store.block_bytes}"
            )
        self._pool = pool
        self._faults = faults

    def run_job(self, job: Job) -> BackendOutcome:
        if job.kind == JobKind.PROBE:
            return self._probe(job)
        if job.kind in (JobKind.PROMOTION, JobKind.CASCADE):
            return self._transfer(job)
        if job.kind == JobKind.DELETE:
            return self._delete(job)
        return BackendOutcome(ok_keys=[], error=f"unsupported_kind: {job.kind!r}")

    def stats(self) -> ObjectWorkerStats:
        with self._lock:
            counters = dict(self._counters, pending_releases=self._pending_releases)
        return ObjectWorkerStats(**counters, breaker=self._store.breaker.snapshot())

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        self._store.close()

    # ---- jobs ---------------------------------------------------------------------------------

    def _probe(self, job: Job) -> BackendOutcome:
        self._count(probes=1, keys_probed=len(job.keys))
        try:
            self._faults.on_op(JobKind.PROBE)
            found = self._store.exists_many(job.keys, job.tenants or None)
        except (ObjectStoreError, OSError) as exc:
            self._count(probe_failures=1)
            log.warning(
                "object_probe_failed", job_id=job.job_id, keys=len(job.keys), error=str(exc)
            )
            return BackendOutcome(ok_keys=[], error=f"probe_failed: {exc}")
        ok = [key for key, present in zip(job.keys, found, strict=True) if present]
        self._count(keys_found=len(ok))
        return BackendOutcome(
            ok_keys=ok,
            absent_keys=[key for key, present in zip(job.keys, found, strict=True) if not present],
        )

    def _transfer(self, job: Job) -> BackendOutcome:
        promote = job.kind == JobKind.PROMOTION
        owners = job.tenants or [NO_TENANT] * len(job.keys)
        triples = list(zip(job.keys, job.slots, owners, strict=True))
        results = list(self._io.map(lambda triple: self._one(job, promote, *triple), triples))
        pairs = [(key, slot) for key, slot, _ in triples]
        ok = [key for (key, _), (moved, _, _) in zip(pairs, results, strict=True) if moved]
        errors = [error for _, _, error in results if error]
        absent = [
            key
            for (key, _), (_, _, error) in zip(pairs, results, strict=True)
            if promote and error.split(":", 1)[0] in _GONE_REASONS
        ]
        pending = [transfer for _, transfer, _ in results if transfer is not None]
        nbytes = len(ok) * self._store.block_bytes
        self._count(**{"bytes_read" if promote else "bytes_written": nbytes})
        error = f"{len(errors)} of {len(pairs)} keys failed, first: {errors[0]}" if errors else ""
        release = self._release_pending(job, pending) if pending else None
        return BackendOutcome(
            ok_keys=ok, nbytes=nbytes, error=error, release=release, absent_keys=absent
        )

    def _delete(self, job: Job) -> BackendOutcome:
        """Remove the job's keys (each under its tenant's name); a tenant drop's
        (``purge_tenant``) first removes every object under that tenant's name, other nodes'
        included, and counts those (its keys are among them)."""
        owners = job.tenants or [NO_TENANT] * len(job.keys)
        try:
            purged = self._store.purge_tenant(job.purge_tenant) if job.purge_tenant else 0
            for key, tid in zip(job.keys, owners, strict=True):
                self._store.delete(key, tid)
        except (ObjectStoreError, OSError) as exc:
            self._count(delete_failures=1)
            log.warning("object_delete_failed", job_id=job.job_id, error=str(exc))
            return BackendOutcome(ok_keys=[], error=f"delete_failed: {exc}")
        removed = purged if job.purge_tenant else len(job.keys)
        self._count(deletes=1, objects_deleted=removed)
        if job.purge_tenant:
            log.info("object_tenant_purged", job_id=job.job_id, objects=purged)
        return BackendOutcome(ok_keys=list(job.keys), removed=removed)

    def _one(
        self, job: Job, promote: bool, key: bytes, slot: int, tenant: str = NO_TENANT
    ) -> tuple[bool, SlotTransfer | None, str]:
        """(data moved, transfer still holding the slot or None, failure summary or "")."""
        op = "get" if promote else "put"
        self._count(**{f"{op}s": 1})
        outcome: BaseException | None = None
        held: SlotTransfer | None = None
        try:
            self._faults.on_op(op, key)
            corrupt = not promote and self._faults.should_corrupt()
            if corrupt:
                self._count(injected_corruptions=1)
            with self._require_pool().slot(slot) as view:
                if promote:
                    header = self._store.get(key, view, tenant)
                else:
                    stamped = (
                        None if self._headers is None else self._headers.checksum_of(slot, key)
                    )
                    self._store.put(key, view, corrupt=corrupt, checksum=stamped, tenant=tenant)
            if promote and self._headers is not None:
                self._headers.stamp(slot, key, job.job_id, header.block_checksum)
        except ReleaseFailed as exc:
            held, outcome = exc.transfer, exc.transfer_error
            self._count(slot_release_failures=1)
            with self._lock:
                self._pending_releases += 1
        except Exception as exc:  # noqa: BLE001 - one key's failure never fails the others
            outcome = exc
        if outcome is None:
            return True, held, ""
        self._count(**{f"{op}_failures": 1})
        reason = _failure_reason(outcome)
        if not isinstance(outcome, BreakerOpen):  # fast refusals: the job's failure log is enough
            log.warning(
                f"object_{op}_failed",  # noqa: G004 - a structlog event name, not a format
                job_id=job.job_id,
                key=key.hex(),
                slot=slot,
                reason=reason,
                error=str(outcome),
            )
        return False, held, f"{reason}: {outcome}"

    def _release_pending(self, job: Job, pending: list[SlotTransfer]) -> Callable[[], None]:
        """Release every pending transfer; raise while any still fails. Safe to call again."""

        def release() -> None:
            failed: list[SlotTransfer] = []
            first: Exception | None = None
            for transfer in pending:
                try:
                    transfer.release()
                except Exception as exc:  # noqa: BLE001 - kept and retried on the next call
                    failed.append(transfer)
                    first = first or exc
            with self._lock:
                self._pending_releases -= len(pending) - len(failed)
            pending[:] = failed
            if failed:
                raise RuntimeError(
                    f"{len(failed)} slot transfers of job {job.job_id} still held"
                ) from first
            log.info("object_slots_released", job_id=job.job_id)

        return release

    def _require_pool(self) -> HostPool:
        if self._pool is None:
            raise RuntimeError("ObjectBackend.start was not called")
        return self._pool
