"""Whose blocks are where: the owner of each tenant's block on each tier, each tenant's limits
and counts, and what a request of a tenant may see.

A request names its tenant (``ReqContext.tenant``, an id, ``NO_TENANT`` for none). Every block a
request stores or promotes is its tenant's; a tenant sees only its own blocks (a block of
another tenant is a miss; a block without a tenant, e.g. one a restarted manager found on disk,
goes to the first tenant that looks it up). ``TenantOwners`` hears of every block the pool and
the secondary tiers gain and lose (it is the pool's ``PoolListener`` and each tier's
``IndexListener``) once tenants are active, and does nothing before.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvoffload.logs import get_logger
from kvoffload.tiering.secondary import SecondaryTier, TierSpec
from kvoffload.tiering.tenants.policy import (
    DOOMED,
    NO_LIMITS,
    PRIMARY,
    TenantLimits,
    TenantPolicy,
)
from kvoffload.tiering.types import Key
from kvoffload.wire.status import TenantStatus, TenantTierStatus
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import JobKind, LookupResult

log = get_logger()

REFUSAL_LOG_INTERVAL_S = 1.0
PROBED_KEYS_KEPT = 1 << 16


@dataclass(slots=True)
class TenantTierCounts:
    """One tenant on one tier: blocks evicted (``evicted_by_others``: for another tenant's
    traffic) and blocks refused at its cap (stores on the primary tier, cascades on the
    others)."""

    evictions: int = 0
    evicted_by_others: int = 0
    refused: int = 0


@dataclass(slots=True)
class TenantCounts:
    lookups_hit: int = 0
    lookups_hit_pending: int = 0
    lookups_miss: int = 0
    requests: int = 0
    tiers: dict[str, TenantTierCounts] = field(default_factory=dict)

    def tier(self, name: str) -> TenantTierCounts:
        counts = self.tiers.get(name)
        if counts is None:
            counts = self.tiers[name] = TenantTierCounts()
        return counts


class TierOwners:
    """Who owns the blocks of one tier: the owner of each tenant's block (a key not listed has
    none), blocks per tenant, the blocks without a tenant, and, with ``ordered``, each owner's
    keys from least to most recent (the keys without a tenant under ``NO_TENANT``)."""

    def __init__(self, name: str, ordered: bool) -> None:
        self.name = name
        self.owner: dict[Key, str] = {}
        self.used: Counter[str] = Counter()
        self.untenanted = 0
        self.order: dict[str, OrderedDict[Key, int]] | None = {} if ordered else None
        self._tick = 0
        self.stale: dict[Key, str] = {}
        """Owners of the keys of a tier whose worker restarted, until it announces them."""

    def usage(self, tid: str) -> int:
        return self.used.get(tid, 0) if tid != NO_TENANT else self.untenanted

    def owner_of(self, key: Key) -> str:
        return self.owner.get(key, NO_TENANT)

    def _untenanted_here(self, key: Key) -> bool:
        return self.order is not None and key in self.order.get(NO_TENANT, ())

    def add(self, key: Key, tid: str) -> None:
        current = self.owner.get(key)
        if current is None and self._untenanted_here(key):
            current = NO_TENANT
        if current is not None:
            if current == tid:
                return
            self.remove(key)
        if tid != NO_TENANT:
            self.owner[key] = tid
            self.used[tid] += 1
        else:
            self.untenanted += 1
        if self.order is not None:
            self._tick += 1
            self.order.setdefault(tid, OrderedDict())[key] = self._tick

    def remove(self, key: Key) -> str:
        """Forget the key; returns its owner."""
        tid = self.owner.pop(key, None)
        if tid is not None:
            left = self.used[tid] - 1
            if left:
                self.used[tid] = left
            else:
                del self.used[tid]
        else:
            tid = NO_TENANT
            if self.untenanted and (self.order is None or self._untenanted_here(key)):
                self.untenanted -= 1
        if self.order is not None:
            keys = self.order.get(tid)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.order[tid]
        return tid

    def claim(self, key: Key, tid: str) -> None:
        """A block without an owner becomes ``tid``'s (where this knows it holds the block)."""
        if self._untenanted_here(key):
            self.add(key, tid)

    def touch(self, keys: Iterable[Key]) -> None:
        if self.order is None:
            return
        for key in keys:
            keys_of = self.order.get(self.owner.get(key, NO_TENANT))
            if keys_of is not None and key in keys_of:
                self._tick += 1
                keys_of[key] = self._tick
                keys_of.move_to_end(key)

    def keys_of(self, tid: str) -> list[Key]:
        """The keys of ``tid`` and its doomed ones (``DOOMED``); scans the owners."""
        doomed = DOOMED + tid
        return [k for k, t in self.owner.items() if t in (tid, doomed)]

    def reset(self) -> None:
        self.owner.clear()
        self.used.clear()
        self.untenanted = 0
        if self.order is not None:
            self.order.clear()


