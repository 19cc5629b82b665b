"""Where a vLLM worker's KV bytes live inside one pool block (pure arithmetic, no vLLM, no I/O).

One pool block holds one offload key. A key names ``blocks_per_chunk`` consecutive vLLM blocks
of one KV cache group (vLLM's key carries the group index), for every tensor-parallel rank.
Rank ``r`` owns the bytes ``[r * per_rank_bytes, (r + 1) * per_rank_bytes)``; inside them,
block ``j`` of the chunk (0-based) starts at ``j * block_stride`` and holds the pages of the
key's group, in that group's tensor order:

    pool block = rank 0 [chunk block 0: t0 page | t1 page | ...][chunk block 1: ...] ...
                 rank 1 [...]

``block_stride`` is vLLM's bytes per block of one rank (given, so the scheduler side, which
sees no pages, lays slots out as the workers do), at least the largest group's pages, so every
group fits; a smaller group leaves the rest of each stride unused. ``per_rank_bytes =
blocks_per_chunk * block_stride``. The pool's ``block_bytes`` must be at least ``copies *
per_rank_bytes``; the rest of the block is left unused.

A replicated layout (vLLM's, for models whose every rank holds the same KV bytes, such as MLA
under tensor parallelism) keeps one copy: rank 0 writes it at offset 0 and every rank reads it
from there, so ``copies`` is 1 whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class GeometryError(ValueError):
    """The pool's block size cannot hold vLLM's block (message names both numbers)."""


@dataclass(frozen=True)
class BlockLayout:
    """``group_pages[g]``: the page bytes of each KV tensor of the ``g``-th offloaded group, in
    the order of vLLM's offloading config (the order of a transfer's ``group_sizes``).
    ``stride``: the bytes of one vLLM block of one rank in a slot; 0: the largest group's."""

    group_pages: tuple[tuple[int, ...], ...]
    blocks_per_chunk: int
    rank: int
    world_size: int
    replicated: bool = False
    stride: int = 0

    def __post_init__(self) -> None:
        if not self.group_pages or not all(self.group_pages):
            raise ValueError(f"every KV cache group needs at least one page: {self.group_pages}")
        if self.stride and self.stride < self.largest_group_bytes:
            raise ValueError(
                f"the KV pages of the largest group sum to {self.largest_group_bytes} bytes per "
                f"block, more than the stride of {self.stride}"
            )

    @property
    def largest_group_bytes(self) -> int:
        return max(sum(pages) for pages in self.group_pages)

    @property
    def block_stride(self) -> int:
        """Bytes of one vLLM block of this rank in a slot."""
        return self.stride or self.largest_group_bytes

    @property
    def per_rank_bytes(self) -> int:
        return self.blocks_per_chunk * self.block_stride

    @property
    def copies(self) -> int:
        """Copies of a block's bytes in its slot: one per rank, or one for all (replicated)."""
        return 1 if self.replicated else self.world_size

    @property
    def writes(self) -> bool:
        """Whether this rank writes its bytes to the pool (in a replicated layout rank 0 alone
        does, for every rank)."""
        return not self.replicated or self.rank == 0

    @property
    def slice_index(self) -> int:
        """Which of a block's slice digests is this rank's (one slice: the whole slot)."""
        return 0 if self.copies == 1 else self.rank

    def checked_bytes(self, slot: np.ndarray) -> np.ndarray:
        """What this rank's digest of a slot covers: the whole slot when one copy lives in it
        (one rank, or a replicated layout), else this rank's slice."""
        if self.copies == 1:
            return slot
        return slot[self.rank * self.per_rank_bytes : (self.rank + 1) * self.per_rank_bytes]

    @property
    def needed_block_bytes(self) -> int:
        return self.copies * self.per_rank_bytes

    def unused_fraction(self) -> float:
        """The share of a slot's per-rank bytes the smallest group leaves unused."""
        return 1 - min(sum(pages) for pages in self.group_pages) / self.block_stride

    def tensor_offsets(self, group: int) -> tuple[int, ...]:
        offsets, at = [], 0
        for size in self.group_pages[group]:
            offsets.append(at)
            at += size
        return tuple(offsets)

    def offset(self, chunk_block: int) -> int:
        """Byte offset, inside a pool block, of this rank's block ``chunk_block`` of the chunk."""
        rank = 0 if self.replicated else self.rank
        return rank * self.per_rank_bytes + chunk_block * self.block_stride

    def check_fits(self, pool_block_bytes: int) -> None:
        check_fits(pool_block_bytes, self.copies, self.blocks_per_chunk, self.block_stride)


