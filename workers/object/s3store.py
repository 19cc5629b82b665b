"""S3BlockStore: fixed-size KV blocks as S3 objects, moved between host-pool slots and a bucket.

Object name: ``{prefix}/{fingerprint_hex}/{key_hex}``; object body: the 128-byte
``kvoffload.memory.blockformat`` header followed by the block. Client: obstore (measured faster than
tuned boto3 against SeaweedFS, see kvoffload/bench/object.py); no other module sees it.

Errors: ``KeyError`` (absent), ``CorruptBlock`` (confirmed on a second read; the object is then
deleted), ``TransientObjectError`` (timeouts, 5xx, throttling, connection failures after bounded
jittered retries; ``BreakerOpen`` when the circuit breaker refuses the call without network),
``ObjectStoreConfigError`` (credentials rejected, bucket absent), ``ObjectStoreError`` (any other
rejection). Callers treat every one of them as a miss for that block.

Slot release: put/get derive memoryviews from the caller's slot and release them all before
returning. If releasing fails they raise ``ReleaseFailed`` instead of their own outcome: the slot
is still exported, so the worker keeps it out of circulation and calls
``exc.transfer.release()`` again (e.g. on its next poll) until that returns without raising;
``exc.transfer_error`` is what the transfer itself ended with (None: the data moved).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import obstore
import structlog
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from kvoffload.memory.blockformat import (
    HEADER_SIZE,
    BlockChecksum,
    BlockHeader,
    CorruptBlock,
    decode_header,
    make_header,
    verify_payload,
)
from kvoffload.wire.tenant_ids import NO_TENANT
from workers.object.breaker import CircuitBreaker
from workers.object.classify import UNREACHABLE, ErrorKind, Failure, classify
from workers.object.errors import (
    ObjectStoreConfigError,
    ObjectStoreError,
    ReleaseFailed,
    StoreNotReady,
    TransientObjectError,
)
from workers.object.naming import (
    TENANTS_DIR,
    namespace,
    normalize_prefix,
    object_name,
    tenant_namespace,
)
from workers.object.release import ReleaseHook, SlotTransfer
from workers.object.retry import RetryPolicy

KEY_MARKER = "key-check"
"""Under the deployment's tenants directory: which key the fleet's tenant ids are made with."""
log = structlog.get_logger()

T = TypeVar("T")
PURGE_BATCH = 256
"""Objects removed per DELETE request of a tenant purge."""
_CLIENT_ERRORS = (ObstoreError, OSError)


class _Generations:
    """Strictly increasing header generations, seeded from the wall clock in nanoseconds."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last


def _slot_view(buf: Any, block_bytes: int, *, writable: bool) -> memoryview:
    """A new flat byte view of a caller's slot; ValueError unless block_bytes long (and writable)."""
    with memoryview(buf) as view:
        if not view.c_contiguous:
            raise ValueError("slot must be a contiguous buffer")
        if view.nbytes != block_bytes:
            raise ValueError(f"slot is {view.nbytes} bytes, expected {block_bytes}")
        if writable and view.readonly:
            raise ValueError("destination slot is read-only")
        return view.cast("B")


@contextlib.contextmanager
def _releasing(transfer: SlotTransfer) -> Iterator[SlotTransfer]:
    """Release the transfer on every exit; a failed release raises ReleaseFailed with the outcome."""
    try:
        yield transfer
    except BaseException as exc:
        _release_or_raise(transfer, exc)
        raise
    _release_or_raise(transfer, None)


def _release_or_raise(transfer: SlotTransfer, outcome: BaseException | None) -> None:
    try:
        transfer.release()
    except Exception as release_exc:
        log.error(
            "object_slot_release_failed", error=repr(release_exc), transfer_error=repr(outcome)
        )
        raise ReleaseFailed(transfer, outcome) from release_exc


