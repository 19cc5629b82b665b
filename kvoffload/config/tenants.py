"""The ``[tenants]`` section of the configuration: shares and caps per tenant and tier.

``[tenants.default]`` applies to every tenant the file does not name; ``[tenants.<name>]``
names one (its name as the engine gives it: vLLM's ``cache_salt``, or the namespace of a whole
engine). A field a named entry leaves out takes the default entry's value. Per tier, a
**share** is room no other tenant's traffic takes away and a **cap** the most the tenant holds:
``pool_slots_*`` in host pool slots, ``disk_bytes_*`` and ``object_bytes_*`` in bytes.

Overrides from the environment: ``KVOFFLOAD_TENANTS__<NAME>__<FIELD>=<value>`` sets one field,
``KVOFFLOAD_TENANTS__<NAME>='{ pool_slots_share = 64 }'`` a whole entry (environment names are
not case-sensitive: a name the file has matches whatever its case, a new one is lower case).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

DEFAULT = "default"
TIERS = ("pool_slots", "disk_bytes", "object_bytes")

NonNegative = Annotated[int, Meta(ge=0)]
Unset = msgspec.UnsetType


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[tenants.<name>]`` entry; a field left out is the default entry's (``resolve``)."""

    pool_slots_share: NonNegative | Unset = msgspec.UNSET
    pool_slots_cap: NonNegative | Unset = msgspec.UNSET
    disk_bytes_share: NonNegative | Unset = msgspec.UNSET
    disk_bytes_cap: NonNegative | Unset = msgspec.UNSET
    object_bytes_share: NonNegative | Unset = msgspec.UNSET
    object_bytes_cap: NonNegative | Unset = msgspec.UNSET


FIELDS = tuple(TenantConfig.__struct_fields__)


def resolve(tenants: Mapping[str, TenantConfig], name: str) -> dict[str, int | None]:
    """Every field of the entry ``name`` (or of the default entry): its own value, else the
    default entry's, else 0 for a share and None (no cap) for a cap."""
    default = tenants.get(DEFAULT, TenantConfig())
    entry = tenants.get(name, default)
    out: dict[str, int | None] = {}
    for field in FIELDS:
        value = getattr(entry, field)
        if value is msgspec.UNSET:
            value = getattr(default, field)
        if value is msgspec.UNSET:
            value = 0 if field.endswith("_share") else None
        out[field] = value
    return out


def check_file_table(table: Any, source: str, sources: dict[str, str], fail: Failer) -> None:
    """The ``[tenants]`` table of a file: entries that are tables of known fields."""
    if not isinstance(table, dict):
        return
    for name, entry in table.items():
        sources[f"tenants.{name}"] = source
        if not isinstance(entry, dict):
            continue
        for key in entry:
            sources[f"tenants.{name}.{key}"] = source
            if key not in FIELDS:
                fail(f"tenants.{name}.{key}", f"unknown key; a tenant has {sorted(FIELDS)}", source)


Failer = Callable[[str, str, str | None], None]
"""(dotted key, message, source) -> raises the configuration error."""


def check_entries(table: Any, fail: Callable[[str, str], None]) -> None:
    """Each entry of ``[tenants]`` as a ``TenantConfig``, so an error names its tenant."""
    if not isinstance(table, dict):
        return
    for name, entry in table.items():
        try:
            msgspec.convert(entry, TenantConfig)
        except msgspec.ValidationError as exc:
            message = str(exc)
            field = message.rsplit("$.", 1)[-1].rstrip("`") if "$." in message else ""
            fail(f"tenants.{name}" + (f".{field}" if field in FIELDS else ""), message)


def apply_env(
    data: dict[str, Any],
    rest: str,
    raw: Any,
    var: str,
    sources: dict[str, str],
    fail: Failer,
) -> None:
    """Apply one ``KVOFFLOAD_TENANTS__<rest>`` override (``rest`` lower case, ``raw`` parsed
    as a TOML value) to ``data``."""
    name, _, field = rest.partition("__")
    tenants = data.setdefault("tenants", {})
    if not isinstance(tenants, dict) or not name:
        fail("tenants", "needs a tenant: KVOFFLOAD_TENANTS__<NAME>[__<FIELD>]", var)
        return
    name = next((known for known in tenants if known.lower() == name), name)
    entry = tenants.setdefault(name, {})
    if not field:
        if not isinstance(raw, dict):
            fail(f"tenants.{name}", "must be an inline table, e.g. '{ pool_slots_share = 8 }'", var)
        entry.update(raw)
        sources[f"tenants.{name}"] = var
        return
    if field not in FIELDS:
        fail(f"tenants.{name}.{field}", f"unknown key; a tenant has {sorted(FIELDS)}", var)
    entry[field] = raw
    sources[f"tenants.{name}.{field}"] = var


def validate(
    tenants: Mapping[str, TenantConfig],
    pool_slots: int,
    disk_bytes: int | None,
    fail: Callable[[str, str], None],
) -> None:
    """Refuse a cap below its share, and shares that add up to more than a tier (the named
    entries' and one default share: ``pool_slots`` slots, ``disk_bytes`` bytes when the disk
    tier is on; the object tier has no size)."""
    totals = dict.fromkeys(TIERS, 0)
    for name in [*(n for n in tenants if n != DEFAULT), DEFAULT]:
        if not name.strip():
            fail("tenants", "a tenant's name must not be empty")
        values = resolve(tenants, name)
        own = tenants.get(name, TenantConfig())
        for tier in TIERS:
            share, cap = values[f"{tier}_share"], values[f"{tier}_cap"]
            assert share is not None
            totals[tier] += share
            if cap is not None and cap < share:
                inherited = getattr(own, f"{tier}_cap") is msgspec.UNSET
                fail(
                    f"tenants.{name}.{tier}_cap",
                    f"must be >= {tier}_share ({share}), got {cap}"
                    + (f" (from [tenants.{DEFAULT}])" if inherited else ""),
                )
    sizes = {"pool_slots": pool_slots, "disk_bytes": disk_bytes}
    for tier, size in sizes.items():
        if size is not None and totals[tier] > size:
            fail(
                "tenants",
                f"the {tier}_share values add up to {totals[tier]} {tier.split('_')[1]} (every named tenant's "
                f"and one default share), more than the tier's {size}",
            )
