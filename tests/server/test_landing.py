"""Landing notices (``Lookup.landing``): the disk worker tells the waiting client of each
promoted key as it lands, and the manager pins it for the client once it hears of it, through
a real service with the disk tier (real processes, sockets, files)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvoffload.bench.service import engine_load, engine_load_prefixes
from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.slotcopy import shared_copier
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.service import service_pool
from kvoffload.tiering import LookupResult
from kvoffload.wire import protocol as p

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
BLOCK = 65536
BLOCKS = 6


def cold_blocks(service, client, pool, name: str, count: int = BLOCKS):
    """``count`` random blocks written through the engine-side path, cascaded to disk, then
    gone from the host pool: (keys, rows)."""
    rows = np.random.default_rng(len(name)).integers(0, 256, size=(count, BLOCK), dtype=np.uint8)
    keys = keys_for(name, count)
    before = service.status().tiering.tiers["disk"].indexed_keys  # before the cascade can land
    client.new_request(f"{name}-writer")
    prepared = client.prepare_store(f"{name}-writer", keys)
    sums = shared_copier().copy_with_checksums(
        [(pool.slot_array(slot), rows[i]) for i, slot in enumerate(prepared.slots)]
    )
    client.complete_store(f"{name}-writer", keys, checksums=[[s] for s in sums])
    client.finish_request(f"{name}-writer")
    wait_until(
        lambda: service.status().tiering.tiers["disk"].indexed_keys >= before + count,
        what="the cascade to disk",
    )
    client.reset_cache()
    return keys, rows


def take_until_final(client, ticket: int, timeout_s: float = 20.0) -> list[p.Landed]:
    """Every notice of ``ticket`` up to and including its final one."""
    notices: list[p.Landed] = []
    deadline = time.monotonic() + timeout_s
    while not any(n.final for n in notices):
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, f"no final notice for ticket {ticket}: {notices}"
        notices.extend(n for n in client.take_landed(left_ms) if n.ticket == ticket)
    return notices


@pytest.fixture
def disk_service(start_service):
    return start_service(workers=("cpu", "disk"), block_bytes=BLOCK)


def test_the_worker_tells_the_client_of_each_key_and_the_manager_pins_it(disk_service):
    service = disk_service
    with (
        service.client("engine", timeout_s=20.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        assert client.landing_endpoint.startswith("fifo://")
        keys, rows = cold_blocks(service, client, pool, "told")
        client.new_request("reader")
        outcome = client.lookup("reader", keys, pin=True, landing=True)
        assert outcome.results == [HIT_PENDING] * BLOCKS, outcome
        assert outcome.ticket and all(s >= 0 for s in outcome.landing_slots)
        notices = take_until_final(client, outcome.ticket)
        told = {
            key: (slot, digests)
            for n in notices
            for key, slot, digests in zip(n.keys, n.slots, n.checksums, strict=True)
        }
        assert set(told) == set(keys)
        assert not any(n.failed for n in notices)
        # the notice of the last key is the final one: none follows it
        assert notices[-1].final and notices[-1].keys, notices[-1]
        assert not client.take_landed(200)
        for i, key in enumerate(keys):
            slot, digests = told[key]
            assert slot == outcome.landing_slots[i]
            assert np.array_equal(pool.slot_array(slot), rows[i])
            assert digests == [payload_checksum(rows[i])]
        # the manager pins each for this client once it hears of it: released by complete_load
        wait_until(
            lambda: service.status().tiering.jobs_in_flight == 0, what="the promotion's result"
        )
        assert service.status().tiering.pinned_slots == BLOCKS
        client.complete_load("reader", keys)
        assert service.status().tiering.pinned_slots == 0
        assert client.lookup("reader", keys).results == [HIT] * BLOCKS
        client.finish_request("reader")
        wait_until(
            lambda: service.status().workers["disk"].stats.loop.landing_notices >= 2,
            what="the notices counted in the disk worker's heartbeat",
        )


def test_a_release_before_the_manager_hears_of_the_landing_leaves_no_pin(disk_service):
    """The client copies on the worker's word and releases at once; whichever the manager
    hears first, the wait or the landing, no pin is left."""
    service = disk_service
    with (
        service.client("engine", timeout_s=20.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        keys, rows = cold_blocks(service, client, pool, "raced")
        client.new_request("reader")
        out = np.zeros_like(rows)
        engine_load(client, "reader", keys, pool, out, wait_ms=10_000)
        assert np.array_equal(out, rows)
        wait_until(lambda: service.status().tiering.jobs_in_flight == 0, what="the result")
        assert client.status().tiering.pinned_slots == 0
        assert not client.deferred_errors, list(client.deferred_errors)
        client.finish_request("reader")


def test_prefixes_looked_up_ahead_land_for_their_own_lookup_and_leave_no_pin(disk_service):
    """Each batch's lookup is sent while the batch ahead of it lands: the notices of both
    tickets interleave, and each batch still takes its blocks from its own lookup's notices
    (a notice dropped would leave its batch waiting, then looking up again)."""
    service = disk_service
    with (
        service.client("engine", timeout_s=20.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        keys, rows = cold_blocks(service, client, pool, "ahead", 12)
        client.new_request("reader")
        out = np.zeros_like(rows)
        batches = [keys[i : i + 3] for i in range(0, 12, 3)]
        assert engine_load_prefixes(client, "reader", batches, pool, out, 20_000) == len(batches)
        assert np.array_equal(out, rows)
        wait_until(lambda: service.status().tiering.jobs_in_flight == 0, what="the results")
        assert client.status().tiering.pinned_slots == 0
        assert not client.deferred_errors, list(client.deferred_errors)


def test_a_client_without_a_landing_socket_gets_no_landing_slots(disk_service):
    service = disk_service
    with service.client("plain", timeout_s=20.0) as client, service_pool(client) as pool:
        keys, _ = cold_blocks(service, client, pool, "plain")
        client.new_request("reader")
        outcome = client.lookup("reader", keys, pin=True, landing=True)
        assert outcome.landing_slots == [] and outcome.ticket == 0
        assert outcome.results == [HIT_PENDING] * BLOCKS
        client.finish_request("reader")


def test_a_key_gone_from_disk_is_told_failed_and_misses(start_service):
    service = start_service(
        workers=("cpu", "disk"),
        block_bytes=BLOCK,
        extra_config="[faults]\ncorrupt_fraction = 1.0\n",
    )
    with (
        service.client("engine", timeout_s=20.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        keys, _ = cold_blocks(service, client, pool, "corrupt", count=2)
        client.new_request("reader")
        outcome = client.lookup("reader", keys, pin=True, landing=True)
        assert outcome.results == [HIT_PENDING, HIT_PENDING], outcome
        notices = take_until_final(client, outcome.ticket)
        failed = {key for n in notices for key in n.failed}
        assert failed == set(keys) and not any(n.keys for n in notices)
        wait_until(lambda: service.status().tiering.jobs_in_flight == 0, what="the result")
        assert client.lookup("reader", keys).results[0] is MISS
        assert service.status().tiering.pinned_slots == 0
        client.finish_request("reader")


def test_a_worker_killed_mid_promotion_leaves_the_client_to_give_up_and_nothing_pinned(
    start_service,
):
    service = start_service(
        workers=("cpu", "disk"),
        block_bytes=BLOCK,
        extra_config="[faults]\ndelay_s = 0.5\ndelay_fraction = 1.0\n[disk]\nread_threads = 1\n",
    )
    with (
        service.client("engine", timeout_s=30.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        keys, _ = cold_blocks(service, client, pool, "killed", count=4)
        client.new_request("reader")
        outcome = client.lookup("reader", keys, pin=True, landing=True)
        assert outcome.ticket, outcome
        old_pid = service.status().workers["disk"].pid
        os.kill(old_pid, signal.SIGKILL)
        assert client.take_landed(200) == []  # it died before any key landed
        client.complete_load("reader", keys)  # gives up on every key
        wait_until(lambda: service.status().tiering.jobs_in_flight == 0, what="the jobs' end")
        assert service.status().tiering.pinned_slots == 0
        client.finish_request("reader")
        assert not client.deferred_errors


def test_keys_given_up_before_they_land_are_neither_pinned_nor_protected(start_service):
    """A release of keys still on their way cancels their waits: once they land the manager
    pins and releases them at once, so no pin is left, not even the request's unread one."""
    service = start_service(
        workers=("cpu", "disk"),
        block_bytes=BLOCK,
        extra_config="[faults]\ndelay_s = 0.2\ndelay_fraction = 1.0\n[disk]\nread_threads = 1\n",
    )
    with (
        service.client("engine", timeout_s=20.0, landing=True) as client,
        service_pool(client) as pool,
    ):
        keys, _ = cold_blocks(service, client, pool, "cancelled", count=3)
        client.new_request("reader")
        outcome = client.lookup("reader", keys, pin=True, landing=True)
        assert outcome.results == [HIT_PENDING] * 3, outcome
        client.complete_load("reader", keys)
        notices = take_until_final(client, outcome.ticket)
        assert {k for n in notices for k in n.keys} == set(keys)
        wait_until(lambda: service.status().tiering.jobs_in_flight == 0, what="the result")
        assert service.status().tiering.pinned_slots == 0
        assert client.lookup("reader", keys).results == [HIT] * 3
        client.finish_request("reader")
        assert not client.deferred_errors
