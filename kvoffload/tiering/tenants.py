"""Tenants: whose blocks are where, the shares no other tenant's traffic takes away, the caps.

A request names its tenant (``ReqContext.tenant``, an id, "" for none). Every block a request
stores or promotes is its tenant's; a tenant sees only its own blocks (a block of another
tenant is a miss; a block without a tenant, e.g. one a restarted manager found on disk, goes to
the first tenant that looks it up). Per tier (``PRIMARY``, then each secondary tier by name) a
tenant may have a **share** (blocks no other tenant's traffic evicts) and a **cap** (blocks it
holds at most), from a ``TenantPolicy``: named tenants, and a default for every other one (its
share granted while the tier has room for it beside the others').

The primary tier (``allocate``): a store or promotion over its tenant's cap first evicts that
tenant's own idle blocks (least recent first); when they cannot make the room (pinned, being
written, held for their cascade) it is refused (``TenantCapReached``, counted, logged). Room in
a full pool is then taken from tenants over their share first, down to their share and never
below it (``ShareGuard``), and only then from the storing tenant's own blocks. The write-back
rules stay whole: a held block is never evicted, a block dirty for a best-effort tier goes last.
The secondary tiers follow the same rules in ``tenant_room``; a tenant drop is
``tenant_drops``.

Everything here is off until a policy is configured or a request names a tenant (``activate``):
the ledger then routes its allocations, lookups and tier changes through it.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.logs import get_logger
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.types import Allocation, Key, TieringError
from kvoffload.tiering.writeback import Eviction
from kvoffload.wire.vocab import ErrorCode, JobKind, LookupResult

log = get_logger()

PRIMARY = "primary"
NO_TENANT = ""
DOOMED = "!"
"""Prefix of the owner of a dropped tenant's block that was busy at the drop: no request sees
it, any eviction may take it."""
REFUSAL_LOG_INTERVAL_S = 1.0
PROBED_KEYS_KEPT = 1 << 16


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's room on one tier, in blocks: ``share`` guaranteed, ``cap`` at most (None:
    no cap)."""

    share: int = 0
    cap: int | None = None


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class TenantPolicy:
    """Shares and caps: ``named`` by tenant id, then tier; ``default`` by tier, for the others."""

    named: Mapping[str, Mapping[str, TenantLimits]] = field(default_factory=dict)
    default: Mapping[str, TenantLimits] = field(default_factory=dict)

    @property
    def configured(self) -> bool:
        return bool(self.named) or any(lim != NO_LIMITS for lim in self.default.values())


class TenantCapReached(TieringError):
    """A store of a tenant at its cap whose own blocks cannot make the room."""

    code = ErrorCode.TENANT_CAP


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
    none), blocks per tenant and, with ``ordered``, each owner's keys from least to most recent.
    ``size``: the tier's blocks in all, when the tier itself counts them (the primary tier);
    otherwise the blocks without an owner are counted here."""

    def __init__(self, name: str, size: Callable[[], int] | None, ordered: bool) -> None:
        self.name = name
        self._size = size
        self.owner: dict[Key, str] = {}
        self.used: Counter[str] = Counter()
        self.untenanted = 0
        self._tenanted = 0
        self.order: dict[str, OrderedDict[Key, int]] | None = {} if ordered else None
        self._tick = 0
        self.stale: dict[Key, str] = {}
        """Owners of the keys of a tier whose worker restarted, until it announces them."""

    def usage(self, tid: str) -> int:
        if tid != NO_TENANT:
            return self.used.get(tid, 0)
        if self._size is not None:
            return max(0, self._size() - self._tenanted)
        return self.untenanted

    def owner_of(self, key: Key) -> str:
        return self.owner.get(key, NO_TENANT)

    def add(self, key: Key, tid: str) -> None:
        if key in self.owner:
            if self.owner[key] == tid:
                return
            self.remove(key)
        if tid != NO_TENANT:
            self.owner[key] = tid
            self.used[tid] += 1
            self._tenanted += 1
        elif self._size is None:
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
            self._tenanted -= 1
        else:
            tid = NO_TENANT
            if self._size is None and self.untenanted:
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
        if self._size is not None:
            self.add(key, tid)
        elif self.order is not None and key in self.order.get(NO_TENANT, ()):
            self.remove(key)
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
        self.untenanted = self._tenanted = 0
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


class _NotOwnedBy(Collection[Key]):
    """Protects every key but the tenant's own (a tenant at its cap evicting its own)."""

    def __init__(self, base: Collection[Key], owners: TierOwners, tid: str) -> None:
        self._base, self._owners, self._tid = base, owners, tid

    def __contains__(self, key: object) -> bool:
        return key in self._base or self._owners.owner_of(key) != self._tid  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


