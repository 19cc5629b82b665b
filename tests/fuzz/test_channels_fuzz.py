"""Fuzzing a real manager's two ROUTER sockets with seeded random frames.

Client endpoint: every message gets exactly one reply that decodes as a ClientReply (a typed
Error for anything invalid); job endpoint (random identities, never a worker's): nothing is
answered but hello refusals and re-hello requests. Afterwards the manager is the same process,
logged no handler crash, still serves a real engine byte-exactly, and its RSS has stopped
growing.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from kvoffload.client import KVOffloadError
from kvoffload.soak.probe import ProbeEngine
from kvoffload.testing.helpers import keys_for
from kvoffload.testing.service import services
from kvoffload.wire import protocol as p

SEED = 20261129
MESSAGES_PER_ROUND = 300
REPLY_TIMEOUT_MS = 5000
OVERSIZED = b"\x00" * (p.MAX_MESSAGE_BYTES + 10)
"""Sent first in every round, so the manager's allocator has seen the largest frame before
RSS is compared between rounds."""
CRASH_EVENTS = {"message_handling_crashed", "client_request_crashed"}
CLIENT_TAGS = [t.__struct_config__.tag for t in p.ClientRequest.__args__]
WORKER_TAGS = [t.__struct_config__.tag for t in p.WorkerMessage.__args__]
FIELDS = sorted(
    {f for t in p.ClientRequest.__args__ + p.WorkerMessage.__args__ for f in t.__struct_fields__}
    - {"rid"}
)


@pytest.fixture
def harness(tmp_path):
    with services(tmp_path) as start:
        yield start(disk={"enabled": False}, service={"request_lease_s": 5.0})


def random_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(9 if depth < 2 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.randrange(-(2**63), 2**63)
    if pick == 3:
        return rng.random() * 10 ** rng.randrange(-5, 20)
    if pick == 4:
        return "".join(rng.choice("ab/.\x00é") for _ in range(rng.randrange(12)))
    if pick == 5:
        return rng.randbytes(rng.randrange(70))
    if pick == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 7:
        return [rng.randbytes(rng.choice([8, 16, 32, 65])) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_structure(rng: random.Random, tags: list[str]) -> bytes:
    """A msgpack map with a known or unknown tag, an int rid or none, and random fields."""
    body = {rng.choice(FIELDS): random_value(rng) for _ in range(rng.randrange(6))}
    body["t"] = rng.choice(tags) if rng.random() < 0.8 else "bogus"
    if rng.random() < 0.8:
        body["rid"] = rng.randrange(2**40)
    return msgspec.msgpack.encode(body)


def valid_request(rng: random.Random) -> bytes:
    rid = rng.randrange(2**31)
    keys = [rng.randbytes(rng.choice([16, 32, 15, 65])) for _ in range(rng.randrange(4))]
    return p.encode(
        rng.choice(
            [
                p.Connect(rid=rid, version=rng.choice([p.PROTOCOL_VERSION, 99])),
                p.Status(rid=rid),
                p.NewRequest(rid=rid, req_id=f"r{rng.randrange(5)}"),
                p.Lookup(rid=rid, req_id=f"r{rng.randrange(5)}", keys=keys),
                p.PrepareLoad(rid=rid, req_id=f"r{rng.randrange(5)}", keys=keys),
                p.CompleteLoad(rid=rid, req_id="r0", keys=keys),
                p.CompleteStore(rid=rid, req_id="r1", keys=keys, success=False),
                p.Store(
                    rid=rid,
                    req_id="r1",
                    keys=keys,
                    device_blocks=[rng.randrange(-3, 9) for _ in keys],
                    handle_id="none",
                ),
                p.Poll(rid=rid, wait_ms=rng.randrange(100)),
                p.FinishRequest(rid=rid, req_id=f"r{rng.randrange(5)}"),
                p.Touch(rid=rid, keys=keys),
            ]
        )
    )


def client_message(rng: random.Random) -> list[bytes]:
    """One message (a list of frames) for the client endpoint."""
    pick = rng.random()
    if pick < 0.2:
        return [rng.randbytes(rng.randrange(300))]
    if pick < 0.45:
        return [random_structure(rng, CLIENT_TAGS)]
    if pick < 0.65:
        frame = bytearray(valid_request(rng))
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        return [bytes(frame)]
    if pick < 0.9:
        return [valid_request(rng)]
    if pick < 0.99:
        return [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(2, 4))]
    return [OVERSIZED]


def bound_long_polls(frames: list[bytes]) -> list[bytes]:
    """A valid Poll may be held until its wait_ms passes: keep the waits short."""
    if len(frames) == 1:
        try:
            msg = p.decode_client_request(frames[0])
        except p.ProtocolError:
            return frames
        if isinstance(msg, p.Poll) and not 0 <= msg.wait_ms <= 100:
            return [p.encode(p.Poll(rid=msg.rid, wait_ms=50))]
    return frames


def fuzz_client_endpoint(endpoint: str, rng: random.Random) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for n in range(MESSAGES_PER_ROUND):
            frames = bound_long_polls(client_message(rng)) if n else [OVERSIZED]
            sock.send_multipart(frames)
            assert sock.poll(REPLY_TIMEOUT_MS), (
                f"message {n} ({[f[:40] for f in frames]}) got no reply"
            )
            reply = p.decode_client_reply(sock.recv())
            if len(frames) > 1:
                assert (
                    isinstance(reply, p.Error) and reply.code == "bad_message" and reply.rid == -1
                )
            elif isinstance(reply, p.Error) and reply.code == "bad_message":
                assert reply.rid == p.request_id_of(frames[0])
            else:
                assert reply.rid == p.decode_client_request(frames[0]).rid
            assert not sock.poll(0), f"message {n} got a second reply"
    finally:
        sock.close()


def fuzz_job_endpoint(endpoint: str, rng: random.Random) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    identity = f"fuzz-{rng.randrange(1 << 30):x}"
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    try:
        for _ in range(MESSAGES_PER_ROUND // 3):
            pick = rng.random()
            if pick < 0.3:
                frames = [rng.randbytes(rng.randrange(200))]
            elif pick < 0.6:
                frames = [random_structure(rng, WORKER_TAGS)]
            elif pick < 0.8:
                frames = [
                    p.encode(
                        rng.choice(
                            [
                                p.WorkerHello(
                                    version=p.PROTOCOL_VERSION,
                                    worker=identity,
                                    medium="device",
                                    pid=1,
                                ),
                                p.JobDone(job_id=rng.randrange(2**62), success=True),
                                p.IndexUpdate(added=[rng.randbytes(32)], complete=True),
                                p.Heartbeat(inflight=rng.randrange(9)),
                            ]
                        )
                    )
                ]
            else:
                frames = [rng.randbytes(8) for _ in range(rng.randrange(2, 4))]
            sock.send_multipart(frames)
        while sock.poll(300):
            reply = p.decode_manager_message(sock.recv())
            assert isinstance(reply, (p.HelloAck, p.Control))
            assert not isinstance(reply, p.HelloAck) or not reply.accepted
    finally:
        sock.close()


def round_trip_is_exact(harness, tag: str) -> None:
    keys = keys_for(tag, 4)
    with ProbeEngine(harness, f"after-{tag}") as engine:
        engine.assert_round_trip(keys)


def test_random_frames_on_both_channels_are_answered_or_ignored(harness):
    manager = harness.manager_pid()
    cpu = harness.worker_pid("cpu")
    rng = random.Random(SEED)
    rss = []
    for round_ in range(3):
        fuzz_client_endpoint(harness.endpoint, rng)
        fuzz_job_endpoint(harness.job_endpoint, rng)
        round_trip_is_exact(harness, f"round{round_}")
        rss.append(harness.rss_bytes(manager))
    assert harness.manager_pid() == manager and harness.restarts()["manager"] == 0
    assert harness.worker_pid("cpu") == cpu
    assert not [e for e in harness.log_events() if e.get("event") in CRASH_EVENTS]
    assert rss[2] - rss[1] < 8 << 20, f"manager RSS still growing: {[r >> 20 for r in rss]} MiB"


def test_a_frame_nested_too_deep_to_decode_gets_one_typed_reply_with_its_rid(harness):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(harness.endpoint)
    deep = b"\x91" * 100_000 + b"\xc0"
    try:
        for frame, rid in [
            (b"\x83\xa1t\xabnew_request\xa3rid\x05\xa6params\x81\xa1x" + deep, 5),
            (b"\x82\xa1t\xa6status\xa1x" + deep, -1),
        ]:
            sock.send(frame)
            assert sock.poll(REPLY_TIMEOUT_MS), "a deeply nested frame got no reply"
            reply = p.decode_client_reply(sock.recv())
            assert isinstance(reply, p.Error) and reply.code == "bad_message" and reply.rid == rid
            assert not sock.poll(200), "a second reply"
    finally:
        sock.close()
    assert not [e for e in harness.log_events() if e.get("event") in CRASH_EVENTS]


def test_the_client_refuses_a_call_over_the_size_limit_before_sending_it(harness):
    with ProbeEngine(harness, "big") as engine:
        req = engine.new_request()
        started = time.monotonic()
        with pytest.raises(KVOffloadError) as err:
            engine.client.lookup(req, [b"k" * (20 << 20)])
        assert err.value.code == "message_too_large" and str(p.MAX_MESSAGE_BYTES) in str(err.value)
        assert time.monotonic() - started < 1.0
        keys = keys_for("after-big", 2)
        assert engine.store(req, keys).success, "the session survives the refused call"
        assert engine.lookup_ready(req, keys).ready_prefix == 2