class S3BlockStore:
    """Blocks of ``block_bytes`` under one bucket/prefix/fingerprint. Thread-safe.

    One request attempt at a time per call, each bounded by ``request_timeout_s`` (connect by
    ``connect_timeout_s``); retryable failures are retried ``max_retries`` times with jittered
    exponential backoff; every attempt passes through the circuit breaker.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        bucket: str,
        prefix: str,
        access_key_id: str,
        secret_access_key: str,
        region: str,
        block_bytes: int,
        fingerprint: bytes,
        request_timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        max_retries: int = 3,
        retry_base_delay_s: float = 0.05,
        retry_max_delay_s: float = 1.0,
        io_threads: int = 8,
        breaker: CircuitBreaker | None = None,
        release_hook: ReleaseHook | None = None,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes (blockformat.deployment_fingerprint)")
        self.endpoint = endpoint
        self.bucket = bucket
        self.block_bytes = block_bytes
        self._access_key_id = access_key_id
        self._prefix = normalize_prefix(prefix)
        self._fingerprint = bytes(fingerprint)
        self._namespace = namespace(self._prefix, self._fingerprint)
        self._retry = RetryPolicy(max_retries, retry_base_delay_s, retry_max_delay_s)
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._release_hook = release_hook
        self._generations = _Generations()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="s3-io")
        self._store = S3Store(
            bucket,
            endpoint=endpoint,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            region=region,
            virtual_hosted_style_request=False,
            unsigned_payload=True,  # integrity comes from the block header's xxh3 checksum
            client_options={
                "allow_http": endpoint.startswith("http://"),
                "timeout": timedelta(seconds=request_timeout_s),
                "connect_timeout": timedelta(seconds=min(connect_timeout_s, request_timeout_s)),
                "pool_max_idle_per_host": str(io_threads),
            },
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=request_timeout_s)},
        )
        self._closed = False

    def object_key(self, key: bytes, tenant: str = NO_TENANT) -> str:
        """The object name a block key of ``tenant`` (an id) is stored under."""
        return object_name(self._prefix, self._fingerprint, key, tenant)

    def check(self) -> None:
        """Verify at startup that the endpoint answers, the credentials work and the bucket exists.

        One LIST request, no retries, no breaker; raises StoreNotReady naming the problem.
        """
        self._ensure_open()
        try:
            next(iter(obstore.list(self._store, self._namespace, chunk_size=1)), None)
        except _CLIENT_ERRORS as exc:
            raise self._config_error(classify(exc)) from exc

    def check_tenant_key(self, marker: str) -> None:
        """The bucket's tenant-key marker (``wire.tenant_ids.key_check`` of the key its ids are
        made with) is ``marker``, written now if absent; ObjectStoreConfigError when it holds
        another: this node's tenant ids would not be the fleet's."""
        path = f"{self._namespace}{TENANTS_DIR}/{KEY_MARKER}"
        try:
            found = bytes(self._fetch(path)).decode()
        except KeyError:
            body = marker.encode()
            self._request("put", path, lambda: obstore.put(self._store, path, body))
            found = bytes(self._fetch(path)).decode()  # another node may have won the race
        if found != marker:
            raise ObjectStoreConfigError(
                f"the bucket's tenant ids are made with another key than this node's "
                f"({path} says {found!r}, this node {marker!r}): give every node of the fleet "
                f"the same KVOFFLOAD_TENANT_KEY_FILE (or none)"
            )

    def _config_error(self, failure: Failure) -> StoreNotReady:
        if failure.kind == ErrorKind.NO_BUCKET:
            return StoreNotReady(f"bucket {self.bucket!r} does not exist at {self.endpoint}")
        if failure.kind == ErrorKind.AUTH:
            return StoreNotReady(
                f"{self.endpoint} rejected the credentials (access key id {self._access_key_id!r}) "
                f"for bucket {self.bucket!r}: {failure.code or failure.status}"
            )
        if failure.kind in (ErrorKind.CONNECTION, ErrorKind.SERVER, ErrorKind.THROTTLED):
            return StoreNotReady(f"cannot reach the S3 endpoint {self.endpoint}: {failure.detail}")
        return StoreNotReady(
            f"S3 endpoint {self.endpoint} refused bucket {self.bucket!r}: {failure.detail}"
        )

    def put(
        self,
        key: bytes,
        src: memoryview,
        corrupt: bool = False,
        checksum: BlockChecksum | None = None,
        tenant: str = NO_TENANT,
    ) -> None:
        """Store src (block_bytes long) under key; visible to readers only once complete.
        ``checksum``: the checksum of ``src`` taken when its bytes were written (stored as is, so
        bytes that changed since fail verification when read); computed from ``src`` when None.

        The request body is the header followed by the slot itself: no copy of the block is
        made on the Python side, and the client is done with the slot when put returns.
        Overwrites any previous block. With ``corrupt`` (fault injection) the body is a copy with
        one payload byte flipped after the header's checksum was computed: the stored copy fails
        verification when read.
        """
        self._ensure_open()
        path = self.object_key(key, tenant)
        with _releasing(SlotTransfer(self._release_hook)) as transfer:
            view = transfer.hold(_slot_view(src, self.block_bytes, writable=False))
            header = make_header(
                key, view, self._fingerprint, self._generations.next(), checksum
            ).encode()
            body: tuple[bytes | bytearray | memoryview, ...] = (header, view)
            if corrupt:
                flipped = bytearray(header + view)
                flipped[HEADER_SIZE + self.block_bytes // 2] ^= 0xFF
                body = (flipped,)
            self._request(
                "put", path, lambda: obstore.put(self._store, path, body, use_multipart=False)
            )

    def get(self, key: bytes, dst: memoryview, tenant: str = NO_TENANT) -> BlockHeader:
        """Read the block stored under key into dst (block_bytes long, writable); returns its
        verified header (whose checksum is that of the bytes now in dst).

        Raises KeyError if absent. A block that fails validation is read a second time; if that
        read fails too the object is deleted and CorruptBlock raised. dst holds verified data on
        success and unspecified bytes otherwise (corrupt data is never copied into it). The
        check and the copy both run outside the GIL, so the io threads' GETs overlap.
        """
        self._ensure_open()
        path = self.object_key(key, tenant)
        with _releasing(SlotTransfer(self._release_hook)) as transfer:
            view = transfer.hold(_slot_view(dst, self.block_bytes, writable=True))
            try:
                return self._read_into(key, path, view)
            except CorruptBlock as first:
                log.warning("object_block_corrupt_read", path=path, reason=str(first))
                try:
                    return self._read_into(key, path, view)
                except CorruptBlock as second:
                    self._discard_corrupt(path, second)
                    raise

    def _fetch(self, path: str) -> obstore.Bytes:
        return self._request("get", path, lambda: obstore.get(self._store, path).bytes())

    def _read_into(self, key: bytes, path: str, view: memoryview) -> BlockHeader:
        # One view of the response, released on return; slicing it makes no response objects.
        with memoryview(self._fetch(path)) as body:
            if body.nbytes != HEADER_SIZE + self.block_bytes:
                raise CorruptBlock(
                    f"object is {body.nbytes} bytes, expected {HEADER_SIZE + self.block_bytes}"
                )
            header = decode_header(body[:HEADER_SIZE], self._fingerprint)
            payload = body[HEADER_SIZE:]
            verify_payload(header, key, payload)
            np.copyto(np.frombuffer(view, dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
            return header

    def _discard_corrupt(self, path: str, reason: CorruptBlock) -> None:
        try:
            self._request("delete", path, lambda: obstore.delete(self._store, path))
        except KeyError:
            pass
        except ObjectStoreError as exc:
            log.error("object_corrupt_delete_failed", path=path, reason=str(reason), error=str(exc))
            return
        log.error("object_block_corrupt_deleted", path=path, reason=str(reason))

    def exists_many(self, keys: list[bytes], tenants: list[str] | None = None) -> list[bool]:
        """Whether each key (of its tenant in ``tenants``, co-indexed; None: none has one) has
        an object, by concurrent HEADs on the io_threads pool.

        Any failure other than "absent" raises (TransientObjectError/BreakerOpen when the server
        does not answer); no partial answer is returned.
        """
        self._ensure_open()
        owners = tenants or [NO_TENANT] * len(keys)
        paths = [self.object_key(key, tid) for key, tid in zip(keys, owners, strict=True)]
        futures = [self._pool.submit(self._exists, path) for path in paths]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        for future in futures:
            exc = future.exception() if future in done else None
            if exc is not None:
                raise exc
        return [future.result() for future in futures]

    def _exists(self, path: str) -> bool:
        try:
            self._request("head", path, lambda: obstore.head(self._store, path))
        except KeyError:
            return False
        return True

    def delete(self, key: bytes, tenant: str = NO_TENANT) -> None:
        """Remove the block stored under key; no error if it is absent."""
        self._ensure_open()
        path = self.object_key(key, tenant)
        with contextlib.suppress(KeyError):
            self._request("delete", path, lambda: obstore.delete(self._store, path))

    def purge_tenant(self, tenant: str) -> int:
        """Remove every object under the tenant's name (an id), whichever node stored it;
        returns how many. Raises as ``delete`` does when the store fails."""
        self._ensure_open()
        head = tenant_namespace(self._prefix, self._fingerprint, tenant)
        paths = [
            meta["path"]
            for batch in self._request("list", head, lambda: list(obstore.list(self._store, head)))
            for meta in batch
        ]
        for first in range(0, len(paths), PURGE_BATCH):
            self._delete_paths(head, paths[first : first + PURGE_BATCH])
        return len(paths)

    def _delete_paths(self, head: str, paths: list[str]) -> None:
        with contextlib.suppress(KeyError):
            self._request("delete", head, lambda: obstore.delete(self._store, paths))

    def close(self) -> None:
        """Stop the HEAD pool; later calls raise RuntimeError. Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("S3BlockStore is closed")

    def _request(self, op: str, path: str, call: Callable[[], T]) -> T:
        """Run call with breaker admission, classification and bounded jittered retries."""
        retry_index = 0
        while True:
            self.breaker.before_call()
            try:
                result = call()
            except _CLIENT_ERRORS as exc:
                failure = classify(exc)
                if failure.kind in UNREACHABLE:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()
                if not failure.retryable:
                    raise self._final_error(op, path, failure) from exc
                if retry_index >= self._retry.max_retries:
                    raise TransientObjectError(
                        f"{op} {path}: {failure.kind.value} after {retry_index + 1} attempts: {failure.detail}"
                    ) from exc
                delay = self._retry.delay(retry_index)
                log.warning(
                    "object_request_retry",
                    op=op,
                    path=path,
                    kind=failure.kind.value,
                    attempt=retry_index + 1,
                    delay_s=round(delay, 3),
                )
                time.sleep(delay)
                retry_index += 1
            else:
                self.breaker.record_success()
                return result

    def _final_error(self, op: str, path: str, failure: Failure) -> Exception:
        if failure.kind == ErrorKind.NOT_FOUND:
            return KeyError(path)
        if failure.kind in (ErrorKind.NO_BUCKET, ErrorKind.AUTH):
            return self._config_error(failure)
        return ObjectStoreError(f"{op} {path} rejected: {failure.detail}")