def check_fits(
    pool_block_bytes: int, copies: int, blocks_per_chunk: int, rank_block_bytes: int
) -> None:
    """GeometryError unless a pool block holds ``copies`` copies (one per rank, or one for all
    ranks in a replicated layout) of one offload key."""
    needed = copies * blocks_per_chunk * rank_block_bytes
    if pool_block_bytes < needed:
        raise GeometryError(
            f"the kvoffload pool's block_bytes is {pool_block_bytes}, but one vLLM offload "
            f"block needs {needed} bytes ({copies} rank cop(ies) x {blocks_per_chunk} "
            f"block(s) per chunk x {rank_block_bytes} bytes). Set pool.block_bytes "
            f"(KVOFFLOAD_POOL__BLOCK_BYTES) to {_round_up(needed)} in the kvoffload config, "
            f"or lower 'blocks_per_chunk' / 'block_size' in kv_connector_extra_config."
        )


class CopyRow(NamedTuple):
    """One vLLM block <-> one place in a pool slot: ``key_index`` indexes the transfer's keys,
    ``group`` the offloaded group whose tensors the block belongs to."""

    block_id: int
    key_index: int
    chunk_block: int
    group: int = 0


def transfer_rows(
    num_keys: int,
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
) -> list[CopyRow]:
    """Pair the vLLM blocks of one transfer with its keys, group by group.

    ``block_ids`` holds the blocks of every group, concatenated in group order, ``group_sizes[g]``
    of them for group ``g``; the transfer's keys are in the same group order. A group's blocks are
    consecutive blocks of one request starting at request block index ``block_indices[g]``, so
    they cover the chunks from the one holding that block on: a transfer may start in the middle
    of a chunk (the blocks before it are already computed, or outside a sliding window), and ends
    at the end of one. ValueError when the blocks and the keys do not pair up exactly."""
    if len(group_sizes) != len(block_indices) or sum(group_sizes) != len(block_ids):
        raise ValueError(
            f"{len(block_ids)} blocks do not match group sizes {list(group_sizes)} "
            f"and first block indexes {list(block_indices)}"
        )
    rows: list[CopyRow] = []
    first_key = first_block = 0
    for group, (size, start) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        if (start + size) % blocks_per_chunk:
            raise ValueError(
                f"group {group}: {size} blocks from index {start} end inside a chunk of "
                f"{blocks_per_chunk} blocks (a key names whole chunks)"
            )
        key_base = first_key - start // blocks_per_chunk
        rows.extend(
            CopyRow(block_id, key_base + index // blocks_per_chunk, index % blocks_per_chunk, group)
            for block_id, index in zip(
                block_ids[first_block : first_block + size], range(start, start + size), strict=True
            )
        )
        first_block += size
        first_key = rows[-1].key_index + 1
    if first_key != num_keys:
        raise ValueError(
            f"{len(block_ids)} blocks in groups {list(group_sizes)} from indexes "
            f"{list(block_indices)} cover {first_key} keys of {blocks_per_chunk} blocks, "
            f"the transfer has {num_keys}"
        )
    return rows


def _round_up(value: int, to: int = 4096) -> int:
    return (value + to - 1) // to * to
