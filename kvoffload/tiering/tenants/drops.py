"""A tenant drop: every block of one tenant leaves every tier of this node and the shared bucket.

``drop`` acts at once on what the manager alone decides: the tenant's cascades still waiting
in a backlog are given up, its idle blocks leave the pool, the ones busy there (being loaded,
written or cascaded) become *doomed* (no request sees them; any eviction may take them; a store
of one that lands is removed on landing and cascades nothing), and its blocks leave the index
of every secondary tier, so from the call on no lookup of the tenant hits anywhere.

The tiers then remove the bytes, once every tier job in flight that carries one of the
tenant's blocks has reported (a cascade landing later would store it again): a ``DELETE`` job
per tier with the tenant's blocks there, the object tier's also removing every object under
the tenant's name (other nodes' included). The drop finishes when those jobs have reported;
``take_finished`` hands over its counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.logs import get_logger
from kvoffload.tiering.cascades import Cascades
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.tenants.owners import TenantOwners
from kvoffload.tiering.tenants.policy import DOOMED, PRIMARY
from kvoffload.tiering.tenants.room import DeleteJob, TenantRoom
from kvoffload.tiering.types import Key, TransferJob, TransferResult
from kvoffload.wire.vocab import JobKind

log = get_logger()


@dataclass(slots=True)
class DropProgress:
    """One drop: the blocks removed per tier (the pool's counted at the call), the blocks a
    tier could not remove, and what it still waits for."""

    drop_id: int
    tenant: str
    removed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    """Blocks a tier could not remove (-1: its removal failed as a whole)."""
    waiting_jobs: set[int] = field(default_factory=set)
    delete_jobs: set[int] = field(default_factory=set)
    started: bool = False
    tier_keys: dict[int, list[Key]] = field(default_factory=dict)
    """The tenant's blocks each indexed tier held at the call (out of its index since)."""

    @property
    def finished(self) -> bool:
        return self.started and not self.delete_jobs


class TenantDrops:
    def __init__(
        self,
        tenants: TenantOwners,
        primary: PrimaryIndex,
        tiers: Sequence[SecondaryTier],
        cascades: Cascades,
        room: TenantRoom,
    ) -> None:
        self.tenants = tenants
        self.primary = primary
        self.tiers = tiers
        self.cascades = cascades
        self.room = room
        self._ids = itertools.count(1)
        self.pending: dict[int, DropProgress] = {}
        self._finished: list[DropProgress] = []

    def drop(self, tid: str, in_flight: list[TransferJob]) -> DropProgress:
        """Start dropping ``tid`` (module docstring; tenants are active) with the tier jobs
        ``in_flight`` now; returns the drop, finished or not."""
        drop = DropProgress(next(self._ids), tid)
        keys = self.tenants.primary_owners.keys_of(tid)
        gone = set(keys)
        self.cascades.discard(gone)
        self.room.discard(gone)
        drop.removed[PRIMARY] = self._clear_pool(tid, keys)
        for tier_idx, tier in enumerate(self.tiers):
            if tier.spec.indexed:
                drop.tier_keys[tier_idx] = self.tenants.tier_owners[tier_idx].keys_of(tid)
                tier.forget(drop.tier_keys[tier_idx])
        drop.waiting_jobs = {
            job.job_id
            for job in in_flight
            if job.kind in (JobKind.CASCADE, JobKind.PROMOTION) and not gone.isdisjoint(job.keys)
        }
        log.info(
            "tenant_drop_started",
            tenant=tid,
            pool_blocks=drop.removed[PRIMARY],
            waiting_jobs=len(drop.waiting_jobs),
        )
        self.pending[drop.drop_id] = drop
        if not drop.waiting_jobs:
            self._start_deletes(drop)
        return drop

    def _clear_pool(self, tid: str, keys: list[Key]) -> int:
        """Remove the tenant's idle blocks from the pool and doom the busy ones; returns how
        many of its blocks (not doomed before) it had there."""
        owner_of = self.tenants.primary_owners.owner_of
        fresh = [k for k in keys if not owner_of(k).startswith(DOOMED)]
        removed = set(self.primary.remove(keys))
        self.tenants.doom([k for k in fresh if k not in removed and k in self.primary], tid)
        return len(fresh)

    def job_finished(self, job: TransferJob) -> None:
        """A tier job reported: drops waiting on it may go on."""
        for drop in list(self.pending.values()):
            if not drop.started and job.job_id in drop.waiting_jobs:
                drop.waiting_jobs.discard(job.job_id)
                if not drop.waiting_jobs:
                    self._start_deletes(drop)

    def _start_deletes(self, drop: DropProgress) -> None:
        """The tiers remove the tenant's blocks: one ``DELETE`` job per tier (the object
        tier's purging its name), once blocks that landed while the drop waited left the pool
        and the tiers' indexes too."""
        drop.started = True
        tid = drop.tenant
        drop.removed[PRIMARY] += self._clear_pool(tid, self.tenants.primary_owners.keys_of(tid))
        for tier_idx, tier in enumerate(self.tiers):
            keys = drop.tier_keys.pop(tier_idx, []) + self.tenants.tier_owners[tier_idx].keys_of(
                tid
            )
            drop.removed[tier.name] = 0
            if keys or not tier.spec.indexed:
                owners = dict.fromkeys(keys, tid)
                purge = "" if tier.spec.indexed else tid
                job_id = self.room.delete(tier_idx, keys, drop.drop_id, purge, owners)
                drop.delete_jobs.add(job_id)
        self._finish_if_done(drop)

    def deleted(
        self, job: DeleteJob, ok: list[Key], failed: list[Key], result: TransferResult
    ) -> None:
        """A ``DELETE`` job of a drop reported (``TenantRoom.delete_done``'s entry)."""
        drop = self.pending.get(job.drop) if job.drop is not None else None
        if drop is None:
            return
        name = self.tiers[job.tier].name
        drop.removed[name] = drop.removed.get(name, 0) + max(len(ok), result.removed)
        if failed:
            drop.failed[name] = drop.failed.get(name, 0) + len(failed)
        elif not result.success:
            drop.failed[name] = -1
        drop.delete_jobs.difference_update([j for j in drop.delete_jobs if j not in self.room.jobs])
        self._finish_if_done(drop)

    def _finish_if_done(self, drop: DropProgress) -> None:
        if drop.finished and drop.drop_id in self.pending:
            del self.pending[drop.drop_id]
            self._finished.append(drop)
            log.info("tenant_dropped", tenant=drop.tenant, removed=drop.removed, failed=drop.failed)

    def take_finished(self) -> list[DropProgress]:
        out, self._finished = self._finished, []
        return out
