"""Runtime directory: permissions, owner records, endpoints and stale-run clean-up."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import posix_ipc
import psutil
import pytest
from structlog.testing import capture_logs

from kvoffload.runtime.rundir import (
    MAX_IPC_PATH_BYTES,
    RunDir,
    RunDirError,
    cleanup_stale,
    live_runs,
)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return tmp_path / "rt"


@pytest.fixture
def shm_token() -> Iterator[str]:
    """A unique token for shm names; fails the test if a segment carrying it survives."""
    token = secrets.token_hex(6)
    yield token
    leftovers = [n for n in os.listdir("/dev/shm") if token in n]
    for leftover in leftovers:
        os.unlink(f"/dev/shm/{leftover}")
    assert not leftovers, f"test left shared memory behind: {leftovers}"


def _dead_process() -> tuple[int, float]:
    """Pid and start time of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(proc.pid).create_time()  # readable until reaped, even as a zombie
    proc.wait()
    return proc.pid, started


def _bind_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def _make_segment(name: str) -> None:
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    shm.close_fd()


def _write_owner(
    base: Path, run_id: str, pid: int, shm_names: list[str], create_time: float | None = None
) -> Path:
    path = base / f"owner-{run_id}.json"
    record = {
        "pid": pid,
        "run_id": run_id,
        "started_at": time.time(),
        "create_time": create_time,
        "shm_names": shm_names,
    }
    path.write_text(json.dumps(record))
    return path


def test_create_makes_private_dir_and_owner_file(base: Path) -> None:
    run = RunDir.create(base)
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
    assert len(run.run_id) == 8
    record = json.loads(run.owner_file.read_text())
    assert record["pid"] == os.getpid()
    assert record["run_id"] == run.run_id
    assert record["shm_names"] == []
    assert abs(record["started_at"] - time.time()) < 60
    assert stat.S_IMODE(os.stat(run.owner_file).st_mode) == 0o600
    assert [r.run_id for r in live_runs(base)] == [run.run_id]


def test_existing_dir_is_chmodded(base: Path) -> None:
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    RunDir.create(base)
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700


def test_symlink_base_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(RunDirError, match="symlink"):
        RunDir.create(link)
    assert list(target.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="changing a directory's owner needs root")
def test_base_owned_by_another_uid_is_refused(base: Path) -> None:
    base.mkdir(mode=0o700)
    os.chown(base, 12345, -1)
    with pytest.raises(RunDirError, match="owned by uid 12345"):
        RunDir.create(base)


def test_two_runs_share_a_base(base: Path) -> None:
    first, second = RunDir.create(base), RunDir.create(base)
    assert first.run_id != second.run_id
    assert first.endpoint("client") != second.endpoint("client")
    assert {r.run_id for r in live_runs(base)} == {first.run_id, second.run_id}


def test_endpoint_and_length_limit(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "rt")
    assert run.endpoint("jobs") == f"ipc://{tmp_path / 'rt'}/{run.run_id}-jobs.sock"
    deep = tmp_path / ("d" * max(8, MAX_IPC_PATH_BYTES - len(str(tmp_path))))
    long_run = RunDir.create(deep)
    with pytest.raises(RunDirError, match="runtime_dir"):
        long_run.endpoint("client")


def test_record_shm_rewrites_owner_file(base: Path) -> None:
    run = RunDir.create(base)
    run.record_shm("/kvoffload-x-pool")
    run.record_shm("/kvoffload-x-pool")
    run.record_shm("/kvoffload-x-other")
    record = json.loads(run.owner_file.read_text())
    assert record["shm_names"] == ["/kvoffload-x-pool", "/kvoffload-x-other"]
    assert run.shm_names == record["shm_names"]
    assert not list(base.glob(".*.tmp"))


def test_remove_unlinks_own_files_only(base: Path) -> None:
    run, other = RunDir.create(base), RunDir.create(base)
    mine, theirs = run.socket_path("client"), other.socket_path("client")
    _bind_socket(mine)
    _bind_socket(theirs)
    run.remove()
    run.remove()
    assert not mine.exists() and not run.owner_file.exists()
    assert theirs.exists() and other.owner_file.exists()


def test_cleanup_stale_removes_dead_run(base: Path, shm_token: str) -> None:
    live = RunDir.create(base)
    live_shm = f"/kvoffload-{shm_token}-live"
    live.record_shm(live_shm)
    _make_segment(live_shm)
    live_sock = live.socket_path("client")
    _bind_socket(live_sock)

    dead_id = "deadbeef"
    dead_shm = f"/kvoffload-{shm_token}-dead"
    _make_segment(dead_shm)
    dead_sock = base / f"{dead_id}-client.sock"
    _bind_socket(dead_sock)
    pid, started = _dead_process()
    recorded = [dead_shm, f"/kvoffload-{shm_token}-gone"]
    dead_owner = _write_owner(base, dead_id, pid, recorded, create_time=started)

    try:
        with capture_logs() as logs:
            removed = cleanup_stale(base)
        assert set(removed) == {dead_shm, str(dead_sock), str(dead_owner)}
        cleaned = [e for e in logs if e["event"] == "stale_run_cleaned"]
        assert [e["run_id"] for e in cleaned] == [dead_id]
        assert set(cleaned[0]["removed"]) == set(removed)
        assert not os.path.exists(f"/dev/shm{dead_shm}")
        assert not dead_sock.exists() and not dead_owner.exists()
        assert os.path.exists(f"/dev/shm{live_shm}")
        assert live_sock.exists() and live.owner_file.exists()
        assert cleanup_stale(base) == []
    finally:
        for name in (live_shm, dead_shm):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)


def test_cleanup_treats_reused_pid_as_dead(base: Path) -> None:
    record = {
        "pid": os.getppid(),
        "run_id": "0badf00d",
        "started_at": 0.0,
        "create_time": 1.0,
        "shm_names": [],
    }
    owner = base / "owner-0badf00d.json"
    base.mkdir(mode=0o700)
    owner.write_text(json.dumps(record))
    assert cleanup_stale(base) == [str(owner)]


def test_cleanup_leaves_live_foreign_owner(base: Path) -> None:
    base.mkdir(mode=0o700)
    owner = _write_owner(base, "0000cafe", os.getppid(), [])
    assert cleanup_stale(base) == []
    assert owner.exists()


def test_cleanup_missing_base(tmp_path: Path) -> None:
    assert cleanup_stale(tmp_path / "absent") == []
