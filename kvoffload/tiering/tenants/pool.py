"""The pool's room for tenants: each store or promotion under its tenant's cap and the shares.

A store or promotion over its tenant's cap first evicts that tenant's own idle blocks (least
recent first); when they cannot make the room (pinned, being written, held for their cascade)
it is refused (``TenantCapReached``, counted, logged). Room in a full pool is then taken from
tenants over their share first, down to their share and never below it (``ShareGuard``), and
only then from the storing tenant's own blocks. The write-back rules stay whole: a held block
is never evicted, a block dirty for a best-effort tier goes last.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.tenants.owners import NotOwnedBy, ShareGuard, TenantOwners
from kvoffload.tiering.tenants.policy import PRIMARY, TenantCapReached
from kvoffload.tiering.types import Allocation, Key
from kvoffload.tiering.writeback import Eviction


class PoolShares:
    def __init__(self, owners: TenantOwners, primary: PrimaryIndex, eviction: Eviction) -> None:
        self.owners = owners
        self.primary = primary
        self.eviction = eviction
        self.cap_evicted: list[Key] = []
        """Blocks a refused allocation evicted for its tenant's cap (the caller reports them)."""

    def allocate(
        self, tid: str, keys: Sequence[Key], protected: Collection[Key]
    ) -> Allocation | None:
        """``Eviction.allocate`` for a store or promotion of ``tid``, under its cap and the
        shares (module docstring). TenantCapReached when its cap leaves no room; None when
        the pool has none."""
        primary = self.primary
        new = len({k for k in keys if k not in primary})
        if not new:
            return self.eviction.allocate(keys, protected)
        tenants = self.owners
        owners = tenants.primary_owners
        with tenants.evicting_for(tid):
            cap = tenants.limits(tid, PRIMARY).cap
            over = owners.usage(tid) + new - cap if cap is not None else 0
            own: list[Key] | None = []
            if over > 0:
                own = self.eviction.evict(over, NotOwnedBy(protected, owners, tid))
            if own is None:
                tenants.refused(tid, PRIMARY, new, cap)
                raise TenantCapReached(
                    f"tenant {tid or 'none'} is at its cap of {cap} pool slots and none of its "
                    "own blocks can make room now"
                )
            excess = tenants.excess(owners)
            out = self.eviction.allocate(
                keys, protected, lambda p: ShareGuard(p, owners, excess, tid, own=False)
            )
            if out is None:
                out = self.eviction.allocate(
                    keys, protected, lambda p: ShareGuard(p, owners, excess, tid, own=True)
                )
        if out is None:
            self.cap_evicted = own or []  # the evictions its cap made stand
            return None
        for key in out.new_keys:
            owners.add(key, tid)
        return out._replace(evicted=own + out.evicted) if own else out
