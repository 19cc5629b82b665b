"""S3BlockStore against a real SeaweedFS server, plus pure tests of its breaker, retry and naming."""

from __future__ import annotations

import mmap
import os
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("object")

from botocore.exceptions import ClientError  # noqa: E402
from obstore.exceptions import GenericError, PermissionDeniedError  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402

from kvoffload.memory.blockformat import HEADER_SIZE, CorruptBlock, deployment_fingerprint  # noqa: E402
from kvoffload.testing.s3server import S3Server  # noqa: E402
from workers.object import (  # noqa: E402
    BreakerOpen,
    CircuitBreaker,
    ObjectStoreConfigError,
    ReleaseFailed,
    S3BlockStore,
    TransientObjectError,
)
from workers.object.classify import ErrorKind, classify  # noqa: E402
from workers.object.naming import normalize_prefix, object_name  # noqa: E402
from workers.object.retry import RetryPolicy  # noqa: E402

BLOCK = 64 << 10
FINGERPRINT = deployment_fingerprint(BLOCK, "test-layout")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return b"blk-" + i.to_bytes(4, "big")


class SlotPool:
    """Page-aligned anonymous mmap cut into BLOCK-sized writable slots, like the host pool."""

    def __init__(self, slots: int) -> None:
        self.mem = mmap.mmap(-1, slots * BLOCK)
        self.whole = memoryview(self.mem)
        self.views: list[memoryview] = []

    def slot(self, index: int) -> memoryview:
        view = self.whole[index * BLOCK : (index + 1) * BLOCK]
        self.views.append(view)
        return view

    def close(self) -> None:
        """Release our own views and unmap; BufferError if anyone else still holds a view."""
        for view in self.views:
            view.release()
        self.whole.release()
        self.mem.close()


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.create_bucket(f"kvo-test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def make_store(s3_server: S3Server, bucket: str) -> Iterator[Callable[..., S3BlockStore]]:
    """Factory of stores on the test's own prefix; every store is closed at teardown."""
    prefix = f"kv/{uuid.uuid4().hex[:8]}"
    stores: list[S3BlockStore] = []

    def make(**overrides) -> S3BlockStore:
        settings = dict(
            endpoint=s3_server.endpoint,
            bucket=bucket,
            prefix=prefix,
            access_key_id=s3_server.access_key,
            secret_access_key=s3_server.secret_key,
            region=s3_server.region,
            block_bytes=BLOCK,
            fingerprint=FINGERPRINT,
            request_timeout_s=5.0,
            io_threads=4,
        )
        settings.update(overrides)
        store = S3BlockStore(**settings)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def store(make_store) -> S3BlockStore:
    return make_store()


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    slots = SlotPool(4)
    yield slots
    if not slots.mem.closed:
        slots.close()


def fill(slot: memoryview) -> bytes:
    data = os.urandom(BLOCK)
    slot[:] = data
    return data


def raw_object_exists(s3_server: S3Server, bucket: str, name: str) -> bool:
    try:
        s3_server.client().head_object(Bucket=bucket, Key=name)
    except ClientError as exc:
        assert exc.response["Error"]["Code"] in ("404", "NoSuchKey")
        return False
    return True


# --- engine against SeaweedFS ---------------------------------------------------------------


def test_round_trip_random_blocks(store: S3BlockStore, pool: SlotPool) -> None:
    src, dst = pool.slot(0), pool.slot(1)
    written = {}
    for i in range(12):
        written[key(i)] = fill(src)
        store.put(key(i), src)
    for k, data in written.items():
        dst[:] = b"\0" * BLOCK
        store.get(k, dst)
        assert bytes(dst) == data


def test_overwrite_serves_newest(store: S3BlockStore, pool: SlotPool) -> None:
    src, dst = pool.slot(0), pool.slot(1)
    fill(src)
    store.put(key(1), src)
    newest = fill(src)
    store.put(key(1), src)
    store.get(key(1), dst)
    assert bytes(dst) == newest


def test_second_instance_reads_first_instances_blocks(make_store, pool: SlotPool) -> None:
    writer, reader = make_store(), make_store()
    src, dst = pool.slot(0), pool.slot(1)
    data = fill(src)
    writer.put(key(7), src)
    writer.close()
    reader.get(key(7), dst)
    assert bytes(dst) == data
    assert reader.exists_many([key(7), key(8)]) == [True, False]


def test_exists_many_mixed(store: S3BlockStore, pool: SlotPool) -> None:
    src = pool.slot(0)
    present = {key(i) for i in range(0, 20, 3)}
    for k in present:
        fill(src)
        store.put(k, src)
    keys = [key(i) for i in range(20)]
    assert store.exists_many(keys) == [k in present for k in keys]
    assert store.exists_many([]) == []


def test_object_name_is_prefix_fingerprint_key_hex(
    store, s3_server: S3Server, bucket: str, pool: SlotPool
) -> None:
    fill(pool.slot(0))
    store.put(b"\x00\xffab", pool.slot(0))
    name = store.object_key(b"\x00\xffab")
    assert name.endswith(f"/{FINGERPRINT.hex()}/00ff6162")
    body = s3_server.client().get_object(Bucket=bucket, Key=name)["Body"].read()
    assert len(body) == HEADER_SIZE + BLOCK
    assert body[HEADER_SIZE:] == bytes(pool.slot(0))


def test_deleted_behind_the_stores_back_is_keyerror(
    store, s3_server, bucket, pool: SlotPool
) -> None:
    fill(pool.slot(0))
    store.put(key(3), pool.slot(0))
    s3_server.client().delete_object(Bucket=bucket, Key=store.object_key(key(3)))
    with pytest.raises(KeyError):
        store.get(key(3), pool.slot(1))
    assert store.exists_many([key(3)]) == [False]


def test_delete(store: S3BlockStore, pool: SlotPool) -> None:
    fill(pool.slot(0))
    store.put(key(4), pool.slot(0))
    store.delete(key(4))
    store.delete(key(4))
    assert store.exists_many([key(4)]) == [False]
    with pytest.raises(KeyError):
        store.get(key(4), pool.slot(1))


def _flip_payload_byte(good: bytes) -> bytes:
    at = HEADER_SIZE + 99
    return good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :]


