"""The one face of tenants to the ledger: the calls it makes at each step of a request, and the
parts behind them (``owners``, ``pool``, ``room``, ``drops``), which the ledger builds and
hands to the pool, the tiers, the cascades and the jobs table as their listeners.

Off until a policy is configured or a request names a tenant; until then each call costs one
attribute test.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.tenants.drops import DropProgress, TenantDrops
from kvoffload.tiering.tenants.owners import TenantOwners
from kvoffload.tiering.tenants.policy import TenantCapReached
from kvoffload.tiering.tenants.pool import PoolShares
from kvoffload.tiering.tenants.room import TenantRoom
from kvoffload.tiering.types import (
    Allocation,
    Key,
    PrefixResult,
    ReqContext,
    TransferJob,
    TransferResult,
)
from kvoffload.wire.status import TenantStatus
from kvoffload.wire.tenant_ids import NO_TENANT
from kvoffload.wire.vocab import JobKind


class Tenancy:
    """The ``JobListener`` of the ledger's jobs table: removals for room and drops report
    here."""

    def __init__(
        self,
        owners: TenantOwners,
        pool: PoolShares,
        room: TenantRoom,
        drops: TenantDrops,
        primary: PrimaryIndex,
        tiers: Sequence[SecondaryTier],
        allocate: Callable[[Sequence[Key], Collection[Key]], Allocation | None],
        record_evictions: Callable[[list[Key]], None],
    ) -> None:
        """``allocate``: the pool's allocation without tenants (``Eviction.allocate``);
        ``record_evictions``: what the ledger does with evicted keys."""
        self.owners = owners
        self.pool = pool
        self.room = room
        self.drops = drops
        self.primary = primary
        self.tiers = tiers
        self._allocate = allocate
        self._record_evictions = record_evictions
        if owners.policy.configured:
            self.activate()

    @property
    def active(self) -> bool:
        return self.owners.active

    def activate(self) -> None:
        self.owners.activate((key for key, _, _ in self.primary.items()), self.tiers)

    # ---- the ledger's steps ---------------------------------------------------------------

    def request_started(self, ctx: ReqContext) -> None:
        if ctx.tenant != NO_TENANT:
            self.activate()
        if self.owners.active:
            self.owners.register(ctx.tenant)

    def request_done(self, ctx: ReqContext) -> None:
        if self.owners.active:
            self.owners.unregister(ctx.tenant)

    def allocate(
        self, tid: str, keys: Sequence[Key], protected: Collection[Key], refuse: bool = True
    ) -> Allocation | None:
        """Slots for ``keys`` of a store or promotion of ``tid``: ``Eviction.allocate`` (the
        write-back rules), under the tenant's cap and the shares once active
        (``PoolShares.allocate``). None: no room. A tenant at its cap: ``TenantCapReached``,
        or None unless ``refuse``."""
        if not self.owners.active:
            return self._allocate(keys, protected)
        try:
            out = self.pool.allocate(tid, keys, protected)
        except TenantCapReached:
            if refuse:
                raise
            out = None
        if out is None and self.pool.cap_evicted:
            evicted, self.pool.cap_evicted = self.pool.cap_evicted, []
            self._record_evictions(evicted)
        return out

    def looked_up(self, tid: str, result: PrefixResult) -> None:
        if self.owners.active:
            self.owners.count_lookup(tid, result.results)

    def landed(self, keys: list[Key]) -> list[Key]:
        """Keys whose store just landed, less those of a dropped tenant (removed now)."""
        doomed = self.owners.doomed_among(keys) if self.owners.active else []
        if not doomed:
            return keys
        self.primary.remove(doomed)
        gone = set(doomed)
        return [k for k in keys if k not in gone]

    def touch(self, keys: Sequence[Key]) -> None:
        if self.owners.active:
            self.owners.touch(keys)

    def job_created(self, job: TransferJob) -> None:
        """A tier that names blocks by tenant (a probed one), or that asks another node for
        them (one that stores nothing), gets each key's tenant with the job."""
        spec = self.tiers[job.tier].spec
        if (
            self.owners.active
            and not job.tenants
            and (not spec.indexed or not spec.stores)
            and job.kind in (JobKind.CASCADE, JobKind.PROMOTION, JobKind.PROBE)
        ):
            job.tenants = self.owners.job_tenants(job.tier, job.keys, job.kind)

    def reset(self) -> None:
        """The primary tier was emptied."""
        self.owners.pool_reset()

    def snapshot(self) -> dict[str, TenantStatus]:
        return self.owners.snapshot() if self.owners.active else {}

    # ---- drops ----------------------------------------------------------------------------

    def drop(self, tid: str, in_flight: list[TransferJob]) -> DropProgress:
        """Drop every block of ``tid`` (``drops``), with the tier jobs ``in_flight`` now."""
        self.activate()
        return self.drops.drop(tid, in_flight)

    def take_finished_drops(self) -> list[DropProgress]:
        return self.drops.take_finished()

    # ---- the jobs table (JobListener) -----------------------------------------------------

    def deleted(
        self, job: TransferJob, ok: list[Key], failed: list[Key], result: TransferResult
    ) -> None:
        """A ``DELETE`` job's result (removals for room, or for a drop)."""
        entry = self.room.delete_done(job, ok, failed, result)
        if entry is not None and entry.drop is not None:
            self.drops.deleted(entry, ok, failed, result)

    def finished(self, job: TransferJob) -> None:
        """A tier job reported: drops waiting on it may go on."""
        self.drops.job_finished(job)
