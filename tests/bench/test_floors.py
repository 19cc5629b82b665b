"""The floors the benchmarks measure their cells against: ``kvoffload.bench.hops``'s bare chain
of a cold one-block load's hops runs real processes over real sockets, a FIFO and a
shared-memory slot, checks every copy, fails clearly when its reader dies, and leaves no
process, segment or file behind; nor does the bare round trip of ``kvoffload.bench.limits``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest

from kvoffload.bench import hops
from kvoffload.bench.limits import zmq_rtt_us

SHM = Path("/dev/shm")


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def assert_nothing_left(directory: Path, children_before: set[int]) -> None:
    """No file in ``directory``, no chain segment in /dev/shm, no child process started since."""
    assert list(directory.iterdir()) == []
    assert [name for name in os.listdir(SHM) if name.startswith("kvo-chain-")] == []
    assert children() == children_before


def test_cold_chain_times_verified_loads_and_leaves_nothing_behind(tmp_path: Path) -> None:
    children_before = children()
    figures = hops.cold_chain(tmp_path, 64 << 10, loads=30, records=16)
    assert figures["loads"] == 30
    assert figures["block_bytes"] == 64 << 10
    assert isinstance(figures["direct"], bool)
    assert 0 < figures["chain_p10_us"] <= figures["chain_p50_us"]
    assert_nothing_left(tmp_path, children_before)


def test_a_reader_that_dies_is_a_clear_error_with_nothing_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records missing from the file make the reader's read come up short: it raises and exits,
    closing its end of the pipe, and the caller stops at once rather than at its timeout."""

    def first_record_only(path: Path, block: int, records: int) -> None:
        path.write_bytes(np.ones(block, dtype=np.uint8).tobytes())

    children_before = children()
    monkeypatch.setattr(hops, "_write_records", first_record_only)
    with pytest.raises(RuntimeError, match="sent no notice"):
        hops.cold_chain(tmp_path, 64 << 10, loads=30, records=16)
    assert_nothing_left(tmp_path, children_before)


def test_a_bare_round_trip_leaves_no_socket_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits' round trip (an echo process over ipc) removes its socket's directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert zmq_rtt_us(rounds=20) > 0
    assert list(tmp_path.iterdir()) == []