CORRUPTIONS = {
    "garbage": lambda good, other: os.urandom(len(good)),
    "flipped_payload_byte": lambda good, other: _flip_payload_byte(good),
    "truncated": lambda good, other: good[:-1],
    "header_of_another_key": lambda good, other: other,
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_object_confirmed_then_deleted(
    corruption, store, s3_server, bucket, pool: SlotPool
) -> None:
    client = s3_server.client()
    fill(pool.slot(0))
    store.put(key(1), pool.slot(0))
    fill(pool.slot(0))
    store.put(key(2), pool.slot(0))
    good = client.get_object(Bucket=bucket, Key=store.object_key(key(1)))["Body"].read()
    other = client.get_object(Bucket=bucket, Key=store.object_key(key(2)))["Body"].read()
    client.put_object(
        Bucket=bucket, Key=store.object_key(key(1)), Body=CORRUPTIONS[corruption](good, other)
    )

    dst = pool.slot(1)
    dst[:] = b"\x5a" * BLOCK
    with capture_logs() as logs, pytest.raises(CorruptBlock):
        store.get(key(1), dst)
    assert bytes(dst) == b"\x5a" * BLOCK, "corrupt bytes were copied into the slot"
    events = [entry["event"] for entry in logs]
    assert events.count("object_block_corrupt_read") == 1
    assert "object_block_corrupt_deleted" in events
    assert not raw_object_exists(s3_server, bucket, store.object_key(key(1)))
    assert raw_object_exists(s3_server, bucket, store.object_key(key(2)))


def test_corruption_seen_once_is_not_deleted(
    store, s3_server, bucket, pool: SlotPool, monkeypatch
) -> None:
    data = fill(pool.slot(0))
    store.put(key(5), pool.slot(0))
    real_fetch = store._fetch
    calls = []

    def corrupt_first_fetch(path: str):
        fetched = real_fetch(path)
        calls.append(path)
        return os.urandom(len(fetched)) if len(calls) == 1 else fetched

    monkeypatch.setattr(store, "_fetch", corrupt_first_fetch)
    store.get(key(5), pool.slot(1))
    assert len(calls) == 2
    assert bytes(pool.slot(1)) == data
    assert raw_object_exists(s3_server, bucket, store.object_key(key(5)))


def test_other_fingerprint_does_not_see_blocks(
    make_store, s3_server, bucket, pool: SlotPool
) -> None:
    ours = make_store()
    theirs = make_store(fingerprint=deployment_fingerprint(BLOCK, "other-layout"))
    fill(pool.slot(0))
    ours.put(key(1), pool.slot(0))
    assert theirs.exists_many([key(1)]) == [False]
    with pytest.raises(KeyError):
        theirs.get(key(1), pool.slot(1))
    body = s3_server.client().get_object(Bucket=bucket, Key=ours.object_key(key(1)))["Body"].read()
    s3_server.client().put_object(Bucket=bucket, Key=theirs.object_key(key(1)), Body=body)
    with pytest.raises(CorruptBlock):
        theirs.get(key(1), pool.slot(1))


def test_slot_and_key_validation(store: S3BlockStore, pool: SlotPool) -> None:
    with pytest.raises(ValueError, match="expected"):
        store.put(key(1), pool.slot(0)[:-1])
    with pytest.raises(ValueError, match="read-only"):
        store.get(key(1), memoryview(bytes(BLOCK)))
    with pytest.raises(ValueError, match="key length"):
        store.put(b"", pool.slot(0))
    with pytest.raises(ValueError, match="key length"):
        store.get(b"k" * 65, pool.slot(0))


def test_check_accepts_good_config(store: S3BlockStore) -> None:
    store.check()


def test_check_wrong_credentials(make_store, pool: SlotPool) -> None:
    store = make_store(secret_access_key="not-the-secret")
    with pytest.raises(ObjectStoreConfigError, match="rejected the credentials"):
        store.check()
    with pytest.raises(ObjectStoreConfigError, match="credentials"):
        store.get(key(1), pool.slot(0))
    assert store.breaker.state == "closed"


def test_check_missing_bucket(make_store) -> None:
    with pytest.raises(ObjectStoreConfigError, match="bucket 'kvo-absent-bucket' does not exist"):
        make_store(bucket="kvo-absent-bucket").check()


def test_check_unreachable_endpoint(make_store) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = make_store(endpoint=endpoint, request_timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(ObjectStoreConfigError, match=f"cannot reach the S3 endpoint {endpoint}"):
        store.check()
    assert time.monotonic() - started < 2.5


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_put_sends_header_and_slot_without_copying_the_block(
    store: S3BlockStore, s3_server: S3Server, bucket: str, pool: SlotPool
) -> None:
    data = fill(pool.slot(0))
    store.put(key(1), pool.slot(0))  # warm up: connection, lazily built client state
    tracemalloc.start()
    try:
        store.put(key(2), pool.slot(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BLOCK // 4, (
        f"put allocated {peak} bytes of Python memory for a {BLOCK}-byte block"
    )
    body = s3_server.client().get_object(Bucket=bucket, Key=store.object_key(key(2)))["Body"].read()
    assert len(body) == HEADER_SIZE + BLOCK
    assert body[HEADER_SIZE:] == data
    pool.close()  # BufferError here means the client still holds the slot after put returned


def test_put_get_and_failures_release_the_slot(store: S3BlockStore, pool: SlotPool) -> None:
    data = fill(pool.slot(0))
    store.put(key(1), pool.slot(0))
    store.get(key(1), pool.slot(1))
    assert bytes(pool.slot(1)) == data
    with pytest.raises(KeyError) as missing:
        store.get(key(2), pool.slot(2))
    pool.close()  # BufferError here means the engine still holds a view of a slot
    assert missing.value is not None


def test_release_failure_is_reported_and_retryable(make_store, pool: SlotPool) -> None:
    failures = iter([OSError("injected release failure")])

    def flaky_release() -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure

    store = make_store(release_hook=flaky_release)
    data = fill(pool.slot(0))
    with pytest.raises(ReleaseFailed) as failed:
        store.put(key(1), pool.slot(0))
    assert failed.value.transfer_error is None
    assert not failed.value.transfer.released
    with pytest.raises(BufferError):
        pool.close()
    failed.value.transfer.release()
    assert failed.value.transfer.released
    pool.close()
    reader = make_store()
    check_pool = SlotPool(1)
    reader.get(key(1), check_pool.slot(0))
    assert bytes(check_pool.slot(0)) == data
    check_pool.close()


def test_release_failure_keeps_the_transfer_error(make_store, pool: SlotPool) -> None:
    broken = [True]

    def release_step() -> None:
        if broken[0]:
            raise OSError("injected release failure")

    store = make_store(release_hook=release_step)
    with pytest.raises(ReleaseFailed) as failed:
        store.get(key(99), pool.slot(0))
    assert isinstance(failed.value.transfer_error, KeyError)
    with pytest.raises(OSError):
        failed.value.transfer.release()
    assert not failed.value.transfer.released
    broken[0] = False
    failed.value.transfer.release()
    pool.close()


def test_outage_opens_breaker_and_probe_recovers(
    make_store, s3_server: S3Server, pool: SlotPool
) -> None:
    breaker = CircuitBreaker(failure_threshold=3, base_cooldown_s=0.5, max_cooldown_s=2.0)
    store = make_store(
        breaker=breaker, request_timeout_s=2.0, max_retries=1, retry_base_delay_s=0.01
    )
    before = fill(pool.slot(0))
    store.put(key(1), pool.slot(0))

    s3_server.stop()
    try:
        started = time.monotonic()
        with pytest.raises(TransientObjectError) as first:
            store.get(key(1), pool.slot(1))
        assert not isinstance(first.value, BreakerOpen)
        assert "connection" in str(first.value)
        assert time.monotonic() - started < 2 * 2.0
        assert breaker.state == "closed"

        with capture_logs() as logs, pytest.raises(BreakerOpen):
            store.put(key(2), pool.slot(0))
        assert breaker.state == "open"
        assert [e["event"] for e in logs].count("object_breaker_opened") == 1

        started = time.monotonic()
        with pytest.raises(BreakerOpen):
            store.exists_many([key(1)])
        assert time.monotonic() - started < 0.1
    finally:
        s3_server.start()

    deadline = time.monotonic() + 15.0
    while True:
        try:
            store.get(key(1), pool.slot(1))
            break
        except TransientObjectError:
            assert time.monotonic() < deadline, f"no recovery: {breaker.snapshot()}"
            time.sleep(0.1)
    assert bytes(pool.slot(1)) == before
    assert breaker.state == "closed"
    after = fill(pool.slot(0))
    store.put(key(2), pool.slot(0))
    store.get(key(2), pool.slot(1))
    assert bytes(pool.slot(1)) == after
    assert breaker.snapshot().opened_total >= 1


def test_hung_server_fails_within_request_timeout(
    make_store, s3_server: S3Server, pool: SlotPool
) -> None:
    store = make_store(request_timeout_s=1.0, max_retries=1, retry_base_delay_s=0.01)
    data = fill(pool.slot(0))
    store.put(key(1), pool.slot(0))
    s3_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(TransientObjectError, match="connection after 2 attempts"):
            store.get(key(1), pool.slot(1))
        elapsed = time.monotonic() - started
    finally:
        s3_server.resume()
    assert 2 * 1.0 <= elapsed < 2 * 1.0 + 1.0
    store.get(key(1), pool.slot(1))
    assert bytes(pool.slot(1)) == data


# --- circuit breaker (pure) ---------------------------------------------------------------


def make_breaker(clock: FakeClock, **overrides) -> CircuitBreaker:
    settings = dict(
        failure_threshold=3,
        base_cooldown_s=1.0,
        max_cooldown_s=4.0,
        probe_timeout_s=10.0,
        clock=clock,
    )
    settings.update(overrides)
    return CircuitBreaker(**settings)


def fail_n(breaker: CircuitBreaker, n: int) -> None:
    for _ in range(n):
        breaker.before_call()
        breaker.record_failure()


def test_breaker_opens_after_threshold_consecutive_failures() -> None:
    breaker = make_breaker(FakeClock())
    fail_n(breaker, 2)
    breaker.before_call()
    breaker.record_success()
    fail_n(breaker, 2)
    assert breaker.state == "closed"
    with capture_logs() as logs:
        fail_n(breaker, 1)
    assert breaker.state == "open"
    assert logs[0]["event"] == "object_breaker_opened"
    assert logs[0]["consecutive_failures"] == 3


def test_breaker_open_fails_fast_until_cooldown_then_admits_one_probe() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail_n(breaker, 3)
    clock.now += 0.75
    with pytest.raises(BreakerOpen) as refused:
        breaker.before_call()
    assert refused.value.retry_in_s == pytest.approx(0.25)
    assert isinstance(refused.value, TransientObjectError)
    clock.now += 0.25
    breaker.before_call()
    assert breaker.state == "half_open"
    with pytest.raises(BreakerOpen):
        breaker.before_call()
    assert breaker.snapshot().rejected_total == 2


def test_breaker_probe_success_closes_and_resets_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail_n(breaker, 3)
    clock.now += 1.0
    breaker.before_call()
    breaker.record_failure()
    assert breaker.snapshot().cooldown_s == 2.0
    clock.now += 2.0
    breaker.before_call()
    with capture_logs() as logs:
        breaker.record_success()
    assert breaker.state == "closed"
    assert logs[0]["event"] == "object_breaker_closed"
    snap = breaker.snapshot()
    assert snap.cooldown_s == 1.0 and snap.consecutive_failures == 0 and snap.opened_total == 2
    breaker.before_call()
    breaker.before_call()


def test_breaker_probe_failure_reopens_with_growing_capped_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail_n(breaker, 3)
    expected = [2.0, 4.0, 4.0]
    waited = 1.0
    for cooldown in expected:
        clock.now += waited - 0.25
        with pytest.raises(BreakerOpen):
            breaker.before_call()
        clock.now += 0.25
        breaker.before_call()
        with capture_logs() as logs:
            breaker.record_failure()
        assert logs[0]["event"] == "object_breaker_reopened"
        assert breaker.state == "open"
        assert breaker.snapshot().cooldown_s == cooldown
        waited = cooldown


def test_breaker_replaces_a_probe_that_never_reports() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, probe_timeout_s=5.0)
    fail_n(breaker, 3)
    clock.now += 1.0
    breaker.before_call()
    clock.now += 4.5
    with pytest.raises(BreakerOpen):
        breaker.before_call()
    clock.now += 0.5
    breaker.before_call()
    breaker.record_success()
    assert breaker.state == "closed"


def test_breaker_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(base_cooldown_s=2.0, max_cooldown_s=1.0)


# --- retry, classification, naming (pure) -----------------------------------------------------


def test_retry_delays_grow_jittered_and_capped() -> None:
    policy = RetryPolicy(max_retries=5, base_delay_s=0.1, max_delay_s=0.5)
    assert [policy.delay(i, rand=1.0) for i in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert [policy.delay(i, rand=0.0) for i in range(5)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.25, 0.25]
    )
    assert all(0.05 <= policy.delay(0) <= 0.1 for _ in range(100))
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def _s3_error(status: str, code: str | None = None) -> str:
    body = f'<?xml version="1.0"?>\n<Error><Code>{code}</Code></Error>' if code else ""
    return (
        "Generic S3 error: Error performing GET http://127.0.0.1:9/b/k in 1ms - "
        f"Server returned non-2xx status code: {status}: {body}\n\nDebug source:\nGeneric {{ status: 999 }}"
    )


@pytest.mark.parametrize(
    ("exc", "kind", "retryable"),
    [
        (FileNotFoundError(_s3_error("404 Not Found", "NoSuchKey")), ErrorKind.NOT_FOUND, False),
        (FileNotFoundError(_s3_error("404 Not Found", "NoSuchBucket")), ErrorKind.NO_BUCKET, False),
        (GenericError(_s3_error("404 Not Found", "NoSuchBucket")), ErrorKind.NO_BUCKET, False),
        (
            PermissionDeniedError(_s3_error("403 Forbidden", "SignatureDoesNotMatch")),
            ErrorKind.AUTH,
            False,
        ),
        (GenericError(_s3_error("403 Forbidden", "InvalidAccessKeyId")), ErrorKind.AUTH, False),
        (GenericError(_s3_error("503 Service Unavailable", "SlowDown")), ErrorKind.THROTTLED, True),
        (GenericError(_s3_error("429 Too Many Requests")), ErrorKind.THROTTLED, True),
        (
            GenericError(_s3_error("500 Internal Server Error", "InternalError")),
            ErrorKind.SERVER,
            True,
        ),
        (
            GenericError(_s3_error("503 Service Unavailable", "ServiceUnavailable")),
            ErrorKind.SERVER,
            True,
        ),
        (GenericError(_s3_error("400 Bad Request", "InvalidArgument")), ErrorKind.REJECTED, False),
        (
            GenericError("GET http://x in 1ms - HTTP error: error sending request"),
            ErrorKind.CONNECTION,
            True,
        ),
        (ConnectionResetError("reset by peer"), ErrorKind.CONNECTION, True),
        (TimeoutError("timed out"), ErrorKind.CONNECTION, True),
    ],
)
def test_classify(exc: BaseException, kind: ErrorKind, retryable: bool) -> None:
    failure = classify(exc)
    assert failure.kind == kind
    assert failure.retryable == retryable
    assert "Debug source" not in failure.detail


def test_object_names_and_prefixes() -> None:
    assert object_name("a/b", b"\x01" * 16, b"\xab") == f"a/b/{'01' * 16}/ab"
    assert object_name("", b"\x01" * 16, b"\xab") == f"{'01' * 16}/ab"
    assert normalize_prefix("/kv/cache/") == "kv/cache"
    for bad in ("kv/../x", "kv cache", "kv//x", "kv/é"):
        with pytest.raises(ValueError):
            normalize_prefix(bad)
    with pytest.raises(ValueError):
        object_name("kv", b"\x01" * 16, b"k" * 65)
