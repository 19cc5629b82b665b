"""The kvoffload side of a vLLM transfer: which pool slots hold which keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LoadStoreSpec

from kvoffload.wire.protocol import Connected

NO_SLOT = -1


@dataclass
class PoolBlocks(LoadStoreSpec):
    """Slots of the host pool ``pool_name`` co-indexed with ``keys`` (namespaced keys).

    For a load, every slot is pinned for this engine until ``complete_load``; a slot of
    ``NO_SLOT`` means the key could not be pinned and its load must be reported failed. For a
    store, the slots were reserved by ``prepare_store`` and are written by the workers.
    ``req_id`` is vLLM's request id, so a worker can say whose transfer failed.
    ``manager_pid`` is the manager that reserved the slots: they are only valid while it lives.
    ``checksums`` (loads only, co-indexed with ``keys``): the digests each block had when it
    was written (one for the whole slot, or one per rank's slice), empty where none was
    recorded; a worker verifies its bytes of each slot against them."""

    req_id: str
    pool_name: str
    num_slots: int
    block_bytes: int
    keys: list[bytes]
    slots: list[int]
    manager_pid: int
    checksums: list[list[int]] = field(default_factory=list)

    @classmethod
    def in_pool(
        cls,
        info: Connected | None,
        req_id: str,
        keys: list[bytes],
        slots: list[int],
        checksums: list[list[int]] | None = None,
    ) -> PoolBlocks:
        """The slots of the pool the service described (``info``; None when it is
        unreachable: a pool no worker can map, so every copy of the transfer fails)."""
        return cls(
            req_id=req_id,
            pool_name=info.pool_name if info is not None else "",
            num_slots=info.num_slots if info is not None else 0,
            block_bytes=info.block_bytes if info is not None else 0,
            keys=keys,
            slots=slots,
            manager_pid=info.manager_pid if info is not None else 0,
            checksums=checksums or [],
        )
