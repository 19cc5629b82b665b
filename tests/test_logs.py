"""Structured logs: every stderr line is one JSON event with proc, pid, level and timestamp."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import structlog

from kvoffload.logs import configure_logging, get_logger
from kvoffload.testing.helpers import REPO_ROOT


def _stderr_events(code: str) -> tuple[int, list[dict]]:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stderr.splitlines()
    assert lines, "no log output"
    return result.returncode, [json.loads(line) for line in lines]


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    yield
    structlog.reset_defaults()
    root.setLevel(level)
    for handler in [h for h in root.handlers if getattr(h, "_kvoffload_handler", False)]:
        root.removeHandler(handler)


def test_subprocess_events_are_json_lines() -> None:
    code = """
        import logging, os, sys
        from kvoffload.logs import configure_logging, get_logger
        log = get_logger(tier="disk")  # created before configuration on purpose
        configure_logging("worker-disk", level="info")
        log.info("job_done", job_id=7, keys=["a", "b"], bytes=4096, duration_ms=1.5)
        log.debug("too_detailed")
        logging.getLogger("somelib").warning("library says %s", "hi")
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("job_failed", job_id=8)
        if os.fork() == 0:
            log.info("from_child")
            sys.stderr.flush()
            os._exit(0)
        os.wait()
        print(os.getpid())
    """
    returncode, events = _stderr_events(code)
    assert returncode == 0
    by_event = {e["event"]: e for e in events}
    assert set(by_event) == {"job_done", "library says hi", "job_failed", "from_child"}

    done = by_event["job_done"]
    assert done["proc"] == "worker-disk"
    assert done["level"] == "info"
    assert (done["tier"], done["job_id"], done["keys"]) == ("disk", 7, ["a", "b"])
    assert done["bytes"] == 4096
    assert done["duration_ms"] == 1.5
    stamp = datetime.fromisoformat(done["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0

    library = by_event["library says hi"]
    assert library["level"] == "warning"
    assert library["proc"] == "worker-disk"
    assert library["logger"] == "somelib"
    assert "timestamp" in library

    failed = by_event["job_failed"]
    assert failed["level"] == "error"
    assert "ZeroDivisionError" in failed["exception"]

    parent_pid = done["pid"]
    assert all(e["pid"] == parent_pid for e in events if e["event"] != "from_child")
    assert by_event["from_child"]["pid"] != parent_pid


def test_level_filter_and_contextvars() -> None:
    out = io.StringIO()
    configure_logging("manager", level="warning", stream=out)
    log = get_logger()
    structlog.contextvars.bind_contextvars(req_id="r1")
    try:
        log.info("hidden")
        log.warning("shown", error="boom")
    finally:
        structlog.contextvars.clear_contextvars()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert (event["event"], event["req_id"], event["error"]) == ("shown", "r1", "boom")
    assert (event["proc"], event["level"]) == ("manager", "warning")


def test_reconfigure_replaces_stdlib_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("a", stream=first)
    configure_logging("b", stream=second)
    logging.getLogger("lib").error("once")
    assert first.getvalue() == ""
    assert [json.loads(line)["proc"] for line in second.getvalue().splitlines()] == ["b"]


def test_a_logger_in_use_follows_every_new_configuration() -> None:
    """A module logger resolves its configuration once and keeps it, until the configuration
    changes: a new ``configure_logging`` (level, stream, name) or a test's ``capture_logs``."""
    first, second = io.StringIO(), io.StringIO()
    log = get_logger(tier="disk")
    configure_logging("a", level="info", stream=first)
    log.info("one")
    log.debug("hidden")
    configure_logging("b", level="debug", stream=second)
    log.debug("two")
    with structlog.testing.capture_logs() as captured:
        log.info("three")
    log.info("four")
    assert [json.loads(line)["event"] for line in first.getvalue().splitlines()] == ["one"]
    events = [json.loads(line) for line in second.getvalue().splitlines()]
    assert [(e["event"], e["proc"], e["tier"]) for e in events] == [
        ("two", "b", "disk"),
        ("four", "b", "disk"),
    ]
    assert [e["event"] for e in captured] == ["three"]


def test_unknown_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="loud"):
        configure_logging("x", level="loud")


def test_library_use_logs_nothing_until_asked(tmp_path: Path) -> None:
    """An engine that imports the client, creates a KV cache, fails to connect and triggers a
    library warning prints nothing; once it configures ``logging``, those events reach it."""
    code = f"""
        import logging, os, sys
        from kvoffload.client import KVOffloadClient, ServiceUnavailable
        from kvoffload.memory.kvcache import SharedKVCache
        from kvoffload.tiering.types import parse_tier_filter

        def use_the_library():
            cache = SharedKVCache.create(f"/kvoffload-logtest-{{os.getpid()}}", 4, [4096])
            cache.close()
            cache.unlink()
            parse_tier_filter("not a list")
            try:
                KVOffloadClient("ipc://{tmp_path}/nobody.sock", timeout_s=0.2)
            except ServiceUnavailable:
                pass
            else:
                raise SystemExit("connected to nobody")

        use_the_library()
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, b"--configured--\\n")
        logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="%(name)s %(message)s")
        use_the_library()
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    silent, configured = result.stderr.split("--configured--\n")
    assert silent == ""
    events = {}
    for line in configured.splitlines():
        name, message = line.split(" ", 1)
        assert name == "kvoffload"
        event = json.loads(message)
        events[event["event"]] = event
    assert set(events) == {"kv_cache_created", "tier_filter_not_a_list"}
    assert events["kv_cache_created"]["blocks"] == 4
