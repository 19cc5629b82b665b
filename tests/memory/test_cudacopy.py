"""The batched device copies (``kvoffload.memory.cudacopy``), run on CPU tensors: the same torch
code as on a GPU, synchronous here. Bit-exactness against per-block slicing."""

from __future__ import annotations

import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

import torch  # noqa: E402

from kvoffload.memory.cudacopy import Part, SlotRegion, StageBuffer, copy_slots  # noqa: E402

PAGE = 96
NUM_BLOCKS = 12


def tensors(seed: int, count: int = 3, dtype=torch.int8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen).view(dtype)
        for _ in range(count)
    ]


@pytest.mark.parametrize("stage_slots", [1, 2, 16])
def test_whole_slots_store_and_load_bit_exact_in_any_batch_size(stage_slots):
    src = tensors(seed=1, dtype=torch.uint8)  # the cpu worker's rows are uint8
    block = len(src) * PAGE
    pool = torch.zeros(8, block, dtype=torch.uint8)
    slots, blocks = [3, 4, 5, 0, 7], [9, 2, 2, 11, 0]  # a run of three slots, then two singles
    parts = [Part(t, blocks, range(5), j * PAGE, PAGE) for j, t in enumerate(src)]
    stage = StageBuffer(torch.device("cpu"), max_bytes=stage_slots * block)

    moved = copy_slots(pool, slots, SlotRegion(0, block, block), parts, True, stage)

    assert moved == 5 * block
    for slot, b in zip(slots, blocks, strict=True):
        assert torch.equal(pool[slot], torch.cat([t[b] for t in src]))
    assert not pool[[1, 2, 6]].any()
    dst = [torch.zeros_like(t) for t in src]
    back = [Part(t, [1, 3, 5, 7, 8], range(5), j * PAGE, PAGE) for j, t in enumerate(dst)]
    copy_slots(pool, slots, SlotRegion(0, block, block), back, False, stage)
    for got, want in zip([1, 3, 5, 7, 8], blocks, strict=True):
        for j in range(len(src)):
            assert torch.equal(dst[j][got], src[j][want])


def test_a_region_of_the_slot_is_written_around_the_rest_and_gaps_are_zero():
    """One rank's region (bytes [R, 2R) of each slot), two blocks per slot, a group whose
    pages fill only part of the stride, and a first slot covered only from its second block."""
    src = tensors(seed=2, count=2)
    stride = 3 * PAGE  # the widest group's pages; this group has two tensors
    region = SlotRegion(2 * stride, 2 * stride, stride)
    pool = torch.full((4, 4 * stride + 8), 5, dtype=torch.int8)
    fine = [1, 2, 3]  # slot 0's second block, slot 1's two blocks
    blocks = [4, 5, 6]
    parts = [Part(t, blocks, fine, j * PAGE, PAGE) for j, t in enumerate(src)]

    copy_slots(pool, [2, 0], region, parts, True, StageBuffer(torch.device("cpu")))

    def at(slot: int, block_in_slot: int, j: int) -> torch.Tensor:
        start = region.offset + block_in_slot * stride + j * PAGE
        return pool[slot, start : start + PAGE]

    for j, t in enumerate(src):
        assert torch.equal(at(2, 1, j), t[4])
        assert torch.equal(at(0, 0, j), t[5]) and torch.equal(at(0, 1, j), t[6])
    assert (pool[:, : region.offset] == 5).all()  # other ranks' bytes untouched
    assert (pool[:, region.offset + region.nbytes :] == 5).all()
    assert (
        not at(2, 0, 0).any()
        and not pool[2, region.offset + 2 * PAGE : region.offset + stride].any()
    )
    assert (pool[[1, 3]] == 5).all()


def test_a_load_reads_only_the_pages_asked_for():
    src = tensors(seed=3, count=1)
    region = SlotRegion(0, 2 * PAGE, PAGE)
    pool = torch.zeros(3, 2 * PAGE, dtype=torch.int8)
    pool[1, :PAGE], pool[1, PAGE:] = src[0][0], src[0][1]
    dst = torch.zeros_like(src[0])
    copy_slots(
        pool, [1], region, [Part(dst, [7], [1], 0, PAGE)], False, StageBuffer(torch.device("cpu"))
    )
    assert torch.equal(dst[7], src[0][1])
    assert not dst[[i for i in range(NUM_BLOCKS) if i != 7]].any()
