"""Held lookups (``wait_ms``), promotions that land key by key, and completions sent without
waiting, through a real service with the disk tier (real processes, sockets, files)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvoffload.client import KVOffloadError
from kvoffload.memory.slotcopy import shared_copier
from kvoffload.testing.helpers import keys_for, wait_until
from kvoffload.testing.service import service_pool
from kvoffload.tiering import LookupResult
from kvoffload.wire import protocol as p
from kvoffload.wire.vocab import ErrorCode

HIT, HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
BLOCK = 65536
READ_DELAY_S = 0.5
"""Every disk-store operation (each block read of a promotion, too) is delayed this long."""
PROMOTED_BLOCKS = 8
"""Read two chunks at a time (one block, then two, then two...): the last blocks land at least a
second after the first ones."""


@pytest.fixture
def cold(start_service):
    """A service with the disk tier, slow disk operations and one helper reader thread (a
    promotion reads two blocks at a time: its job thread and the helper), eight blocks written
    through the engine-side path, cascaded to disk, then gone from the host pool: (client, pool,
    keys, rows)."""
    service = start_service(
        workers=("cpu", "disk"),
        extra_config=(
            f"[faults]\ndelay_s = {READ_DELAY_S}\ndelay_fraction = 1.0\n[disk]\nread_threads = 1\n"
        ),
    )
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, size=(PROMOTED_BLOCKS, BLOCK), dtype=np.uint8)
    keys = keys_for("cold", PROMOTED_BLOCKS)
    with service.client("engine", timeout_s=20.0) as client, service_pool(client) as pool:
        client.new_request("writer")
        prepared = client.prepare_store("writer", keys)
        sums = shared_copier().copy_with_checksums(
            [(pool.slot_array(slot), rows[i]) for i, slot in enumerate(prepared.slots)]
        )
        client.complete_store("writer", keys, checksums=[[s] for s in sums])
        client.finish_request("writer")
        wait_until(
            lambda: service.status().tiering.tiers["disk"].indexed_keys == len(keys),
            what="the cascade to disk",
        )
        client.reset_cache()
        client.new_request("reader")
        yield client, pool, keys, rows


def test_a_held_lookup_answers_when_the_promotion_lands_and_waits_at_most_wait_ms(cold):
    client, pool, keys, rows = cold
    t0 = time.monotonic()
    outcome = client.lookup("reader", keys[:1], pin=True, wait_ms=50)
    elapsed = time.monotonic() - t0
    assert outcome.results == [HIT_PENDING], outcome
    assert 0.045 <= elapsed < READ_DELAY_S, elapsed
    t0 = time.monotonic()
    outcome = client.lookup("reader", keys[:1], pin=True, wait_ms=10_000)
    elapsed = time.monotonic() - t0
    assert outcome.results == [HIT], outcome
    assert elapsed < 5.0, elapsed
    assert np.array_equal(pool.slot_array(outcome.slots[0]), rows[0])
    client.complete_load("reader", keys[:1])


def test_a_promotion_makes_its_landed_keys_hit_before_the_rest(cold):
    client, pool, keys, rows = cold
    remaining = list(range(len(keys)))
    answers = []
    while remaining:
        outcome = client.lookup("reader", [keys[i] for i in remaining], pin=True, wait_ms=10_000)
        answers.append(outcome.results)
        landed = [i for i, slot in zip(remaining, outcome.slots, strict=False) if slot >= 0]
        assert landed, outcome
        for i in landed:
            position = remaining.index(i)
            assert np.array_equal(pool.slot_array(outcome.slots[position]), rows[i])
        client.complete_load("reader", [keys[i] for i in landed])
        remaining = [i for i in remaining if i not in landed]
    # the first answer came when the first block had landed and the others had not
    assert answers[0][0] is HIT and HIT_PENDING in answers[0], answers
    assert len(answers) >= 2, answers


def test_completions_sent_without_waiting_take_effect_in_order_and_report_errors_later(
    start_service,
):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("nowait", 2)
    with service.client("engine") as client, service_pool(client) as pool:
        client.new_request("r")
        prepared = client.prepare_store("r", keys)
        row = np.arange(BLOCK, dtype=np.uint8)
        sums = shared_copier().copy_with_checksums(
            [(pool.slot_array(s), row) for s in prepared.slots]
        )
        client.complete_store("r", keys, checksums=[[s] for s in sums], wait=False)
        outcome = client.lookup("r", keys, pin=True)
        assert outcome.results == [HIT, HIT]
        client.complete_load("r", keys, wait=False)
        assert client.status().tiering.pinned_slots == 0
        client.complete_load("r", keys, wait=False)  # not pinned any more: refused later
        assert client.lookup("r", keys).results == [HIT, HIT]
        assert [e.code for e in client.deferred_errors] == ["not_pinned"]
        assert isinstance(client.deferred_errors[0], KVOffloadError)

        client.finish_request("r", wait=False)
        with pytest.raises(KVOffloadError) as finished:  # the finish took effect first
            client.lookup("r", keys)
        assert finished.value.code == "unknown_request"
        assert len(client.deferred_errors) == 1  # the finish itself was answered with nothing
        client.finish_request("r", wait=False)  # finished already: refused later
        client.status()
        assert [e.code for e in client.deferred_errors] == ["not_pinned", "unknown_request"]


def test_a_completion_sent_errors_only_is_answered_only_when_it_fails(start_service):
    service = start_service(block_bytes=BLOCK)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:

        def receive():
            assert sock.poll(5000), "no reply"
            return p.decode_client_reply(sock.recv())

        sock.send(p.encode(p.Connect(rid=1, version=p.PROTOCOL_VERSION, client_name="raw")))
        assert isinstance(receive(), p.Connected)
        sock.send(p.encode(p.NewRequest(rid=2, req_id="r")))
        assert isinstance(receive(), p.NewRequestReply)
        sock.send(p.encode(p.CompleteLoad(rid=3, req_id="r", keys=[], errors_only=True)))
        sock.send(p.encode(p.CompleteLoad(rid=4, req_id="r", keys=[b"k" * 16], errors_only=True)))
        sock.send(p.encode(p.CompleteLoad(rid=5, req_id="r", keys=[])))
        first, second = receive(), receive()
        assert isinstance(first, p.Error) and first.rid == 4, first
        assert first.code is ErrorCode.NOT_PINNED
        assert isinstance(second, p.Ok) and second.rid == 5, second
        assert not sock.poll(100), "an Ok was sent to a call that asked for errors only"
    finally:
        sock.close()


def test_a_held_lookup_is_answered_when_its_client_sends_something_else(cold):
    client, _, keys, _ = cold
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client.endpoint)
    try:

        def send(msg) -> None:
            sock.send(p.encode(msg))

        def receive():
            assert sock.poll(5000), "no reply"
            return p.decode_client_reply(sock.recv())

        send(p.Connect(rid=1, version=p.PROTOCOL_VERSION, client_name="raw"))
        assert isinstance(receive(), p.Connected)
        send(p.NewRequest(rid=2, req_id="raw"))
        assert isinstance(receive(), p.NewRequestReply)
        send(p.Lookup(rid=3, req_id="raw", keys=keys[:1], wait_ms=60_000))
        assert not sock.poll(100), "a lookup of a block still on disk was answered at once"
        send(p.Status(rid=4))  # the client gave up waiting: its lookup is answered first
        first, second = receive(), receive()
        assert isinstance(first, p.LookupReply) and first.rid == 3
        assert list(first.results) == [HIT_PENDING]
        assert isinstance(second, p.StatusReply) and second.rid == 4
    finally:
        sock.close()
