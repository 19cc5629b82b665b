"""What the real-engine tests share: the model under test (``case``, chosen per module with an
indirect ``case`` parameter), one service and the engines of each module, vLLM without
kvoffload as the reference, and the checks of identical output."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from kvoffload.testing.helpers import wait_until
from kvoffload.testing.service import ServiceHarness, serve_harness
from kvoffload.testing.vllm_engine import (
    BLOCK_TOKENS,
    ModelSpec,
    TinyGemma3,
    TinyLlama,
    VllmEngineProcess,
    kvoffload_transfer,
    make_model,
)


@dataclass
class ModelCase:
    """A model the engine tests run on. ``keys``: the offload keys one prompt stores (and a
    hit of it reads): every full block of each full-attention group, the last ``window``
    blocks of each sliding-window group. ``block_bytes``: the largest group's bytes per key,
    the service's pool block size. ``key_tokens``: tokens per key (vLLM's ``block_size`` for
    the connector when more than one block)."""

    name: str
    spec: ModelSpec
    other: ModelSpec  # same architecture, other weights
    prompt_tokens: int
    keys: int
    block_bytes: int
    tp: int = 1  # tensor-parallel ranks of its engines
    key_tokens: int = BLOCK_TOKENS
    _prompts: random.Random = field(default_factory=lambda: random.Random(20261130))

    @property
    def full_tokens(self) -> int:
        """The prompt's tokens in whole keys: what a hit of it serves."""
        return self.prompt_tokens // self.key_tokens * self.key_tokens

    def new_prompt(self) -> list[int]:
        """A prompt no other test uses (random token ids, ending in a partial block)."""
        return [self._prompts.randrange(3, 1024) for _ in range(self.prompt_tokens)]


_PAGE = 2 * 2 * 64 * 2 * BLOCK_TOKENS  # K and V of 2 heads of 64 in bf16, one 32-token block
SLIDING, FULL = "sliding_attention", "full_attention"

CASES = {
    # one KV cache group: 6 full blocks per prompt
    "llama": ModelCase(
        "llama", TinyLlama(seed=0), TinyLlama(seed=1), 200, 6, TinyLlama().kv_bytes_per_token() * 32
    ),
    # Gemma 3 style: three sliding-window groups (a 64-token window: 2 blocks) and a full one,
    # one layer each; a prompt of several windows stores 9 full blocks and 3 x 2 window blocks
    "gemma3": ModelCase("gemma3", TinyGemma3(seed=0), TinyGemma3(seed=1), 300, 9 + 3 * 2, _PAGE),
    # every layer sliding: one group of 4 layers, of which a prompt stores its last window
    # two tensor-parallel ranks (one core each): each rank writes its half of every pool block
    "llama-tp2": ModelCase(
        "llama-tp2", TinyLlama(seed=0), TinyLlama(seed=1), 200, 6, 2 * 32 * 1024, tp=2
    ),
    # the same model with keys of four blocks (128 tokens) of one group: a prompt stores its
    # 2 full chunks of the full group and, of each sliding group, the chunk of its window
    "gemma3-chunks": ModelCase(
        "gemma3-chunks",
        TinyGemma3(seed=0),
        TinyGemma3(seed=1),
        300,
        2 + 3 * 1,
        4 * _PAGE,
        key_tokens=4 * BLOCK_TOKENS,
    ),
    "gemma3-sliding": ModelCase(
        "gemma3-sliding",
        TinyGemma3(layer_types=(SLIDING,) * 4, seed=0),
        TinyGemma3(layer_types=(SLIDING,) * 4, seed=1),
        300,
        2,
        4 * _PAGE,
    ),
}
assert CASES["gemma3"].spec.layer_types == (SLIDING,) * 3 + (FULL,)


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest) -> ModelCase:
    return CASES[request.param]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, case: ModelCase) -> Path:
    return tmp_path_factory.mktemp(f"vllm-{case.name}")


