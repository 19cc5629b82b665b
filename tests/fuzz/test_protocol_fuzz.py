"""Fuzzing the protocol decoders: whatever arrives, the answer is a valid message of the
channel or a ProtocolError, never another exception (hypothesis)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.wire import protocol as p

DECODERS = {
    "client_request": (p.decode_client_request, p.ClientRequest),
    "client_reply": (p.decode_client_reply, p.ClientReply),
    "worker_message": (p.decode_worker_message, p.WorkerMessage),
    "manager_message": (p.decode_manager_message, p.ManagerMessage),
}
MESSAGE_TYPES = [t for _, union in DECODERS.values() for t in union.__args__]
TAGS = sorted({t.__struct_config__.tag for t in MESSAGE_TYPES})
FIELD_NAMES = sorted({f for t in MESSAGE_TYPES for f in t.__struct_fields__})

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
tagged = st.builds(
    lambda tag, fields: {**fields, "t": tag},
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=6),
)
SAMPLES = [
    p.Connect(rid=1, version=p.PROTOCOL_VERSION, client_name="x"),
    p.Lookup(rid=2, req_id="r", keys=[b"k" * 16]),
    p.Store(rid=3, req_id="r", keys=[b"k" * 16], device_blocks=[0], handle_id="h"),
    p.RegisterKV(rid=4, handle=p.KVHandle("h", "shm", 2, [p.TensorSpec(row_bytes=4096)], "/x")),
    p.JobsFinished(
        rid=5,
        finished=[p.DeviceJobFinished(1, "r", p.JobKind.DEVICE_LOAD, False, [b"k" * 16], "e")],
    ),
    p.WorkerHello(version=1, worker="cpu", medium="device", pid=7),
    p.JobDone(job_id=1, success=False, successful_keys=[b"k" * 16]),
    p.Job(job_id=1, kind="cascade", keys=[b"k" * 16], slots=[3]),
    p.Control(action="faults", faults=p.FaultSpec(fail_fraction=0.5)),
]
DEEP_IN_MAP = (
    b"\x83\xa1t\xabnew_request\xa3rid\x05\xa6params\x81\xa1x" + b"\x91" * 100_000 + b"\xc0"
)
"""A NewRequest with rid 5 whose params hold a value nested 100k levels deep."""
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_protocol_error(name: str, frame: bytes) -> None:
    decode, union = DECODERS[name]
    try:
        msg = decode(frame)
    except p.ProtocolError:
        return
    assert isinstance(msg, union.__args__)
    assert decode(p.encode(msg)) == msg


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(frame=st.binary(max_size=200))
def test_random_bytes(name, frame):
    decode_or_protocol_error(name, frame)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(structure=values | tagged)
def test_random_msgpack_structures(name, structure):
    decode_or_protocol_error(name, msgspec.msgpack.encode(structure))


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_mutated_valid_messages(name, sample, data):
    frame = bytearray(p.encode(sample))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    decode_or_protocol_error(name, bytes(frame[:cut]))


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize(
    "frame",
    [
        b"\x91" * 100_000 + b"\xc0",  # nested 100k deep
        DEEP_IN_MAP,
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4G entries
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\xd6\xff\x00\x00\x00\x01",  # timestamp ext
        b"",
        b"\x00" * (p.MAX_MESSAGE_BYTES + 1),
    ],
    ids=["deep", "deep-in-map", "huge-array", "huge-bin", "ext", "empty", "oversized"],
)
def test_hostile_frames(name, frame):
    decode_or_protocol_error(name, frame)


def test_valid_samples_decode_on_their_channel_only():
    for sample in SAMPLES:
        homes = [name for name, (_, union) in DECODERS.items() if type(sample) in union.__args__]
        for name, (decode, _) in DECODERS.items():
            if name in homes:
                assert decode(p.encode(sample)) == sample
            else:
                with pytest.raises(p.ProtocolError):
                    decode(p.encode(sample))


@FUZZ
@given(structure=values | tagged, rid=st.integers(min_value=0, max_value=2**63 - 1))
def test_the_error_reply_to_a_bad_frame_is_itself_valid(structure, rid):
    for frame in (msgspec.msgpack.encode(structure), msgspec.msgpack.encode({"rid": rid, "t": 5})):
        reply = p.Error(p.request_id_of(frame), "bad_message", "x")
        assert p.decode_client_reply(p.encode(reply)) == reply


def test_a_boolean_rid_is_not_echoed():
    frame = msgspec.msgpack.encode({"t": "lookup", "rid": True})
    reply = p.Error(p.request_id_of(frame), "bad_message", "x")
    assert p.decode_client_reply(p.encode(reply)) == reply


def test_the_rid_of_a_frame_nested_too_deep_to_decode_is_still_read():
    assert p.request_id_of(DEEP_IN_MAP) == 5
    rid_after = b"\x82\xa1x" + b"\x91" * 100_000 + b"\xc0" + b"\xa3rid\x07"
    assert p.request_id_of(rid_after) == -1, (
        "the scan is bounded: a rid after a huge value is not looked for"
    )
    assert p.request_id_of(msgspec.msgpack.encode({"params": {"a": [1, 2]}, "rid": 9})) == 9
    assert p.request_id_of(b"\x82\xa1t\xa1x\xa3rid") == -1  # truncated
