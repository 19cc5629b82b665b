"""The reference engine through a real service (supervisor, manager, cpu, disk or object
workers): KV computed by one engine, offloaded, and reloaded by another from the host pool, from
the disk tier, from the object tier (SeaweedFS) and in another process, must be bit-identical to
what was computed, and generation on top of it must equal generation on the writer's own K/V (bit
for bit) and a full recompute (within tolerance, same greedy tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

import torch  # noqa: E402

from kvoffload.engine import DEMO_MODEL, Engine, Generation, TinyDecoder  # noqa: E402
from kvoffload.testing.helpers import wait_until  # noqa: E402

BT = DEMO_MODEL.block_tokens
PREFIX_BLOCKS = 6
NEW_TOKENS = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    return TinyDecoder(DEMO_MODEL)


@pytest.fixture
def engines(model: TinyDecoder) -> Iterator[Callable[[str, str], Engine]]:
    """Engines connected to a service; closed at teardown and their segments checked gone."""
    opened: list[Engine] = []

    def connect(endpoint: str, name: str) -> Engine:
        engine = Engine.connect(model, endpoint, 32, name)
        opened.append(engine)
        return engine

    yield connect
    names = [e.cache.segment.name for e in opened]
    for engine in opened:
        engine.close()
    assert not [n for n in names if os.path.exists(f"/dev/shm{n}")]


def conversation(seed: int) -> tuple[list[int], list[int]]:
    """A first prompt of 6 full blocks + 5 tokens, and a follow-up that extends it."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(
        0, DEMO_MODEL.vocab_size, (PREFIX_BLOCKS * BT + 5,), generator=gen
    ).tolist()
    extra = torch.randint(0, DEMO_MODEL.vocab_size, (27,), generator=gen).tolist()
    return first, first + extra


def write_prefix(engine: Engine, prompt: list[int]) -> Generation:
    written = engine.generate(prompt, NEW_TOKENS, keep_kv=True)
    assert written.reused_blocks == 0 and written.store_failures == 0
    assert list(written.stored) == engine.keys(prompt)[:PREFIX_BLOCKS]
    return written


