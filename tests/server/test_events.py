"""The tiers' events through a real service (``kvoffload serve`` with its cpu and disk
workers): a client that takes them (``TakeTierEvents``) and the node stream (``[events]``,
decoded with vLLM's own ``KVEventBatch``) each hold, after a flood that evicts from the pool and
the disk, exactly what the service holds; another tenant's blocks are never shown; a client
that fell behind gets a snapshot; a subscriber that lost its connection catches up through the
replay; bad requests get typed errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
import zmq

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.config import EventsConfig, ServiceConfig
from kvoffload.memory.blockformat import disk_record_bytes
from kvoffload.server.eventstream import END_SEQ, NodeStream
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.service import BLOCK_BYTES, ServiceHarness, to_toml
from kvoffload.wire.events import (
    STREAM_SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockStored,
    HeldBlocks,
    KVEventBatch,
    TierEvent,
)
from kvoffload.wire.protocol import ErrorCode
from kvoffload.wire.tenant_ids import tenant_id
from kvoffload.wire.vocab import Locality, Medium

SLOTS = 32
DISK_RECORDS = 48
FEED_KEYS = 512


def events_service(start_service, tmp_path: Path, **events: object) -> ServiceHarness:
    return start_service(
        workers=("cpu", "disk"),
        num_slots=SLOTS,
        extra_config=to_toml(
            {
                "disk": {"capacity_bytes": DISK_RECORDS * disk_record_bytes(BLOCK_BYTES)},
                "events": {"feed_keys": FEED_KEYS, **events},
            }
        ),
    )


def store(client: KVOffloadClient, req_id: str, keys: list[bytes], tenant: str = "") -> None:
    client.new_request(req_id, tenant=tenant)
    for first in range(0, len(keys), 8):
        prepared = client.prepare_store(req_id, keys[first : first + 8])
        client.complete_store(req_id, prepared.keys)
    client.finish_request(req_id)


def settled(service: ServiceHarness) -> None:
    """Wait until no cascade is waiting or in flight: the tiers hold what they will hold."""
    wait_until(
        lambda: (s := service.status().tiering).cascade_backlog == 0 and s.jobs_in_flight == 0,
        what="the cascades to the disk",
    )


def take_all(client: KVOffloadClient, held: HeldBlocks, cursor: int) -> tuple[int, bool]:
    """Apply replies until none waits; (the cursor, whether a snapshot began)."""
    resynced = False
    while True:
        reply = client.take_tier_events(cursor, max_keys=100)
        assert sum(len(e.keys) for e in reply.events) <= 100  # events of 8 keys here
        resynced |= reply.resync
        held.apply(reply)
        cursor = reply.cursor
        if not reply.more:
            return cursor, resynced


def snapshot_of(service: ServiceHarness) -> dict[str, set[bytes]]:
    """What a new client's snapshot lists, per tier."""
    held = HeldBlocks()
    with service.client("fresh") as fresh:
        _, resynced = take_all(fresh, held, 0)
    assert resynced
    return {tier: set(keys) for tier, keys in held.held.items()}


def test_a_client_taking_events_holds_what_the_service_holds_after_a_flood(start_service, tmp_path):
    service = events_service(start_service, tmp_path)
    held = HeldBlocks()
    with service.client("router") as router, service.client("engine") as engine:
        store(engine, "before", keys_for("before", 8))  # stored before events were asked for
        settled(service)
        cursor, resynced = take_all(router, held, 0)
        assert resynced and held.complete == {"primary", "disk"}
        assert set(held.held["primary"]) == set(keys_for("before", 8))
        removed: dict[str, int] = {}
        for round_no in range(10):  # 160 blocks through a pool of 32 and a disk of 48
            store(engine, f"flood-{round_no}", keys_for(f"flood-{round_no}", 16))
            settled(service)
            before = {t: set(k) for t, k in held.held.items()}
            cursor, resynced = take_all(router, held, cursor)
            assert not resynced  # it kept up with the feed
            for tier, keys in before.items():
                removed[tier] = removed.get(tier, 0) + len(keys - set(held.held[tier]))
        status = router.status().tiering
    assert removed["primary"] > 0 and removed["disk"] > 0  # evictions were told
    truth = snapshot_of(service)
    assert {t: set(k) for t, k in held.held.items()} == truth
    assert len(truth["primary"]) == status.used_slots - status.writing_slots
    assert len(truth["disk"]) == status.tiers["disk"].indexed_keys