class ShareGuard(Collection[Key]):
    """An eviction's view of shares, asked last after what it protects anyway (``base``): a
    key is protected while its owner holds no more than its share, except the requesting
    tenant's own keys with ``own``. Each key it lets go is taken by the eviction asking (the
    primary tier's policies take every key they find evictable), so its owner's excess drops."""

    def __init__(
        self,
        base: Collection[Key],
        owners: TierOwners,
        excess: Callable[[str], int],
        requester: str,
        own: bool,
    ) -> None:
        self._base = base
        self._owners = owners
        self._excess = excess
        self._requester = requester
        self._own = own
        self._left: dict[str, int] = {}

    def __contains__(self, key: object) -> bool:
        if key in self._base:
            return True
        tid = self._owners.owner.get(key, NO_TENANT)  # type: ignore[call-overload]
        if tid.startswith(DOOMED) or (self._own and tid == self._requester):
            return False
        left = self._left.get(tid)
        if left is None:
            left = self._excess(tid)
        if left <= 0:
            self._left[tid] = left
            return True
        self._left[tid] = left - 1
        return False

    def __iter__(self) -> Iterator[Key]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


class NotOwnedBy(Collection[Key]):
    """Protects every key but the tenant's own (a tenant at its cap evicting its own)."""

    def __init__(self, base: Collection[Key], owners: TierOwners, tid: str) -> None:
        self._base, self._owners, self._tid = base, owners, tid

    def __contains__(self, key: object) -> bool:
        return key in self._base or self._owners.owner_of(key) != self._tid  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


