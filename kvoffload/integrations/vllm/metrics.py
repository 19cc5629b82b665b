"""The integration's counters, reported through vLLM's connector stats (``get_stats``) and so
exported by vLLM's Prometheus endpoint, with the metric definitions vLLM needs for them."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

from kvoffload.integrations.vllm.link import ServiceLink


class Counter(Enum):
    HIT_BLOCKS = "vllm:kvoffload_hit_blocks"
    MISS_BLOCKS = "vllm:kvoffload_miss_blocks"
    LOAD_FAILED_BLOCKS = "vllm:kvoffload_load_failed_blocks"
    STORED_BLOCKS = "vllm:kvoffload_stored_blocks"
    STORES_DROPPED = "vllm:kvoffload_stores_dropped"
    SERVICE_OUTAGES = "vllm:kvoffload_service_outages"


_DOCS = {
    Counter.HIT_BLOCKS: (
        "Offload blocks kvoffload answered as hits, by the tier they came from.",
        ("tier",),
    ),
    Counter.MISS_BLOCKS: (
        "Offload blocks kvoffload answered as misses (including while unreachable).",
        (),
    ),
    Counter.LOAD_FAILED_BLOCKS: ("Offload blocks whose load failed and were recomputed.", ()),
    Counter.STORED_BLOCKS: ("Offload blocks stored into kvoffload.", ()),
    Counter.STORES_DROPPED: ("Offload blocks not stored, by reason.", ("reason",)),
    Counter.SERVICE_OUTAGES: ("Times the kvoffload service stopped answering.", ()),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        name.value: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        for name, (doc, labels) in _DOCS.items()
    }


class StatsAccumulator:
    """Counts since the last ``take`` (vLLM asks once per logging interval)."""

    def __init__(self) -> None:
        self._stats = OffloadingConnectorStats()
        self.totals: dict[tuple[str, tuple[str, ...]], int] = {}

    def add(self, counter: Counter, value: int = 1, *labels: str) -> None:
        if value <= 0:
            return
        self._stats.increase_counter(counter.value, value, tuple(labels))
        key = (counter.value, tuple(labels))
        self.totals[key] = self.totals.get(key, 0) + value

    def take(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, OffloadingConnectorStats()
        return out


CONFIG_INFO_KEYS = (
    "kvoffload_version",
    "endpoint_kind",
    "pool_slots",
    "pool_block_bytes",
    "tiers",
    "offload_block_bytes",
    "blocks_per_chunk",
    "fingerprint",
    "namespace",
    "verify_loads",
    "sync_load_budget_bytes",
)
"""The label names of ``config_info`` (``KVOffloadSpec.config_info_keys``), in order."""


class ConfigInfo:
    """The labels of vLLM's ``vllm:kv_offload_config_info`` (``CONFIG_INFO_KEYS``): the
    engine's settings (``engine_info``), and the pool as the service described it at the first
    connection (``unknown`` when it was unreachable until the first stats). Fixed at the first
    call: vLLM sets the metric once. ``endpoint_setting``: the endpoint the settings name ("":
    discovered)."""

    def __init__(
        self, engine_info: Mapping[str, str | int | float | bool], endpoint_setting: str
    ) -> None:
        self._engine_info = dict(engine_info)
        self._endpoint_setting = endpoint_setting
        self._labels: dict[str, str | int | float | bool] | None = None

    def labels(self, link: ServiceLink) -> list[dict[str, str | int | float | bool]]:
        if self._labels is None:
            info = link.info
            self._labels = {
                **self._engine_info,
                "pool_slots": info.num_slots if info is not None else "unknown",
                "pool_block_bytes": info.block_bytes if info is not None else "unknown",
                "tiers": ",".join(["host", *info.tiers]) if info is not None else "unknown",
                "endpoint_kind": endpoint_kind(link.endpoint, self._endpoint_setting),
            }
        return [dict(self._labels)]


def endpoint_kind(endpoint: str, setting: str) -> str:
    """How the engine reaches the service: ``ipc`` or ``tcp`` (its scheme), ``discovered``
    appended when the settings named none (found through the environment or a local run)."""
    scheme = endpoint.partition("://")[0] if "://" in endpoint else "unknown"
    return scheme if setting else f"{scheme}-discovered"
