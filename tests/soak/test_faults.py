"""One targeted test per production fault, each against a real service (docs/operations.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvoffload.client import KVOffloadError
from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.pool import HostPool
from kvoffload.soak.blocks import expected_block
from kvoffload.soak.probe import ProbeEngine
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.service import services
from kvoffload.wire.status import DiskWorkerStats

NO_DISK = {"enabled": False}


@pytest.fixture
def start_service(tmp_path):
    with services(tmp_path) as start:
        yield start


def kill_manager(harness) -> int:
    """SIGKILL the manager and wait until the supervisor has started a new one; its old pid."""
    old = harness.manager_pid()
    assert harness.signal_child(old, signal.SIGKILL)
    wait_until(lambda: harness.manager_pid() not in (old, None), 15, what="a new manager")
    return old


def test_stopped_worker_is_killed_by_the_manager_its_job_fails_and_it_is_restarted(start_service):
    harness = start_service(disk=NO_DISK)
    timeout_s = harness.cfg.service.heartbeat_timeout_s
    keys = keys_for("stopped", 4)
    with ProbeEngine(harness) as engine:
        pid = harness.worker_pid("cpu")
        assert harness.signal_child(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            done = engine.store(engine.new_request(), keys, wait_s=timeout_s + 10)
            assert not done.success, "a job sent to a stopped worker cannot succeed"
            assert time.monotonic() - started < timeout_s + 5
            wait_until(
                lambda: not harness.is_own_child(pid),
                10,
                what="the manager to kill the silent worker",
            )
        finally:
            harness.signal_child(pid, signal.SIGCONT)
        harness.wait_workers(["cpu"], exclude_pids={pid})
        timeouts = [e for e in harness.log_events() if e.get("event") == "worker_heartbeat_timeout"]
        assert [e["worker_pid"] for e in timeouts] == [pid]
        engine.assert_round_trip(keys)


def test_killed_manager_is_restarted_with_fenced_workers_and_serves_correct_bytes(start_service):
    """The old workers are killed before the new manager hands out slots; whatever the new
    manager still serves from the pool (a warm restart) loads bit-exact, and the old client's
    session is gone."""
    harness = start_service(disk=NO_DISK)
    keys = keys_for("before-crash", 4)
    old_engine = ProbeEngine(harness, "old")
    req = old_engine.new_request()
    assert old_engine.store(req, keys).success
    cpu_pid = harness.worker_pid("cpu")
    kill_manager(harness)
    workers = harness.wait_workers(["cpu"], exclude_pids={cpu_pid})
    assert workers["cpu"].pid != cpu_pid, "the old worker must be fenced (killed)"
    with pytest.raises(KVOffloadError) as err:
        old_engine.client.lookup(req, keys)
    assert err.value.code == "not_connected"
    old_engine.close()
    with ProbeEngine(harness, "new") as engine:
        req = engine.new_request()
        outcome = engine.lookup_ready(req, keys)
        if outcome.ready_prefix:
            done, wrong = engine.load(req, keys[: outcome.ready_prefix])
            assert done.success and wrong == []
        fresh = keys_for("after-crash", 4)
        assert engine.store(req, fresh).success
        req = engine.new_request()
        assert engine.lookup_ready(req, fresh).ready_prefix == len(fresh)
        done, wrong = engine.load(req, fresh)
        assert done.success and wrong == []


def test_after_a_manager_restart_the_disk_tier_serves_its_keys_verified(start_service):
    harness = start_service()
    keys = keys_for("durable", 6)
    with ProbeEngine(harness, "before") as engine:
        assert engine.store(engine.new_request(), keys).success
        assert harness.wait_status(lambda s: s["tiering"]["jobs_in_flight"] == 0, 10)
    disk_pid = harness.worker_pid("disk")
    kill_manager(harness)
    workers = harness.wait_workers(["cpu", "disk"], exclude_pids={disk_pid})
    assert workers["disk"].pid != disk_pid
    with ProbeEngine(harness, "after") as engine:
        req = engine.new_request()
        assert engine.lookup_ready(req, keys).ready_prefix == len(keys)
        done, wrong = engine.load(req, keys)
        assert done.success and wrong == []


def test_job_ids_are_not_reused_after_a_manager_restart(start_service):
    """A job still running on a worker when the manager dies must not be mistaken for a new
    manager's job of the same id (that served the old job's bytes under the new key)."""
    harness = start_service(disk=NO_DISK, faults={"delay_s": 2.0, "delay_fraction": 1.0})
    old_engine = ProbeEngine(harness, "old")
    old_keys = keys_for("old", 1)
    old_engine.kv.tensors[0][0] = 0xAA
    old_job = old_engine.client.store(old_engine.new_request(), old_keys, [0], old_engine.handle_id)
    kill_manager(harness)
    harness.wait_workers(["cpu"])
    try:
        with ProbeEngine(harness, "new") as engine:
            keys = keys_for("new", 1)
            done = engine.store(engine.new_request(), keys)
            assert done.success and done.job_id != old_job.job_id
            req = engine.new_request()
            assert engine.lookup_ready(req, keys).ready_prefix == 1
            done, wrong = engine.load(req, keys)
            assert done.success and wrong == []
    finally:
        old_engine.close()


def test_a_copy_running_when_the_manager_dies_cannot_overwrite_a_reused_slot(start_service):
    # seed 13 delays the first copy (the old manager's store) and none of the next two.
    harness = start_service(
        disk=NO_DISK,
        pool={"num_slots": 1},
        faults={"delay_s": 3.0, "delay_fraction": 0.5, "seed": 13},
    )
    old_engine = ProbeEngine(harness, "old")
    old_engine.kv.tensors[0][0] = 0xAA
    old_engine.client.store(old_engine.new_request(), keys_for("old", 1), [0], old_engine.handle_id)
    started = time.monotonic()
    kill_manager(harness)
    harness.wait_workers(["cpu"])
    try:
        with ProbeEngine(harness, "new") as engine:
            keys = keys_for("new", 1)
            assert engine.store(engine.new_request(), keys).success
            time.sleep(max(0.0, 3.5 - (time.monotonic() - started)))
            req = engine.new_request()
            assert engine.lookup_ready(req, keys).ready_prefix == 1
            done, wrong = engine.load(req, keys)
            assert done.success and wrong == []
    finally:
        old_engine.close()


DOOMED_CLIENT = textwrap.dedent(
    """
    import sys, time
    from kvoffload.client import KVOffloadClient
    from kvoffload.memory.pool import HostPool
    from kvoffload.soak.blocks import expected_block
    from kvoffload.testing.helpers import keys_for

    client = KVOffloadClient(sys.argv[1], name="doomed")
    info = client.info
    pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
    keys = keys_for("doomed", 4)
    client.new_request("r")
    out = client.prepare_store("r", keys)
    for key, slot in zip(out.keys, out.slots, strict=True):
        pool.slot_array(slot)[:] = expected_block(key, info.block_bytes)
    client.complete_store("r", out.keys)
    client.prepare_load("r", keys)
    client.prepare_store("r", keys_for("never-completed", 1))
    print("pinned", flush=True)
    time.sleep(600)
    """
)


def test_killed_client_pins_and_open_stores_are_released_after_its_lease(start_service):
    harness = start_service(disk=NO_DISK, service={"request_lease_s": 2.0})
    proc = subprocess.Popen(
        [sys.executable, "-c", DOOMED_CLIENT, harness.endpoint], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "pinned"
        tiering = harness.status().tiering
        assert (tiering.pinned_slots, tiering.writing_slots) == (4, 1)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    killed_at = time.monotonic()
    tiering = harness.status().tiering
    assert tiering.pinned_slots == 4, "pins must outlive the client until its lease expires"
    released = harness.wait_status(
        lambda s: s["tiering"]["pinned_slots"] == 0 and s["tiering"]["writing_slots"] == 0, 10
    )
    assert released is not None and released["clients"] <= 1
    assert time.monotonic() - killed_at < harness.cfg.service.request_lease_s + 3
    dropped = [e for e in harness.log_events() if e.get("event") == "client_dropped"]
    assert any(e["reason"] == "lease_expired" and e["pins"] == 4 for e in dropped)
    keys = keys_for("doomed", 4)
    with ProbeEngine(harness, "survivor") as engine:
        req = engine.new_request()
        assert engine.lookup_ready(req, keys).ready_prefix == 4
        done, wrong = engine.load(req, keys)
        assert done.success and wrong == []


def test_disk_io_faults_fail_keys_partially_and_never_serve_wrong_bytes(start_service):
    harness = start_service(faults={"fail_fraction": 0.1, "corrupt_fraction": 0.3, "seed": 5})
    keys = keys_for("flaky", 32)
    results = []
    with ProbeEngine(harness) as engine:
        for start in range(0, len(keys), 8):
            results.append(engine.store(engine.new_request(), keys[start : start + 8]))
        assert harness.wait_status(lambda s: s["tiering"]["jobs_in_flight"] == 0, 20)
        engine.client.reset_cache()
        wrong, loaded = [], 0
        for key in keys:
            req = engine.new_request()
            if engine.lookup_ready(req, [key]).ready_prefix:
                done, bad = engine.load(req, [key])
                results.append(done)
                wrong += bad
                loaded += done.success
            engine.client.finish_request(req)
    assert wrong == []
    assert loaded > 0
    assert any(not r.success and r.successful_keys for r in results), "expected a partial result"
    status = harness.status()
    disk = status.workers["disk"].stats.medium
    assert isinstance(disk, DiskWorkerStats)
    assert disk.injected_corruptions > 0 and disk.corrupt_blocks > 0
    assert status.tiering.per_tier["disk"].promotion_jobs_failed > 0
    assert harness.status().tiering.pinned_slots == 0


# ---- durable cascades ---------------------------------------------------------------------


def cascades_settled(status: dict) -> bool:
    """No tier job in flight, no cascade waiting, no adopted block awaiting verification, and
    every worker connected with its index announced."""
    tiering = status["tiering"]
    unverified = (status.get("warm_restart") or {}).get("unverified", 0)
    workers_ready = all(w["index_complete"] for w in status["workers"].values())
    return (
        tiering["jobs_in_flight"] == 0
        and tiering["cascade_backlog"] == 0
        and unverified == 0
        and workers_ready
    )


def assert_all_come_back_after_reset(engine: ProbeEngine, keys: list[bytes]) -> None:
    engine.client.reset_cache()
    for start in range(0, len(keys), 8):
        chunk = keys[start : start + 8]
        req = engine.new_request()
        assert engine.lookup_ready(req, chunk).ready_prefix == len(chunk), (
            "an acknowledged block was lost"
        )
        done, wrong = engine.load(req, chunk)
        assert done.success and wrong == []
        engine.client.finish_request(req)


def test_blocks_stored_while_the_disk_worker_is_down_reach_the_disk_once_it_is_back(start_service):
    harness = start_service()
    keys = keys_for("while-down", 16)
    with ProbeEngine(harness) as engine:
        pid = harness.worker_pid("disk")
        assert harness.signal_child(pid, signal.SIGSTOP)
        try:
            assert engine.store(engine.new_request(), keys[:8]).success  # its cascade hangs
            wait_until(
                lambda: harness.worker_pid("disk") != pid, 15, what="the manager to drop the worker"
            )
            assert engine.store(
                engine.new_request(), keys[8:]
            ).success  # the worker is down or restarting
        finally:
            harness.signal_child(pid, signal.SIGCONT)
        harness.wait_workers(["disk"], exclude_pids={pid})
        status = harness.wait_status(cascades_settled, 20)
        assert status is not None, harness.status()
        disk = status["tiering"]["per_tier"]["disk"]
        assert disk["cascade_keys_resubmitted"] >= 8 and disk["cascaded_keys_ok"] == len(keys)
        assert status["tiering"]["pinned_slots"] == 0
        assert_all_come_back_after_reset(engine, keys)


def test_blocks_adopted_by_a_restarted_manager_reach_the_disk(start_service):
    """Blocks acknowledged while their cascade could not run survive a manager crash in the
    pool (device stores, and direct stores that sent their checksums) and are cascaded by the
    new manager."""
    harness = start_service()
    stored, direct = keys_for("adopted", 8), keys_for("adopted-direct", 4)
    old = ProbeEngine(harness, "old")
    pool = HostPool.attach(old.client.info.pool_name, old.client.info.num_slots, old.block_bytes)
    disk_pid = harness.worker_pid("disk")
    assert harness.signal_child(disk_pid, signal.SIGSTOP)
    try:
        req = old.new_request()
        assert old.store(req, stored).success
        out = old.client.prepare_store(req, direct)
        for key, slot in zip(out.keys, out.slots, strict=True):
            pool.slot_array(slot)[:] = expected_block(key, old.block_bytes)
        checksums = [[payload_checksum(pool.slot_array(slot))] for slot in out.slots]
        old.client.complete_store(req, out.keys, checksums=checksums)
        kill_manager(harness)  # the supervisor also kills the stopped disk worker
    finally:
        harness.signal_child(disk_pid, signal.SIGCONT)
        pool.close()
        old.close()
    harness.wait_workers(["cpu", "disk"], exclude_pids={disk_pid})
    status = harness.wait_status(cascades_settled, 20)
    assert status is not None, harness.status()
    assert status["warm_restart"]["verified"] == len(stored) + len(direct)
    assert status["tiering"]["per_tier"]["disk"]["cascaded_keys_ok"] == len(stored) + len(direct)
    with ProbeEngine(harness, "new") as engine:
        assert_all_come_back_after_reset(engine, stored + direct)
