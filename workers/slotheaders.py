"""A worker's view of the slot header table: stamp a slot once its bytes are complete, and check
a stamped slot against its bytes (the ``verify`` job of a restarted manager).

A worker stamps only slots the manager handed it for writing, after every byte of the block has
landed (CUDA copies synchronized) and before it reports the key as succeeded. The header's
generation is the job id, so the newest copy of a key wins when a restarted manager rebuilds.
"""

from __future__ import annotations

from kvoffload.config import Config
from kvoffload.memory.blockformat import (
    BlockChecksum,
    block_checksum,
    deployment_fingerprint,
    payload_checksum,
    slice_checksums,
)
from kvoffload.memory.pool import HostPool
from kvoffload.memory.slottable import SlotTable


class SlotHeaders:
    """Stamps and checks slot headers of one pool for one deployment fingerprint. Thread-safe:
    each call touches one slot's header, and the manager never hands one slot to two writers."""

    def __init__(self, table: SlotTable, pool: HostPool, fingerprint: bytes) -> None:
        if table.num_slots != pool.num_slots:
            raise ValueError(f"slot table has {table.num_slots} slots, the pool {pool.num_slots}")
        self._table = table
        self._pool = pool
        self._fingerprint = fingerprint

    @classmethod
    def open(cls, table_name: str, cfg: Config, pool: HostPool) -> SlotHeaders | None:
        """Attach the run's table; None when slot headers are off (no name or config off)."""
        if not table_name or not cfg.pool.slot_headers:
            return None
        table = SlotTable.attach(table_name, pool.num_slots)
        return cls(table, pool, deployment_fingerprint(pool.block_bytes, cfg.pool.layout_id))

    def stamp(
        self, slot: int, key: bytes, generation: int, checksum: BlockChecksum | None = None
    ) -> list[int]:
        """Describe ``slot`` as holding ``key``. ``checksum``: the slot's checksum when the
        caller already verified it against a stored header; the xxh3 of the slot computed now
        if None. A block of several slices also gets its slices' digests, taken from the slot
        (ValueError if they do not make ``checksum``: the bytes changed since). Returns the
        block's digests as a reader verifies them (``BlockChecksum.digests``)."""
        data = self._pool.slot_array(slot)
        if checksum is None:
            checksum = BlockChecksum(payload_checksum(data))
        digests: list[int] = []
        if checksum.slices > 1:
            digests = slice_checksums(data, checksum.slices, checksum.slice_bytes)
        header = checksum.header(key, self._pool.block_bytes, self._fingerprint, generation)
        self._table.write(slot, header, digests)
        return digests or [checksum.value]

    def checksum_of(self, slot: int, key: bytes) -> BlockChecksum | None:
        """The checksum stamped for ``key`` in ``slot``'s header: the one its writers took of
        the bytes when they landed. None when the slot has no valid header of this deployment
        for ``key`` and this block size (then nobody vouched for the bytes)."""
        header = self._table.read(slot, self._fingerprint)
        if header is None or header.key != key or header.payload_len != self._pool.block_bytes:
            return None
        return header.block_checksum

    def check(self, slot: int, key: bytes) -> str:
        """ "" when ``slot`` has a header for ``key`` that matches the slot's bytes, else why not."""
        header = self._table.read(slot, self._fingerprint)
        if header is None:
            return "no valid header"
        if header.key != key:
            return "header names another key"
        if header.payload_len != self._pool.block_bytes:
            return f"header length {header.payload_len} != block size {self._pool.block_bytes}"
        data = self._pool.slot_array(slot)
        if block_checksum(data, header.slices, header.slice_bytes) != header.checksum:
            return "checksum mismatch"
        if header.slices > 1 and not self._table.slice_checksums(slot, header):
            return "slice checksums lost"
        return ""

    def close(self) -> None:
        self._table.close()
