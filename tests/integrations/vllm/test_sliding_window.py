"""A model whose every layer is sliding-window attention (one KV cache group, Mistral style)
through kvoffload in real vLLM engines: a prompt several windows long stores only its last
window, and a hit of it serves the whole full-block prefix, from the pool, from another engine
and from disk, with output identical to vLLM without kvoffload."""

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

pytestmark = pytest.mark.parametrize("case", ["gemma3-sliding"], indirect=True, scope="module")


def test_a_prompt_of_several_windows_hits_its_whole_prefix_from_its_last_window(
    engines, service, reference, case
):
    engine = engines.get("a")
    prompt = case.new_prompt()
    disk_before = on_disk(service)
    offload(engine, service, case, prompt, cascaded=True)
    assert on_disk(service) - disk_before == case.keys  # the window, not the prompt's history
    hits_before = primary_hits(service)

    assert engine.reset_prefix_cache()
    out = engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens  # 288 tokens from a 64-token window
    assert primary_hits(service) - hits_before == case.keys
    same_output(out, reference(prompt, case.full_tokens))


def test_another_engine_and_the_disk_serve_the_window(engines, service, reference, case):
    prompt = case.new_prompt()
    offload(engines.get("a"), service, case, prompt, cascaded=True)
    with service.client("reset") as client:
        client.reset_cache()  # the pool is emptied: the window comes back from disk
    promoted_before = promoted(service, "disk")

    out = engines.get("b").generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    assert promoted_once(service, "disk", promoted_before + case.keys) == (
        promoted_before + case.keys
    )
    same_output(out, reference(prompt, case.full_tokens))
