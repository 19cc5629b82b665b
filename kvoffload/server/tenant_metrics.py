"""Prometheus families of the tenants (``TieringStatus.tenants``), labelled by tenant id (a
digest of the tenant's name, never the name; ``none`` for requests without a tenant)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "kvoffload_"


def tenant_families(tenants: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """Lookups by result per tenant; blocks, bytes, share, evictions and refusals per tenant
    and tier."""
    lookups = CounterMetricFamily(
        PREFIX + "tenant_lookup_keys",
        "Keys looked up by the tenant, by result.",
        labels=["tenant", "result"],
    )
    requests = GaugeMetricFamily(
        PREFIX + "tenant_requests", "Open requests of the tenant.", labels=["tenant"]
    )

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, labels=["tenant", "tier"])

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + name, doc, labels=["tenant", "tier"])

    blocks = gauge("tenant_blocks", "Blocks the tenant holds on the tier.")
    held_bytes = gauge("tenant_bytes", "Bytes the tenant's blocks take on the tier.")
    share = gauge("tenant_share_blocks", "Blocks of the tier no other tenant's traffic takes.")
    evictions = counter("tenant_evictions", "The tenant's blocks evicted from the tier.")
    by_others = counter(
        "tenant_evicted_by_others", "The tenant's blocks evicted for another tenant's traffic."
    )
    refused = counter(
        "tenant_refused_blocks", "The tenant's blocks refused at its cap on the tier."
    )
    for tid, tenant in tenants.items():
        for result in ("hit", "hit_pending", "miss"):
            lookups.add_metric([tid, result], tenant[f"lookups_{result}"])
        requests.add_metric([tid], tenant["requests"])
        for tier, c in tenant["tiers"].items():
            blocks.add_metric([tid, tier], c["blocks"])
            held_bytes.add_metric([tid, tier], c["bytes"])
            share.add_metric([tid, tier], c["share_blocks"])
            evictions.add_metric([tid, tier], c["evictions"])
            by_others.add_metric([tid, tier], c["evicted_by_others"])
            refused.add_metric([tid, tier], c["refused"])
    yield from (lookups, requests, blocks, held_bytes, share, evictions, by_others, refused)