def stop_all(engines: Iterable[VllmEngineProcess]) -> None:
    """Stop ``engines`` side by side: each is asked to quit before any is waited for."""
    started = list(engines)
    for engine in started:
        engine.request_quit()
    for engine in started:
        engine.stop()


class Models:
    """The models of the session, each written once (``get``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._written: dict[ModelSpec, Path] = {}

    def get(self, spec: ModelSpec) -> Path:
        if spec not in self._written:
            self._written[spec] = make_model(self.root / f"model-{len(self._written)}", spec)
        return self._written[spec]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("vllm-models"))


class PlainEngines:
    """vLLM without kvoffload, one engine per model and tensor-parallel size, started on first
    use and kept for the session: the reference every module compares with."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._started: dict[tuple[Path, int], VllmEngineProcess] = {}

    def get(self, model: Path, tp: int) -> VllmEngineProcess:
        if (model, tp) not in self._started:
            self._started[model, tp] = VllmEngineProcess(
                model,
                self.root / f"engine-plain-{model.name}-tp{tp}.log",
                None,
                tensor_parallel_size=tp,
                engine_core_process=False,
            )
        return self._started[model, tp]

    def stop(self) -> None:
        stop_all(self._started.values())


@pytest.fixture(scope="session")
def plain_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainEngines]:
    started = PlainEngines(tmp_path_factory.mktemp("vllm-plain"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def model(models: Models, case: ModelCase) -> Path:
    return models.get(case.spec)


@pytest.fixture(scope="module")
def service(work: Path, case: ModelCase) -> Iterator[ServiceHarness]:
    home = work / "service"
    home.mkdir()
    svc = serve_harness(home, workers=("cpu", "disk"), num_slots=256, block_bytes=case.block_bytes)
    try:
        yield svc.start()
    finally:
        svc.stop()


class Engines:
    """Engines started on first use and stopped at the end of the module; "plain" (vLLM
    without kvoffload) is the session's engine of the model (``PlainEngines``). Each runs
    vLLM's engine core in the engine's process (``engine_core_process=False``: a third of the
    start time; ``kvoffload serve``'s test runs it apart, as vLLM serves by default), logs at
    DEBUG, where the connector names each synchronous load, and is handed out once its link to
    the service is up. Such an engine binds no thread to a core, so it is given every CPU for
    its layered loads (``layered_load_cpus``), as a deployment's reserved cores would be."""

    def __init__(
        self, work: Path, model: Path, service: ServiceHarness, tp: int, plain: PlainEngines
    ) -> None:
        self.work, self.model, self.service, self.tp = work, model, service, tp
        self._plain = plain
        self._started: dict[str, VllmEngineProcess] = {}

    def get(
        self, name: str, model: Path | None = None, tp: int | None = None, **connector: Any
    ) -> VllmEngineProcess:
        """The engine ``name`` (started on first use with ``model`` or the module's model, ``tp``
        ranks or the module's, and ``connector`` settings; "plain": without kvoffload)."""
        if name == "plain":
            return self._plain.get(model or self.model, tp or self.tp)
        if name not in self._started:
            # A call bound above the default 0.5 s keeps a loaded 2-core CI machine from
            # reading a slow answer as an outage; the outage tests stay bounded by it.
            config = kvoffload_transfer(
                {
                    "endpoint": self.service.endpoint,
                    "call_timeout_s": 1.0,
                    "layered_load_cpus": sorted(os.sched_getaffinity(0)),
                    **connector,
                }
            )
            engine = self._started[name] = VllmEngineProcess(
                model or self.model,
                self.work / f"engine-{name}.log",
                config,
                tensor_parallel_size=tp or self.tp,
                extra_env={"VLLM_LOGGING_LEVEL": "DEBUG"},
                engine_core_process=False,
            )
            # An engine whose first connection attempt ran out of time serves (MISS) while its
            # link retries in the background: the tests' prompts start once it is up.
            wait_until(
                lambda: "kvoffload_connected" in engine.log_path.read_text(errors="replace"),
                timeout_s=60,
                what=f"engine {name}'s link to the service",
            )
        return self._started[name]

    def stop(self) -> None:
        stop_all(self._started.values())


class EngineNode(Protocol):
    """A kvoffload service of its own and its engines (``engine``: the node's own)."""

    @property
    def service(self) -> ServiceHarness: ...

    @property
    def engines(self) -> Engines: ...

    @property
    def engine(self) -> VllmEngineProcess: ...


@contextlib.contextmanager
def running_nodes(nodes: Sequence[EngineNode]) -> Iterator[None]:
    """Start each node's service, then every node's engine and the first node's plain vLLM
    side by side (most of a start is one process on one core); at exit stop the engines, then
    the services, which must leave no segment, runtime file or process behind."""
    started: list[EngineNode] = []
    try:
        for node in nodes:
            node.service.start()
            started.append(node)
        starts = [lambda node=node: node.engine for node in nodes]
        starts.append(lambda: nodes[0].engines.get("plain"))
        with ThreadPoolExecutor(len(starts)) as pool:
            for engine in [pool.submit(start) for start in starts]:
                engine.result()
        yield
    finally:
        for node in nodes:
            node.engines.stop()
        leftovers = [node.service.stop() for node in started]
        assert all(left.clean for left in leftovers), leftovers


@pytest.fixture(scope="module")
def engines(
    work: Path, model: Path, service: ServiceHarness, case: ModelCase, plain_engines: PlainEngines
) -> Iterator[Engines]:
    started = Engines(work, model, service, case.tp, plain_engines)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def reference(engines: Engines) -> Callable[[list[int], int], dict]:
    """vLLM without kvoffload on ``prompt`` with exactly ``cached`` tokens served from its own
    prefix cache (0: a full recompute)."""

    def run(prompt: list[int], cached: int) -> dict:
        plain = engines.get("plain")
        assert plain.reset_prefix_cache()
        if cached:
            plain.generate([prompt[: cached + 1]], max_tokens=1)
        out = plain.generate([prompt])[0]
        assert out["cached"] == cached
        return out

    return run


def connected_manager(endpoint: str, fingerprint: bytes, name: str) -> Any:
    """A scheduler-side ``KVOffloadManager`` connected to the service at ``endpoint`` (calls
    bounded by 5 s), for tests that drive the manager without an engine."""
    from kvoffload.integrations.vllm.link import ServiceLink
    from kvoffload.integrations.vllm.manager import KVOffloadManager

    link = ServiceLink(
        lambda: endpoint, name=name, call_timeout_s=5, connect_timeout_s=5, max_backoff_s=0.1
    )
    assert link.connect_now()
    return KVOffloadManager(link, fingerprint)


def primary_hits(service: ServiceHarness) -> int:
    return service.status().tiering.per_tier["primary"].lookups_hit


def promoted(service: ServiceHarness, tier: str) -> int:
    return service.status().tiering.per_tier[tier].promoted_keys_ok


def promoted_once(service: ServiceHarness, tier: str, count: int) -> int:
    """The keys promoted from ``tier`` once at least ``count``. The count lags a hit: a worker
    tells the engine of each promoted block as it lands, and the engine may load it before the
    manager has taken that job's result."""
    return wait_until(
        lambda: (n := promoted(service, tier)) >= count and n,
        10.0,
        f"{count} keys promoted from {tier}",
    )


def on_disk(service: ServiceHarness) -> int:
    return service.status().tiering.tiers["disk"].indexed_keys


def offload(
    engine: VllmEngineProcess,
    service: ServiceHarness,
    case: ModelCase,
    prompt: list[int],
    cascaded: bool = False,
) -> dict:
    """Run ``prompt`` once so its blocks are stored (and, with ``cascaded``, on disk)."""
    disk_before = on_disk(service)
    out = engine.generate([prompt])[0]
    if cascaded:
        wait_until(
            lambda: on_disk(service) >= disk_before + case.keys, 30.0, "the cascade to disk", 0.1
        )
    return out


def same_output(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == want["logprobs"]
