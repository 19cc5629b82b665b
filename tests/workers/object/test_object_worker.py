"""The object worker: ObjectBackend in-process against a real SeaweedFS and a real host pool, its
start-up check as a process, and the object tier end to end through the running service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import msgspec
import numpy as np
import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("object")

from botocore.exceptions import ClientError  # noqa: E402

from kvoffload.config import Config, ObjectConfig, PoolConfig  # noqa: E402
from kvoffload.memory.blockformat import HEADER_SIZE, deployment_fingerprint  # noqa: E402
from kvoffload.memory.kvcache import SharedKVCache  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402
from kvoffload.memory.slottable import SlotTable  # noqa: E402
from kvoffload.runtime.runspec import RunSpec  # noqa: E402
from kvoffload.testing.helpers import REPO_ROOT, random_kv_cache, wait_until  # noqa: E402
from kvoffload.testing.s3server import S3Server, block_object_names, object_section  # noqa: E402
from kvoffload.testing.service import shm_names_containing, to_toml  # noqa: E402
from kvoffload.tiering import LookupResult  # noqa: E402
from kvoffload.wire.protocol import FaultSpec, Job, JobKind  # noqa: E402
from kvoffload.wire.status import ObjectWorkerStats, WorkerStats  # noqa: E402
from workers.backend import Backend  # noqa: E402
from workers.faults import FaultInjector  # noqa: E402
from workers.object.breaker import CircuitBreaker  # noqa: E402
from workers.object.worker import ObjectBackend  # noqa: E402
from workers.slotheaders import SlotHeaders  # noqa: E402

BLOCK = 65536
SLOTS = 16


def key(i: int, tag: str = "k") -> bytes:
    return f"{tag}-{i}".encode().ljust(16, b".")


def job(job_id: int, kind: str, keys: list[bytes], slots: list[int] | None = None) -> Job:
    return Job(job_id=job_id, kind=kind, keys=keys, slots=slots or [])


def fill(pool: HostPool, slot: int, rng: np.random.Generator) -> bytes:
    data = rng.integers(0, 256, size=BLOCK, dtype=np.uint8)
    pool.slot_array(slot)[:] = data
    return data.tobytes()


def slot_bytes(pool: HostPool, slot: int) -> bytes:
    return pool.slot_array(slot).tobytes()


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.create_bucket(f"kvo-worker-{uuid.uuid4().hex[:12]}")


def make_config(s3_server: S3Server, bucket: str, prefix: str, **object_fields) -> Config:
    fields = object_section(
        s3_server, bucket, prefix, io_threads=4, request_timeout_s=2.0, max_retries=1
    )
    fields.update(object_fields)
    return Config(
        pool=PoolConfig(num_slots=SLOTS, block_bytes=BLOCK), object=ObjectConfig(**fields)
    )


@pytest.fixture
def make_pool() -> Iterator[Callable[[], HostPool]]:
    """Host pools under unique names; each is closed and unlinked at teardown."""
    pools: list[HostPool] = []

    def make() -> HostPool:
        pool = HostPool.create(f"/kvoffload-test-{uuid.uuid4().hex[:12]}", SLOTS, BLOCK)
        pools.append(pool)
        return pool

    try:
        yield make
    finally:
        for pool in pools:
            pool.close()
            pool.unlink()
        assert not [p for p in pools if os.path.exists(f"/dev/shm{p.name}")]


@pytest.fixture
def make_backend(
    s3_server: S3Server, bucket: str, make_pool
) -> Iterator[Callable[..., tuple[ObjectBackend, HostPool]]]:
    """Started backends sharing one prefix (like nodes sharing a bucket), each with its own pool."""
    prefix = f"kv/{uuid.uuid4().hex[:8]}"
    backends: list[ObjectBackend] = []

    def make(
        faults: FaultInjector | None = None, breaker: CircuitBreaker | None = None, **object_fields
    ) -> tuple[ObjectBackend, HostPool]:
        backend = ObjectBackend(
            make_config(s3_server, bucket, prefix, **object_fields), breaker=breaker
        )
        backends.append(backend)
        pool = make_pool()
        backend.start(pool, faults or FaultInjector())
        return backend, pool

    yield make
    for backend in backends:
        backend.close()


def test_cascade_probe_promote_and_cross_node_sharing(make_backend) -> None:
    rng = np.random.default_rng(1)
    node_a, pool_a = make_backend()
    assert isinstance(node_a, Backend)
    keys = [key(i) for i in range(6)]
    written = {k: fill(pool_a, slot, rng) for slot, k in enumerate(keys)}

    stored = node_a.run_job(job(1, JobKind.CASCADE, keys, list(range(6))))
    assert stored.ok_keys == keys and stored.error == "" and stored.release is None
    assert stored.nbytes == 6 * BLOCK

    asked = [key(0), key(100), key(3), key(101), key(5)]
    probed = node_a.run_job(job(2, JobKind.PROBE, asked))
    assert probed.ok_keys == [key(0), key(3), key(5)]
    assert probed.absent_keys == [key(100), key(101)], "a probe confirms what it did not find"
    assert node_a.run_job(job(3, JobKind.PROBE, [key(102)])).ok_keys == []

    promoted = node_a.run_job(job(4, JobKind.PROMOTION, keys, list(range(8, 14))))
    assert promoted.ok_keys == keys
    for slot, k in zip(range(8, 14), keys, strict=True):
        assert slot_bytes(pool_a, slot) == written[k]

    node_b, pool_b = make_backend()
    assert node_b.run_job(job(1, JobKind.PROBE, keys)).ok_keys == keys
    shared = node_b.run_job(job(2, JobKind.PROMOTION, keys[::-1], list(range(6))))
    assert shared.ok_keys == keys[::-1]
    for slot, k in enumerate(keys[::-1]):
        assert slot_bytes(pool_b, slot) == written[k]

    stats = node_a.stats()
    assert (stats.puts, stats.gets, stats.probes) == (6, 6, 2)
    assert stats.keys_found == 3 and stats.breaker.state == "closed"
    assert not node_a.degraded
    msgspec.msgpack.encode(stats)


def test_promote_partial_failure_absent_and_corrupt(
    make_backend, s3_server: S3Server, bucket: str
) -> None:
    rng = np.random.default_rng(2)
    backend, pool = make_backend()
    keys = [key(i, "partial") for i in range(3)]
    good, absent, corrupt = keys
    data = {k: fill(pool, slot, rng) for slot, k in enumerate(keys)}
    assert backend.run_job(job(1, JobKind.CASCADE, keys, [0, 1, 2])).ok_keys == keys

    raw = s3_server.client()
    raw.delete_object(Bucket=bucket, Key=backend.store.object_key(absent))
    name = backend.store.object_key(corrupt)
    body = bytearray(raw.get_object(Bucket=bucket, Key=name)["Body"].read())
    body[HEADER_SIZE + 100] ^= 0xFF
    raw.put_object(Bucket=bucket, Key=name, Body=bytes(body))

    outcome = backend.run_job(job(2, JobKind.PROMOTION, keys, [5, 6, 7]))
    assert outcome.ok_keys == [good]
    assert outcome.absent_keys == [absent, corrupt], (
        "absent and corrupt are confirmed, not transient"
    )
    assert outcome.nbytes == BLOCK
    assert "2 of 3 keys failed" in outcome.error
    assert slot_bytes(pool, 5) == data[good]
    assert slot_bytes(pool, 7) != data[corrupt]
    with pytest.raises(ClientError):
        raw.head_object(Bucket=bucket, Key=name)  # the corrupt copy was removed
    assert backend.stats().get_failures == 2


def test_cascade_stores_the_stamped_checksum_so_later_changes_are_caught(
    s3_server: S3Server, bucket: str, make_pool
) -> None:
    """A PUT carries the checksum its slot was stamped with when the bytes landed, not one of
    the bytes as they are now: a block whose slot changed in between is never served back."""
    cfg = make_config(s3_server, bucket, f"kv/{uuid.uuid4().hex[:8]}")
    pool = make_pool()
    table = SlotTable.create(f"/kvoffload-shtest-{uuid.uuid4().hex[:12]}", SLOTS)
    headers = SlotHeaders(table, pool, deployment_fingerprint(BLOCK, cfg.pool.layout_id))
    backend = ObjectBackend(cfg)
    backend.use_slot_headers(headers)
    backend.start(pool, FaultInjector())
    try:
        rng = np.random.default_rng(4)
        stamped, changed, unstamped = keys = [key(i, "stamp") for i in range(3)]
        data = {k: fill(pool, slot, rng) for slot, k in enumerate(keys)}
        headers.stamp(0, stamped, 1)
        headers.stamp(1, changed, 1)
        pool.slot_array(1)[7] ^= 0xFF  # the slot's bytes change after they were stamped
        assert backend.run_job(job(2, JobKind.CASCADE, keys, [0, 1, 2])).ok_keys == keys
        outcome = backend.run_job(job(3, JobKind.PROMOTION, keys, [4, 5, 6]))
        assert outcome.ok_keys == [stamped, unstamped]
        assert outcome.absent_keys == [changed], "the changed block is dropped as corrupt"
        assert (slot_bytes(pool, 4), slot_bytes(pool, 6)) == (data[stamped], data[unstamped])
    finally:
        backend.close()
        table.unlink()


def test_release_failure_keeps_the_job_until_released(make_backend) -> None:
    rng = np.random.default_rng(3)
    backend, pool = make_backend(FaultInjector(FaultSpec(release_failures=2)))
    k = key(1, "release")
    data = fill(pool, 0, rng)

    outcome = backend.run_job(job(1, JobKind.CASCADE, [k], [0]))
    assert outcome.ok_keys == [k]
    assert outcome.release is not None
    assert backend.stats().pending_releases == 1
    with pytest.raises(RuntimeError, match="still held"):
        outcome.release()
    assert backend.stats().pending_releases == 1
    outcome.release()
    outcome.release()
    assert backend.stats().pending_releases == 0

    loaded = backend.run_job(job(2, JobKind.PROMOTION, [k], [3]))
    assert loaded.ok_keys == [k] and loaded.release is None
    assert slot_bytes(pool, 3) == data


def test_failed_transfer_with_failed_release_fails_the_key(make_backend) -> None:
    backend, pool = make_backend(FaultInjector(FaultSpec(release_failures=1)))
    outcome = backend.run_job(job(1, JobKind.PROMOTION, [key(1, "nowhere")], [0]))
    assert outcome.ok_keys == [] and "absent" in outcome.error
    assert outcome.release is not None
    outcome.release()
    assert backend.stats().pending_releases == 0


def test_fault_fail_fraction_fails_each_operation(make_backend) -> None:
    backend, pool = make_backend(FaultInjector(FaultSpec(fail_fraction=1.0)))
    probed = backend.run_job(job(1, JobKind.PROBE, [key(1)]))
    assert probed.ok_keys == [] and "injected probe failure" in probed.error
    assert probed.absent_keys == [], "a failed probe confirms nothing"
    outcome = backend.run_job(job(2, JobKind.CASCADE, [key(1), key(2)], [0, 1]))
    assert outcome.ok_keys == [] and "InjectedFault" in outcome.error
    assert backend.stats().puts == 2 and backend.stats().put_failures == 2
    loaded = backend.run_job(job(3, JobKind.PROMOTION, [key(1)], [0]))
    assert loaded.ok_keys == [] and loaded.absent_keys == [], (
        "a transient GET failure confirms nothing"
    )


def test_fault_corrupt_fraction_corrupts_what_puts_store_not_the_slot(make_backend) -> None:
    rng = np.random.default_rng(5)
    backend, pool = make_backend(FaultInjector(FaultSpec(corrupt_fraction=1.0)))
    keys = [key(i, "corrupt-put") for i in range(2)]
    data = [fill(pool, slot, rng) for slot in range(2)]
    stored = backend.run_job(job(1, JobKind.CASCADE, keys, [0, 1]))
    assert stored.ok_keys == keys, "the PUTs themselves succeed"
    assert [slot_bytes(pool, slot) for slot in range(2)] == data, "the pool slots are never altered"
    assert backend.stats().injected_corruptions == 2
    loaded = backend.run_job(job(2, JobKind.PROMOTION, keys, [4, 5]))
    assert loaded.ok_keys == [] and loaded.absent_keys == keys, (
        "each stored copy fails its checksum"
    )
    assert backend.run_job(job(3, JobKind.PROBE, keys)).absent_keys == keys, (
        "the corrupt copies were deleted"
    )


def test_breaker_thresholds_come_from_the_object_config(make_backend) -> None:
    backend, _ = make_backend(
        breaker_failure_threshold=2, breaker_cooldown_s=0.25, breaker_max_cooldown_s=0.5
    )
    breaker = backend.store.breaker
    assert breaker.snapshot().cooldown_s == 0.25
    breaker.record_failure()
    assert breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open"
    time.sleep(0.3)
    breaker.before_call()
    breaker.record_failure()
    assert breaker.snapshot().cooldown_s == 0.5
    time.sleep(0.55)
    breaker.before_call()
    breaker.record_failure()
    assert breaker.snapshot().cooldown_s == 0.5, "the cooldown stops doubling at the maximum"


def test_outage_opens_breaker_and_recovers(make_backend, s3_server: S3Server) -> None:
    rng = np.random.default_rng(4)
    breaker = CircuitBreaker(failure_threshold=3, base_cooldown_s=0.3, max_cooldown_s=1.0)
    backend, pool = make_backend(breaker=breaker, request_timeout_s=2.0, max_retries=1)
    before = fill(pool, 0, rng)
    k = key(1, "outage")
    assert backend.run_job(job(1, JobKind.CASCADE, [k], [0])).ok_keys == [k]

    s3_server.kill()  # abrupt outage; a graceful stop of weed can take its full 20 s grace
    try:
        for attempt in range(5):
            started = time.monotonic()
            probed = backend.run_job(job(10 + attempt, JobKind.PROBE, [k, key(2, "outage")]))
            assert probed.ok_keys == [] and "probe_failed" in probed.error
            assert time.monotonic() - started < 2 * 2.0 + 1.0
            if backend.degraded:
                break
        assert backend.degraded and backend.stats().breaker.state == "open"

        started = time.monotonic()
        dropped = backend.run_job(job(20, JobKind.CASCADE, [key(3, "outage")], [1]))
        probed = backend.run_job(job(21, JobKind.PROBE, [k]))
        assert time.monotonic() - started < 0.2
        assert dropped.ok_keys == [] and "BreakerOpen" in dropped.error
        assert probed.ok_keys == [] and "breaker open" in probed.error
    finally:
        s3_server.start()

    deadline = time.monotonic() + 15.0
    while backend.run_job(job(30, JobKind.PROBE, [k])).ok_keys != [k]:
        assert time.monotonic() < deadline, f"no recovery: {breaker.snapshot()}"
        time.sleep(0.1)
    assert not backend.degraded
    after = fill(pool, 1, rng)
    assert backend.run_job(job(31, JobKind.CASCADE, [key(3, "outage")], [1])).ok_keys == [
        key(3, "outage")
    ]
    assert backend.run_job(job(32, JobKind.PROMOTION, [k, key(3, "outage")], [4, 5])).ok_keys == [
        k,
        key(3, "outage"),
    ]
    assert (slot_bytes(pool, 4), slot_bytes(pool, 5)) == (before, after)
    assert backend.stats().breaker.opened_total >= 1


# --- the worker process ----------------------------------------------------------------------


def object_worker_command(tmp_path: Path, cfg: Config) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``python -m workers.object`` with a spec for ``cfg`` whose
    pool and manager do not exist."""
    spec = RunSpec(
        run_id="objtest",
        job_endpoint=f"ipc://{tmp_path}/no-manager.sock",
        client_endpoint=f"ipc://{tmp_path}/no-client.sock",
        pool_name=f"/kvoffload-test-absent-{uuid.uuid4().hex[:8]}",
        config=cfg.to_toml_dict(redact_secrets=False),
    )
    path = tmp_path / "runspec.json"
    path.write_bytes(msgspec.json.encode(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return [
        sys.executable,
        "-m",
        "workers.object",
        "--spec",
        str(path),
        "--hello-timeout",
        "2",
    ], env


def run_object_worker(
    tmp_path: Path, cfg: Config
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The object worker run to its end (``object_worker_command``)."""
    argv, env = object_worker_command(tmp_path, cfg)
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    return proc, events


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"secret_access_key": "wrong-secret"}, "rejected the credentials"),
        ({"bucket": "kvo-no-such-bucket"}, "does not exist"),
    ],
)
def test_a_worker_whose_store_is_not_ready_tries_again_until_it_is_stopped(
    tmp_path, s3_server: S3Server, bucket: str, change, expected
) -> None:
    cfg = make_config(s3_server, bucket, "kv/startup")
    cfg = msgspec.structs.replace(
        cfg,
        object=msgspec.structs.replace(cfg.object, **change),
        supervisor=msgspec.structs.replace(
            cfg.supervisor, restart_backoff_initial_s=0.05, restart_backoff_max_s=0.1
        ),
    )
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        proc = start_object_worker(tmp_path, cfg, log_file)
        try:

            def unavailable() -> list[dict]:
                return [e for e in log_events(log_path) if e["event"] == "object_store_unavailable"]

            wait_until(unavailable, what="the store's first failed check")
            time.sleep(1.0)  # about ten more checks, none of them logged
            assert proc.poll() is None  # still trying
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=10)
    events = log_events(log_path)
    logged = [e for e in events if e["event"] == "object_store_unavailable"]
    assert code == 0
    assert len(logged) == 1 and expected in logged[0]["error"] and logged[0]["level"] == "warning"
    assert not [e for e in events if e["event"] in ("object_store_ready", "worker_started")]


def start_object_worker(tmp_path: Path, cfg: Config, log_file: IO[str]) -> subprocess.Popen:
    argv, env = object_worker_command(tmp_path, cfg)
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stderr=log_file, text=True)


def log_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_worker_with_a_usable_store_goes_on_to_the_manager(
    tmp_path, s3_server: S3Server, bucket: str
) -> None:
    proc, events = run_object_worker(tmp_path, make_config(s3_server, bucket, "kv/startup"))
    names = [e["event"] for e in events]
    assert "object_store_ready" in names and "object_store_unusable" not in names
    assert "pool_attach_failed" in names and proc.returncode == 1, proc.stderr


# --- end to end through the service ----------------------------------------------------------


@pytest.fixture
def kv() -> Iterator[SharedKVCache]:
    cache = random_kv_cache(32, [BLOCK // 2, BLOCK // 2], seed=5)
    try:
        yield cache
    finally:
        cache.close()
        cache.unlink()


def device_block(cache: SharedKVCache, block: int) -> bytes:
    return b"".join(t[block].tobytes() for t in cache.tensors)


def object_config(s3_server: S3Server, bucket: str, prefix: str) -> str:
    """The ``[object]`` table of a service on ``s3_server``, as TOML."""
    section = object_section(
        s3_server, bucket, prefix, io_threads=4, request_timeout_s=2.0, verdict_timeout_s=10.0
    )
    return to_toml({"object": section})


def lookup_until_hit(
    client, req: str, keys: list[bytes], timeout_s: float = 20.0
) -> list[LookupResult]:
    """Repeat the lookup (ending steps) until every key is HIT; returns the sequence of
    distinct results seen for the first key. A MISS fails the test."""
    seen: list[LookupResult] = []
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = client.lookup(req, keys)
        if not seen or seen[-1] != outcome.results[0]:
            seen.append(outcome.results[0])
        if outcome.results == [LookupResult.HIT] * len(keys):
            assert outcome.hit_prefix == len(keys)
            return seen
        assert LookupResult.MISS not in outcome.results, outcome
        assert time.monotonic() < deadline, (seen, outcome)
        client.end_step()
        time.sleep(0.02)


def test_second_node_hits_blocks_the_first_node_stored(
    start_service, s3_server: S3Server, bucket: str, kv
) -> None:
    """Two services (two pools, two managers) on one bucket: a prefix computed on one node is
    a hit on the other, and loads bit-exact."""
    prefix = f"fleet/{uuid.uuid4().hex[:8]}"
    node_a = start_service(
        workers=("cpu", "object"), extra_config=object_config(s3_server, bucket, prefix)
    )
    node_b = start_service(
        workers=("cpu", "object"), extra_config=object_config(s3_server, bucket, prefix)
    )
    keys = [key(i, "fleet") for i in range(6)]
    with node_a.client("engine-a") as a:
        a.register_kv(kv.handle("kv-a"))
        a.new_request("w")
        accepted = a.store("w", keys, list(range(6)), "kv-a")
        assert a.wait([accepted.job_id])[accepted.job_id].success
        a.finish_request("w")
        wait_until(lambda: node_a.status().tiering.jobs_in_flight == 0, 20.0, "the cascade to S3")
    with node_b.client("engine-b") as b:
        b.register_kv(kv.handle("kv-b"))
        b.new_request("r")
        assert lookup_until_hit(b, "r", keys) == [
            LookupResult.RETRY,
            LookupResult.HIT_PENDING,
            LookupResult.HIT,
        ]
        loaded = b.load("r", keys, list(range(20, 26)), "kv-b")
        assert b.wait([loaded.job_id])[loaded.job_id].success
        for i in range(6):
            assert device_block(kv, 20 + i) == device_block(kv, i)
        b.finish_request("r")


@pytest.mark.parametrize("release_failures", [0, 1])
def test_blocks_come_back_from_s3_after_reset(
    start_service, s3_server: S3Server, bucket: str, kv, release_failures: int
) -> None:
    """With ``release_failures`` the object worker's first slot release fails: the
    cascade's result still arrives once, after the retried release, and nothing is lost."""
    prefix = f"e2e/{uuid.uuid4().hex[:8]}"
    service = start_service(
        workers=("cpu", "object"),
        extra_config=object_config(s3_server, bucket, prefix)
        + f"\n[faults]\nrelease_failures = {release_failures}\n",
    )
    keys = [key(i, "e2e") for i in range(8)]
    raw = s3_server.client()
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        c.new_request("writer")
        accepted = c.store("writer", keys, list(range(8)), "kv")
        assert c.wait([accepted.job_id])[accepted.job_id].success
        c.finish_request("writer")

        def cascaded() -> bool:
            listed = len(block_object_names(raw, bucket, prefix + "/"))
            tiering = service.status().tiering
            return listed == len(keys) and tiering.jobs_in_flight == 0 and tiering.pinned_slots == 0

        wait_until(cascaded, 20.0, "the cascade to S3")
        c.reset_cache()

        c.new_request("reader")
        seen = lookup_until_hit(c, "reader", keys)
        assert seen == [LookupResult.RETRY, LookupResult.HIT_PENDING, LookupResult.HIT], seen

        loaded = c.load("reader", keys, list(range(16, 24)), "kv")
        assert c.wait([loaded.job_id])[loaded.job_id].success
        for i in range(8):
            assert device_block(kv, 16 + i) == device_block(kv, i)
        c.finish_request("reader")

    def reported(stats: WorkerStats) -> bool:  # heartbeat stats lag by up to one interval
        medium = stats.medium
        return (
            isinstance(medium, ObjectWorkerStats)
            and medium.gets == len(keys)
            and stats.loop.jobs_done >= 3
        )

    wait_until(lambda: reported(service.status().workers["object"].stats), 5.0, "object heartbeat")
    worker = service.status().workers["object"]
    assert worker.degraded is False
    stats = worker.stats.medium
    assert isinstance(stats, ObjectWorkerStats)
    assert (stats.puts, stats.keys_found, worker.stats.loop.jobs_failed) == (
        len(keys),
        len(keys),
        0,
    )
    assert stats.slot_release_failures == release_failures and stats.pending_releases == 0
    events = service.log_events()
    names = [e["event"] for e in events if e.get("proc") == "object"]
    assert "object_store_ready" in names
    assert names.count("object_slot_release_failed") == release_failures
    assert names.count("object_slots_released") == release_failures
    errors = [e for e in events if e.get("proc") == "object" and e.get("level") == "error"]
    assert len(errors) == release_failures, errors
    assert not [
        e for e in events if e["event"] in ("job_result_rejected", "device_job_result_rejected")
    ]
    run_id = service.run_id
    assert service.stop().exit_code == 0
    assert shm_names_containing(run_id) == []
