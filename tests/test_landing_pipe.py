"""The landing pipe (``kvoffload.wire.landing_pipe``): frames whole and in order between real
processes' ends of a real FIFO, notices cut to fit, and every way a write can fail reported
without blocking."""

from __future__ import annotations

import os
import threading
import time

import pytest
from structlog.testing import capture_logs

from kvoffload.wire import protocol as p
from kvoffload.wire.landing_pipe import (
    FRAME_BYTES,
    LANDING_SCHEME,
    LandingPipe,
    LandingWriters,
    landing_frames,
    pipe_path,
)
from kvoffload.wire.protocol import Landed, LandingTarget
from workers.landing import LandingNotifier


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i:06d}".encode().ljust(32, b".") for i in range(n)]


def notice(ticket: int, n: int, final: bool = False) -> Landed:
    ks = keys(n, str(ticket))
    return Landed(ticket, ks, list(range(n)), [[i, i * 7] for i in range(n)], final=final)


@pytest.fixture
def pipe(tmp_path):
    pipe = LandingPipe(str(tmp_path / "landing.fifo"))
    yield pipe
    pipe.close()


def decoded(frames: list[bytes]) -> list[Landed]:
    return [p.decode_landing(frame) for frame in frames]


def test_frames_arrive_whole_and_in_order(pipe):
    writers = LandingWriters()
    sent = [notice(t, 1 + t % 5, final=t % 2 == 0) for t in range(1, 40)]
    for n in sent:
        assert writers.write(pipe.endpoint, landing_frames(n)) == ""
    assert decoded(pipe.frames(timeout_ms=1000)) == sent
    assert pipe.frames() == []
    writers.close()


def test_a_large_notice_is_cut_into_frames_that_fit_and_only_the_last_is_final():
    big = Landed(7, keys(300), list(range(300)), [[i] for i in range(300)], keys(90, "f"), True)
    frames = landing_frames(big)
    assert len(frames) > 1
    assert all(len(f) <= FRAME_BYTES for f in frames)
    parts = [p.decode_landing(f[4:]) for f in frames]
    assert [part.final for part in parts] == [False] * (len(parts) - 1) + [True]
    assert {part.ticket for part in parts} == {7}
    assert [k for part in parts for k in part.keys] == big.keys
    assert [s for part in parts for s in part.slots] == big.slots
    assert [c for part in parts for c in part.checksums] == big.checksums
    assert [k for part in parts for k in part.failed] == big.failed


def test_a_notice_whose_one_key_cannot_fit_is_refused():
    huge = Landed(1, keys(1), [0], [list(range(FRAME_BYTES))])
    with pytest.raises(ValueError):
        landing_frames(huge)


def test_concurrent_writers_never_interleave_their_frames(pipe):
    writers = LandingWriters()
    received: list[Landed] = []
    per_thread = 300

    def write(thread: int) -> None:
        for i in range(per_thread):
            frames = landing_frames(notice(thread * 100_000 + i, 1 + i % 40))
            while (reason := writers.write(pipe.endpoint, frames)) == "full":
                threading.Event().wait(0.001)
            assert reason == ""

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(received) < 4 * per_thread and time.monotonic() < deadline:
        received.extend(decoded(pipe.frames(timeout_ms=100)))
    for t in threads:
        t.join()
    by_ticket = {n.ticket: n for n in received}
    assert len(received) == len(by_ticket) == 4 * per_thread
    for thread in range(4):
        for i in range(per_thread):
            assert by_ticket[thread * 100_000 + i] == notice(thread * 100_000 + i, 1 + i % 40)
    writers.close()


def test_a_full_pipe_drops_whole_notices_and_keeps_what_it_took(pipe):
    writers = LandingWriters()
    written = 0
    while writers.write(pipe.endpoint, landing_frames(notice(written + 1, 20))) == "":
        written += 1
    assert written > 0
    got = decoded(pipe.frames())
    assert [n.ticket for n in got] == list(range(1, written + 1))
    assert writers.write(pipe.endpoint, landing_frames(notice(1, 1))) == ""
    writers.close()


def test_a_frame_split_across_reads_is_kept_until_it_is_whole(pipe):
    frame = landing_frames(notice(3, 4))[0]
    fd = os.open(pipe.path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, frame[:10])
        assert pipe.frames() == []
        start = time.monotonic()
        assert pipe.frames(timeout_ms=200) == []  # part of a frame: the rest is waited for
        assert time.monotonic() - start >= 0.15
        os.write(fd, frame[10:])
        assert decoded(pipe.frames()) == [notice(3, 4)]
        os.write(fd, (FRAME_BYTES * 2).to_bytes(4, "little") + b"junk")  # no frame is that long
        assert pipe.frames() == []
        os.write(fd, frame)
        assert decoded(pipe.frames()) == [notice(3, 4)]
    finally:
        os.close(fd)


def test_a_client_gone_is_no_reader_before_and_after_its_pipe_was_opened(tmp_path):
    writers = LandingWriters()
    pipe = LandingPipe(str(tmp_path / "gone.fifo"))
    frames = landing_frames(notice(1, 1))
    assert writers.write(pipe.endpoint, frames) == ""
    pipe.close()
    assert not os.path.exists(pipe.path)
    assert writers.write(pipe.endpoint, frames) == "no_reader"  # the open descriptor: EPIPE
    assert writers.write(pipe.endpoint, frames) == "no_reader"  # reopened: no such file
    os.mkfifo(pipe.path)  # a FIFO that nobody reads
    assert writers.write(pipe.endpoint, frames) == "no_reader"
    writers.close()


def test_only_a_fifo_named_by_an_absolute_fifo_endpoint_is_written(tmp_path, pipe):
    writers = LandingWriters()
    frames = landing_frames(notice(1, 1))
    plain = tmp_path / "plain"
    plain.write_bytes(b"keep")
    link = tmp_path / "link.fifo"
    link.symlink_to(pipe.path)
    assert writers.write(f"{LANDING_SCHEME}{plain}", frames) == "not_a_pipe"
    assert writers.write(f"{LANDING_SCHEME}{link}", frames) == "not_a_pipe"
    assert writers.write(f"{LANDING_SCHEME}relative.fifo", frames) == "bad_endpoint"
    assert writers.write(f"ipc://{pipe.path}", frames) == "bad_endpoint"
    assert plain.read_bytes() == b"keep"
    assert pipe.frames() == []
    assert pipe_path(pipe.endpoint) == pipe.path
    assert pipe_path("ipc:///tmp/x") == ""
    writers.close()


def test_the_notifier_counts_and_logs_a_dropped_notice(tmp_path):
    notifier = LandingNotifier()
    pipe = LandingPipe(str(tmp_path / "client.fifo"))
    target = LandingTarget(pipe.endpoint, 9)
    notifier.landed(target, keys(2), [4, 5], [[1], [2]], final=True)
    assert decoded(pipe.frames()) == [Landed(9, keys(2), [4, 5], [[1], [2]], final=True)]
    pipe.close()
    with capture_logs() as logs:
        notifier.over(target, keys(1))
    assert (notifier.sent, notifier.dropped) == (1, 1)
    assert [e["event"] for e in logs] == ["landing_notice_dropped"]
    assert logs[0]["reason"] == "no_reader"
    notifier.close()
