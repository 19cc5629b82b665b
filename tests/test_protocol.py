"""The wire protocol: round trips, strict decoding, size limit, no pickle."""

import subprocess
import sys

import msgspec
import pytest

from kvoffload.wire import protocol as p
from kvoffload.wire.status import BreakerStats, ObjectWorkerStats, WorkerLoopStats, WorkerStats

CLIENT_REQUESTS = [
    p.Connect(rid=1, version=p.PROTOCOL_VERSION, client_name="e"),
    p.RegisterKV(rid=2, handle=p.KVHandle("h", "shm", 8, [p.TensorSpec(4096)], "/x")),
    p.NewRequest(rid=3, req_id="r", params={"kv_load_tiers": [{"medium": "cpu"}]}),
    p.Lookup(rid=4, req_id="r", keys=[b"k" * 16]),
    p.Load(rid=5, req_id="r", keys=[b"k" * 16], device_blocks=[3], handle_id="h"),
    p.Store(rid=6, req_id="r", keys=[b"k" * 16], device_blocks=[3], handle_id="h"),
    p.CompleteStore(rid=7, req_id="r", keys=[b"k" * 16], success=False, successful_keys=[]),
    p.Poll(rid=8, wait_ms=10),
]
WORKER_MESSAGES = [
    p.WorkerHello(version=1, worker="disk", medium="storage", pid=9),
    p.IndexUpdate(added=[b"a" * 16], removed=[], complete=True),
    p.JobDone(job_id=3, success=False, successful_keys=[b"a" * 16], transfer_s=0.1, nbytes=5),
    p.Heartbeat(
        inflight=2,
        degraded=True,
        stats=WorkerStats(
            loop=WorkerLoopStats(jobs_done=4, queued=1),
            medium=ObjectWorkerStats(puts=2, breaker=BreakerStats(state="open")),
        ),
    ),
]
MANAGER_MESSAGES = [
    p.HelloAck(version=1, accepted=False, reason="no"),
    p.Job(job_id=1, kind="cascade", keys=[b"a" * 16], slots=[4]),
    p.Control(action="faults", faults=p.FaultSpec(fail_fraction=0.5)),
]


@pytest.mark.parametrize("msg", CLIENT_REQUESTS, ids=lambda m: type(m).__name__)
def test_client_request_round_trip(msg):
    assert p.decode_client_request(p.encode(msg)) == msg


@pytest.mark.parametrize("msg", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_message_round_trip(msg):
    assert p.decode_worker_message(p.encode(msg)) == msg


@pytest.mark.parametrize("msg", MANAGER_MESSAGES, ids=lambda m: type(m).__name__)
def test_manager_message_round_trip(msg):
    assert p.decode_manager_message(p.encode(msg)) == msg


def test_reply_round_trip():
    reply = p.JobsFinished(
        rid=3,
        finished=[p.DeviceJobFinished(1, "r", p.JobKind.DEVICE_LOAD, False, [b"x" * 16], "boom")],
    )
    assert p.decode_client_reply(p.encode(reply)) == reply


@pytest.mark.parametrize(
    "msg, decode",
    [
        (p.Job(job_id=1, kind="teleport", keys=[]), p.decode_manager_message),
        (p.Control(action="reboot"), p.decode_manager_message),
        (p.Error(rid=1, code="whatever", message=""), p.decode_client_reply),
        (
            p.JobsFinished(rid=1, finished=[p.DeviceJobFinished(1, "r", "copy", True)]),
            p.decode_client_reply,
        ),
        (
            p.RegisterKV(rid=1, handle=p.KVHandle("h", "nfs", 8, [p.TensorSpec(4096)])),
            p.decode_client_request,
        ),
    ],
    ids=["job_kind", "control_action", "error_code", "device_job_kind", "handle_kind"],
)
def test_words_outside_the_vocabulary_are_refused(msg, decode):
    with pytest.raises(p.ProtocolError):
        decode(p.encode(msg))


def test_vocabulary_decodes_to_enums_equal_to_their_strings():
    reply = p.decode_client_reply(
        p.encode(p.Error(rid=1, code=p.ErrorCode.NO_SPACE, message="full"))
    )
    assert reply.code is p.ErrorCode.NO_SPACE and reply.code == "no_space"
    job = p.decode_manager_message(p.encode(p.Job(job_id=1, kind=p.JobKind.PROBE, keys=[])))
    assert job.kind is p.JobKind.PROBE


def test_the_client_does_not_import_the_tiering_library():
    code = "import sys, kvoffload.client; print(sorted(m for m in sys.modules if 'tiering' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_decoding_is_strict_per_channel():
    frame = p.encode(WORKER_MESSAGES[0])
    with pytest.raises(p.ProtocolError):
        p.decode_client_request(frame)
    with pytest.raises(p.ProtocolError):
        p.decode_manager_message(frame)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"t": "lookup", "rid": 1, "req_id": "r", "keys": ["not-bytes"]}),
        msgspec.msgpack.encode({"t": "lookup", "rid": 1, "req_id": "r", "keys": [], "extra": 1}),
        msgspec.msgpack.encode({"t": "nope", "rid": 1}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
    ids=["empty", "invalid-byte", "wrong-type", "unknown-field", "unknown-tag", "not-a-map"],
)
def test_malformed_frames_raise_protocol_error(raw):
    with pytest.raises(p.ProtocolError):
        p.decode_client_request(raw)


def test_oversized_frame_is_refused_before_decoding():
    big = b"\x00" * (p.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode_client_request(big)


def test_request_id_recovered_from_bad_frame():
    raw = msgspec.msgpack.encode({"t": "lookup", "rid": 42, "keys": 5})
    assert p.request_id_of(raw) == 42
    assert p.request_id_of(b"\xc1garbage") == -1


def test_pickle_payload_is_not_accepted():
    import pickle

    with pytest.raises(p.ProtocolError):
        p.decode_client_request(pickle.dumps({"t": "status", "rid": 1}))
