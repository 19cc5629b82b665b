"""The tiers' events on the wire: what each tier of a node gained and lost.

- ``TierEvent``: one change of one tier, as the tiering library records it and as a client
  takes it (``protocol.TakeTierEvents``);
- vLLM's KV-event format (``KVEventBatch`` of ``BlockStored``, ``BlockRemoved`` and
  ``AllBlocksCleared``, msgpack), byte for byte what vLLM's ``vllm.distributed.kv_events``
  publishes, so a router that reads vLLM's events reads the node stream unchanged;
  ``vllm_events`` turns tier events into it;
- ``HeldBlocks``: a consumer's view of what each tier holds, built from the replies to
  ``protocol.TakeTierEvents``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from kvoffload.wire.vocab import PRIMARY, Locality, Medium


class TierEvent(msgspec.Struct, forbid_unknown_fields=True):
    """``keys`` entered (``removed`` false) or left tier ``tier`` (``PRIMARY``: the host pool,
    else a secondary tier's name), which keeps blocks in ``medium`` at ``locality``; every key
    is ``tenant``'s (a tenant id, "" for none)."""

    tier: str
    medium: Medium
    locality: Locality
    removed: bool
    keys: list[bytes]
    tenant: str = ""


# ---- vLLM's KV events (vllm/distributed/kv_events.py) ------------------------------------------

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV cache events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


STREAM_END_SEQ = -1
"""The sequence number of the frame that ends a node stream's replay (signed, 8 bytes)."""
STREAM_SNAPSHOT_REQUEST = b"snapshot"
"""The replay request that asks a node stream for a snapshot."""

VLLM_MEDIUM = {Medium.CPU: "CPU", Medium.STORAGE: "STORAGE"}
VLLM_LOCALITY = {Locality.LOCAL: "LOCAL", Locality.REMOTE: "REMOTE"}

FINGERPRINT_BYTES = 16
"""The deployment fingerprint that starts every key of the vLLM integration."""
GROUP_BYTES = 4
"""The KV-cache group index (big-endian) that ends vLLM's offload key."""
INT_HASH_MASK = (1 << 64) - 1


class KeyForm(enum.StrEnum):
    """How the node stream names a block in ``block_hashes``."""

    KEY = "key"  # the service's key, as clients send it
    VLLM = "vllm"  # vLLM's block hash as vLLM's own events carry it by default: a 64-bit int
    VLLM_BYTES = "vllm-bytes"  # vLLM's block hash as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)


def _block_ids(keys: list[bytes], form: KeyForm) -> dict[int | None, list[ExternalBlockHash]]:
    """``keys`` as ``form`` names them, by KV-cache group (None: ``KEY`` has no groups). A
    vLLM key is ``fingerprint || block hash || group``; a key too short for it stays whole."""
    if form is KeyForm.KEY:
        return {None: list(keys)}
    out: dict[int | None, list[ExternalBlockHash]] = {}
    floor = FINGERPRINT_BYTES + GROUP_BYTES
    for key in keys:
        if len(key) <= floor:
            out.setdefault(None, []).append(key)
            continue
        digest = key[FINGERPRINT_BYTES:-GROUP_BYTES]
        group = int.from_bytes(key[-GROUP_BYTES:], "big")
        block: ExternalBlockHash = digest
        if form is KeyForm.VLLM:
            block = int.from_bytes(digest, "big") & INT_HASH_MASK
        out.setdefault(group, []).append(block)
    return out


def _merged(events: Iterable[TierEvent]) -> list[TierEvent]:
    """``events`` with each run of neighbours of the same tier and change as one event."""
    out: list[TierEvent] = []
    for event in events:
        last = out[-1] if out else None
        if last is not None and (last.tier, last.removed) == (event.tier, event.removed):
            last.keys = [*last.keys, *event.keys]  # vLLM's format names no tenant
        else:
            out.append(msgspec.structs.replace(event))
    return out


def vllm_events(
    events: Iterable[TierEvent], form: KeyForm = KeyForm.KEY
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """Tier events as vLLM's KV events: the pool's blocks under medium ``CPU`` without an
    ``ownership`` (as vLLM's own CPU tier), a secondary tier's under its medium and locality
    with its name as ``ownership``. A stored block carries no tokens (``block_size`` 0).
    Neighbouring events of one tier and one change become one."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in _merged(events):
        medium = VLLM_MEDIUM[event.medium]
        pool = event.tier == PRIMARY
        locality = None if pool else VLLM_LOCALITY[event.locality]
        ownership = None if pool else event.tier
        for group, hashes in _block_ids(event.keys, form).items():
            if event.removed:
                out.append(BlockRemoved(hashes, medium, group, locality, ownership))
            else:
                out.append(
                    BlockStored(
                        hashes,
                        None,
                        [],
                        0,
                        None,
                        medium,
                        None,
                        group_idx=group,
                        locality=locality,
                        ownership=ownership,
                    )
                )
    return out


class TierEventsReply(Protocol):
    """What ``HeldBlocks`` reads of a ``protocol.TierEvents`` reply."""

    @property
    def events(self) -> list[TierEvent]: ...
    @property
    def resync(self) -> bool: ...
    @property
    def complete(self) -> list[str]: ...
    @property
    def in_snapshot(self) -> bool: ...


class HeldBlocks:
    """What a consumer of ``protocol.TierEvents`` knows each tier of a service holds (tier
    name -> key -> tenant). ``apply`` each reply in the order taken; it returns the changes to
    tell onwards, each key at most once per change: a key announced twice is told once, a
    removal of a key never told is not told, and a snapshot ends in the difference between
    what was held and what the snapshot lists (tiers it does not list in full keep theirs)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[bytes, str]] = {}
        self.complete: set[str] = set()
        """The tiers the last snapshot listed in full (they announce their removals)."""
        self._where: dict[str, tuple[Medium, Locality]] = {}
        self._snapshot: dict[str, dict[bytes, str]] | None = None

    def apply(self, reply: TierEventsReply) -> list[TierEvent]:
        if reply.resync:
            self._snapshot = {name: {} for name in reply.complete}
            self.complete = set(reply.complete)
        snapshot = self._snapshot
        if snapshot is None:
            return [change for e in reply.events for change in self._change(e)]
        for event in reply.events:
            self._where[event.tier] = (event.medium, event.locality)
            snapshot.setdefault(event.tier, {}).update(dict.fromkeys(event.keys, event.tenant))
        if reply.in_snapshot:
            return []
        self._snapshot = None
        out: list[TierEvent] = []
        for tier, listed in snapshot.items():
            held = self.held.setdefault(tier, {})
            if tier in self.complete:
                out.extend(
                    self._told(tier, True, {k: t for k, t in held.items() if k not in listed})
                )
            out.extend(self._told(tier, False, {k: t for k, t in listed.items() if k not in held}))
            if tier in self.complete:
                self.held[tier] = listed
            else:
                held.update(listed)
        return out

    def _change(self, event: TierEvent) -> list[TierEvent]:
        self._where[event.tier] = (event.medium, event.locality)
        held = self.held.setdefault(event.tier, {})
        if event.removed:
            keys = [k for k in event.keys if held.pop(k, None) is not None]
        else:
            keys = [k for k in event.keys if k not in held]
            held.update(dict.fromkeys(keys, event.tenant))
        if len(keys) == len(event.keys):
            return [event]
        return (
            [TierEvent(*self._tier(event.tier), event.removed, keys, event.tenant)] if keys else []
        )

    def _tier(self, tier: str) -> tuple[str, Medium, Locality]:
        medium, locality = self._where.get(tier, (Medium.CPU, Locality.LOCAL))
        return tier, medium, locality

    def _told(self, tier: str, removed: bool, keys: dict[bytes, str]) -> list[TierEvent]:
        by_tenant: dict[str, list[bytes]] = {}
        for key, tenant in keys.items():
            by_tenant.setdefault(tenant, []).append(key)
        return [TierEvent(*self._tier(tier), removed, ks, t) for t, ks in by_tenant.items()]
