"""The environment of the service's tier workers: non-temporal stores for block copies.

glibc's memcpy writes through the cache up to a large share of the last-level cache and only
beyond it streams to memory (non-temporal stores). A host-pool block (256 KiB to a few MiB) is
written once and read much later, so caching it only evicts other data and costs a read of
every destination line first: on the machines measured, copies of 256 KiB-4 MiB blocks ran
1.6-1.9x as fast with non-temporal stores (``kvoffload bench`` measures both as its memcpy
limit). The workers therefore start with glibc's threshold lowered to ``NONTEMPORAL_BYTES``.
An operator's own ``glibc.cpu.x86_non_temporal_threshold`` in ``GLIBC_TUNABLES`` is kept; on
other C libraries or CPUs the setting is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

NONTEMPORAL_BYTES = 256 << 10
THRESHOLD_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def worker_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``THRESHOLD_TUNABLE`` set to ``NONTEMPORAL_BYTES`` in ``GLIBC_TUNABLES``,
    unless ``base`` already sets that tunable."""
    env = dict(base)
    tunables = env.get("GLIBC_TUNABLES", "")
    if THRESHOLD_TUNABLE in tunables:
        return env
    ours = f"{THRESHOLD_TUNABLE}={NONTEMPORAL_BYTES:#x}"
    env["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables else ours
    return env
