"""The ledger's gauges and counters as one plain dict, for status and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.tiering.ledger import TieringLedger


def ledger_snapshot(ledger: TieringLedger) -> dict[str, Any]:
    """What ``ManagerStatus.tiering`` reports (``kvoffload.wire.status.TieringStatus``)."""
    return {
        **ledger.primary.gauges(),
        "unverified_slots": len(ledger.adoption),
        "unread_promotion_pins": ledger.promotions.unread_total,
        "jobs_in_flight": len(ledger.jobs),
        "cascade_backlog": ledger.cascade_backlog(),
        "requests": ledger.open_requests(),
        "tiers": {
            t.name: {
                **t.gauges(),
                "cascade_backlog": len(cascades.backlog),
                "dirty_keys": len(cascades.dirty),
                "cascade_inflight_keys": cascades.inflight_keys,
            }
            for t, cascades in zip(ledger.tiers, ledger.cascades.per_tier, strict=True)
        },
        **ledger.stats.as_dict(),
        "tenants": ledger.tenancy.snapshot(),
    }
