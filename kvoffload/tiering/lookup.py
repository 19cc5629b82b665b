"""Prefix lookups: a request's keys evaluated in order across the tiers, up to the first MISS.

A key ready in the primary tier is a HIT; one being written there is HIT_PENDING until the
request's deadline for it (``deadlines``). A key only a secondary tier holds starts a promotion
(HIT_PENDING) unless an earlier key is still uncertain (RETRY), in which case it answers RETRY
and nothing is promoted past that point. Each non-hit carries its ``MissReason``.

The promotions of consecutive keys that indexed tiers hold are started together, with one
allocation of slots (``StartPromotions``), before the lookup looks at anything it cannot
answer without side effects (a probed tier, another request's pending write): the results
are those of starting each key's promotion in turn, up to the first that found no slot.
"""

from __future__ import annotations

import collections
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

StartPromotions = Callable[[RequestState, Sequence[tuple[int, Key]], Collection[Key]], int]
"""(request, (tier index, key) of each promotion in order, keys not to evict) -> how many
started: all, or those before the first that found no slot."""

_Wanted = tuple[int, Key, int, int]
"""A promotion not started yet: (tier index, key, its position in the results, how many
allowed tiers the lookup asked before that tier)."""


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
        start_promotions: StartPromotions,
        visibility: Visibility = EVERYONE,
    ) -> None:
        """``visibility``: which blocks a request may read (tenants, ``tenants.owners``), while
        it is ``active``."""
        self.primary = primary
        self.tiers = tiers
        self.stats = stats
        self.deadlines = deadlines
        self._start_promotions = start_promotions
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
        allowed = (
            self._allowed_tiers(state) if leading_hits < len(keys) and not owners_apply else []
        )
        wanted: list[_Wanted] = []
        wanted_keys: set[Key] = set()
        for key in keys[leading_hits:]:
            result = primary_lookup(key)
            if (
                owners_apply
                and result is not MISS
                and not visibility.visible_in_pool(state.ctx.tenant, key)
            ):
                results.append(MISS)  # another tenant's block
                reasons.append(MissReason.ABSENT)
                break
            if result is HIT:
                results.append(HIT)
                reasons.append(none)
                continue
            if result is MISS and allowed and not uncertain and key not in wanted_keys:
                held = self._indexed_holder(state, key, allowed)
                if held is not None:
                    wanted.append((allowed[held], key, len(results), held))
                    wanted_keys.add(key)
                    results.append(HIT_PENDING)
                    reasons.append(none)
                    continue
            if wanted:
                if not self._start_wanted(state, wanted, allowed, protected, results, reasons):
                    break
                wanted = []
                result = primary_lookup(key)  # a key asked twice is being promoted now
            if result is HIT_PENDING:
                result, reason = self.deadlines.check(state, key)
            else:
                result, reason = self._secondary(state, key, uncertain, protected)
            results.append(result)
            reasons.append(reason)
            if result is MISS:
                break
            if result is RETRY:
                uncertain = True
        else:
            if wanted:
                self._start_wanted(state, wanted, allowed, protected, results, reasons)
        not_hit_results = [r for r in results[leading_hits:] if r is not HIT]
        self.stats.record_lookups(len(results) - len(not_hit_results), not_hit_results)
        hit_prefix = leading_hits
        for result in results[leading_hits:]:
            if result is not HIT and result is not HIT_PENDING:
                break
            hit_prefix += 1
        return PrefixResult(results, reasons, hit_prefix, leading_hits)

    def _allowed_tiers(self, state: RequestState) -> list[int]:
        """Indexes of the secondary tiers the request's filter lets it read, in order."""
        tier_filter = state.ctx.tier_filter
        return [
            i
            for i, tier in enumerate(self.tiers)
            if tier_filter.allows(tier.spec.medium, tier.spec.locality)
        ]

    def _indexed_holder(self, state: RequestState, key: Key, allowed: list[int]) -> int | None:
        """The position in ``allowed`` of the tier that would promote ``key`` (absent from the
        pool), when indexed tiers tell it without side effects: the first allowed tier holding
        it, every one before it indexed and without it. None when only ``_secondary`` can
        tell (a probed tier on the way, a failed load, a deadline of the request's)."""
        if key in state.pending_deadlines:
            return None
        req_id = state.ctx.req_id
        tiers = self.tiers
        for position, tier_idx in enumerate(allowed):
            held = tiers[tier_idx].holds(key, req_id)
            if held is None:
                return None
            if held:
                return position
        return None

    def _start_wanted(
        self,
        state: RequestState,
        wanted: list[_Wanted],
        allowed: list[int],
        protected: Collection[Key],
        results: list[LookupResult],
        reasons: list[MissReason],
    ) -> bool:
        """Start the promotions ``wanted`` (answered HIT_PENDING so far) and count the tier
        lookups that found them. False when one found no slot: its answer becomes MISS
        (PRIMARY_FULL) and the answers after it are dropped, as if the lookup had stopped
        there."""
        started = self._start_promotions(state, [(t, k) for t, k, _, _ in wanted], protected)
        found = collections.Counter(held for _, _, _, held in wanted[: started + 1])
        for held, count in found.items():
            for tier_idx in allowed[:held]:
                self.stats.tier_lookup(tier_idx + 1, MISS, count)
            self.stats.tier_lookup(allowed[held] + 1, HIT, count)
        if started == len(wanted):
            return True
        at = wanted[started][2]
        del results[at + 1 :], reasons[at + 1 :]
        results[at], reasons[at] = MISS, MissReason.PRIMARY_FULL
        return False

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
                if self._start_promotions(state, [(i, key)], protected):
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
