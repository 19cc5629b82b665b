"""Write-back under a burst against a real service (docs/operations.md, "Cascades and
durability"): a store acknowledged with a disk tier configured is never lost, a store that
finds no clean room is refused at once, and a slow object tier never fills the pool."""

from __future__ import annotations

import signal
import time

import pytest

from kvoffload.testing.burst import DirectWriter, settle
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.s3server import object_section
from kvoffload.testing.service import DISK_RECORD_BYTES, services

SLOTS = 64
BURST = 10 * SLOTS
BATCH = 16
SECTIONS = {
    "pool": {"num_slots": SLOTS},
    "disk": {"capacity_bytes": 2 * BURST * DISK_RECORD_BYTES, "write_threads": 2},
}


@pytest.fixture
def start_service(tmp_path):
    with services(tmp_path) as start:
        yield start


def assert_every_acknowledged_block_comes_back(harness, writer, out) -> None:
    status, _ = settle(harness, timeout_s=60.0)
    assert status is not None, harness.status()
    disk = status["tiering"]["per_tier"]["disk"]
    assert disk["cascade_dropped_evicted"] == 0, "a block waiting for the disk was evicted"
    assert status["tiering"]["held_slots"] == 0 and status["tiering"]["pinned_slots"] == 0
    missing, wrong = writer.recover(out.acked)
    assert wrong == [], f"{len(wrong)} blocks came back with wrong bytes"
    assert missing == [], f"{len(missing)} of {len(out.acked)} acknowledged blocks were lost"


def test_a_burst_of_ten_pools_loses_no_acknowledged_block(start_service):
    harness = start_service(**SECTIONS)
    with DirectWriter(harness) as writer:
        out = writer.store_burst(keys_for("burst", BURST), batch=BATCH)
        assert out.refused_keys == [] and len(out.acked) == BURST
        assert_every_acknowledged_block_comes_back(harness, writer, out)
    tiering = harness.status().tiering
    assert tiering.per_tier["disk"].cascaded_keys_ok == BURST
    assert tiering.store_allocation_failures == out.refusals, "every refusal is counted"
    assert tiering.stores_refused_dirty <= tiering.store_allocation_failures


def test_a_burst_with_the_disk_worker_killed_loses_only_what_was_refused(start_service):
    harness = start_service(**SECTIONS)
    killed = []

    def kill_disk_worker(batch: int) -> None:
        if batch == BURST // BATCH // 3:
            pid = harness.worker_pid("disk")
            assert harness.signal_child(pid, signal.SIGKILL)
            killed.append(pid)

    keys = keys_for("killed", BURST)
    with DirectWriter(harness) as writer:
        out = writer.store_burst(keys, batch=BATCH, between=kill_disk_worker)
        assert killed and set(out.acked) | set(out.refused_keys) == set(keys)
        harness.wait_workers(["disk"], exclude_pids=killed)
        assert_every_acknowledged_block_comes_back(harness, writer, out)
    assert any(e.get("event") == "worker_jobs_failed" for e in harness.log_events())


def test_with_the_object_tier_hung_stores_go_on_and_the_pool_never_fills(start_service, s3_server):
    s3_server.create_bucket("writeback")
    harness = start_service(
        **SECTIONS, object=object_section(s3_server, "writeback", f"hung-{time.time_ns()}")
    )
    peak = {"object_inflight": 0, "held": 0}

    def sample(_batch: int) -> None:
        status = harness.poll_status()
        assert status is not None
        tiering = status["tiering"]
        peak["object_inflight"] = max(
            peak["object_inflight"], tiering["tiers"]["object"]["cascade_inflight_keys"]
        )
        peak["held"] = max(peak["held"], tiering["held_slots"])

    with DirectWriter(harness) as writer:
        s3_server.pause()  # every PUT hangs until its request timeout
        try:
            out = writer.store_burst(keys_for("hung", BURST), batch=BATCH, between=sample)
            assert out.refused_keys == [] and len(out.acked) == BURST, "stores went on"
            assert peak["object_inflight"] <= SLOTS // 4, peak
            wait_until(
                lambda: harness.status().tiering.tiers["disk"].dirty_keys == 0,
                30,
                what="the disk tier to take every block",
            )
            tiering = harness.status().tiering
            assert tiering.tiers["object"].cascade_inflight_keys <= SLOTS // 4
            more = writer.store_burst(keys_for("after", SLOTS // 2), batch=SLOTS // 2)
            assert more.refusals == 0, "the pool is not full of blocks stuck for the object tier"
        finally:
            s3_server.resume()
        assert_every_acknowledged_block_comes_back(harness, writer, out)
    counters = harness.status().tiering.per_tier["object"]
    assert counters.cascaded_keys_ok + counters.cascade_dropped_evicted > 0
