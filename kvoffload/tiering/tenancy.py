"""The tenants of a ``TieringLedger``: its parts (``tenants``, ``tenant_room``, ``tenant_drops``)
wired into the ledger's, and the calls the ledger makes at each step of a request.

Off until a policy is configured or a request names a tenant; until then each call costs one
attribute test.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.tiering.lookup import PrefixLookup
from kvoffload.tiering.tenant_drops import TenantDrop, TenantDrops
from kvoffload.tiering.tenant_room import TenantRoom
from kvoffload.tiering.tenants import NO_TENANT, TenantCapReached, TenantPolicy, Tenants
from kvoffload.tiering.types import Allocation, Key, PrefixResult, ReqContext, TransferJob
from kvoffload.wire.vocab import JobKind

if TYPE_CHECKING:
    from kvoffload.tiering.ledger import TieringLedger


class Tenancy:
    def __init__(
        self,
        policy: TenantPolicy | None,
        ledger: TieringLedger,
        lookup: PrefixLookup,
        submit: Callable[[TransferJob], None],
        record_evictions: Callable[[list[Key]], None],
    ) -> None:
        """``lookup``, ``submit`` and ``record_evictions``: the ledger's prefix lookup, job
        submission and what it does with evicted keys."""
        primary, tiers, cascades = ledger.primary, ledger.tiers, ledger.cascades
        self.tenants = Tenants(policy or TenantPolicy(), primary, tiers, ledger.eviction)
        self.room = TenantRoom(self.tenants, tiers, cascades, submit)
        self.drops = TenantDrops(
            self.tenants, primary, tiers, cascades, self.room, ledger.jobs.in_flight
        )
        self.tiers = tiers
        self._lookup = lookup
        self._record_evictions = record_evictions
        self._allocate = ledger.eviction.allocate
        cascades.tenant_room = self.room
        ledger.jobs.on_delete = self.room.delete_done
        ledger.jobs.on_result = self.drops.job_finished
        if self.tenants.policy.configured:
            self.activate()

    @property
    def active(self) -> bool:
        return self.tenants.active

    def activate(self) -> None:
        self.tenants.activate()
        self._lookup.tenants = self.tenants

    # ---- the ledger's steps ---------------------------------------------------------------

    def request_started(self, ctx: ReqContext) -> None:
        if ctx.tenant != NO_TENANT:
            self.activate()
        if self.tenants.active:
            self.tenants.register(ctx.tenant)

    def request_done(self, ctx: ReqContext) -> None:
        if self.tenants.active:
            self.tenants.unregister(ctx.tenant)

    def allocate(
        self, tid: str, keys: Sequence[Key], protected: Collection[Key], refuse: bool = True
    ) -> Allocation | None:
        """Slots for ``keys`` of a store or promotion of ``tid``: ``Eviction.allocate`` (the
        write-back rules), under the tenant's cap and the shares once active
        (``Tenants.allocate``). None: no room. A tenant at its cap: ``TenantCapReached``, or
        None unless ``refuse``."""
        if not self.tenants.active:
            return self._allocate(keys, protected)
        try:
            out = self.tenants.allocate(tid, keys, protected)
        except TenantCapReached:
            if refuse:
                raise
            out = None
        if out is None and self.tenants.cap_evicted:
            evicted, self.tenants.cap_evicted = self.tenants.cap_evicted, []
            self._record_evictions(evicted)
        return out

    def looked_up(self, tid: str, result: PrefixResult) -> None:
        if self.tenants.active:
            self.tenants.count_lookup(tid, result.results)

    def landed(self, keys: list[Key]) -> list[Key]:
        return self.tenants.landed(keys) if self.tenants.active else keys

    def touch(self, keys: Sequence[Key]) -> None:
        if self.tenants.active:
            self.tenants.touch(keys)

    def job_created(self, job: TransferJob) -> None:
        """A tier that names blocks by tenant gets each key's tenant with the job."""
        if (
            self.tenants.active
            and not job.tenants
            and not self.tiers[job.tier].spec.indexed
            and job.kind in (JobKind.CASCADE, JobKind.PROMOTION, JobKind.PROBE)
        ):
            job.tenants = self.tenants.job_tenants(job.tier, job.keys, job.kind)

    def reset(self) -> None:
        """The primary tier was emptied."""
        self.tenants.primary_reset()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return self.tenants.snapshot() if self.tenants.active else {}

    # ---- drops ----------------------------------------------------------------------------

    def drop(self, tid: str) -> TenantDrop:
        self.activate()
        return self.drops.drop(tid)

    def take_finished_drops(self) -> list[TenantDrop]:
        return self.drops.take_finished()
