"""Counters of the tiering library, per tier (index 0 = primary), for status and metrics."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import msgspec

from kvoffload.tiering.types import CascadeDrop
from kvoffload.wire.status import TierCounters
from kvoffload.wire.vocab import JobKind, LookupResult


class TieringStats:
    """Counters since start. ``tier(0)`` is the primary tier."""

    def __init__(self, tier_names: list[str]) -> None:
        self.names = tier_names
        self._tiers = [TierCounters() for _ in tier_names]
        self.hit_pending_expired = 0
        self.promotion_allocation_failures = 0
        self.store_allocation_failures = 0
        self.stores_refused_dirty = 0
        self.store_backpressure_s = 0.0
        self.promoted_keys = 0
        self.promoted_keys_consumed = 0

    def tier(self, index: int) -> TierCounters:
        return self._tiers[index]

    def tier_lookup(self, index: int, result: LookupResult, count: int = 1) -> None:
        """``count`` lookups of the tier answered ``result``."""
        tier = self._tiers[index]
        if result is LookupResult.HIT:
            tier.lookups_hit += count
        elif result is LookupResult.HIT_PENDING:
            tier.lookups_hit_pending += count
        elif result is LookupResult.RETRY:
            tier.lookups_retry += count
        else:
            tier.lookups_miss += count

    def cascade_dropped(self, index: int, reason: CascadeDrop, keys: int) -> None:
        tier = self._tiers[index]
        if reason is CascadeDrop.EVICTED:
            tier.cascade_dropped_evicted += keys
        elif reason is CascadeDrop.TIER_FULL:
            tier.cascade_dropped_tier_full += keys
        elif reason is CascadeDrop.TENANT_CAP:
            tier.cascade_dropped_tenant_cap += keys
        else:
            tier.cascade_dropped_retry_bound += keys

    def job_submitted(self, index: int, kind: JobKind) -> None:
        tier = self._tiers[index]
        tier.active_jobs += 1
        if kind is JobKind.PROMOTION:
            tier.promotion_jobs += 1
        elif kind is JobKind.CASCADE:
            tier.cascade_jobs += 1
        elif kind is JobKind.DELETE:
            tier.delete_jobs += 1
        else:
            tier.probe_jobs += 1

    def job_finished(
        self, index: int, kind: JobKind, success: bool, ok_keys: int, seconds: float | None
    ) -> None:
        """A job's result. A promotion's keys are counted in ``promoted_keys_ok`` by
        ``Promotions`` as they land, which may be before the result."""
        tier = self._tiers[index]
        tier.active_jobs -= 1
        tier.transfer_time_s += seconds or 0.0
        if kind is JobKind.PROMOTION:
            tier.promotion_jobs_failed += not success
        elif kind is JobKind.CASCADE:
            tier.cascaded_keys_ok += ok_keys
            tier.cascade_jobs_failed += not success
        elif kind is JobKind.DELETE:
            tier.deleted_keys += ok_keys
            tier.delete_jobs_failed += not success
        else:
            tier.probe_jobs_failed += not success

    def record_lookups(self, hits: int, others: Sequence[LookupResult]) -> None:
        """Results of one batched lookup as the engine sees them (primary view)."""
        self._tiers[0].lookups_hit += hits
        if not others:
            return
        for result, count in collections.Counter(others).items():
            self.tier_lookup(0, result, count)

    @property
    def promotion_amplification(self) -> float | None:
        """Keys promoted / promoted keys the engine then loaded (None before any load)."""
        if not self.promoted_keys_consumed:
            return None
        return self.promoted_keys / self.promoted_keys_consumed

    def per_tier(self) -> dict[str, TierCounters]:
        """A copy of each tier's counters, by tier name."""
        return {
            name: msgspec.structs.replace(c)
            for name, c in zip(self.names, self._tiers, strict=True)
        }
