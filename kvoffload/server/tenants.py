"""Tenants on the manager: the ``TenantPolicy`` of the ``[tenants]`` configuration, the bytes
per block of each tier, and tenant drops from the client's call to its ``TenantDropped`` reply.

The configuration names tenants in clear; the policy knows them by ``tenant_id`` only, and
counts shares and caps in blocks: pool slots as they are, disk bytes in disk records (a header
page and the block), object bytes in blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from kvoffload.config import Config
from kvoffload.config import tenants as tenant_settings
from kvoffload.memory.blockformat import HEADER_SIZE, disk_record_bytes
from kvoffload.tiering.tenants import PRIMARY, DropProgress, TenantLimits, TenantPolicy
from kvoffload.wire import protocol as p
from kvoffload.wire.status import TenantStatus
from kvoffload.wire.tenant_ids import tenant_id, tenant_label

_TIER_OF_FIELD = {"pool_slots": PRIMARY, "disk_bytes": "disk", "object_bytes": "object"}


def block_bytes_per_tier(cfg: Config) -> dict[str, int]:
    """The bytes one block takes on each tier, as it stores it."""
    block = cfg.pool.block_bytes
    return {
        PRIMARY: block,
        "disk": disk_record_bytes(block),
        "object": block + HEADER_SIZE,
    }


def disk_capacity_keys(cfg: Config) -> int:
    """The records the disk tier holds (its worker's ``DiskStore``)."""
    return cfg.disk.capacity_bytes // block_bytes_per_tier(cfg)["disk"]


def tenant_policy(cfg: Config) -> TenantPolicy:
    """The configuration's shares and caps, by tenant id and tier, in blocks."""
    per_block = block_bytes_per_tier(cfg)

    def limits(values: Mapping[str, int | None]) -> dict[str, TenantLimits]:
        out = {}
        for field, tier in _TIER_OF_FIELD.items():
            unit = 1 if tier == PRIMARY else per_block[tier]
            share, cap = values[f"{field}_share"] or 0, values[f"{field}_cap"]
            out[tier] = TenantLimits(share // unit, None if cap is None else cap // unit)
        return out

    tenants = cfg.tenants
    named = {
        tenant_id(name): limits(tenant_settings.resolve(tenants, name))
        for name in tenants
        if name != tenant_settings.DEFAULT
    }
    return TenantPolicy(named, limits(tenant_settings.resolve(tenants, tenant_settings.DEFAULT)))


def with_bytes(tenants: Mapping[str, TenantStatus], cfg: Config) -> dict[str, TenantStatus]:
    """The ledger's per-tenant status (by id), by ``tenant_label``, with each tier's ``bytes``
    (its blocks' size there)."""
    per_block = block_bytes_per_tier(cfg)
    return {
        tenant_label(tid): msgspec.structs.replace(
            entry,
            tiers={
                tier: msgspec.structs.replace(counts, bytes=counts.blocks * per_block.get(tier, 0))
                for tier, counts in entry.tiers.items()
            },
        )
        for tid, entry in tenants.items()
    }


class DropReplies:
    """The ``TenantDrop`` calls waiting for their drop to finish, by drop id."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[bytes, int]] = {}

    def wait(self, drop: DropProgress, identity: bytes, rid: int) -> None:
        self._waiting[drop.drop_id] = (identity, rid)

    def settle(
        self, finished: list[DropProgress], reply: Callable[[bytes, p.ClientReply], None]
    ) -> None:
        """Answer the calls whose drop is among ``finished``."""
        for drop in finished:
            waiting = self._waiting.pop(drop.drop_id, None)
            if waiting is not None:
                identity, rid = waiting
                reply(identity, dropped_reply(rid, drop))


def dropped_reply(rid: int, drop: DropProgress) -> p.TenantDropped:
    return p.TenantDropped(rid, dict(drop.removed), dict(drop.failed))
