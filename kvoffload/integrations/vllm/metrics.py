"""The integration's counters, reported through vLLM's connector stats (``get_stats``) and so
exported by vLLM's Prometheus endpoint, with the metric definitions vLLM needs for them."""

from __future__ import annotations

from enum import Enum

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata


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
