"""The service's tier events as vLLM's ``OffloadingEvent``s (``KVOffloadManager.take_events``).

vLLM asks for events every scheduler step, once KV cache events are on
(``kv_events_config.enable_kv_cache_events``). They come from the service, not from this
engine's own calls: the service tells what its host pool, disk and object tiers gained and
lost, whoever's traffic caused it (other engines of the node included). At most one call every
``INTERVAL_S`` (``TakeTierEvents``, apart from lookups and stores), of this engine's keys only
(the fingerprint prefix), of no tenant or of the tenants this engine's requests named.

Tiers: the host pool as medium CPU with no locality or ownership (as vLLM's own CPU tier), the
disk as STORAGE/LOCAL and the object store as STORAGE/REMOTE, each named in ``ownership``. A
block stored in a tier that announces its removals (the pool and the indexed tiers) is sent
with ``removal_expected``, so vLLM's self-describing events keep its token ids until then.

When the service comes back (a reconnect) or this engine fell behind its event log, the
service sends a snapshot and this engine tells only the difference (``HeldBlocks``).
"""

from __future__ import annotations

import time

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.integrations.vllm import integration_logger
from kvoffload.integrations.vllm.keys import offload_key_of
from kvoffload.integrations.vllm.link import ServiceDown, ServiceLink
from kvoffload.wire.events import VLLM_LOCALITY, VLLM_MEDIUM, HeldBlocks, TierEvent
from kvoffload.wire.protocol import TierEvents
from kvoffload.wire.vocab import PRIMARY

log = integration_logger(__name__)

INTERVAL_S = 0.05
"""The shortest time between two calls for events."""
MAX_CALLS = 8
"""The most calls one ``take`` makes while the service says more events wait."""
MAX_KEYS = 16384


class ServiceEvents:
    def __init__(self, link: ServiceLink, fingerprint: bytes) -> None:
        self._link = link
        self._fingerprint = fingerprint
        self._held = HeldBlocks()
        self._cursor = 0
        self._generation = link.generation
        self._last_call = 0.0

    def take(self) -> list[OffloadingEvent]:
        """The changes since the last call (none while the service is down or asked too
        recently)."""
        now = time.monotonic()
        if now - self._last_call < INTERVAL_S:
            return []
        self._last_call = now
        out: list[OffloadingEvent] = []
        try:
            for _ in range(MAX_CALLS):
                if self._link.generation != self._generation:
                    self._generation = self._link.generation
                    self._cursor = 0  # a new session: start from a snapshot
                reply = self._link.call(self._take_from)
                self._cursor = reply.cursor
                out.extend(self._offloading(e) for e in self._held.apply(reply))
                if not reply.more:
                    break
        except (ServiceDown, KVOffloadError) as exc:
            log.debug("kvoffload_events_not_taken error=%s", exc)
        return out

    def _take_from(self, client: KVOffloadClient) -> TierEvents:
        return client.take_tier_events(self._cursor, self._fingerprint, MAX_KEYS)

    def _offloading(self, event: TierEvent) -> OffloadingEvent:
        keys = [OffloadKey(offload_key_of(k)) for k in event.keys]
        if event.tier == PRIMARY:
            return OffloadingEvent(keys, Medium.CPU, event.removed, removal_expected=True)
        return OffloadingEvent(
            keys,
            Medium(VLLM_MEDIUM[event.medium]),
            event.removed,
            locality=Locality(VLLM_LOCALITY[event.locality]),
            ownership=event.tier,
            removal_expected=event.tier in self._held.complete,
        )
