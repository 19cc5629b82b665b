"""Batched copies between KV tensors on a device and host-pool slots, through a staging buffer
on the device (no vLLM; torch only).

A transfer moves the pages of many blocks of many tensors. One ``copy_`` per (block, tensor)
costs a copy launch each (a few microseconds) for pages of tens of KiB, so the copy engines sit
idle most of the time. Here a transfer is instead:

- a store: per tensor, one gather of its pages into the staging buffer, laid out exactly as the
  slots' bytes (``index_select`` + ``index_copy_``: device-memory speed), then one DMA per run of
  consecutive slots (a whole slot region at a time) from the staging buffer to the pool;
- a load: one DMA per run of slots into the staging buffer, then per tensor one scatter of its
  pages into the tensor.

Every byte of a block is moved as is (int8 rows, index copies), so the copies are bit-exact.
Bytes of a slot region that no page covers (a group smaller than the block stride, a chunk a
store covers only in part) are written as zeros by a store. All work is queued on the caller's
current stream; the DMAs are asynchronous when the pool is page-locked (``cudaHostRegister``),
so a submission does not wait for the copies. The staging buffer is the caller's and may be
reused by the next transfer queued on the same stream. The same code runs on CPU tensors
(synchronously), which is how it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

STAGE_BYTES = 64 << 20
"""Largest staging buffer a transfer uses: longer transfers go in batches of keys (at least
one slot region per batch)."""


@dataclass(frozen=True)
class Part:
    """The pages one tensor contributes to a transfer. ``rows``: the tensor as (blocks, row
    bytes) of int8/uint8 on the device; ``blocks[i]`` goes to (or comes from) fine row
    ``fine_rows[i]`` of the staging buffer, bytes ``[offset, offset + nbytes)`` of it."""

    rows: torch.Tensor
    blocks: Sequence[int]
    fine_rows: Sequence[int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SlotRegion:
    """Where a transfer's bytes sit in each slot: ``[offset, offset + nbytes)``, cut into fine
    rows of ``fine_bytes`` (a block stride) that parts address as ``slot index * fine_per_slot
    + fine row in the slot``."""

    offset: int
    nbytes: int
    fine_bytes: int

    @property
    def fine_per_slot(self) -> int:
        return self.nbytes // self.fine_bytes


class StageBuffer:
    """A staging buffer on one device for one stream, grown on demand up to ``max_bytes``
    (rounded up to one slot region). Only transfers queued on that stream may share it."""

    def __init__(self, device: torch.device, max_bytes: int = STAGE_BYTES) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._buffer: torch.Tensor | None = None

    def slots_per_batch(self, region_bytes: int) -> int:
        return max(1, self.max_bytes // region_bytes)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.int8, device=self.device)
        return self._buffer[:nbytes]


def copy_slots(
    pool: torch.Tensor,
    slots: Sequence[int],
    region: SlotRegion,
    parts: Sequence[Part],
    to_pool: bool,
    stage: StageBuffer,
) -> int:
    """Copy ``parts`` between their tensors and ``slots`` (pool slot of each staging slot
    index); queued on the current stream. ``pool``: the host pool as (num_slots, block_bytes)
    int8. Returns the bytes of pages moved."""
    if region.nbytes % region.fine_bytes:
        raise ValueError(f"slot region {region.nbytes} is not a multiple of {region.fine_bytes}")
    pool = _int8(pool)
    parts = [
        Part(_int8(p.rows), p.blocks, p.fine_rows, p.offset, p.nbytes) for p in parts if p.blocks
    ]
    per_batch = stage.slots_per_batch(region.nbytes)
    moved = 0
    for first in range(0, len(slots), per_batch):
        batch = range(first, min(first + per_batch, len(slots)))
        moved += _copy_batch(pool, slots, batch, region, parts, to_pool, stage)
    return moved


def _copy_batch(
    pool: torch.Tensor,
    slots: Sequence[int],
    batch: range,
    region: SlotRegion,
    parts: Sequence[Part],
    to_pool: bool,
    stage: StageBuffer,
) -> int:
    per_slot = region.fine_per_slot
    low, high = batch.start * per_slot, batch.stop * per_slot
    selected = []
    for part in parts:
        pairs = [
            (block, fine - low)
            for block, fine in zip(part.blocks, part.fine_rows, strict=True)
            if low <= fine < high
        ]
        if pairs:
            selected.append((part, pairs))
    if not selected:
        return 0
    buffer = stage.get(len(batch) * region.nbytes)
    slot_view = buffer.view(len(batch), region.nbytes)
    fine = buffer.view(len(batch) * per_slot, region.fine_bytes)
    indexes = _device_indexes([p for _, pairs in selected for p in pairs], fine.device)
    covered = sum(part.nbytes * len(pairs) for part, pairs in selected)
    moved = 0
    if to_pool:
        if covered < buffer.numel():
            buffer.zero_()
        at = 0
        for part, pairs in selected:
            blocks, rows = indexes(at, len(pairs))
            at += len(pairs)
            pages = part.rows[:, : part.nbytes].index_select(0, blocks)
            fine[:, part.offset : part.offset + part.nbytes].index_copy_(0, rows, pages)
            moved += pages.numel()
        _dma(pool, slots, batch, region, slot_view, to_pool=True)
        return moved
    _dma(pool, slots, batch, region, slot_view, to_pool=False)
    at = 0
    for part, pairs in selected:
        blocks, rows = indexes(at, len(pairs))
        at += len(pairs)
        pages = fine[:, part.offset : part.offset + part.nbytes].index_select(0, rows)
        part.rows[:, : part.nbytes].index_copy_(0, blocks, pages)
        moved += pages.numel()
    return moved


def _int8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)


def _device_indexes(
    pairs: list[tuple[int, int]], device: torch.device
) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """One host-to-device copy of every (block, fine row) index of a batch; returns a slicer
    ``(start, count) -> (blocks, fine rows)`` of device index tensors. From page-locked memory
    and non-blocking, so queuing it does not wait for the stream."""
    host = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    if device.type == "cuda":
        host = host.pin_memory()
    both = host.to(device, non_blocking=True)

    def take(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return both[0, start : start + count], both[1, start : start + count]

    return take


def _dma(
    pool: torch.Tensor,
    slots: Sequence[int],
    batch: range,
    region: SlotRegion,
    slot_view: torch.Tensor,
    to_pool: bool,
) -> None:
    """Copy the batch's slot regions between the pool and the staging buffer: one copy per run
    of consecutive slots when the region is the whole slot (the run is one contiguous span of
    the pool), else one per slot."""
    whole = region.offset == 0 and region.nbytes == pool.shape[1]
    batch_slots = [slots[i] for i in batch]
    runs = _runs(batch_slots) if whole else [(i, s, 1) for i, s in enumerate(batch_slots)]
    end = region.offset + region.nbytes
    for first, slot, count in runs:
        host = pool[slot : slot + count, region.offset : end]
        staged = slot_view[first : first + count]
        if to_pool:
            host.copy_(staged, non_blocking=True)
        else:
            staged.copy_(host, non_blocking=True)


def _runs(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index of the first value, first value, length) of each run of consecutive values."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == value:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((i, value, 1))
    return runs
