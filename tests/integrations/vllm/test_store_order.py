"""A prefix reaches the service, and its disk tier, in the order vLLM prepared its store, though
vLLM hands ``complete_store`` the keys as a set: the disk then holds the prefix in consecutive
records, which a promotion reads back together (a real service with a disk worker)."""

from __future__ import annotations

import pytest
import xxhash

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadKey, ReqContext  # noqa: E402

from kvoffload.client import KVOffloadClient  # noqa: E402
from kvoffload.integrations.vllm.blocks import PoolBlocks  # noqa: E402
from kvoffload.integrations.vllm.manager import KVOffloadManager  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402
from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.wire.vocab import PRIMARY  # noqa: E402
from tests.integrations.vllm.conftest import connected_manager  # noqa: E402

FINGERPRINT = b"O" * 16


def added_keys(client: KVOffloadClient, cursor: int) -> tuple[int, dict[str, list[bytes]]]:
    """The keys each tier gained after ``cursor``, in the order the service reported them."""
    added: dict[str, list[bytes]] = {}
    while True:
        reply = client.take_tier_events(cursor)
        for event in reply.events:
            if not event.removed:
                added.setdefault(event.tier, []).extend(event.keys)
        cursor = reply.cursor
        if not reply.more:
            return cursor, added


def test_a_store_completed_with_its_keys_in_any_order_reaches_the_tiers_in_prefix_order(
    start_service,
):
    service = start_service(workers=("cpu", "disk"))
    manager: KVOffloadManager = connected_manager(service.endpoint, FINGERPRINT, "order")
    watcher = service.client("watcher")
    try:
        cursor, _ = added_keys(watcher, 0)
        ctx = ReqContext("r1")
        manager.on_new_request(ctx)
        keys = [OffloadKey(b"prefix-%02d" % i + bytes(23)) for i in range(12)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        spec = out.store_spec
        assert isinstance(spec, PoolBlocks)
        pool = HostPool.attach(spec.pool_name, spec.num_slots, spec.block_bytes)
        try:
            digests = {}
            for i, (nkey, slot) in enumerate(zip(spec.keys, spec.slots, strict=True)):
                pool.slot_array(slot)[:] = i
                digests[nkey] = {0: xxhash.xxh3_64_intdigest(pool.slot(slot))}
        finally:
            pool.close()
        manager.note_store_checksums(digests)

        manager.complete_store(list(reversed(keys)), ctx)  # vLLM's set, in some order

        wait_until(
            lambda: (
                (s := service.status().tiering).cascade_backlog == 0
                and s.jobs_in_flight == 0
                and s.tiers["disk"].indexed_keys == len(keys)
            ),
            what="the prefix on disk",
        )
        _, added = added_keys(watcher, cursor)
        assert added[PRIMARY] == list(spec.keys)
        assert added["disk"] == list(spec.keys)
    finally:
        watcher.close()
        manager.shutdown()
