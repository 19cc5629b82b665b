"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from kvoffload.testing.helpers import skip_without_extra
from kvoffload.testing.s3server import S3Server
from kvoffload.testing.service import ServiceHarness, serve_harness, services


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[Callable[..., ServiceHarness]]:
    """``start(**serve_harness options)`` -> a started ``kvoffload serve``; each is stopped at
    the end and must leave no segment, runtime file or process behind."""
    with services(tmp_path, serve_harness) as start:
        yield start


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real SeaweedFS S3 server for the whole run (endpoint, access_key, secret_key, region,
    create_bucket(name), client(), stop()/start(), pause()/resume()).

    A test that stops or pauses it brings it back before returning. Stopped at the end of the
    run; its pid is verified gone. Skipped without the object extra."""
    skip_without_extra("object")
    server = S3Server(tmp_path_factory.mktemp("s3server"))
    server.start()
    yield server
    pid = server.pid
    server.stop()
    assert pid is None or not psutil.pid_exists(pid), f"weed pid {pid} still running"