class TenantOwners:
    """The owners of every tier, each tenant's limits and counts. Built before the pool and
    the tiers it listens to: ``num_slots`` and ``specs`` say what they are."""

    def __init__(
        self,
        policy: TenantPolicy,
        num_slots: int,
        specs: Sequence[TierSpec],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self.active = False
        self.primary_owners = TierOwners(PRIMARY, ordered=True)
        self.tier_owners = [TierOwners(s.name, ordered=s.capacity_keys > 0) for s in specs]
        self._tier_index = {s.name: i for i, s in enumerate(specs)}
        self.counts: dict[str, TenantCounts] = {}
        self._limits: dict[str, dict[str, TenantLimits]] = {}
        self._capacity = {PRIMARY: num_slots, **{s.name: s.capacity_keys for s in specs}}
        self._reserved = {name: 0 for name in self._capacity}
        for named in policy.named.values():
            for tier, limits in named.items():
                if tier in self._reserved:
                    self._reserved[tier] += limits.share
        self._evicting_for: str | None = None
        self._logged_at: dict[tuple[str, str], tuple[float, int]] = {}
        self.doomed = 0
        """Blocks of dropped tenants still in the pool, busy at their drop."""
        self._probed_for: dict[Key, str] = {}

    # ---- activation -----------------------------------------------------------------------

    def activate(self, pool_keys: Iterable[Key], tiers: Sequence[SecondaryTier]) -> None:
        """Start following every tier (a policy is configured, or a request named a tenant);
        what the pool (``pool_keys``) and the tiers hold now has no tenant."""
        if self.active:
            return
        self.active = True
        for key in pool_keys:
            self.primary_owners.add(key, NO_TENANT)
        for tier, owners in zip(tiers, self.tier_owners, strict=True):
            for key in tier.index:
                owners.add(key, NO_TENANT)
        log.info("tenants_active", named=len(self.policy.named))

    def register(self, tid: str) -> None:
        """A request of ``tid`` started."""
        self.counts_of(tid).requests += 1

    def unregister(self, tid: str) -> None:
        counts = self.counts.get(tid)
        if counts is not None and counts.requests > 0:
            counts.requests -= 1

    def counts_of(self, tid: str) -> TenantCounts:
        counts = self.counts.get(tid)
        if counts is None:
            counts = self.counts[tid] = TenantCounts()
        return counts

    # ---- limits ---------------------------------------------------------------------------

    def limits(self, tid: str, tier: str) -> TenantLimits:
        """``tid``'s share and cap on ``tier``; an unnamed tenant gets the default share only
        while the tier has room for it beside every share already given."""
        by_tier = self._limits.get(tid)
        if by_tier is None:
            by_tier = self._limits[tid] = self._resolve(tid)
        return by_tier.get(tier, NO_LIMITS)

    def _resolve(self, tid: str) -> dict[str, TenantLimits]:
        named = self.policy.named.get(tid)
        if named is not None:
            return dict(named)
        out = {}
        for tier, limits in self.policy.default.items():
            capacity = self._capacity.get(tier, 0)
            if limits.share and capacity and self._reserved[tier] + limits.share > capacity:
                log.warning("tenant_share_not_granted", tenant=tid, tier=tier, share=limits.share)
                limits = TenantLimits(0, limits.cap)
            elif limits.share and tier in self._reserved:
                self._reserved[tier] += limits.share
            out[tier] = limits
        return out

    def excess(self, owners: TierOwners) -> Callable[[str], int]:
        """Blocks each tenant holds on the tier beyond its share."""
        name = owners.name
        return lambda tid: owners.usage(tid) - self.limits(tid, name).share

    def refused(self, tid: str, tier: str, blocks: int, cap: int | None) -> None:
        """Blocks of ``tid`` refused at its cap on ``tier``: counted, and logged at most once a
        second per tenant and tier (with the blocks refused since the last line)."""
        self.counts_of(tid).tier(tier).refused += blocks
        now = self._clock()
        last, since = self._logged_at.get((tid, tier), (-1e9, 0))
        since += blocks
        if now - last >= REFUSAL_LOG_INTERVAL_S:
            log.warning("tenant_cap_refused", tenant=tid, tier=tier, cap=cap, blocks=since)
            since, last = 0, now
        self._logged_at[(tid, tier)] = (last, since)

    # ---- the pool (PoolListener) ----------------------------------------------------------

    @contextmanager
    def evicting_for(self, tid: str) -> Iterator[None]:
        """Blocks the pool drops meanwhile are counted as evictions for ``tid``'s traffic."""
        self._evicting_for = tid
        try:
            yield
        finally:
            self._evicting_for = None

    def pool_added(self, keys: Sequence[Key]) -> None:
        if self.active:
            for key in keys:
                self.primary_owners.add(key, NO_TENANT)

    def pool_dropped(self, key: Key) -> None:
        if not self.active:
            return
        tid = self.primary_owners.remove(key)
        if tid.startswith(DOOMED):
            self.doomed -= 1
            return
        requester = self._evicting_for
        if requester is not None:
            counts = self.counts_of(tid).tier(PRIMARY)
            counts.evictions += 1
            counts.evicted_by_others += tid != requester

    def doomed_among(self, keys: list[Key]) -> list[Key]:
        """The keys (of a store that just landed) of a dropped tenant."""
        if not self.doomed:
            return []
        owner = self.primary_owners.owner
        return [k for k in keys if owner.get(k, NO_TENANT).startswith(DOOMED)]

    def doom(self, keys: Sequence[Key], tid: str) -> None:
        """The tenant's blocks that could not be removed at its drop: no one sees them now."""
        for key in keys:
            self.primary_owners.add(key, DOOMED + tid)
        self.doomed += len(keys)

    def pool_reset(self) -> None:
        self.primary_owners.reset()
        self.doomed = 0

    # ---- lookups --------------------------------------------------------------------------

    def visible(self, owners: TierOwners, tid: str, key: Key) -> bool:
        """Whether a request of ``tid`` may read the block: its own, or one without a tenant
        (which becomes its own)."""
        owner = owners.owner.get(key)
        if owner is None:
            if tid != NO_TENANT:
                owners.claim(key, tid)
            return True
        return owner == tid

    def visible_in_pool(self, tid: str, key: Key) -> bool:
        return self.visible(self.primary_owners, tid, key)

    def visible_on_tier(self, tier_idx: int, tid: str, key: Key) -> bool:
        return self.visible(self.tier_owners[tier_idx], tid, key)

    def owned_prefix(self, tid: str, keys: Sequence[Key], n: int) -> int:
        """How many of the first ``n`` keys a request of ``tid`` may read (in order)."""
        owners = self.primary_owners
        get = owners.owner.get
        for i in range(n):
            owner = get(keys[i])
            if owner != tid and not (owner is None and self.visible(owners, tid, keys[i])):
                return i
        return n

    def owner_of(self, tier: int, key: Key) -> str:
        """The tenant owning ``key`` on tier number ``tier`` (0: the pool, ``i + 1``: secondary
        tier ``i``), a dropped one's too, for the events (``tiering.events``)."""
        if tier == 0:
            return self.primary_owners.owner.get(key, NO_TENANT).removeprefix(DOOMED)
        owners = self.tier_owners[tier - 1]
        found = owners.owner.get(key)
        return found if found is not None else owners.stale.get(key, NO_TENANT)

    def count_lookup(self, tid: str, results: list[LookupResult]) -> None:
        counts = self.counts_of(tid)
        counts.lookups_hit += results.count(LookupResult.HIT)
        counts.lookups_hit_pending += results.count(LookupResult.HIT_PENDING)
        counts.lookups_miss += results.count(LookupResult.MISS)

    def touch(self, keys: Collection[Key]) -> None:
        for owners in self.tier_owners:
            owners.touch(keys)

    # ---- the secondary tiers (IndexListener) ----------------------------------------------

    def added(self, tier: SecondaryTier, keys: list[Key]) -> None:
        """A tier gained keys: each is owned by who owned it before the tier's worker
        restarted, else by its owner in the pool (a cascade), else by no one."""
        if not self.active:
            return
        owners = self.tier_owners[self._tier_index[tier.name]]
        in_pool = self.primary_owners.owner
        for key in keys:
            tid = owners.stale.pop(key, None)
            owners.add(key, tid if tid is not None else in_pool.get(key, NO_TENANT))

    def removed(self, tier: SecondaryTier, keys: list[Key]) -> None:
        if not self.active:
            return
        owners = self.tier_owners[self._tier_index[tier.name]]
        for key in keys:
            owners.remove(key)

    def cleared(self, tier: SecondaryTier) -> None:
        if not self.active:
            return
        owners = self.tier_owners[self._tier_index[tier.name]]
        owners.stale.update(owners.owner)
        owners.reset()

    def note_probe(self, key: Key, tid: str) -> None:
        """A request of ``tid`` asks a probed tier for ``key``: its probe names the tenant."""
        if len(self._probed_for) >= PROBED_KEYS_KEPT:
            self._probed_for.clear()  # keys whose probe never went out (answered meanwhile)
        self._probed_for[key] = tid

    def job_tenants(self, tier_idx: int, keys: Sequence[Key], kind: JobKind) -> list[str]:
        """The tenant of each key of a job for a tier that names blocks by tenant (empty when
        none has one): for a probe, the tenant that asked; else the owner in the pool (the
        slot a cascade reads or a promotion writes), else on the tier."""
        out = []
        if kind is JobKind.PROBE:
            probed = self._probed_for
            out = [probed.pop(key, NO_TENANT) for key in keys]
        else:
            in_pool = self.primary_owners.owner
            on_tier = self.tier_owners[tier_idx].owner
            for key in keys:
                tid = in_pool.get(key) or on_tier.get(key, NO_TENANT)
                out.append(tid.removeprefix(DOOMED))
        return out if any(out) else []

    # ---- status ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, TenantStatus]:
        """Per tenant id (named, or holding blocks, or counted): its counters and, per tier,
        its blocks, share, cap, evictions and refusals (``bytes`` left to the caller, who
        knows what a block takes on each tier)."""
        owners = [self.primary_owners, *self.tier_owners]
        tids = set(self.policy.named) | set(self.counts)
        for tier_owners in owners:
            tids.update(t for t in tier_owners.used if not t.startswith(DOOMED))
        if any(o.usage(NO_TENANT) for o in owners):
            tids.add(NO_TENANT)
        out = {}
        for tid in sorted(tids):
            counts = self.counts.get(tid) or TenantCounts()
            tiers = {}
            for tier_owners in owners:
                limits = self.limits(tid, tier_owners.name)
                tier_counts = counts.tiers.get(tier_owners.name) or TenantTierCounts()
                tiers[tier_owners.name] = TenantTierStatus(
                    blocks=tier_owners.usage(tid),
                    share_blocks=limits.share,
                    cap_blocks=limits.cap,
                    evictions=tier_counts.evictions,
                    evicted_by_others=tier_counts.evicted_by_others,
                    refused=tier_counts.refused,
                )
            out[tid] = TenantStatus(
                named=tid in self.policy.named,
                requests=counts.requests,
                lookups_hit=counts.lookups_hit,
                lookups_hit_pending=counts.lookups_hit_pending,
                lookups_miss=counts.lookups_miss,
                tiers=tiers,
            )
        return out
