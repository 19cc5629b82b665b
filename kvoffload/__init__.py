"""kvoffload: a tiered KV-cache offload service for LLM inference.

The public surface is what this module names (``__all__``); everything else in the package
is internal and may change between releases. Each name loads its module on first use, so
``import kvoffload`` is cheap and imports nothing else.

- the client: ``KVOffloadClient``, its errors (``KVOffloadError`` with an ``ErrorCode``,
  ``ServiceUnavailable``), what its calls return (``LookupOutcome``, ``PendingCall``,
  ``LookupResult``, ``MissReason``, ``JobAccepted``, ``DeviceJobFinished``, ``Slots``,
  ``TenantDropped``, ``ManagerStatus``) and the KV handles it registers (``KVHandle``, ``SharedKVCache``,
  ``cuda_kv_handle``);
- the direct path, for a client that copies blocks itself: ``HostPool`` (maps the service's
  host pool) and ``payload_checksum`` (the checksum ``complete_store`` takes);
- finding a running service: ``find_endpoint`` (raises ``NoServiceFound``);
- tenants: ``tenant_id``, the id the service knows a tenant name by;
- vLLM: ``VLLM_CONNECTOR`` and ``VLLM_CONNECTOR_MODULE``, the ``kv_connector`` and
  ``kv_connector_module_path`` of vLLM's ``KVTransferConfig``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.client import (
        KVOffloadClient,
        KVOffloadError,
        LookupOutcome,
        PendingCall,
        ServiceUnavailable,
    )
    from kvoffload.memory.blockformat import payload_checksum
    from kvoffload.memory.kvcache import SharedKVCache, cuda_kv_handle
    from kvoffload.memory.pool import HostPool
    from kvoffload.runtime.discovery import NoServiceFound, find_endpoint
    from kvoffload.wire.protocol import (
        DeviceJobFinished,
        ErrorCode,
        JobAccepted,
        KVHandle,
        LookupResult,
        MissReason,
        Slots,
        TenantDropped,
    )
    from kvoffload.wire.status import ManagerStatus
    from kvoffload.wire.tenant_ids import tenant_id

__version__ = "0.1.0"

VLLM_CONNECTOR = "KVOffloadConnector"
VLLM_CONNECTOR_MODULE = "kvoffload.integrations.vllm.connector"

_HOMES = {
    "KVOffloadClient": "kvoffload.client",
    "KVOffloadError": "kvoffload.client",
    "ServiceUnavailable": "kvoffload.client",
    "LookupOutcome": "kvoffload.client",
    "PendingCall": "kvoffload.client",
    "SharedKVCache": "kvoffload.memory.kvcache",
    "cuda_kv_handle": "kvoffload.memory.kvcache",
    "HostPool": "kvoffload.memory.pool",
    "payload_checksum": "kvoffload.memory.blockformat",
    "find_endpoint": "kvoffload.runtime.discovery",
    "NoServiceFound": "kvoffload.runtime.discovery",
    "DeviceJobFinished": "kvoffload.wire.protocol",
    "ErrorCode": "kvoffload.wire.protocol",
    "JobAccepted": "kvoffload.wire.protocol",
    "KVHandle": "kvoffload.wire.protocol",
    "LookupResult": "kvoffload.wire.protocol",
    "MissReason": "kvoffload.wire.protocol",
    "Slots": "kvoffload.wire.protocol",
    "TenantDropped": "kvoffload.wire.protocol",
    "ManagerStatus": "kvoffload.wire.status",
    "tenant_id": "kvoffload.wire.tenant_ids",
}

__all__ = [
    "VLLM_CONNECTOR",
    "VLLM_CONNECTOR_MODULE",
    "DeviceJobFinished",
    "ErrorCode",
    "HostPool",
    "JobAccepted",
    "KVHandle",
    "KVOffloadClient",
    "KVOffloadError",
    "LookupOutcome",
    "LookupResult",
    "ManagerStatus",
    "MissReason",
    "NoServiceFound",
    "PendingCall",
    "ServiceUnavailable",
    "SharedKVCache",
    "Slots",
    "TenantDropped",
    "__version__",
    "cuda_kv_handle",
    "find_endpoint",
    "payload_checksum",
    "tenant_id",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
