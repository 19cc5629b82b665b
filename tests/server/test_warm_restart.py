"""Warm manager restart against a real service: kill -9 the manager, and the supervisor's new
manager rebuilds its primary index from the slot headers, verifies every block's checksum before
serving it, drops what was in flight or corrupted, and starts with nothing pinned."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import psutil
import pytest

from kvoffload.client import KVOffloadClient, KVOffloadError, ServiceUnavailable
from kvoffload.memory.blockformat import slice_checksums
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.memory.pool import HostPool
from kvoffload.testing.helpers import keys_for, random_kv_cache, wait_until
from kvoffload.testing.service import service_pool, shm_names_containing
from kvoffload.tiering import LookupResult

BLOCK = 65536
SOURCE_BLOCKS = 32
HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture
def kv():
    """48 device blocks of random bytes: 0..31 are stored, 32..47 receive loads."""
    cache = random_kv_cache(48, [BLOCK // 2, BLOCK // 2], seed=11)
    yield cache
    cache.close()
    cache.unlink()


def block_bytes(cache: SharedKVCache, block: int) -> bytes:
    return b"".join(t[block].tobytes() for t in cache.tensors)


def store_all(client, req: str, keys: list[bytes]) -> None:
    for start in range(0, len(keys), SOURCE_BLOCKS):
        part = keys[start : start + SOURCE_BLOCKS]
        accepted = client.store(req, part, list(range(len(part))), "kv")
        assert client.wait([accepted.job_id])[accepted.job_id].success


def kill_manager(service) -> int:
    """SIGKILL the manager the service reports (checked to be the supervisor's child)."""
    pid = service.status().pid
    assert psutil.Process(pid).ppid() == service.supervisor_pid
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_for_new_manager(service, old_pid: int, timeout_s: float = 20.0) -> dict:
    """The status of a new manager whose cpu worker is connected and whose adopted blocks are
    all verified."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = service.status()
        except (TimeoutError, KVOffloadError):
            continue
        warm = status.warm_restart
        if (
            status.pid != old_pid
            and "cpu" in status.workers
            and (warm is None or warm.unverified == 0)
        ):
            return status
        time.sleep(0.05)
    raise TimeoutError(f"no verified new manager:\n{service.log_path.read_text()[-3000:]}")


def test_ready_blocks_survive_a_manager_crash_and_nothing_unverified_is_served(start_service, kv):
    service = start_service()
    keys = keys_for("warm", 64)  # fills the 64-slot pool
    torn_key = b"torn".ljust(16, b".")
    old = service.client("before")
    old.register_kv(kv.handle("kv"))
    old.new_request("r")
    store_all(old, "r", keys)
    info = old.info
    pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
    try:
        old.prepare_load("r", keys[60:62])  # pinned when the manager dies
        corrupt_slot = old.prepare_load("r", [keys[40]]).slots[0]
        old.complete_load("r", [keys[40]])
        torn = old.prepare_store("r", [torn_key])  # evicts keys[0] and reuses its slot
        assert torn.evicted == [keys[0]]
        pool.slot_array(torn.slots[0])[: BLOCK // 2] = 0xEE  # a write that never completes
        pool.slot_array(corrupt_slot)[777] ^= 0x01  # behind the manager's back
    finally:
        pool.close()
    before = service.status()
    assert (before.tiering.pinned_slots, before.tiering.writing_slots) == (2, 1)
    assert before.warm_restart.headers_found == 0, "a fresh run starts from an empty table"

    old_pid = kill_manager(service)
    after = wait_for_new_manager(service, old_pid)
    old.close()

    assert msgspec.to_builtins(after.warm_restart) == {
        "headers_found": 63,
        "adopted": 63,
        "duplicates": 0,
        "verified": 62,
        "dropped": 1,
        "unverified": 0,
    }
    tiering = after.tiering
    assert (tiering.used_slots, tiering.pinned_slots, tiering.writing_slots) == (62, 0, 0)

    with service.client("after") as new:
        new.register_kv(kv.handle("kv"))
        new.new_request("r2")
        results = {key: new.lookup("r2", [key]).results[0] for key in [*keys, torn_key]}
        assert results[keys[0]] is MISS, (
            "an evicted key's header was cleared when its slot was reused"
        )
        assert results[keys[40]] is MISS, "a slot that fails its checksum is dropped"
        assert results[torn_key] is MISS, "a write in flight at the crash is never served"
        assert [k for k, r in results.items() if r is not HIT] == [keys[0], keys[40], torn_key]

        loaded = keys[1:8] + keys[41:47] + keys[60:63]
        targets = list(range(SOURCE_BLOCKS, SOURCE_BLOCKS + len(loaded)))
        for t in kv.tensors:
            t[SOURCE_BLOCKS:] = 0
        accepted = new.load("r2", loaded, targets, "kv")
        assert new.wait([accepted.job_id])[accepted.job_id].success
        for key, target in zip(loaded, targets, strict=True):
            source = keys.index(key) % SOURCE_BLOCKS
            assert block_bytes(kv, target) == block_bytes(kv, source), f"{key!r} not bit-exact"
        new.finish_request("r2")
    assert service.status().tiering.pinned_slots == 0

    events = service.log_events()
    rebuilt = [e for e in events if e.get("event") == "primary_index_rebuilt"]
    assert len(rebuilt) == 1 and (rebuilt[0]["verified"], rebuilt[0]["dropped"]) == (62, 1)
    failed = [e for e in events if e.get("event") == "slot_verify_failed"]
    assert [(e["slot"], e["reason"]) for e in failed] == [(corrupt_slot, "checksum mismatch")]

    run_id = service.run_id
    assert service.stop().exit_code == 0
    assert shm_names_containing(run_id) == []


def test_with_slot_headers_off_a_restarted_manager_starts_cold(start_service, kv, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_POOL__SLOT_HEADERS", "false")
    service = start_service()
    assert not [n for n in shm_names_containing(service.run_id) if n.endswith("-slots")]
    keys = keys_for("cold", 4)
    with service.client("before") as old:
        old.register_kv(kv.handle("kv"))
        old.new_request("r")
        store_all(old, "r", keys)
    old_pid = kill_manager(service)
    after = wait_for_new_manager(service, old_pid)
    assert after.warm_restart is None and after.tiering.used_slots == 0
    with service.client("after") as new:
        new.new_request("r")
        assert new.lookup("r", keys).results == [MISS]


def test_a_client_reconnects_after_a_manager_restart_with_its_handles_and_requests(
    start_service, kv
):
    service = start_service()
    keys = keys_for("again", 8)
    manual = service.client("manual")
    auto = KVOffloadClient(service.endpoint, timeout_s=10.0, name="auto", auto_reconnect=True)
    try:
        manual.register_kv(kv.handle("kv"))
        manual.new_request("r")
        store_all(manual, "r", keys)
        auto.new_request("a")
        unreported = manual.store("r", keys_for("unreported", 2), [8, 9], "kv").job_id
        old_pid = kill_manager(service)
        wait_for_new_manager(service, old_pid)

        with pytest.raises(KVOffloadError) as err:
            manual.lookup("r", keys)
        assert err.value.code == "not_connected"
        manual.reconnect()
        lost = manual.wait([unreported])[unreported]
        assert not lost.success and lost.error.startswith("lost") and lost.req_id == "r"
        assert manual.lookup("r", keys).results == [HIT] * len(keys), "request r is open again"
        for t in kv.tensors:
            t[SOURCE_BLOCKS:] = 0
        targets = list(range(SOURCE_BLOCKS, SOURCE_BLOCKS + len(keys)))
        accepted = manual.load("r", keys, targets, "kv")
        assert manual.wait([accepted.job_id])[accepted.job_id].success, (
            "handle kv is registered again"
        )
        assert [block_bytes(kv, t) for t in targets] == [
            block_bytes(kv, b) for b in range(len(keys))
        ]
        manual.finish_request("r")

        assert auto.lookup("a", keys).results == [HIT] * len(keys), "reconnected by itself"
        auto.finish_request("a")
    finally:
        manual.close()
        auto.close()
    assert service.status().tiering.pinned_slots == 0


def test_an_unreachable_service_raises_service_unavailable(tmp_path):
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable) as err:
        KVOffloadClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.3)
    assert err.value.code == "unavailable" and isinstance(err.value, TimeoutError)
    assert isinstance(err.value, KVOffloadError) and time.monotonic() - started < 2.0


def write_in_slices(
    client: KVOffloadClient, pool: HostPool, keys: list[bytes], slices: int
) -> list[list[int]]:
    """Reserve slots for ``keys`` (request "r"), fill each with its own byte and return each
    block's slice digests, as ``slices`` tensor-parallel ranks would report them."""
    client.new_request("r")
    prepared = client.prepare_store("r", keys)
    digests = []
    for i, slot in enumerate(prepared.slots):
        pool.slot_array(slot)[:] = (i * 37 + 5) % 251
        digests.append(slice_checksums(pool.slot_array(slot), slices, BLOCK // slices))
    return digests


def test_blocks_written_in_slices_keep_every_slice_digest_across_a_restart(start_service):
    """Tensor parallelism writes each block in slices, one per rank, and no rank sees the whole:
    the block is stamped with every slice's digest, a pinned lookup hands them out, a restarted
    manager verifies the block slice by slice, and a block with a changed slice is dropped."""
    service = start_service()
    keys = keys_for("sliced", 4)
    half = BLOCK // 2
    with service.client("ranks") as client:
        with service_pool(client) as pool:
            digests = write_in_slices(client, pool, keys, 2)
            with pytest.raises(KVOffloadError, match="slices"):
                client.complete_store("r", keys, checksums=[[1, 2, 3]] * 4, slice_bytes=half)
            client.complete_store("r", keys, checksums=digests, slice_bytes=half)

            outcome = client.lookup("r", keys, pin=True)
            assert outcome.results == [HIT] * 4 and outcome.checksums == digests
            client.complete_load("r", keys)
            pool.slot_array(outcome.slots[1])[half + 3] ^= 0x01  # rank 1's slice changes
        client.finish_request("r")

    after = wait_for_new_manager(service, kill_manager(service))

    assert (after.warm_restart.verified, after.warm_restart.dropped) == (3, 1)
    with service.client("after") as client:
        client.new_request("r2")
        outcome = client.lookup("r2", [keys[0], keys[2], keys[3]], pin=True)
        assert outcome.results == [HIT] * 3
        assert outcome.checksums == [digests[0], digests[2], digests[3]]
        client.complete_load("r2", [keys[0], keys[2], keys[3]])
        assert client.lookup("r2", [keys[1]]).results == [MISS]
        client.finish_request("r2")


def test_a_block_in_slices_comes_back_from_disk_with_its_slice_digests(start_service):
    """The disk record keeps the block's slice layout and checksum; the promotion verifies the
    slices it read and stamps the slot with their digests again, so every rank can check its
    slice of a block that came back from disk."""
    service = start_service(workers=("cpu", "disk"))
    keys = keys_for("sliced-disk", 3)
    quarter = BLOCK // 4
    with service.client("ranks") as client, service_pool(client) as pool:
        digests = write_in_slices(client, pool, keys, 4)
        client.complete_store("r", keys, checksums=digests, slice_bytes=quarter)
        client.finish_request("r")
        wait_until(
            lambda: service.status().tiering.tiers["disk"].indexed_keys == len(keys),
            20.0,
            "the cascade to disk",
        )
        client.reset_cache()  # the pool forgets them: they come back from disk

        client.new_request("r2")
        outcome = client.lookup("r2", keys, pin=True, wait_ms=10_000)
        while outcome.must_wait:
            outcome = client.lookup("r2", keys, pin=True, wait_ms=10_000)
        assert outcome.results == [HIT] * 3 and outcome.checksums == digests
        for slot, want in zip(outcome.slots, digests, strict=True):
            assert slice_checksums(pool.slot_array(slot), 4, quarter) == want
        client.complete_load("r2", keys)
        client.finish_request("r2")
    assert service.status().tiering.per_tier["disk"].promoted_keys_ok == len(keys)
