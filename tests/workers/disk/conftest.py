"""Fixtures of the disk tier's tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from kvoffload.memory.pool import HostPool


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> Iterator[HostPool]:
    """A fresh host pool of the test module's ``SLOTS`` x ``BLOCK``; unlinked at teardown."""
    name = f"/kvoffload-test-{uuid.uuid4().hex[:12]}"
    host_pool = HostPool.create(name, request.module.SLOTS, request.module.BLOCK)
    try:
        yield host_pool
    finally:
        host_pool.close()
        host_pool.unlink()
    assert not os.path.exists(f"/dev/shm{name}")
