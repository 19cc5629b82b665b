"""The reset fence at the library level, with a real service: ``reset_cache`` must not let the
service hand a slot that this engine's flushed jobs still write to another key before the
workers reported those jobs (``on_reset_flushed``).

The hazard, step by step: the engine reserves a slot for a store (``prepare_store``); its
worker has not copied yet when vLLM resets the cache; another engine then stores a key and is
given a slot; the first engine's worker finally writes its (flushed) store. Without the fence
the pool was emptied at the reset, so the other engine was given that very slot and reads the
first engine's bytes back under its own key."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext  # noqa: E402

from kvoffload.integrations.vllm.blocks import PoolBlocks  # noqa: E402
from kvoffload.integrations.vllm.manager import KVOffloadManager  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402
from tests.integrations.vllm.conftest import connected_manager  # noqa: E402

FINGERPRINT = b"F" * 16
OTHER_KEY = b"another engine key"


def engine_manager(endpoint: str) -> KVOffloadManager:
    manager: KVOffloadManager = connected_manager(endpoint, FINGERPRINT, "fence")
    manager.expect_reset_flushed()  # what the connector (0.32) or vLLM (0.33) promises
    return manager


def key(name: bytes) -> OffloadKey:
    return OffloadKey(name.ljust(32, b".") + bytes(4))


def late_write_reads_back(service, manager: KVOffloadManager, reset) -> bytes:
    """Run the hazard; returns what the other engine reads back under its key (it wrote
    ``b"B"`` bytes; the late flushed store writes ``b"A"`` bytes)."""
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    out = manager.prepare_store([key(b"a")], ctx)
    assert out is not None
    spec = out.store_spec
    assert isinstance(spec, PoolBlocks)
    pool = HostPool.attach(spec.pool_name, spec.num_slots, spec.block_bytes)
    other = service.client("other-engine")
    try:
        reset(manager)  # vLLM flushes the store job: its worker has not written yet

        other.new_request("o1")
        slots = other.prepare_store("o1", [OTHER_KEY])
        pool.slot_array(slots.slots[0])[:] = ord("B")
        other.complete_store("o1", slots.keys)

        pool.slot_array(spec.slots[0])[:] = ord("A")  # the flushed store's late copy

        other.new_request("o2")
        outcome = other.lookup("o2", [OTHER_KEY], pin=True)
        assert outcome.results[0].name == "HIT"
        read = bytes(np.unique(pool.slot_array(outcome.slots[0])))
        other.complete_load("o2", [OTHER_KEY])
        return read
    finally:
        other.close()
        pool.close()


def test_without_the_fence_a_flushed_store_overwrites_a_slot_given_to_another_key(start_service):
    """The service's pool emptied at the reset itself (kvoffload's behaviour before the fence):
    the other engine's block is corrupted. This is what the fence prevents."""
    service = start_service()
    manager = engine_manager(service.endpoint)
    try:
        read = late_write_reads_back(service, manager, lambda m: m._reset_service())
        assert read == b"A"
    finally:
        manager.shutdown()


def test_the_fence_keeps_flushed_slots_until_the_workers_reported(start_service):
    service = start_service()
    manager = engine_manager(service.endpoint)
    try:
        assert late_write_reads_back(service, manager, lambda m: m.reset_cache()) == b"B"

        # Until the flushed jobs are reported this engine finds nothing and stores nothing:
        # what it would pin or reserve now is emptied by the service's reset.
        ctx = ReqContext("r2")
        manager.on_new_request(ctx)
        assert manager.has_pending_work()
        assert manager.lookup(key(b"a"), ctx) is LookupResult.MISS
        assert manager.prepare_store([key(b"c")], ctx) is None
        assert service.status().tiering.used_slots > 0  # not emptied yet

        manager.on_reset_flushed()

        assert not manager.has_pending_work()
        assert service.status().tiering.used_slots == 0
        ctx = ReqContext("r3")
        manager.on_new_request(ctx)
        assert manager.prepare_store([key(b"d")], ctx) is not None
        manager.on_reset_flushed()  # a second report changes nothing
        assert service.status().tiering.used_slots == 1
    finally:
        manager.shutdown()
