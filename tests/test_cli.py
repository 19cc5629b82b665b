"""The ``kvoffload`` command and closed output pipes: every command exits quietly (no traceback)
when the reader of its output goes away, as Unix tools do; ``kvoffload serve`` keeps serving
when the reader of its logs goes away."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvoffload.cli import EXIT_PIPE_CLOSED
from kvoffload.client import KVOffloadClient
from kvoffload.runtime.rundir import cleanup_stale, live_runs
from kvoffload.testing.service import TEST_DEFAULTS, merge_sections, shm_names_containing, to_toml


def closed_pipe() -> int:
    """The write end of a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def kvoffload(*args: str, stdout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def test_commands_exit_quietly_when_their_output_pipe_closes(start_service) -> None:
    service = start_service()
    out = closed_pipe()
    try:
        for args in (("status",), ("status", "--json")):
            done = kvoffload(*args, "--endpoint", service.endpoint, stdout=out)
            assert (done.returncode, done.stderr) == (EXIT_PIPE_CLOSED, ""), (args, done.stderr)
        for args in (("--help",), ("bench", "--help"), ("soak", "--help")):
            done = kvoffload(*args, stdout=out)
            assert (done.returncode, done.stderr) == (0, ""), (args, done.stderr)
    finally:
        os.close(out)


def test_serve_keeps_serving_when_its_log_pipe_closes(tmp_path: Path) -> None:
    runtime_dir = Path(tempfile.mkdtemp(prefix="kvpipe-"))
    config = tmp_path / "kvoffload.toml"
    config.write_text(
        to_toml(merge_sections(TEST_DEFAULTS, {"service": {"runtime_dir": str(runtime_dir)}}))
    )
    logs = closed_pipe()
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "serve", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=logs,
        stderr=logs,
    )
    os.close(logs)
    run_id = ""
    try:
        deadline = time.monotonic() + 60
        while not (runs := [r for r in live_runs(runtime_dir) if r.pid == serve.pid]):
            assert serve.poll() is None, f"kvoffload serve exited with {serve.returncode}"
            assert time.monotonic() < deadline, "kvoffload serve did not start"
            time.sleep(0.05)
        run_id = runs[0].run_id
        endpoint = f"ipc://{runtime_dir / (run_id + '-client.sock')}"
        while True:
            try:
                with KVOffloadClient(endpoint, timeout_s=2.0) as client:
                    status = client.status()
                if "cpu" in status.workers:
                    break
            except TimeoutError:
                pass
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.1)
        time.sleep(1.0)  # heartbeats and log lines keep going to the closed pipe
        with KVOffloadClient(endpoint, timeout_s=5.0) as client:
            status = client.status()
        assert status.workers["cpu"].incarnation == 1 and status.worker_restarts_seen == 0
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        assert shm_names_containing(run_id) == []
        assert [p.name for p in runtime_dir.iterdir() if run_id in p.name] == []
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        cleanup_stale(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)