def test_a_client_that_fell_behind_gets_a_snapshot_and_holds_the_truth_again(
    start_service, tmp_path
):
    service = events_service(start_service, tmp_path)
    held = HeldBlocks()
    with service.client("router") as router, service.client("engine") as engine:
        cursor, _ = take_all(router, held, 0)
        for round_no in range(16):  # more keys than the feed keeps
            store(engine, f"flood-{round_no}", keys_for(f"flood-{round_no}", 16))
            settled(service)
        cursor, resynced = take_all(router, held, cursor)
        assert resynced
        wait_until(
            lambda: [e for e in service.log_events() if e.get("event") == "tier_events_resync"],
            what="the resync's log line",
        )
    assert {t: set(k) for t, k in held.held.items()} == snapshot_of(service)


def test_a_tenants_blocks_are_shown_only_to_clients_that_served_the_tenant(start_service, tmp_path):
    service = events_service(start_service, tmp_path)
    alice_keys = keys_for("alice", 8)
    with service.client("router") as router, service.client("engine") as engine:
        take_all(router, HeldBlocks(), 0)
        take_all(engine, HeldBlocks(), 0)
        store(engine, "alice", alice_keys, tenant="alice")
        store(engine, "plain", keys_for("plain", 8))
        settled(service)
        seen_by_router, seen_by_engine = HeldBlocks(), HeldBlocks()
        take_all(router, seen_by_router, 0)
        take_all(engine, seen_by_engine, 0)
    router_keys = set(seen_by_router.held["primary"]) | set(seen_by_router.held["disk"])
    assert router_keys == set(keys_for("plain", 8))
    assert set(alice_keys) <= set(seen_by_engine.held["primary"])
    assert {seen_by_engine.held["primary"][k] for k in alice_keys} == {tenant_id("alice")}


def test_bad_event_requests_get_typed_errors_and_the_manager_keeps_serving(start_service, tmp_path):
    service = events_service(start_service, tmp_path)
    with service.client("engine") as client:
        for kwargs in ({"max_keys": 0}, {"max_keys": 1 << 20}, {"prefix": b"x" * 65}):
            with pytest.raises(KVOffloadError) as refused:
                client.take_tier_events(**kwargs)
            assert refused.value.code is ErrorCode.BAD_MESSAGE
        far_ahead = client.take_tier_events(cursor=1 << 62)
        assert far_ahead.resync  # a cursor this manager never gave: a snapshot
        assert client.status().pid > 0


def test_the_node_stream_tells_a_router_what_the_service_holds_and_replays_what_it_missed(
    start_service, tmp_path
):
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    pub = f"ipc://{tmp_path}/events.sock"
    replay = f"ipc://{tmp_path}/replay.sock"
    service = events_service(
        start_service, tmp_path, endpoint=pub, replay_endpoint=replay, topic="node-a"
    )
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    index: dict[str, set[bytes]] = {}
    next_seq = 0

    def apply(seq: int, payload: bytes) -> None:
        nonlocal next_seq
        assert seq == next_seq  # no gap, no repeat
        next_seq += 1
        for event in decoder.decode(payload).events:
            if isinstance(event, vllm_events.AllBlocksCleared):
                index.clear()
                continue
            tier = "primary" if event.ownership is None else event.ownership
            assert event.medium == ("CPU" if tier == "primary" else "STORAGE")
            if isinstance(event, vllm_events.BlockStored):
                index.setdefault(tier, set()).update(event.block_hashes)
            else:
                index.setdefault(tier, set()).difference_update(event.block_hashes)

    joined = False

    def apply_live(seq: int, payload: bytes) -> None:
        """A batch from the subscription. The first may follow batches published before the
        subscription took effect (a slow joiner): those are asked of the replay socket first,
        as a router does on a gap."""
        nonlocal joined
        if not joined and seq > next_seq:
            for missed_seq, missed in _replay(zctx, replay, next_seq):
                if missed_seq < seq:
                    apply(missed_seq, missed)
        joined = True
        apply(seq, payload)

    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"node-a")
    sub.connect(pub)
    try:
        with service.client("engine") as engine:
            wait_until(  # a subscription takes a moment to reach the publisher
                lambda: _probe(engine, sub, apply_live), what="the subscription", timeout_s=10
            )
            for round_no in range(5):
                store(engine, f"flood-{round_no}", keys_for(f"flood-{round_no}", 16))
                settled(service)
            _drain(sub, apply_live)
            sub.close(linger=0)  # the router goes away while the flood goes on
            for round_no in range(5, 10):
                store(engine, f"flood-{round_no}", keys_for(f"flood-{round_no}", 16))
                settled(service)
            missed = _replay(zctx, replay, next_seq)
            assert missed
            for seq, payload in missed:
                apply(seq, payload)

            def caught_up() -> bool:
                """The stream's thread sends a turn's batch after the manager's turn: replay
                what it sent since, until the index is the service's."""
                for seq, payload in _replay(zctx, replay, next_seq):
                    apply(seq, payload)
                return index == snapshot_of(service)

            wait_until(caught_up, what="the replayed batches to tell what the service holds")
    finally:
        zctx.destroy(linger=0)
    truth = snapshot_of(service)
    assert len(truth["primary"]) <= SLOTS and len(truth["disk"]) <= DISK_RECORDS
    assert index == truth
    events = service.status().events
    assert events is not None and events.active and events.stream_dropped_batches == 0
    assert events.stream_batches == next_seq  # every batch sent was seen, live or replayed


