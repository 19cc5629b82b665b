"""The common worker loop, run as a real subprocess (``python -m tests.workers.test_framework``)
with a trivial backend, against a fake manager over real zmq and a real host pool."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.runspec import EXIT_FAILED, EXIT_OK, EXIT_REFUSED, RunSpec, load_runspec
from kvoffload.wire.protocol import (
    PROTOCOL_VERSION,
    Control,
    FaultSpec,
    Heartbeat,
    IndexUpdate,
    Job,
    JobDone,
    JobKind,
    JobProgress,
    WorkerHello,
    encode,
)
from kvoffload.wire.status import DiskWorkerStats
from tests.workers.conftest import FakeManager, write_spec
from workers.backend import Backend, BackendOutcome, NoIndexBackend
from workers.faults import FaultInjector, InjectedFault
from workers.framework import worker_main
from workers.jobs import job_done_of, report_landed, validate_job

MODULE = "tests.workers.test_framework"
log = get_logger()
IDENTITY = b"test"
RELEASE_MARK = 0xA5
SLOTS = 16
BLOCK = 4096


# ---- the trivial backend run by the worker subprocess ------------------------------------------


def index_key(i: int) -> bytes:
    return b"idx-" + i.to_bytes(12, "big")


class EchoBackend(NoIndexBackend):
    """Writes each key into its slot. Keys containing ``slow`` make the job sleep 0.3 s,
    ``stall`` 1 s; keys starting with ``fail`` fail, ``boom`` raise; ``relfail`` makes the
    release raise twice, ``cleanfail`` the cleanup raise; a job whose keys start with
    ``inline`` may run on the main thread (``runs_inline``). Each job logs the thread it ran
    on (``echo_job_ran``). The release writes RELEASE_MARK into the last byte of each slot, so
    a JobDone seen before the mark shows a result published before its release."""

    name = "test"
    medium = "memory"

    def __init__(self) -> None:
        self.capabilities = sorted(JobKind)
        self.degraded = False
        self._index_keys = int(os.environ.get("TEST_INDEX_KEYS", "0"))
        self._pool: HostPool | None = None
        self._faults = FaultInjector()

    def job_threads(self, cfg: Config) -> int:
        return cfg.cpu.copy_threads()

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        return cfg.cpu.cpu_affinity

    def use_slot_headers(self, headers) -> None:
        """Echo jobs stamp nothing."""

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        self._pool = pool
        self._faults = faults

    def initial_index(self) -> Iterable[list[bytes]]:
        keys = [index_key(i) for i in range(self._index_keys)]
        for start in range(0, len(keys), 1000):
            yield keys[start : start + 1000]

    def runs_inline(self, job: Job) -> bool:
        return all(k.startswith(b"inline") for k in job.keys)

    def run_job(self, job: Job) -> BackendOutcome:
        assert self._pool is not None
        if any(k.startswith(b"boom") for k in job.keys):
            raise RuntimeError("backend exploded")
        log.info("echo_job_ran", job_id=job.job_id, thread=threading.current_thread().name)
        if any(b"slow" in k for k in job.keys):
            time.sleep(0.3)
        if any(b"stall" in k for k in job.keys):
            time.sleep(1.0)
        ok = []
        for i, key in enumerate(job.keys):
            try:
                self._faults.on_op(job.kind, key)
            except InjectedFault:
                continue
            if key.startswith(b"fail"):
                continue
            if job.slots:
                slot = self._pool.slot_array(job.slots[i])
                slot[: len(key)] = list(key)
                slot[-1] = 0
            ok.append(key)
            if key.startswith(b"land"):
                report_landed([key])
                time.sleep(0.2)
        failures = {"count": 2 if any(k.startswith(b"relfail") for k in job.keys) else 0}

        def release() -> None:
            if failures["count"]:
                failures["count"] -= 1
                raise OSError("handle still busy")
            for slot in job.slots:
                self._pool.slot_array(slot)[-1] = RELEASE_MARK

        def cleanup() -> None:
            if any(k.startswith(b"cleanfail") for k in job.keys):
                raise OSError("secondary cleanup failed")

        return BackendOutcome(
            ok_keys=ok, nbytes=len(ok), error="some keys failed", release=release, cleanup=cleanup
        )

    def stats(self) -> DiskWorkerStats:
        return DiskWorkerStats(keys_promoted=7)

    def close(self) -> None:
        return None


# ---- helpers -----------------------------------------------------------------------------------


def start_worker(
    manager: FakeManager,
    make_pool,
    spawn,
    short_dir: Path,
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    accept: bool = True,
):
    pool = make_pool(SLOTS, BLOCK)
    spec = write_spec(short_dir, manager.endpoint, pool, config)
    worker = spawn(MODULE, spec, env=env)
    if accept:
        manager.accept_hello()
        manager.wait_for(IndexUpdate, lambda m: m.complete)
    return pool, worker


def store(job_id: int, keys: list[bytes], slots: list[int], kind: str = "cascade") -> Job:
    return Job(job_id=job_id, kind=kind, keys=keys, slots=slots)


def events_named(worker, name: str) -> list[dict[str, Any]]:
    return [e for e in worker.log_events() if e.get("event") == name]


# ---- tests -------------------------------------------------------------------------------------


def test_hello_ack_index_batches_and_heartbeats(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, env={"TEST_INDEX_KEYS": "5000"}, accept=False
    )
    identity, hello = manager.accept_hello()
    assert identity == IDENTITY
    assert hello == WorkerHello(
        version=PROTOCOL_VERSION,
        worker="test",
        medium="memory",
        pid=worker.pid,
        capabilities=sorted(JobKind),
    )
    manager.wait_for(IndexUpdate, lambda m: m.complete)
    updates = manager.messages(IndexUpdate)
    assert [len(u.added) for u in updates] == [4096, 904]
    assert [u.complete for u in updates] == [False, True]
    assert [k for u in updates for k in u.added] == [index_key(i) for i in range(5000)]

    first = manager.wait_for(Heartbeat)
    second = manager.wait_for(Heartbeat)
    assert first.inflight == 0 and not first.degraded
    assert second.stats.medium == DiskWorkerStats(keys_promoted=7)
    assert second.stats.loop.jobs_done == 0


def test_refused_hello_exits_with_code_2(manager, make_pool, spawn, short_dir):
    _, worker = start_worker(manager, make_pool, spawn, short_dir, accept=False)
    manager.accept_hello(accepted=False, reason="protocol version 0 not supported")
    assert worker.wait() == EXIT_REFUSED
    refused = events_named(worker, "worker_refused")
    assert refused and refused[0]["reason"] == "protocol version 0 not supported"


def test_hello_is_resent_until_a_manager_binds(make_pool, spawn, short_dir):
    pool = make_pool(SLOTS, BLOCK)
    endpoint = f"ipc://{short_dir}/late.sock"
    worker = spawn(MODULE, write_spec(short_dir, endpoint, pool))
    time.sleep(1.5)
    late = FakeManager(endpoint)
    try:
        late.accept_hello()
        late.wait_for(IndexUpdate, lambda m: m.complete)
        late.send(IDENTITY, store(1, [b"k" * 16], [0]))
        assert late.wait_job_dones([1])[1].success
    finally:
        late.close()
    assert worker.proc.poll() is None


def test_hello_timeout_exits_with_code_1(make_pool, spawn, short_dir):
    pool = make_pool(SLOTS, BLOCK)
    spec = write_spec(short_dir, f"ipc://{short_dir}/nobody.sock", pool)
    worker = spawn(MODULE, spec, "--hello-timeout", "0.5")
    assert worker.wait() == EXIT_FAILED
    assert events_named(worker, "hello_timeout")


def test_hello_control_re_hellos_and_re_announces_the_index(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir, env={"TEST_INDEX_KEYS": "10"})
    manager.send(IDENTITY, Control(action="hello"))
    manager.send(IDENTITY, Control(action="hello"))  # a second ask while unacked: no new hello
    _, hello = manager.accept_hello()
    assert hello.pid == worker.pid
    update = manager.wait_for(IndexUpdate, lambda m: m.complete)
    assert update.added == [index_key(i) for i in range(10)]
    manager.send(IDENTITY, store(1, [b"k" * 16], [0]))
    assert manager.wait_job_dones([1])[1].success
    assert len(manager.messages(WorkerHello)) == 2

    manager.send(IDENTITY, Control(action="hello"))
    manager.accept_hello(accepted=False, reason="unknown worker")
    assert worker.wait() == EXIT_REFUSED


def test_invalid_jobs_fail_without_touching_the_pool(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    key = b"k" * 16
    manager.send(IDENTITY, store(1, [key], [SLOTS]))
    manager.send(IDENTITY, store(2, [key, key], [0]))
    manager.send(IDENTITY, Job(job_id=3, kind="device_store", keys=[key], slots=[0], handle_id="h"))
    manager.send(
        IDENTITY, Job(job_id=4, kind="device_store", keys=[key], slots=[0], device_blocks=[0])
    )
    manager.send(IDENTITY, Job(job_id=5, kind="teleport", keys=[key]))
    manager.send(IDENTITY, store(6, [key], [-1]))
    dones = manager.wait_job_dones([1, 2, 3, 4, 6])
    assert not any(d.success for d in dones.values())
    assert dones[1].error.startswith("slot_out_of_range")
    assert dones[6].error.startswith("slot_out_of_range")
    assert dones[2].error.startswith("invalid_job")
    assert dones[3].error.startswith("invalid_job")
    assert dones[4].error.startswith("invalid_job")
    assert 5 not in manager.job_dones(), "a kind outside JobKind is refused by decoding"
    assert any(
        "teleport" in e.get("error", "") for e in events_named(worker, "bad_manager_message")
    )
    assert not pool.as_numpy().any()

    manager.send(IDENTITY, store(7, [key], [3]))
    assert manager.wait_job_dones([7])[7].success
    assert bytes(pool.slot_array(3)[:16]) == key
    assert worker.proc.poll() is None


def test_malformed_manager_frames_are_logged_and_ignored(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    manager.send_raw(IDENTITY, b"\xc1 not msgpack")
    manager.send_raw(IDENTITY, encode(Heartbeat()))  # a worker-side message
    manager.send_raw(IDENTITY, b"\x81\xa1t\xa7unknown")  # {"t": "unknown"}
    manager.send_raw(IDENTITY, encode(store(1, [b"k" * 16], [0])), b"second part")
    manager.send(IDENTITY, Control(action="reboot"))
    manager.send(IDENTITY, store(2, [b"k" * 16], [0]))
    assert manager.wait_job_dones([2])[2].success
    assert 1 not in manager.job_dones()
    assert len(events_named(worker, "bad_manager_message")) == 5
    assert worker.proc.poll() is None


def test_exactly_one_result_per_job_under_concurrency(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, config={"cpu": {"threads": 4}}
    )
    rng = random.Random(7)
    jobs: dict[int, Job] = {}
    for job_id in range(200):
        n = rng.randint(1, 6)
        keys = [
            (b"fail" if rng.random() < 0.2 else b"good")
            + job_id.to_bytes(4, "big")
            + bytes([i]) * 8
            for i in range(n)
        ]
        slots = [rng.randrange(SLOTS) for _ in range(n)]
        jobs[job_id] = store(job_id, keys, slots, kind=rng.choice(["cascade", "promotion"]))
        manager.send(IDENTITY, jobs[job_id])
    dones = manager.wait_job_dones(list(jobs), timeout_s=20)
    manager.pump(0.3)
    assert all(len(v) == 1 for v in manager.job_dones().values())
    assert len(manager.job_dones()) == 200
    partial = 0
    for job_id, done in dones.items():
        keys = jobs[job_id].keys
        ok = [k for k in keys if not k.startswith(b"fail")]
        if len(ok) == len(keys):
            assert done.success and done.successful_keys is None and done.error == ""
        else:
            partial += bool(ok)
            assert not done.success and done.error == "some keys failed"
            assert done.successful_keys == (ok or None)
    assert partial > 10


def test_release_failure_delays_the_result_until_release_succeeds(
    manager, make_pool, spawn, short_dir
):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, config={"faults": {"release_failures": 1}}
    )
    manager.send(IDENTITY, store(1, [b"k" * 16], [5]))
    done = manager.wait_for(JobDone, lambda m: m.job_id == 1)
    # the release writes the mark: seeing it now proves the result followed the release
    assert pool.slot_array(5)[-1] == RELEASE_MARK
    assert done.success
    failed = events_named(worker, "job_release_failed")
    assert [e["job_id"] for e in failed] == [1]
    assert "injected release failure" in failed[0]["error"]

    manager.send(IDENTITY, store(2, [b"relfail" + b"x" * 9, b"cleanfail" + b"y" * 7], [6, 7]))
    done = manager.wait_for(JobDone, lambda m: m.job_id == 2)
    assert done.success
    assert pool.slot_array(6)[-1] == RELEASE_MARK and pool.slot_array(7)[-1] == RELEASE_MARK
    assert [
        e["attempt"] for e in events_named(worker, "job_release_failed") if e["job_id"] == 2
    ] == [1, 2]
    assert [e["job_id"] for e in events_named(worker, "job_cleanup_failed")] == [2]

    manager.pump(0.5)
    assert {k: len(v) for k, v in manager.job_dones().items()} == {1: 1, 2: 1}


def test_landed_keys_are_reported_while_the_job_runs_and_before_its_result(
    manager, make_pool, spawn, short_dir
):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    keys = [b"land" + bytes([i]) * 12 for i in range(3)]
    manager.send(IDENTITY, store(1, keys, [3, 4, 5], kind="promotion"))
    first = manager.wait_for(JobProgress, lambda m: m.job_id == 1)
    assert first.keys == [keys[0]]
    assert bytes(pool.slot_array(3)[:16]) == keys[0]
    assert not manager.messages(JobDone)  # the job is still running
    done = manager.wait_for(JobDone, lambda m: m.job_id == 1)
    assert done.success
    order = [m for _, m in manager.received if isinstance(m, JobProgress | JobDone)]
    assert isinstance(order[-1], JobDone)
    assert [k for m in order[:-1] for k in m.keys] == keys


def test_backend_exception_fails_the_job_and_the_worker_goes_on(
    manager, make_pool, spawn, short_dir
):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    manager.send(IDENTITY, store(1, [b"boom" + b"z" * 12], [0]))
    manager.send(IDENTITY, store(2, [b"k" * 16], [1]))
    dones = manager.wait_job_dones([1, 2])
    assert not dones[1].success and "backend exploded" in dones[1].error
    assert dones[1].successful_keys is None
    assert dones[2].success


def test_faults_control_replaces_the_fault_spec(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    keys = [bytes([i]) * 16 for i in range(4)]
    manager.send(IDENTITY, Control(action="faults", faults=FaultSpec(fail_fraction=1.0)))
    manager.send(IDENTITY, store(1, keys, [0, 1, 2, 3]))
    # faults apply when a job runs, so wait for job 1 before lifting them
    first = manager.wait_job_dones([1])[1]
    assert not first.success and first.successful_keys is None
    manager.send(IDENTITY, Control(action="faults", faults=FaultSpec()))
    manager.send(IDENTITY, store(2, keys, [0, 1, 2, 3]))
    assert manager.wait_job_dones([2])[2].success


def test_drain_refuses_new_jobs_and_finishes_running_ones(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    manager.send(IDENTITY, store(1, [b"slow" + b"s" * 12], [0]))
    manager.send(IDENTITY, Control(action="drain"))
    manager.send(IDENTITY, store(2, [b"k" * 16], [1]))
    dones = manager.wait_job_dones([1, 2])
    assert dones[2] == JobDone(job_id=2, success=False, error="draining")
    assert dones[1].success
    before = len(manager.messages(Heartbeat))
    manager.pump(0.3)
    deadline = time.monotonic() + 2
    while len(manager.messages(Heartbeat)) < before + 3 and time.monotonic() < deadline:
        manager.pump(0.05)
    assert len(manager.messages(Heartbeat)) >= before + 3
    assert manager.messages(Heartbeat)[-1].inflight == 0
    assert worker.proc.poll() is None


def test_shutdown_control_finishes_inflight_jobs_then_exits_0(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    manager.send(IDENTITY, store(1, [b"slow" + b"s" * 12], [0]))
    manager.pump(0.05)
    manager.send(IDENTITY, Control(action="shutdown"))
    assert worker.wait() == EXIT_OK
    manager.pump(0.5)
    assert [d.success for d in manager.job_dones()[1]] == [True]


def test_sigterm_shuts_down_with_exit_0(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(manager, make_pool, spawn, short_dir)
    manager.wait_for(Heartbeat)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait() == EXIT_OK
    assert events_named(worker, "worker_shutting_down")[0]["reason"] == "signal"


def test_loads_and_promotions_run_before_queued_stores(manager, make_pool, spawn, short_dir):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, config={"cpu": {"threads": 1}}
    )
    manager.send(IDENTITY, store(1, [b"slow" + b"s" * 12], [0], kind="cascade"))
    # wait until job 1 occupies the only thread, so the rest queue behind it
    manager.wait_for(Heartbeat, lambda m: m.inflight == 1 and m.stats.loop.queued == 0)
    manager.send(IDENTITY, store(2, [b"a" * 16], [1], kind="cascade"))
    manager.send(IDENTITY, store(3, [b"b" * 16], [2], kind="promotion"))
    manager.send(IDENTITY, store(4, [b"c" * 16], [3], kind="cascade"))
    manager.send(IDENTITY, Job(job_id=5, kind="probe", keys=[b"d" * 16]))
    manager.wait_job_dones([1, 2, 3, 4, 5])
    order = [d.job_id for d in manager.messages(JobDone)]
    assert order == [1, 3, 5, 2, 4]


def ran_on(worker, job_id: int) -> str:
    return next(e["thread"] for e in events_named(worker, "echo_job_ran") if e["job_id"] == job_id)


def test_a_lone_urgent_job_runs_on_the_main_thread_while_no_other_urgent_job_is_in_flight(
    manager, make_pool, spawn, short_dir
):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, config={"cpu": {"threads": 1}}
    )
    manager.send(IDENTITY, store(1, [b"slow" + b"s" * 12], [0], kind="cascade"))
    manager.wait_for(Heartbeat, lambda m: m.inflight == 1 and m.stats.loop.queued == 0)
    manager.send(IDENTITY, store(3, [b"inline" + b"i" * 10], [2], kind="promotion"))
    manager.wait_job_dones([3])
    manager.send(IDENTITY, store(2, [b"a" * 16], [1], kind="promotion"))
    manager.send(IDENTITY, store(5, [b"inline" + b"k" * 10], [4], kind="promotion"))
    manager.send(IDENTITY, store(4, [b"inline" + b"j" * 10], [3], kind="cascade"))
    manager.wait_job_dones([1, 2, 3, 4, 5])
    assert [d.job_id for d in manager.messages(JobDone)] == [3, 1, 2, 5, 4]
    assert all(d.success for d in manager.messages(JobDone))
    assert bytes(pool.slot_array(2)[:16]) == b"inline" + b"i" * 10
    assert pool.slot_array(2)[-1] == RELEASE_MARK
    assert ran_on(worker, 3) == "MainThread"
    assert ran_on(worker, 5) != "MainThread", "job 2, urgent, was in flight"
    assert ran_on(worker, 4) != "MainThread", "a cascade is not urgent"


def test_urgent_jobs_that_arrive_together_keep_the_job_threads(
    manager, make_pool, spawn, short_dir
):
    pool, worker = start_worker(
        manager, make_pool, spawn, short_dir, config={"cpu": {"threads": 4}}
    )
    manager.send(IDENTITY, store(1, [b"inline-stall" + b"s" * 4], [0], kind="promotion"))
    deadline = time.monotonic() + 10
    while not any(e["job_id"] == 1 for e in events_named(worker, "echo_job_ran")):
        assert time.monotonic() < deadline, "job 1 never ran"
        time.sleep(0.005)
    # job 1 holds the main thread for 1 s: the next three arrive together behind it
    for job_id in (2, 3, 4):
        manager.send(
            IDENTITY, store(job_id, [b"inline-%d" % job_id + b"x" * 8], [job_id], "promotion")
        )
    manager.wait_job_dones([1, 2, 3, 4])
    assert all(d.success for d in manager.messages(JobDone))
    assert ran_on(worker, 1) == "MainThread"
    assert [ran_on(worker, job_id) for job_id in (2, 3, 4)].count("MainThread") == 0
    manager.wait_for(Heartbeat, lambda m: m.inflight == 0 and m.stats.loop.jobs_done == 4)


# ---- in-process units --------------------------------------------------------------------------


def test_job_done_success_partial_and_none():
    job = Job(job_id=9, kind="cascade", keys=[b"a", b"b", b"c"], slots=[0, 1, 2])
    assert job_done_of(job, BackendOutcome(ok_keys=[b"a", b"b", b"c"], nbytes=3), 0.5) == JobDone(
        job_id=9, success=True, transfer_s=0.5, nbytes=3
    )
    partial = job_done_of(job, BackendOutcome(ok_keys=[b"c", b"a", b"zz"], error="e"), 0.0)
    assert not partial.success and partial.successful_keys == [b"c", b"a"] and partial.error == "e"
    none = job_done_of(job, BackendOutcome(ok_keys=[]), 0.0)
    assert not none.success and none.successful_keys is None and none.error == "failed"
    assert none.absent_keys == []
    gone = job_done_of(job, BackendOutcome(ok_keys=[b"a"], absent_keys=[b"b", b"a", b"zz"]), 0.0)
    assert gone.successful_keys == [b"a"] and gone.absent_keys == [b"b"], (
        "only failed keys of the job"
    )


def test_validate_job_rules():
    kinds = frozenset(JobKind)
    assert validate_job(Job(job_id=1, kind="probe", keys=[b"a"]), 4, kinds) == ""
    assert validate_job(store(1, [b"a"], [3]), 4, kinds) == ""
    assert validate_job(store(1, [b"a"], [4]), 4, kinds).startswith("slot_out_of_range")
    assert validate_job(store(1, [b"a"], [0]), 4, {"probe"}).startswith("unsupported_kind")
    device = Job(
        job_id=1, kind="device_load", keys=[b"a"], slots=[0], device_blocks=[7], handle_id="h"
    )
    assert validate_job(device, 4, kinds) == ""


def test_runspec_round_trip_and_config(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(
        '{"run_id": "r", "job_endpoint": "ipc:///x", "client_endpoint": "ipc:///y", '
        '"pool_name": "/p", "config": {"cpu": {"threads": 3, "cpu_affinity": [0]}}}'
    )
    spec = load_runspec(path)
    assert isinstance(spec, RunSpec) and spec.pool_name == "/p"
    cfg = spec.load_config()
    assert cfg.cpu.threads == 3 and cfg.cpu.cpu_affinity == (0,)
    path.write_text('{"run_id": "r"}')
    assert worker_main(lambda cfg, spec: EchoBackend(), ["--spec", str(path)]) == EXIT_REFUSED


def test_echo_backend_satisfies_the_protocol():
    assert isinstance(EchoBackend(), Backend)


def test_fault_injector_fractions_are_seeded_and_bounded():
    def failures(seed: int) -> list[bool]:
        faults = FaultInjector(FaultSpec(fail_fraction=0.3, seed=seed))
        out = []
        for _ in range(1000):
            try:
                faults.maybe_fail("op", b"k")
                out.append(False)
            except InjectedFault:
                out.append(True)
        return out

    assert failures(1) == failures(1) != failures(2)
    assert 200 < sum(failures(1)) < 400
    never = FaultInjector(FaultSpec())
    assert not never.active and not any(never.should_corrupt() for _ in range(100))
    always = FaultInjector(FaultSpec(corrupt_fraction=1.0))
    assert all(always.should_corrupt() for _ in range(100))
    with pytest.raises(OSError):
        FaultInjector(FaultSpec(fail_fraction=1.0)).on_op("write", b"key")


def test_fault_injector_delay_and_release_failures():
    faults = FaultInjector(FaultSpec(delay_s=0.02, delay_fraction=1.0, release_failures=2))
    start = time.monotonic()
    assert faults.maybe_delay() == 0.02
    assert time.monotonic() - start >= 0.02
    assert [faults.take_release_failure() for _ in range(4)] == [True, True, False, False]
    faults.replace(FaultSpec(release_failures=1))
    assert [faults.take_release_failure() for _ in range(2)] == [True, False]


def test_fault_injector_is_thread_safe_for_release_failures():
    faults = FaultInjector(FaultSpec(release_failures=500))
    taken: list[bool] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(200):
            got = faults.take_release_failure()
            with lock:
                taken.append(got)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(taken) == 500


def test_crash_after_ops_kills_the_process_with_sigkill():
    code = (
        "from kvoffload.wire.protocol import FaultSpec\n"
        "from workers.faults import FaultInjector\n"
        "f = FaultInjector(FaultSpec(crash_after_ops=2))\n"
        "f.count_op(); f.count_op(); print('two ops done', flush=True)\n"
        "f.count_op(); print('survived', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert "two ops done" in proc.stdout and "survived" not in proc.stdout


if __name__ == "__main__":
    sys.exit(worker_main(lambda cfg, spec: EchoBackend(), sys.argv[1:]))
