"""Tenants in the tiering library: whose blocks are where, what each may see, the shares no
other tenant's traffic takes away, the caps, and tenant drops.

- ``policy``: shares and caps per tenant and tier (``TenantPolicy``, ``TenantLimits``);
- ``owners``: the owner of every block on every tier, limits and counts, visibility
  (``TenantOwners``: the pool's ``PoolListener``, each tier's ``IndexListener``, the lookup's
  ``Visibility``);
- ``pool``: the pool's allocation under caps and shares (``PoolShares``);
- ``room``: the secondary tiers' room (``TenantRoom``: the cascades' ``CascadeRoom``);
- ``drops``: a tenant drop across every tier (``TenantDrops``);
- ``tenancy``: the facade the ledger calls (``Tenancy``: the jobs table's ``JobListener``).

The ledger builds the parts and hands each to the part that calls it; nothing is set on an
object after it was built.
"""

from kvoffload.tiering.tenants.drops import DropProgress
from kvoffload.tiering.tenants.policy import PRIMARY, TenantCapReached, TenantLimits, TenantPolicy
from kvoffload.tiering.tenants.tenancy import Tenancy

__all__ = [
    "PRIMARY",
    "DropProgress",
    "TenantCapReached",
    "TenantLimits",
    "TenantPolicy",
    "Tenancy",
]
