"""Start failures a restart cannot fix (a lock held, a layout error, a missing program) stop the
service with their reason after a small bound, as one structured event; crashes keep their
backoff restarts."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvoffload.config import load_config
from kvoffload.runtime.supervisor import FATAL_START_BOUND, Child, Supervisor

FAST_BACKOFF = {
    "KVOFFLOAD_SUPERVISOR__RESTART_BACKOFF_INITIAL_S": "0.02",
    "KVOFFLOAD_SUPERVISOR__RESTART_BACKOFF_MAX_S": "0.05",
}
FATAL = (
    "import os, sys; "
    "open(os.environ['KVOFFLOAD_FATAL_REASON_FILE'], 'w').write('disk.root = \"/x\": locked; fix it'); "
    "sys.exit(3)"
)


def supervisor_with(tmp_path: Path, code: str) -> tuple[Supervisor, Child]:
    sup = Supervisor(load_config(None, env=FAST_BACKOFF))
    child = Child("disk", [sys.executable, "-c", code], True)
    child.reason_file = tmp_path / "disk-fatal"
    sup.children[child.name] = child
    assert sup._spawn(child)
    return sup, child


def watch(sup: Supervisor, until, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "timed out"
        sup.watch_once()
        time.sleep(0.01)


def stop_events(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "service_stopped_start_failure"]


def test_a_fatal_start_failure_stops_the_service_after_the_bound(tmp_path) -> None:
    sup, child = supervisor_with(tmp_path, FATAL)
    with capture_logs() as logs:
        watch(sup, lambda: sup.failure is not None)
        for _ in range(20):  # nothing more happens once it gave up
            sup.watch_once()
    assert sup.failure is not None and sup._stop_requested
    assert (sup.failure.child, sup.failure.attempts) == ("disk", FATAL_START_BOUND)
    assert sup.failure.reason == 'disk.root = "/x": locked; fix it'
    assert str(sup.failure).startswith("the disk worker cannot start (3 attempts): disk.root")
    assert child.restarts == FATAL_START_BOUND - 1
    [event] = stop_events(logs)
    assert event["reason"] == sup.failure.reason and event["child"] == "disk"
    assert len([e for e in logs if e["event"] == "child_cannot_start"]) == FATAL_START_BOUND


def test_crashes_keep_their_backoff_restarts(tmp_path) -> None:
    sup, child = supervisor_with(tmp_path, "import sys; sys.exit(1)")
    with capture_logs() as logs:
        watch(sup, lambda: child.restarts >= 2 * FATAL_START_BOUND)
    assert sup.failure is None and not sup._stop_requested
    assert stop_events(logs) == []
    if child.proc is not None:
        child.proc.wait()


def test_a_program_that_cannot_be_run_stops_the_service(tmp_path) -> None:
    sup, child = supervisor_with(tmp_path, "import sys; sys.exit(1)")
    child.argv = [str(tmp_path / "gone" / "python"), "-c", "pass"]  # e.g. its virtualenv removed
    with capture_logs() as logs:
        watch(sup, lambda: sup.failure is not None)
    assert sup.failure is not None
    assert sup.failure.reason == f"cannot run {child.argv[0]}: No such file or directory"
    assert len(stop_events(logs)) == 1


def test_a_disk_root_taken_while_running_stops_the_service_with_the_reason(
    start_service,
) -> None:
    """The disk worker dies and another store takes its directory before the restart: the
    restarts fail alike, and after FATAL_START_BOUND of them the service stops (exit code 2)
    with the reason as its last line, instead of restarting the worker forever."""
    service = start_service(workers=("cpu", "disk"))
    [lock] = Path(service.cfg.disk.root).glob("*/lock")
    fd = os.open(lock, os.O_RDWR)
    try:
        assert service.signal_child(service.worker_pid("disk"), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed worker kept its lock"
                time.sleep(0.001)
        assert service.serve is not None
        try:
            code = service.serve.wait(60)
        except Exception:  # noqa: BLE001 - any failure to exit is the finding
            pytest.fail("kvoffload serve kept restarting the disk worker")
    finally:
        os.close(fd)
    assert code == 2
    lines = service.log_path.read_text().strip().splitlines()
    assert lines[-1].startswith(
        "kvoffload: stopped: the disk worker cannot start (3 attempts): "
    ), lines[-1]
    assert f"is open in another DiskStore (pid {os.getpid()})" in lines[-1]
    assert "give this service another disk.root" in lines[-1]
    events = service.log_events()
    [stop] = [e for e in events if e["event"] == "service_stopped_start_failure"]
    assert stop["child"] == "disk" and stop["attempts"] == FATAL_START_BOUND
    assert "Traceback" not in service.log_path.read_text()
