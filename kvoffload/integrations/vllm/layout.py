"""Where a vLLM worker's KV bytes live inside one pool block (pure arithmetic, no vLLM, no I/O).

One pool block holds one offload key: ``blocks_per_chunk`` consecutive vLLM blocks of every
offloaded layer, for every tensor-parallel rank. Rank ``r`` owns the bytes
``[r * per_rank_bytes, (r + 1) * per_rank_bytes)``; inside them, block ``j`` of the chunk
(0-based) starts at ``j * rank_block_bytes`` and holds each KV tensor's page in tensor order:

    pool block = rank 0 [chunk block 0: t0 page | t1 page | ...][chunk block 1: ...] ...
                 rank 1 [...]

``per_rank_bytes = blocks_per_chunk * sum(page bytes)``. The pool's ``block_bytes`` must be at
least ``world_size * per_rank_bytes``; the rest of the block is left unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class GeometryError(ValueError):
    """The pool's block size cannot hold vLLM's block (message names both numbers)."""


@dataclass(frozen=True)
class BlockLayout:
    page_bytes: tuple[int, ...]
    blocks_per_chunk: int
    rank: int
    world_size: int

    @property
    def rank_block_bytes(self) -> int:
        """Bytes of one vLLM block of this rank (all its tensors' pages)."""
        return sum(self.page_bytes)

    @property
    def per_rank_bytes(self) -> int:
        return self.blocks_per_chunk * self.rank_block_bytes

    @property
    def needed_block_bytes(self) -> int:
        return self.world_size * self.per_rank_bytes

    @property
    def tensor_offsets(self) -> tuple[int, ...]:
        offsets, at = [], 0
        for size in self.page_bytes:
            offsets.append(at)
            at += size
        return tuple(offsets)

    def offset(self, chunk_block: int) -> int:
        """Byte offset, inside a pool block, of this rank's block ``chunk_block`` of the chunk."""
        return self.rank * self.per_rank_bytes + chunk_block * self.rank_block_bytes

    def check_fits(self, pool_block_bytes: int) -> None:
        check_fits(pool_block_bytes, self.world_size, self.blocks_per_chunk, self.rank_block_bytes)


def check_fits(
    pool_block_bytes: int, world_size: int, blocks_per_chunk: int, rank_block_bytes: int
) -> None:
    """GeometryError unless a pool block holds one offload key of every rank."""
    needed = world_size * blocks_per_chunk * rank_block_bytes
    if pool_block_bytes < needed:
        raise GeometryError(
            f"the kvoffload pool's block_bytes is {pool_block_bytes}, but one vLLM offload "
            f"block needs {needed} bytes ({world_size} rank(s) x {blocks_per_chunk} "
            f"block(s) per chunk x {rank_block_bytes} bytes). Set pool.block_bytes "
            f"(KVOFFLOAD_POOL__BLOCK_BYTES) to {_round_up(needed)} in the kvoffload config, "
            f"or lower 'blocks_per_chunk' / 'block_size' in kv_connector_extra_config."
        )


@dataclass(frozen=True)
class CopyRow:
    """One vLLM block <-> one place in a pool slot."""

    block_id: int
    key_index: int
    chunk_block: int


def store_rows(num_keys: int, block_ids: Sequence[int], blocks_per_chunk: int) -> list[CopyRow]:
    """Pair the vLLM blocks of a store with its keys: each key is ``blocks_per_chunk`` whole
    blocks, in key order (a store only ever writes whole chunks). ValueError otherwise."""
    if len(block_ids) != num_keys * blocks_per_chunk:
        raise ValueError(
            f"a store of {num_keys} keys needs {num_keys * blocks_per_chunk} blocks, "
            f"got {len(block_ids)}"
        )
    return [
        CopyRow(block_id, i // blocks_per_chunk, i % blocks_per_chunk)
        for i, block_id in enumerate(block_ids)
    ]


def load_rows(
    num_keys: int,
    block_ids: Sequence[int],
    first_block_index: int,
    blocks_per_chunk: int,
) -> list[CopyRow]:
    """Pair the vLLM blocks of a load with the keys they belong to.

    ``block_ids`` are consecutive blocks of one request starting at request block index
    ``first_block_index``; ``num_keys`` keys cover the chunks from the one holding that block
    on. A load may start in the middle of a chunk (the blocks before it are already computed);
    the rows say which chunk block each vLLM block is. ValueError if the blocks run past the
    keys."""
    first_chunk = first_block_index // blocks_per_chunk
    rows = []
    for i, block_id in enumerate(block_ids):
        index = first_block_index + i
        key_index = index // blocks_per_chunk - first_chunk
        if key_index >= num_keys:
            raise ValueError(
                f"{len(block_ids)} blocks from index {first_block_index} need more than "
                f"{num_keys} keys of {blocks_per_chunk} blocks"
            )
        rows.append(CopyRow(block_id, key_index, index % blocks_per_chunk))
    return rows


def _round_up(value: int, to: int = 4096) -> int:
    return (value + to - 1) // to * to
