"""Soak runs: the service under load and every fault kind, with the invariants asserted.

Both run in the default suite: a short run (about 15 s) with every process fault, and the
60-second run with the object tier and object-store outages. Longer runs: ``kvoffload soak``.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvoffload.soak.blocks import POISON, conversation_keys, expected_block, mismatch
from kvoffload.soak.injector import FAULT_KINDS, plan_faults
from kvoffload.soak.invariants import (
    check_acknowledged_blocks,
    check_disk_evictions,
    disk_evicted_keys,
    excused_keys,
    judge_engine_events,
)
from kvoffload.soak.runner import SoakOptions, run_soak

PROCESS_FAULTS = ("kill_worker", "stop_worker", "kill_manager", "kill_client")


CLIENT_KV_LEAK = "client_kv_still_mapped"


def assert_invariants(summary: dict, kinds: tuple[str, ...]) -> None:
    violations = summary["violations"]
    assert violations == [], json.dumps(violations, indent=1)
    injected = summary["faults"]["injected"]
    assert all(injected[kind] >= 1 for kind in kinds), injected
    assert summary["blocks"]["wrong"] == 0 and summary["sweep"]["wrong"] == 0
    assert summary["blocks"]["verified"] > 0 and summary["sweep"]["blocks_verified"] > 0
    durability = summary["durability"]
    assert (
        durability["acknowledged"] > 0 and durability["came_back"] > 0 and durability["lost"] == 0
    ), durability
    assert summary["jobs"]["finished"] > 0
    disk_io = summary["faults"]["disk_io"]
    assert disk_io["injected_corruptions"] > 0 and disk_io["write_errors"] > 0, disk_io
    assert disk_io["enospc_errors"] > 0, disk_io
    assert summary["faults"]["disk_fill_peak"] > 0.9, "the small disk tier should fill up and evict"
    quiet = summary["quiescence"]
    assert (
        quiet["pinned_slots"],
        quiet["writing_slots"],
        quiet["jobs_in_flight"],
        quiet["device_jobs_in_flight"],
    ) == (0, 0, 0, 0)
    assert sorted(summary["workers_at_end"]) == sorted(summary["tiers"])
    leftovers = summary["leftovers"]
    assert (leftovers["shm"], leftovers["runtime_files"], leftovers["processes"]) == ([], [], [])
    assert summary["recoveries"]["supervisor_restarts"]["manager"] >= injected["kill_manager"]
    assert 0 < summary["manager_rss_mb"]["peak"] < summary["manager_rss_mb"]["limit"]
    assert summary["hits_by_tier"]["primary"]["lookups_hit"] > 0


@pytest.fixture(scope="module")
def short_soak() -> tuple[dict, str]:
    out = io.StringIO()
    summary = run_soak(
        SoakOptions(
            duration_s=14,
            seed=7,
            clients=2,
            kinds=PROCESS_FAULTS,
            spacing_s=3.0,
            out=out,
            keep=False,
        )
    )
    return summary, out.getvalue()


def test_short_soak_with_every_process_fault_and_disk_io_faults(short_soak):
    summary, screen = short_soak
    assert_invariants(summary, PROCESS_FAULTS)
    assert "[soak " in screen
    stops = summary["faults"]["injected"]["stop_worker"]
    assert summary["faults"]["stop_worker_outcomes"] == {"killed_by_manager": stops}


def test_no_client_kv_cache_stays_mapped_after_a_manager_restart(short_soak):
    summary, _ = short_soak
    assert summary["faults"]["injected"]["kill_manager"] >= 1
    assert [v for v in summary["violations"] if v["kind"] == CLIENT_KV_LEAK] == []


def test_soak_60s_with_object_tier_and_outages(s3_server):
    """The CI soak: 60 s with every fault kind, object-store outages included."""
    summary = run_soak(
        SoakOptions(duration_s=60, seed=11, clients=3, s3_server=s3_server, keep=False)
    )
    assert_invariants(summary, FAULT_KINDS)
    assert "object" in summary["tiers"]


# ---- the checks themselves can fail -------------------------------------------------------


def test_a_wrong_byte_or_another_keys_block_never_verifies():
    keys = conversation_keys(b"ns", 0, 3)
    block = expected_block(keys[0], 4096).copy()
    assert mismatch(block, expected_block(keys[0], 4096)) is None
    assert mismatch(expected_block(keys[1], 4096), expected_block(keys[0], 4096)) is not None
    block[1234] ^= 1
    assert mismatch(block, expected_block(keys[0], 4096)) == {
        "first_offset": 1234,
        "bytes_differ": 1,
        "poison": False,
    }
    assert mismatch(np.full(4096, POISON, np.uint8), expected_block(keys[0], 4096))["poison"]


def test_timeouts_are_excused_only_inside_a_fault_window():
    events = [
        {"ev": "timeout", "t0": 10.0, "t1": 15.0},
        {"ev": "job_lost", "t0": 40.0, "t1": 60.0},
        {"ev": "violation", "kind": "wrong_bytes", "key": "ab"},
    ]
    excused, violations = judge_engine_events(events, [(14.0, 16.0)])
    assert excused == {"timeout": 1}
    assert [v.kind for v in violations] == ["job_without_result", "wrong_bytes"]


def test_an_acknowledged_block_that_did_not_come_back_is_excused_only_by_a_logged_loss():
    keys = conversation_keys(b"ns", 0, 6)
    log = [
        {
            "event": "cascade_dropped",
            "tier": "object",
            "reason": "evicted",
            "keys": [keys[0].hex()],
        },
        {"event": "disk_keys_evicted", "keys": [keys[1].hex()]},
        {"event": "disk_block_corrupt", "key": keys[2].hex()},
        {"event": "object_block_corrupt_deleted", "path": f"soak/00ff/{keys[3].hex()}"},
        {"event": "disk_scan_corrupt_blocks", "keys": [keys[4].hex()]},
        {"event": "job_failed", "keys": [keys[5].hex()]},
    ]
    excused = excused_keys(log)
    assert set(excused) == set(keys[:5])
    assert check_acknowledged_blocks(keys[:5], excused) == []
    (lost,) = check_acknowledged_blocks(keys, excused)
    assert lost.kind == "acknowledged_block_lost" and lost.detail["keys"] == [keys[5].hex()]


def test_fault_plan_holds_every_kind_and_is_seeded():
    plan = plan_faults(3, duration_s=14, kinds=PROCESS_FAULTS, spacing_s=3.0)
    assert sorted(f.kind for f in plan) == sorted(PROCESS_FAULTS)
    assert plan == plan_faults(3, duration_s=14, kinds=PROCESS_FAULTS, spacing_s=3.0)
    assert all(2.0 <= f.at_s <= 12.0 for f in plan)
    long_plan = plan_faults(3, duration_s=600, kinds=FAULT_KINDS)
    assert {f.kind for f in long_plan} == set(FAULT_KINDS) and len(long_plan) > 100


def test_a_block_evicted_before_reaching_the_disk_is_a_loss_not_an_excuse():
    keys = conversation_keys(b"ns", 1, 3)
    log = [
        {"event": "cascade_dropped", "tier": "disk", "reason": "evicted", "keys": [keys[0].hex()]},
        {
            "event": "cascade_dropped",
            "tier": "disk",
            "reason": "tier_full",
            "keys": [keys[1].hex()],
        },
    ]
    excused = excused_keys(log)
    assert set(excused) == {keys[1]}
    (lost,) = check_acknowledged_blocks(keys[:2], excused)
    assert lost.detail["keys"] == [keys[0].hex()]
    (evicted,) = check_disk_evictions(disk_evicted_keys(log))
    assert evicted.kind == "evicted_before_reaching_disk" and evicted.detail["count"] == 1
    assert check_disk_evictions(disk_evicted_keys(log[1:])) == []
