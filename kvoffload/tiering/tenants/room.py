"""The secondary tiers' room for tenants: their caps, and a tier's capacity shared by shares.

On a tier whose evictions the manager chooses (``TierSpec.capacity_keys`` > 0: the disk tier
when tenants are configured) the tier's worker never has to evict: before a cascade goes out,
the manager makes room by removing blocks (``DELETE`` jobs), taken from tenants over their share
first (their least recent block first, down to their share and never below it), then from the
cascading tenant's own. A tenant at its cap on a tier first removes its own least recent block
there; on a tier that removes nothing for room (the object tier: its bucket is shared by every
node of a fleet and ages blocks out by its own rules) the cascade is given up (``tenant_cap``).
A key that finds no room at all is given up (``tier_full``). Keys waiting for room stay in the
tier's backlog, held in the pool for a ``HOLD`` tier, until the removals land; removed keys
leave the tier's index at once, so no lookup finds them meanwhile.

A ``DELETE`` job's result comes back through ``delete_done``; a removal that failed puts its
keys back in the tier's index (the tier still holds them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.tiering.cascades import TierCascades
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.tenants.owners import TenantOwners
from kvoffload.tiering.tenants.policy import DOOMED
from kvoffload.tiering.types import Admission, Key, TransferJob, TransferResult
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import JobKind


@dataclass(slots=True)
class DeleteJob:
    """A ``DELETE`` job in flight: its tier, the owner of each key, the drop it serves."""

    tier: int
    owners: dict[Key, str]
    drop: int | None = None


class TenantRoom:
    """The ``CascadeRoom`` of ``Cascades``, for tenants. ``cascade_state``: each tier's cascade
    state (shared with ``Cascades``: its cascades in flight count as the tier's occupancy, and
    a finished removal makes the tier's backlog due)."""

    def __init__(
        self,
        tenants: TenantOwners,
        tiers: Sequence[SecondaryTier],
        cascade_state: Sequence[TierCascades],
        submit: Callable[[TransferJob], None],
    ) -> None:
        self.tenants = tenants
        self.tiers = tiers
        self.cascade_state = cascade_state
        self._submit = submit
        n = len(tiers)
        self.deleting = [0] * n
        self.promised: list[set[Key]] = [set() for _ in range(n)]
        self._inflight_by: list[Counter[str]] = [Counter() for _ in range(n)]
        self._inflight_owner: list[dict[Key, str]] = [{} for _ in range(n)]
        self.jobs: dict[int, DeleteJob] = {}
        self._pending_owners: dict[Key, str] = {}
        policy = tenants.policy
        self._capped = [
            any(lim.get(t.name) and lim[t.name].cap is not None for lim in policy.named.values())
            or (t.name in policy.default and policy.default[t.name].cap is not None)
            for t in tiers
        ]

    def tracks(self, tier_idx: int) -> bool:
        """Whether cascades to the tier go through ``admit``."""
        return self.tenants.active and (
            self.tiers[tier_idx].spec.capacity_keys > 0 or self._capped[tier_idx]
        )

    # ---- cascades -------------------------------------------------------------------------

    def admit(self, tier_idx: int, keys: list[Key]) -> Admission:
        """Sort keys about to be cascaded to the tier (module docstring), starting the
        removals that make room for the ones that wait."""
        tier = self.tiers[tier_idx]
        tenants = self.tenants
        owners = tenants.tier_owners[tier_idx]
        in_pool = tenants.primary_owners.owner
        promised = self.promised[tier_idx]
        capacity = tier.spec.capacity_keys
        free = capacity - self._occupied(tier_idx) if capacity else len(keys)
        admitted: Counter[str] = Counter()
        victims: list[Key] = []
        out = Admission()
        for key in keys:
            if key in promised and self.deleting[tier_idx] > 0 and free <= 0:
                out.wait.append(key)
                continue
            promised.discard(key)
            tid = in_pool.get(key, NO_TENANT)
            cap = tenants.limits(tid, tier.name).cap
            room_coming = False
            if cap is not None:
                held = owners.usage(tid) + self._inflight_by[tier_idx][tid] + admitted[tid]
                if held >= cap:
                    victim = self._oldest(tier_idx, only=tid) if owners.order is not None else None
                    if victim is None:
                        tenants.refused(tid, tier.name, 1, cap)
                        out.capped.append(key)
                        continue
                    self._evict(tier_idx, victim, tid, victims)
                    room_coming = True
            if free > 0:
                free -= 1
                admitted[tid] += 1
                out.now.append(key)
                continue
            if not room_coming:
                victim = self._oldest(tier_idx, tid) if owners.order is not None else None
                if victim is None:
                    out.full.append(key)
                    continue
                self._evict(tier_idx, victim, tid, victims)
            promised.add(key)
            out.wait.append(key)
        if victims:
            self.delete(tier_idx, victims)
        return out

    def _occupied(self, tier_idx: int) -> int:
        """Blocks the tier holds or is being given: indexed, cascades in flight, removals in
        flight (still there until they land)."""
        inflight = self.cascade_state[tier_idx].inflight_keys
        return len(self.tiers[tier_idx].index) + inflight + self.deleting[tier_idx]

    def _oldest(
        self, tier_idx: int, requester: str = NO_TENANT, only: str | None = None
    ) -> Key | None:
        """The block to remove: ``only``'s least recent; else the least recent block of the
        tenants over their share (a dropped tenant's first), else ``requester``'s own."""
        owners = self.tenants.tier_owners[tier_idx]
        order = owners.order
        assert order is not None
        if only is not None:
            keys = order.get(only)
            return next(iter(keys)) if keys else None
        excess = self.tenants.excess(owners)
        best: Key | None = None
        best_tick = 0
        for tid, keys in order.items():
            if not keys:
                continue
            if not tid.startswith(DOOMED) and excess(tid) <= 0:
                continue
            key, tick = next(iter(keys.items()))
            if tid.startswith(DOOMED):
                return key
            if best is None or tick < best_tick:
                best, best_tick = key, tick
        if best is None:
            own = order.get(requester)
            best = next(iter(own)) if own else None
        return best

    def _evict(self, tier_idx: int, key: Key, requester: str, victims: list[Key]) -> None:
        """Count ``key``'s removal as an eviction and take it out of the tier's index now (the
        next choice sees the owner's usage without it)."""
        owners = self.tenants.tier_owners[tier_idx]
        tid = owners.owner_of(key)
        counts = self.tenants.counts_of(tid).tier(self.tiers[tier_idx].name)
        counts.evictions += 1
        counts.evicted_by_others += tid != requester
        victims.append(key)
        self._pending_owners[key] = tid
        self.tiers[tier_idx].forget([key])

    def sent(self, tier_idx: int, keys: list[Key]) -> None:
        """Cascade keys went out: counted against their tenant's cap until their result."""
        in_pool = self.tenants.primary_owners.owner
        owner_of = self._inflight_owner[tier_idx]
        by = self._inflight_by[tier_idx]
        for key in keys:
            tid = in_pool.get(key, NO_TENANT)
            owner_of[key] = tid
            by[tid] += 1

    def done(self, tier_idx: int, keys: list[Key]) -> None:
        owner_of = self._inflight_owner[tier_idx]
        by = self._inflight_by[tier_idx]
        for key in keys:
            tid = owner_of.pop(key, None)
            if tid is not None:
                by[tid] -= 1
                if by[tid] <= 0:
                    del by[tid]

    # ---- removals -------------------------------------------------------------------------

    def delete(
        self,
        tier_idx: int,
        keys: list[Key],
        drop: int | None = None,
        purge: str = "",
        owners: dict[Key, str] | None = None,
    ) -> int:
        """Remove ``keys`` from the tier (leaving its index now): one ``DELETE`` job, whose
        id is returned. ``purge``: a tenant drop's, the tier also removes every block it
        holds under that tenant's name. ``owners``: the keys' owners, where the tier's index
        no longer knows them."""
        tier = self.tiers[tier_idx]
        known = owners or {}
        on_tier = self.tenants.tier_owners[tier_idx]
        who = {
            key: known.get(key) or self._pending_owners.pop(key, None) or on_tier.owner_of(key)
            for key in keys
        }
        tier.forget(keys)
        job = TransferJob(0, tier_idx, JobKind.DELETE, list(keys), [], None, purge_tenant=purge)
        if not tier.spec.indexed:
            names = [who[k].removeprefix(DOOMED) for k in keys]
            job.tenants = names if any(names) else []
        self._submit(job)
        self.deleting[tier_idx] += len(keys)
        self.jobs[job.job_id] = DeleteJob(tier_idx, who, drop)
        return job.job_id

    def delete_done(
        self, job: TransferJob, ok: list[Key], failed: list[Key], result: TransferResult
    ) -> DeleteJob | None:
        """A ``DELETE`` job's result: keys it could not remove are back in the tier's index;
        cascades waiting for the room look again. Returns the job's entry (None: not one of
        this room's), whose ``drop`` names the tenant drop it serves."""
        entry = self.jobs.pop(job.job_id, None)
        tier_idx = job.tier
        self.deleting[tier_idx] = max(0, self.deleting[tier_idx] - len(job.keys))
        if entry is None:
            return None
        tier = self.tiers[tier_idx]
        if failed and tier.spec.indexed:
            owners = self.tenants.tier_owners[tier_idx]
            owners.stale.update({k: entry.owners[k] for k in failed if k in entry.owners})
            tier.apply_index_update(failed, [])
        self.cascade_state[tier_idx].due_at = 0.0
        return entry

    def discard(self, keys: set[Key]) -> None:
        """Keys no longer waiting for room (a tenant drop)."""
        for promised in self.promised:
            promised.difference_update(keys)