class Tenants:
    def __init__(
        self,
        policy: TenantPolicy,
        primary: PrimaryIndex,
        tiers: Sequence[SecondaryTier],
        eviction: Eviction,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.primary = primary
        self.tiers = tiers
        self.eviction = eviction
        self._clock = clock
        self.active = False
        self.primary_owners = TierOwners(PRIMARY, primary.__len__, ordered=False)
        self.tier_owners = [
            TierOwners(t.name, None, ordered=t.spec.capacity_keys > 0) for t in tiers
        ]
        self.counts: dict[str, TenantCounts] = {}
        self._limits: dict[str, dict[str, TenantLimits]] = {}
        self._capacity = {
            PRIMARY: primary.num_slots,
            **{t.name: t.spec.capacity_keys for t in tiers},
        }
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
        self.cap_evicted: list[Key] = []
        """Blocks a refused allocation evicted for its tenant's cap (``Tenancy`` reports them)."""

    # ---- activation -----------------------------------------------------------------------

    def activate(self) -> None:
        """Start following every tier (a policy is configured, or a request named a tenant);
        what the tiers hold now has no tenant."""
        if self.active:
            return
        self.active = True
        self.primary.on_drop = self._primary_dropped
        for tier, owners in zip(self.tiers, self.tier_owners, strict=True):
            tier.listener = self
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

    # ---- the primary tier -----------------------------------------------------------------

    def allocate(
        self, tid: str, keys: Sequence[Key], protected: Collection[Key]
    ) -> Allocation | None:
        """``Eviction.allocate`` for a store or promotion of ``tid``, under its cap and the
        shares (module docstring). TenantCapReached when its cap leaves no room."""
        primary = self.primary
        new = len({k for k in keys if k not in primary})
        if not new:
            return self.eviction.allocate(keys, protected)
        owners = self.primary_owners
        self._evicting_for = tid
        try:
            cap = self.limits(tid, PRIMARY).cap
            over = owners.usage(tid) + new - cap if cap is not None else 0
            own: list[Key] | None = []
            if over > 0:
                own = self.eviction.evict(over, _NotOwnedBy(protected, owners, tid))
            if own is None:
                self.refused(tid, PRIMARY, new, cap)
                raise TenantCapReached(
                    f"tenant {tid or 'none'} is at its cap of {cap} pool slots and none of its "
                    "own blocks can make room now"
                )
            excess = self.excess(owners)
            out = self.eviction.allocate(
                keys, protected, lambda p: ShareGuard(p, owners, excess, tid, own=False)
            )
            if out is None:
                out = self.eviction.allocate(
                    keys, protected, lambda p: ShareGuard(p, owners, excess, tid, own=True)
                )
        finally:
            self._evicting_for = None
        if out is None:
            self.cap_evicted = own or []  # the evictions its cap made stand
            return None
        if tid != NO_TENANT:
            for key in out.new_keys:
                owners.add(key, tid)
        return out._replace(evicted=own + out.evicted) if own else out

    def _primary_dropped(self, key: Key) -> None:
        tid = self.primary_owners.remove(key)
        if tid.startswith(DOOMED):
            self.doomed -= 1
            return
        requester = self._evicting_for
        if requester is not None:
            counts = self.counts_of(tid).tier(PRIMARY)
            counts.evictions += 1
            counts.evicted_by_others += tid != requester

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

    def landed(self, keys: list[Key]) -> list[Key]:
        """Keys whose store just landed, less those of a dropped tenant (removed now)."""
        if not self.doomed:
            return keys
        owner = self.primary_owners.owner
        doomed = [k for k in keys if owner.get(k, NO_TENANT).startswith(DOOMED)]
        if not doomed:
            return keys
        self.primary.remove(doomed)
        gone = set(doomed)
        return [k for k in keys if k not in gone]

    def doom(self, keys: Sequence[Key], tid: str) -> None:
        """The tenant's blocks that could not be removed at its drop: no one sees them now."""
        for key in keys:
            self.primary_owners.add(key, DOOMED + tid)
        self.doomed += len(keys)

    def primary_reset(self) -> None:
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

    def owned_prefix(self, tid: str, keys: Sequence[Key], n: int) -> int:
        """How many of the first ``n`` keys a request of ``tid`` may read (in order)."""
        owners = self.primary_owners
        get = owners.owner.get
        for i in range(n):
            owner = get(keys[i])
            if owner != tid and not (owner is None and self.visible(owners, tid, keys[i])):
                return i
        return n

    def count_lookup(self, tid: str, results: list[LookupResult]) -> None:
        counts = self.counts_of(tid)
        counts.lookups_hit += results.count(LookupResult.HIT)
        counts.lookups_hit_pending += results.count(LookupResult.HIT_PENDING)
        counts.lookups_miss += results.count(LookupResult.MISS)

    def touch(self, keys: Collection[Key]) -> None:
        for owners in self.tier_owners:
            owners.touch(keys)

    # ---- the secondary tiers' index (IndexListener) ---------------------------------------

    def added(self, tier: SecondaryTier, keys: list[Key]) -> None:
        """A tier gained keys: each is owned by who owned it before the tier's worker
        restarted, else by its owner in the pool (a cascade), else by no one."""
        owners = self.tier_owners[self._index_of(tier)]
        in_pool = self.primary_owners.owner
        for key in keys:
            tid = owners.stale.pop(key, None)
            owners.add(key, tid if tid is not None else in_pool.get(key, NO_TENANT))

    def removed(self, tier: SecondaryTier, keys: list[Key]) -> None:
        owners = self.tier_owners[self._index_of(tier)]
        for key in keys:
            owners.remove(key)

    def cleared(self, tier: SecondaryTier) -> None:
        owners = self.tier_owners[self._index_of(tier)]
        owners.stale.update(owners.owner)
        owners.reset()

    def _index_of(self, tier: SecondaryTier) -> int:
        for i, known in enumerate(self.tiers):
            if known is tier:
                return i
        raise KeyError(tier.name)

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

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tenant id (named, or holding blocks, or counted): its counters and, per tier,
        its blocks, share, cap, evictions and refusals."""
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
                tiers[tier_owners.name] = {
                    "blocks": tier_owners.usage(tid),
                    "share_blocks": limits.share,
                    "cap_blocks": limits.cap,
                    "evictions": tier_counts.evictions,
                    "evicted_by_others": tier_counts.evicted_by_others,
                    "refused": tier_counts.refused,
                }
            out[tid] = {
                "named": tid in self.policy.named,
                "requests": counts.requests,
                "lookups_hit": counts.lookups_hit,
                "lookups_hit_pending": counts.lookups_hit_pending,
                "lookups_miss": counts.lookups_miss,
                "tiers": tiers,
            }
        return out