def on_own_kv(
    engine: Engine, written: Generation, prompt: list[int]
) -> tuple[list[int], torch.Tensor]:
    """Generate after ``prompt`` on the writer's in-memory K/V of the shared prefix, in the same
    steps (and tensor shapes) as a reader that loaded the prefix."""
    need = -(-(len(prompt) + NEW_TOKENS - 1) // BT)
    extra = engine.cache.allocate(need - PREFIX_BLOCKS)
    table = written.block_table[:PREFIX_BLOCKS] + extra
    try:
        first = engine.prefill(prompt, PREFIX_BLOCKS * BT, table)
        tokens, steps = engine.decode(prompt, int(first.argmax()), table, NEW_TOKENS - 1)
    finally:
        engine.free(extra)
    return [int(first.argmax()), *tokens], torch.stack([first, *steps])


def recompute(model: TinyDecoder, prompt: list[int]) -> Generation:
    with Engine.local(model, 32) as engine:
        return engine.generate(prompt, NEW_TOKENS)


def assert_reader_matches(
    reader: Engine, read: Generation, writer: Engine, written: Generation, model, prompt
) -> None:
    assert read.reused_blocks == PREFIX_BLOCKS
    assert read.computed_tokens == len(prompt) - PREFIX_BLOCKS * BT
    for i in range(PREFIX_BLOCKS):
        assert reader.cache.block_bytes(read.block_table[i]) == writer.cache.block_bytes(
            written.block_table[i]
        ), i
    assert read.loaded == {k: written.stored[k] for k in writer.keys(prompt)[:PREFIX_BLOCKS]}
    own_tokens, own_logits = on_own_kv(writer, written, prompt)
    assert torch.equal(read.logits, own_logits)
    assert read.tokens == own_tokens
    full = recompute(model, prompt)
    torch.testing.assert_close(read.logits, full.logits, atol=ATOL, rtol=0)
    assert read.tokens == full.tokens


def test_prefix_from_the_host_pool(start_service, engines, model) -> None:
    service = start_service(workers=("cpu", "disk"))
    first, follow_up = conversation(seed=1)
    writer = engines(service.endpoint, "writer")
    written = write_prefix(writer, first)
    reader = engines(service.endpoint, "reader")
    read = reader.generate(follow_up, NEW_TOKENS, keep_kv=True)
    assert read.served_by == {"pool": PREFIX_BLOCKS} and read.lookup_rounds == 1
    assert_reader_matches(reader, read, writer, written, model, follow_up)


def test_prefix_from_the_disk_tier_after_reset(start_service, engines, model) -> None:
    service = start_service(workers=("cpu", "disk"))
    first, follow_up = conversation(seed=2)
    writer = engines(service.endpoint, "writer")
    written = write_prefix(writer, first)

    def on_disk() -> bool:
        tiering = service.status().tiering
        return tiering.jobs_in_flight == 0 and tiering.tiers["disk"].indexed_keys >= PREFIX_BLOCKS

    wait_until(on_disk, 20.0, "the cascade to disk")
    writer.client.reset_cache()
    assert service.status().tiering.used_slots == 0
    reader = engines(service.endpoint, "reader")
    read = reader.generate(follow_up, NEW_TOKENS, keep_kv=True)
    assert read.served_by == {"disk": PREFIX_BLOCKS} and read.lookup_rounds > 1
    assert_reader_matches(reader, read, writer, written, model, follow_up)


def test_second_engine_process_reuses_the_first_engines_blocks(
    start_service, engines, model, tmp_path
) -> None:
    service = start_service(workers=("cpu", "disk"))
    first, follow_up = conversation(seed=3)
    writer = engines(service.endpoint, "writer")
    written = write_prefix(writer, first)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([follow_up]))
    out = tmp_path / "out.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffload.engine",
            "--endpoint",
            service.endpoint,
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--threads",
            str(torch.get_num_threads()),
            "--logits",
            "--out",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    [other] = json.loads(out.read_text())
    assert other["reused_blocks"] == PREFIX_BLOCKS and other["served_by"] == {"pool": PREFIX_BLOCKS}
    keys = writer.keys(follow_up)[:PREFIX_BLOCKS]
    assert other["loaded"] == {k.hex(): written.stored[k].hex() for k in keys}
    own_tokens, own_logits = on_own_kv(writer, written, follow_up)
    assert torch.equal(torch.tensor(other["logits"], dtype=torch.float32), own_logits)
    assert other["tokens"] == own_tokens == recompute(model, follow_up).tokens


def test_prefix_from_the_object_tier_after_reset(start_service, engines, model, s3_server) -> None:
    """Disk tier off: after the cascade to S3 and a reset, the prefix is promoted from the object
    tier (a probe first: RETRY, then HIT_PENDING, then HIT)."""
    from tests.workers.object.test_object_worker import object_config  # needs the object extra

    bucket = s3_server.create_bucket(f"kvo-engine-{uuid.uuid4().hex[:12]}")
    service = start_service(
        workers=("cpu", "object"),
        extra_config=object_config(s3_server, bucket, "engine"),
    )
    first, follow_up = conversation(seed=4)
    writer = engines(service.endpoint, "writer")
    written = write_prefix(writer, first)

    def in_s3() -> bool:
        tiering = service.status().tiering
        return (
            tiering.jobs_in_flight == 0
            and tiering.per_tier["object"].cascaded_keys_ok >= PREFIX_BLOCKS
        )

    wait_until(in_s3, 30.0, "the cascade to S3")
    writer.client.reset_cache()
    reader = engines(service.endpoint, "reader")
    read = reader.generate(follow_up, NEW_TOKENS, keep_kv=True)
    assert read.served_by == {"object": PREFIX_BLOCKS} and read.lookup_rounds > 1
    assert_reader_matches(reader, read, writer, written, model, follow_up)
