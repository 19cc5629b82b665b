"""Keys of several vLLM blocks (vLLM's ``block_size`` in ``kv_connector_extra_config``) for a
model with several KV cache groups (Gemma 3 style) in real vLLM engines: a key carries four
blocks of one group, a prompt stores its full chunks and the chunk of each window, and a hit
from the pool or the disk serves the whole chunked prefix with output identical to vLLM
without kvoffload."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.conftest import (  # noqa: E402
    offload,
    on_disk,
    primary_hits,
    promoted,
    promoted_once,
    same_output,
)

pytestmark = pytest.mark.parametrize("case", ["gemma3-chunks"], indirect=True, scope="module")


def test_a_hit_of_chunked_keys_serves_whole_chunks_from_the_pool(engines, service, reference, case):
    engine = engines.get("a", block_size=case.key_tokens)
    prompt = case.new_prompt()
    disk_before = on_disk(service)
    offload(engine, service, case, prompt, cascaded=True)
    assert on_disk(service) - disk_before == case.keys
    hits_before = primary_hits(service)

    assert engine.reset_prefix_cache()
    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert primary_hits(service) - hits_before == case.keys
    same_output(out, reference(prompt, case.full_tokens))


def test_chunked_keys_come_back_from_disk(engines, service, reference, case):
    engine = engines.get("a", block_size=case.key_tokens)
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
