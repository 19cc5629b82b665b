"""What tenants may hold: a share and a cap per tier, named tenants and a default for the others.

A tenant is the id a request names (``ReqContext.tenant``, ``NO_TENANT`` for none). Per tier
(``PRIMARY``, then each secondary tier by name) it may have a **share** (blocks no other
tenant's traffic evicts) and a **cap** (blocks it holds at most).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload.tiering.types import TieringError
from kvoffload.wire.vocab import PRIMARY as PRIMARY
from kvoffload.wire.vocab import ErrorCode

DOOMED = "!"
"""Prefix of the owner of a dropped tenant's block that was busy at the drop: no request sees
it, any eviction may take it."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's room on one tier, in blocks: ``share`` guaranteed, ``cap`` at most (None:
    no cap)."""

    share: int = 0
    cap: int | None = None


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class TenantPolicy:
    """Shares and caps: ``named`` by tenant id, then tier; ``default`` by tier, for the others
    (a default share is granted while the tier has room for it beside the others')."""

    named: Mapping[str, Mapping[str, TenantLimits]] = field(default_factory=dict)
    default: Mapping[str, TenantLimits] = field(default_factory=dict)

    @property
    def configured(self) -> bool:
        return bool(self.named) or any(lim != NO_LIMITS for lim in self.default.values())


class TenantCapReached(TieringError):
    """A store of a tenant at its cap whose own blocks cannot make the room."""

    code = ErrorCode.TENANT_CAP
