"""Prefix lookups: a request's keys evaluated in order across the tiers, up to the first MISS.

A key ready in the primary tier is a HIT; one being written there is HIT_PENDING until the
request's deadline for it (``deadlines``). A key only a secondary tier holds starts a promotion
(HIT_PENDING) unless an earlier key is still uncertain (RETRY), in which case it answers RETRY
and nothing is promoted past that point. Each non-hit carries its ``MissReason``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from kvoffload.tiering.deadlines import PendingDeadlines
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import Key, PrefixResult, RequestState
from kvoffload.wire.vocab import LookupResult, MissReason

HIT, HIT_PENDING, RETRY, MISS = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)

StartPromotion = Callable[[int, RequestState, Key, Collection[Key]], bool]
"""(tier index, request, key, keys not to evict) -> whether a promotion of the key started."""


class Visibility(Protocol):
    """Which blocks a request of a tenant may read, while ``active`` (``tenants.owners``)."""

    active: bool

    def owned_prefix(self, tid: str, keys: Sequence[Key], n: int) -> int: ...

    def visible_in_pool(self, tid: str, key: Key) -> bool: ...

    def visible_on_tier(self, tier_idx: int, tid: str, key: Key) -> bool: ...

    def note_probe(self, key: Key, tid: str) -> None: ...


class _Everyone:
    """Every request reads every block."""

    active = False

    def owned_prefix(self, tid: str, keys: Sequence[Key], n: int) -> int:
        return n

    def visible_in_pool(self, tid: str, key: Key) -> bool:
        return True

    def visible_on_tier(self, tier_idx: int, tid: str, key: Key) -> bool:
        return True

    def note_probe(self, key: Key, tid: str) -> None:
        return None


EVERYONE: Visibility = _Everyone()


class PrefixLookup:
    def __init__(
        self,
        primary: PrimaryIndex,
        tiers: Sequence[SecondaryTier],
        stats: TieringStats,
        deadlines: PendingDeadlines,
        start_promotion: StartPromotion,
        visibility: Visibility = EVERYONE,
    ) -> None:
        """``visibility``: which blocks a request may read (tenants, ``tenants.owners``), while
        it is ``active``."""
        self.primary = primary
        self.tiers = tiers
        self.stats = stats
        self.deadlines = deadlines
        self._start_promotion = start_promotion
        self._visibility = visibility

    def evaluate(self, state: RequestState, keys: Sequence[Key]) -> PrefixResult:
        """The request's results for ``keys``, in order, up to and including the first MISS."""
        leading_hits = self.primary.ready_run(keys)
        visibility = self._visibility
        owners_apply = visibility.active  # read once: the loop below is the lookup's hot path
        if owners_apply and leading_hits:
            leading_hits = visibility.owned_prefix(state.ctx.tenant, keys, leading_hits)
        results = [HIT] * leading_hits
        reasons = [MissReason.NONE] * leading_hits
        uncertain = False
        protected = set(keys) if leading_hits < len(keys) else ()
        primary_lookup = self.primary.lookup
        none = MissReason.NONE
        not_hit_results: list[LookupResult] = []
        for key in keys[leading_hits:]:
            result = primary_lookup(key)
            if (
                owners_apply
                and result is not MISS
                and not visibility.visible_in_pool(state.ctx.tenant, key)
            ):
                results.append(MISS)  # another tenant's block
                reasons.append(MissReason.ABSENT)
                not_hit_results.append(MISS)
                break
            if result is HIT:
                results.append(HIT)
                reasons.append(none)
                continue
            if result is HIT_PENDING:
                result, reason = self.deadlines.check(state, key)
            else:
                result, reason = self._secondary(state, key, uncertain, protected)
            results.append(result)
            reasons.append(reason)
            not_hit_results.append(result)
            if result is MISS:
                break
            if result is RETRY:
                uncertain = True
        self.stats.record_lookups(len(results) - len(not_hit_results), not_hit_results)
        hit_prefix = leading_hits
        for result in results[leading_hits:]:
            if result is not HIT and result is not HIT_PENDING:
                break
            hit_prefix += 1
        return PrefixResult(results, reasons, hit_prefix, leading_hits)

    def _secondary(
        self, state: RequestState, key: Key, uncertain: bool, protected: Collection[Key]
    ) -> tuple[LookupResult, MissReason]:
        """A key absent from the primary tier, as the secondary tiers the request may read
        answer for it."""
        req_id = state.ctx.req_id
        tier_filter = state.ctx.tier_filter
        saw_retry = filtered = False
        reason = MissReason.ABSENT
        for i, tier in enumerate(self.tiers):
            if not tier_filter.allows(tier.spec.medium, tier.spec.locality):
                filtered = True
                continue
            result, tier_reason = tier.lookup(key, req_id)
            visibility = self._visibility
            if visibility.active:
                if result is HIT and not visibility.visible_on_tier(i, state.ctx.tenant, key):
                    result, tier_reason = MISS, MissReason.ABSENT  # another tenant's block
                elif result is RETRY and state.ctx.tenant and not tier.spec.indexed:
                    visibility.note_probe(key, state.ctx.tenant)
            self.stats.tier_lookup(i + 1, result)
            if result is HIT:
                if uncertain:
                    return RETRY, MissReason.AWAITING_PREFIX
                if key in state.pending_deadlines:
                    pending = self.deadlines.check(state, key)
                    if pending[0] is MISS:
                        return pending
                if self._start_promotion(i, state, key, protected):
                    return HIT_PENDING, MissReason.NONE
                return MISS, MissReason.PRIMARY_FULL
            if result is RETRY:
                saw_retry = True
            elif tier_reason is MissReason.FAILED_LOAD or tier_reason is MissReason.PROBE_FAILED:
                reason = tier_reason
        if saw_retry:
            return RETRY, MissReason.PROBING
        if reason is MissReason.ABSENT:
            if key in self.primary.recently_evicted:
                reason = MissReason.EVICTED
            elif filtered:
                reason = MissReason.FILTERED
        return MISS, reason
