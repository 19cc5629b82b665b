"""The peer tier between two real services on one machine, over tcp:// with CURVE: node B
finds node A's blocks through A's node stream and loads them from A's pool and disk, checked;
A refuses what it must refuse. Real processes, sockets, shared memory and files."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from kvoffload.bench.service import engine_store
from kvoffload.cli import format_status
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.peers import PeerNode, fleet, make_node
from kvoffload.testing.service import ServiceHarness, service_pool, services
from kvoffload.tiering import LookupResult
from kvoffload.wire import protocol as p
from kvoffload.wire.events import BlockStored, KVEventBatch

HIT = LookupResult.HIT
BLOCK = 65536
POOL = {"num_slots": 64, "block_bytes": BLOCK}
NO_DISK = {"enabled": False}


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    with services(tmp_path, ServiceHarness) as start:
        yield start


def store_blocks(service: ServiceHarness, name: str, count: int, tenant: str = ""):
    """``count`` random blocks stored in ``service``'s pool through the engine-side path:
    (keys, rows)."""
    rows = np.random.default_rng(len(name)).integers(0, 256, size=(count, BLOCK), dtype=np.uint8)
    keys = keys_for(name, count)
    with service.client("writer") as client, service_pool(client) as pool:
        client.new_request("w", tenant=tenant)
        engine_store(client, "w", keys, pool, rows, wait=True)
        client.finish_request("w")
    return keys, rows


def peer_indexed(service: ServiceHarness) -> int:
    stats = service.status().workers["peer"].stats.medium
    return stats.keys_indexed if stats is not None else 0


def load_all(service: ServiceHarness, keys: list[bytes], tenant: str = "") -> np.ndarray | None:
    """Look ``keys`` up on ``service`` until every one is HIT (None: some key is a MISS),
    and return their bytes as its pool holds them."""
    with service.client("reader", timeout_s=20.0) as client, service_pool(client) as pool:
        client.new_request("r", tenant=tenant)
        slots: dict[bytes, int] = {}

        def all_hit() -> bool:
            todo = [k for k in keys if k not in slots]
            outcome = client.lookup("r", todo, pin=True, wait_ms=2000)
            for key, result, slot in zip(todo, outcome.results, outcome.slots, strict=False):
                if result is HIT:
                    slots[key] = slot
                elif result is LookupResult.MISS:
                    raise LookupError(key)
            return len(slots) == len(keys)

        try:
            wait_until(all_hit, timeout_s=30, what="every key a HIT")
        except LookupError:
            return None
        out = np.stack([pool.slot_array(slots[k]).copy() for k in keys])
        client.complete_load("r", list(slots))
        client.finish_request("r")
        return out


def loaded(service: ServiceHarness, keys: list[bytes]) -> list[np.ndarray] | None:
    """``load_all`` for ``wait_until``: the rows in a list (truthy), or None."""
    got = load_all(service, keys)
    return None if got is None else list(got)


def subscribe(node: PeerNode, follower: PeerNode, ctx: zmq.Context) -> zmq.Socket:
    """A SUB on ``node``'s stream with ``follower``'s client keys."""
    sock = ctx.socket(zmq.SUB)
    public, secret = zmq.auth.load_certificate(str(follower.client_secret))
    server, _ = zmq.auth.load_certificate(str(node.server_public))
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(node.events_endpoint)
    return sock


def stored_pool_keys(sock: zmq.Socket, within_ms: int) -> set[bytes]:
    out: set[bytes] = set()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    while sock.poll(within_ms):
        _, _, payload = sock.recv_multipart()
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored) and event.medium == "CPU" and not event.ownership:
                out.update(k for k in event.block_hashes if isinstance(k, bytes))
    return out


def test_a_node_loads_another_nodes_pool_blocks_bit_identical_and_announces_them(
    start, tmp_path: Path
) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **a.sections(follows=[])})
    node_b = start(sections={"pool": POOL, "disk": NO_DISK, **b.sections(follows=[a], serve=False)})
    keys, rows = store_blocks(node_a, "shared", 8)
    wait_until(lambda: peer_indexed(node_b) >= 8, what="B's peer index to hold A's blocks")

    ctx = zmq.Context()
    try:
        sub = subscribe(b, a, ctx)
        got = load_all(node_b, keys)
        assert got is not None
        assert np.array_equal(got, rows)  # bit-identical, through A's pool, checked
        # B now holds them in its own pool, and says so on its node stream
        assert set(keys) <= stored_pool_keys(sub, within_ms=2000)
        sub.close(linger=0)
    finally:
        ctx.term()
    stats = wait_until(
        lambda: (s := node_b.status().workers["peer"].stats.medium).fetch_keys == 8 and s,
        what="B's fetch counters",
    )
    assert stats.fetch_bad_blocks == 0
    wait_until(
        lambda: node_a.status().workers["peer"].stats.medium.served_keys == 8,
        what="A's serve counters",
    )
    shown = format_status(node_b.status())
    assert "peer: 1 nodes followed (0 silent, 0 breakers open), 8 keys indexed" in shown
    assert "fetched 8 keys (0.5 MiB) in 1 fetches, 0 failed" in shown


def test_blocks_only_on_the_holders_disk_are_served_from_it(start, tmp_path: Path) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    node_a = start(sections={"pool": POOL, **a.sections(follows=[])})
    node_b = start(sections={"pool": POOL, "disk": NO_DISK, **b.sections(follows=[a], serve=False)})
    keys, rows = store_blocks(node_a, "on-disk", 6)
    wait_until(lambda: node_a.status().tiering.tiers["disk"].indexed_keys >= 6, what="A's cascade")
    with node_a.client("admin") as admin:
        admin.reset_cache()  # A now holds them on its disk only
    wait_until(lambda: peer_indexed(node_b) >= 6, what="B's index of A's disk blocks")
    got = load_all(node_b, keys)
    assert got is not None and np.array_equal(got, rows)


def test_a_peer_without_an_admitted_key_is_refused(start, tmp_path: Path) -> None:
    a = make_node(tmp_path, "a")
    stranger = make_node(tmp_path, "stranger")  # A does not admit its key
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **a.sections(follows=[])})
    node_s = start(
        sections={"pool": POOL, "disk": NO_DISK, **stranger.sections(follows=[a], serve=False)}
    )
    keys, _ = store_blocks(node_a, "private", 4)
    assert load_all(node_s, keys) is None  # A's stream refused it: nothing indexed, a MISS
    assert peer_indexed(node_s) == 0
    # a fetch sent with its key straight to A's fetch endpoint gets no answer, and A logs it
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        public, secret = zmq.auth.load_certificate(str(stranger.client_secret))
        server, _ = zmq.auth.load_certificate(str(a.server_public))
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
        sock.connect(a.fetch_endpoint)
        fetch = p.PeerFetch(p.PROTOCOL_VERSION, 1, b"x" * 16, "", "", keys, b"b" * 16, b"k" * 32)
        sock.send(p.encode(fetch))
        assert not sock.poll(1000)
        sock.close(linger=0)
    finally:
        ctx.term()
    refused = wait_until(
        lambda: [e for e in node_a.log_events() if e.get("event") == "peer_handshake_refused"],
        what="A to log the refused handshake",
    )
    assert refused[0]["reason"] == "unknown_key"
    wait_until(
        lambda: node_a.status().workers["peer"].stats.medium.handshakes_refused.get("unknown_key"),
        what="A to count the refused handshake",
    )


def test_another_deployment_is_refused_with_one_clear_log_line(start, tmp_path: Path) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **a.sections(follows=[])})
    other_layout = {**POOL, "layout_id": "another-model"}
    node_b = start(
        sections={"pool": other_layout, "disk": NO_DISK, **b.sections(follows=[a], serve=False)}
    )
    keys, _ = store_blocks(node_a, "layout", 4)
    wait_until(lambda: peer_indexed(node_b) >= 4, what="B's index")
    assert load_all(node_b, keys) is None  # refused, so a MISS: recomputed
    refusals = [e for e in node_a.log_events() if e.get("event") == "peer_fetch_refused"]
    assert len(refusals) == 1 and refusals[0]["code"] == "deployment_mismatch"
    public, _ = zmq.auth.load_certificate(str(b.client_public))
    assert refusals[0]["key_fingerprint"] == public.decode()[:10]  # its key, in Z85
    wait_until(
        lambda: node_b.status().workers["peer"].stats.medium.fetch_failures >= 1,
        what="B to count the refused fetch",
    )


def test_another_tenant_gets_none_of_its_blocks(start, tmp_path: Path) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    events_with_tenants = {"tenant_blocks": True}
    sections_a = a.sections(follows=[])
    sections_a["events"].update(events_with_tenants)
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **sections_a})
    node_b = start(sections={"pool": POOL, "disk": NO_DISK, **b.sections(follows=[a], serve=False)})
    keys, rows = store_blocks(node_a, "tenant-a", 4, tenant="alice")
    wait_until(lambda: peer_indexed(node_b) >= 4, what="B's index of alice's blocks")
    assert load_all(node_b, keys, tenant="bob") is None
    got = load_all(node_b, keys, tenant="alice")
    assert got is not None and np.array_equal(got, rows)


def test_a_killed_holder_is_a_fallback_then_its_restart_and_new_run_are_found(
    start, tmp_path: Path
) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    sections_a = a.sections(follows=[])
    # A's manager must not kill its hung worker for silence before the test does
    sections_a["service"]["heartbeat_timeout_s"] = 60.0
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **sections_a})
    node_b = start(
        sections={
            "pool": POOL,
            "disk": NO_DISK,
            **b.sections(follows=[a], serve=False, fetch_deadline_s=1.0),
        }
    )
    keys, rows = store_blocks(node_a, "killed", 4)
    wait_until(lambda: peer_indexed(node_b) >= 4, what="B's index")

    # the holder hangs: B's fetch gets no answer, its keys are a MISS by the fetch deadline
    holder = node_a.worker_pid("peer")
    assert node_a.signal_child(holder, signal.SIGSTOP)
    try:
        assert load_all(node_b, keys) is None
        wait_until(
            lambda: node_b.status().workers["peer"].stats.medium.fetch_failures >= 1,
            what="B to count the failed fetch",
        )
    finally:
        node_a.signal_child(holder, signal.SIGCONT)
    # the holder is killed, its supervisor restarts it, and B is served by the new one
    assert node_a.signal_child(holder, signal.SIGKILL)
    wait_until(lambda: node_a.restarts().get("peer", 0) >= 1, what="A's peer worker restarted")
    got = wait_until(lambda: loaded(node_b, keys), what="B to load from A again")
    assert np.array_equal(got, rows)

    # A's manager restarts: a new run of its stream, found by B without any new traffic
    snapshots = node_b.status().workers["peer"].stats.medium.stream_snapshots
    assert node_a.signal_child(node_a.manager_pid(), signal.SIGKILL)
    wait_until(
        lambda: node_b.status().workers["peer"].stats.medium.stream_snapshots > snapshots,
        what="B to take the new run's snapshot",
    )
    fresh, fresh_rows = store_blocks(node_a, "after-restart", 4)
    got = wait_until(lambda: loaded(node_b, fresh), what="B to load the new run's blocks")
    assert np.array_equal(got, fresh_rows)


def test_a_silent_stream_takes_its_node_out_of_the_index_until_it_speaks(
    start, tmp_path: Path
) -> None:
    a, b = fleet(tmp_path, ["a", "b"])
    node_a = start(sections={"pool": POOL, "disk": NO_DISK, **a.sections(follows=[])})
    node_b = start(sections={"pool": POOL, "disk": NO_DISK, **b.sections(follows=[a], serve=False)})
    keys, rows = store_blocks(node_a, "silent", 4)
    wait_until(lambda: peer_indexed(node_b) >= 4, what="B's index")
    manager = node_a.manager_pid()
    assert node_a.signal_child(manager, signal.SIGSTOP)
    try:
        wait_until(lambda: peer_indexed(node_b) == 0, what="B to drop the silent node's keys")
        assert node_b.status().workers["peer"].degraded
        assert load_all(node_b, keys) is None  # a MISS at once, not a stuck request
    finally:
        node_a.signal_child(manager, signal.SIGCONT)
    wait_until(lambda: peer_indexed(node_b) >= 4, what="B to index the node again")
    got = wait_until(lambda: loaded(node_b, keys), what="B to load again")
    assert np.array_equal(got, rows)
    assert any(e.get("event") == "peer_node_silent" for e in node_b.log_events())
