"""A loaded key's pin at the service, with a real service: ``complete_load`` (called while vLLM
turns a step's output into tokens) only queues the release; the next step's calls, the
request's finish or the shutdown send it, and the engine keeps stepping until one has."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)

from kvoffload.integrations.vllm.keys import namespaced  # noqa: E402
from kvoffload.integrations.vllm.manager import KVOffloadManager  # noqa: E402
from tests.integrations.vllm.conftest import connected_manager  # noqa: E402

FINGERPRINT = b"R" * 16
KEYS = [OffloadKey(bytes([i]) * 32 + bytes(4)) for i in range(1, 4)]


def pinned_slots(service) -> int:
    with service.client("observer") as observer:
        return observer.status().tiering.pinned_slots


def wait_for_pins(service, expected: int) -> int:
    """The service's pinned slots once they are ``expected`` (the release is not awaited by
    its sender), or what they are after 5 s."""
    deadline = time.monotonic() + 5
    while (pins := pinned_slots(service)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return pins


@pytest.fixture
def loaded(start_service):
    """A service holding ``KEYS``, and an engine's manager that looked them up (pinned),
    loaded and completed them for request ``r``."""
    service = start_service()
    with service.client("writer") as writer:
        nkeys = [namespaced(FINGERPRINT, key) for key in KEYS]
        writer.new_request("w")
        slots = writer.prepare_store("w", nkeys)
        writer.complete_store("w", slots.keys)
    manager: KVOffloadManager = connected_manager(service.endpoint, FINGERPRINT, "releases")
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    manager.ask_now(ctx, KEYS)
    assert [manager.lookup(key, ctx) for key in KEYS] == [LookupResult.HIT] * len(KEYS)
    manager.prepare_load(KEYS, ctx)
    assert pinned_slots(service) == len(KEYS)
    manager.complete_load(KEYS, ctx)
    try:
        yield service, manager, ctx
    finally:
        manager.shutdown()


def test_a_completed_load_is_released_with_the_next_step(loaded):
    service, manager, _ = loaded
    assert manager.has_pending_work()  # the engine steps again to send the release
    assert pinned_slots(service) == len(KEYS)  # not sent while the step's output is made

    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    assert not manager.has_pending_work()
    assert wait_for_pins(service, 0) == 0


def test_a_completed_load_is_released_before_its_request_finishes(loaded):
    service, manager, ctx = loaded
    manager.on_request_finished(ctx)
    assert not manager.has_pending_work()
    assert wait_for_pins(service, 0) == 0


def test_a_completed_load_is_released_at_shutdown(loaded):
    service, manager, _ = loaded
    manager.shutdown()
    assert wait_for_pins(service, 0) == 0