_probes = itertools.count()


def _probe(engine: KVOffloadClient, sub: zmq.Socket, apply) -> bool:
    """Store one block; True once its event reached the subscriber."""
    n = next(_probes)
    store(engine, f"probe-{n}", keys_for(f"probe-{n}", 1))
    return _drain(sub, apply, wait_ms=200) > 0


def _drain(sub: zmq.Socket, apply, wait_ms: int = 500) -> int:
    """Apply every message that arrives within ``wait_ms`` of the last one."""
    got = 0
    while sub.poll(wait_ms):
        _, seq, payload = sub.recv_multipart()
        apply(int.from_bytes(seq, "big"), payload)
        got += 1
    return got


def _replay(zctx: zmq.Context, endpoint: str, first: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from ``first`` on, as vLLM's subscribers do."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(5000)
        _, _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            dealer.close(linger=0)
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def test_a_node_stream_that_drops_batches_resends_everything_after_a_clear(tmp_path):
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    endpoint = f"ipc://{tmp_path}/events.sock"
    stream = NodeStream(EventsConfig(endpoint=endpoint, queue_batches=2), ServiceConfig())
    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    held: set[bytes] = set()
    try:
        keys = keys_for("burst", 4000)

        def subscribed() -> bool:
            stream.publish([TierEvent("primary", Medium.CPU, Locality.LOCAL, False, [b"probe"])])
            return bool(sub.poll(100))

        wait_until(subscribed, what="the subscription")
        for key in keys:  # far faster than the thread sends: the queue of two overflows
            stream.publish([TierEvent("primary", Medium.CPU, Locality.LOCAL, False, [key])])
            stream.flush()
        assert stream.dropped_batches > 0
        wait_until(stream.wants_snapshot, what="room for the snapshot")
        stream.publish_snapshot([TierEvent("primary", Medium.CPU, Locality.LOCAL, False, keys)])
        cleared = False
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            for event in decoder.decode(payload).events:
                if isinstance(event, vllm_events.AllBlocksCleared):
                    held.clear()
                    cleared = True
                elif isinstance(event, vllm_events.BlockStored):
                    held.update(event.block_hashes)
        assert cleared and held == set(keys) and stream.snapshots == 1
    finally:
        stream.close()
        zctx.destroy(linger=0)


def test_a_late_follower_asks_the_node_stream_for_a_snapshot_stamped_with_its_next_batch(
    tmp_path,
):
    endpoint = f"ipc://{tmp_path}/events.sock"
    replay = f"ipc://{tmp_path}/replay.sock"
    stream = NodeStream(
        EventsConfig(endpoint=endpoint, replay_endpoint=replay, key_form="key"),
        ServiceConfig(),
        run_id="run-1",
    )
    zctx = zmq.Context()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        pool = TierEvent("primary", Medium.CPU, Locality.LOCAL, False, [b"k1", b"k2"])
        gone = TierEvent("primary", Medium.CPU, Locality.LOCAL, True, [b"k1"])
        disk = TierEvent("disk", Medium.STORAGE, Locality.LOCAL, False, [b"k3"])
        for sent, event in enumerate((pool, gone, disk), start=1):
            stream.publish([event])
            stream.flush()
            wait_until(lambda sent=sent: stream.sent_batches == sent, what="the batch sent")

        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", STREAM_SNAPSHOT_REQUEST])
        frames = []
        while True:
            assert dealer.poll(5000)
            frames.append(dealer.recv_multipart())
            if frames[-1][2] == END_SEQ:
                break
        *batches, end = frames
        assert end[3] == b"run-1"  # the end frame names the manager's run
        assert {int.from_bytes(f[2], "big") for f in batches} == {3}  # the next batch's number
        events = [e for f in batches for e in decoder.decode(f[3]).events]
        assert isinstance(events[0], AllBlocksCleared)
        held = {
            (e.ownership, k) for e in events if isinstance(e, BlockStored) for k in e.block_hashes
        }
        assert held == {(None, b"k2"), ("disk", b"k3")}  # what the three batches told
        dealer.close(linger=0)
    finally:
        stream.close()
        zctx.destroy(linger=0)
