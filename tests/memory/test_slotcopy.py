import threading
import time

import numpy as np
import pytest

from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.slotcopy import (
    CHUNK_BYTES,
    PARALLEL_MIN_BYTES,
    Hashed,
    IndexedCopy,
    SlotCopier,
    _shares,
    page_items,
)

MIB = 1 << 20


def blocks(count: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(("count", "size"), [(1, 4096), (3, 5 * MIB + 3), (17, 256 << 10)])
def test_copy_with_checksums_copies_every_byte_and_returns_each_blocks_xxh3(threads, count, size):
    src = blocks(count, size, seed=count)
    dst = [np.zeros(size, np.uint8) for _ in range(count)]
    with SlotCopier(threads) as copier:
        sums = copier.copy_with_checksums(list(zip(dst, src, strict=True)))
    assert sums == [payload_checksum(block) for block in src]
    for got, want in zip(dst, src, strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(("count", "size"), [(1, 9 * MIB + 5), (2, 3 * MIB), (9, 300_001)])
def test_copy_moves_every_byte_also_when_blocks_are_cut_between_threads(threads, count, size):
    src = blocks(count, size, seed=size)
    dst = [np.zeros(size, np.uint8) for _ in range(count)]
    with SlotCopier(threads) as copier:
        copier.copy(list(zip(dst, src, strict=True)))
    for got, want in zip(dst, src, strict=True):
        assert np.array_equal(got, want)


def test_copy_writes_through_strided_destinations_and_reshaped_sources():
    src = blocks(1, 4 * MIB, seed=1)[0]
    rows = np.zeros((2, 4 * MIB), np.uint8)
    column_major = np.asfortranarray(np.zeros((2 * MIB, 2), np.uint8))
    with SlotCopier(4) as copier:
        copier.copy([(rows[1, :], src), (column_major, src.reshape(2 * MIB, 2))])
    assert np.array_equal(rows[1], src) and not rows[0].any()
    assert np.array_equal(column_major.reshape(-1), src)


def test_checksums_match_payload_checksum():
    bufs = blocks(6, MIB, seed=3)
    with SlotCopier(3) as copier:
        assert copier.checksums(bufs) == [payload_checksum(buf) for buf in bufs]


def test_a_failing_part_raises_only_after_every_other_part_finished():
    finished: list[int] = []

    def part(index):
        def run():
            if index == 0:
                raise ValueError("the calling thread's part failed")
            time.sleep(0.2)
            finished.append(index)
            return [index]

        return run

    with SlotCopier(3) as copier:
        with pytest.raises(ValueError, match="calling thread"):
            copier.run([part(0), part(1), part(2)])
        assert sorted(finished) == [1, 2]


@pytest.mark.parametrize("hashed", list(Hashed))
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_blocks_hashes_each_block_of_several_segments_in_order(hashed, threads):
    """A block of three segments (one crossing chunks) is copied whole and its digest is the
    xxh3 of its segments' bytes one after the other, whichever side is hashed."""
    sizes = [4096, 2 * CHUNK_BYTES + 4096, 12288]
    sources = [blocks(3, size, seed=size) for size in sizes]
    block_list = []
    for b in range(3):
        block_list.append(
            [(np.zeros(size, np.uint8), sources[j][b]) for j, size in enumerate(sizes)]
        )
    with SlotCopier(threads) as copier:
        sums = copier.copy_blocks(block_list, hashed)
    for b, block in enumerate(block_list):
        whole = np.concatenate([src for _, src in block])
        assert sums[b] == payload_checksum(whole)
        for dst, src in block:
            assert np.array_equal(dst, src)


def test_copy_then_hash_copies_each_part_then_hashes_its_regions():
    """Two parts, each a 2-D copy of consecutive rows into a strided column of the slots: every
    byte lands, and each region's digest is that of the slot after the copy."""
    slots = np.random.default_rng(7).integers(0, 256, (6, 3 * 4096), dtype=np.uint8)
    rows = np.random.default_rng(8).integers(0, 256, (6, 4096), dtype=np.uint8)
    parts = [
        ([(slots[0:3, 4096:8192], rows[0:3])], [slots[i] for i in range(3)]),
        ([(slots[3:6, 4096:8192], rows[3:6])], [slots[i] for i in range(3, 6)]),
    ]
    with SlotCopier(2) as copier:
        sums = copier.copy_then_hash(parts)
    assert np.array_equal(slots[:, 4096:8192], rows)
    assert sums == [payload_checksum(slots[i]) for i in range(6)]


def test_indexed_copies_move_scattered_pages_and_hash_their_slots():
    """Pages scattered on one side or both (an index array) land in their places, once the
    part ran; its regions' digests are taken after the copies."""
    rng = np.random.default_rng(9)
    slots = rng.integers(0, 256, (8, 2 * 4096), dtype=np.uint8)
    rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    on_slots, on_rows = page_items(slots[:, 4096:]), page_items(rows)
    scatter = IndexedCopy(on_slots, np.array([6, 1, 3]), on_rows, slice(0, 3))
    gather = IndexedCopy(on_slots, slice(4, 6), on_rows, np.array([7, 3]))
    both = IndexedCopy(on_slots, np.array([0, 7]), on_rows, np.array([5, 4]))
    with SlotCopier(2) as copier:
        sums = copier.copy_then_hash([([scatter, gather], [slots[6]]), ([both], [slots[0]])])
    for slot, row in ((6, 0), (1, 1), (3, 2), (4, 7), (5, 3), (0, 5), (7, 4)):
        assert np.array_equal(slots[slot, 4096:], rows[row]), (slot, row)
    assert sums == [payload_checksum(slots[6]), payload_checksum(slots[0])]


def test_an_indexed_copy_of_other_page_sizes_or_counts_is_refused():
    slots = np.zeros((4, 8192), np.uint8)
    rows = np.zeros((4, 4096), np.uint8)
    with SlotCopier(1) as copier:
        with pytest.raises(ValueError, match="pages of"):
            copier.copy_then_hash(
                [
                    (
                        [
                            IndexedCopy(
                                page_items(slots), np.array([0]), page_items(rows), slice(0, 1)
                            )
                        ],
                        [],
                    )
                ]
            )
        with pytest.raises(ValueError, match="2 pages into 1"):
            copier.copy_then_hash(
                [
                    (
                        [
                            IndexedCopy(
                                page_items(slots[:, :4096]),
                                np.array([0]),
                                page_items(rows),
                                slice(0, 2),
                            )
                        ],
                        [],
                    )
                ]
            )


def test_copy_blocks_refuses_strided_segments():
    src = np.zeros(8192, np.uint8)
    with SlotCopier(2) as copier, pytest.raises(ValueError, match="contiguous"):
        copier.copy_blocks([[(np.zeros(16384, np.uint8)[::2], src)]], Hashed.SOURCE)


def test_callers_together_never_run_more_parts_than_the_copier_has_threads():
    """Four callers of a 2-thread copier, each with four parts: at most two parts run at once,
    and every caller gets its own results back in order."""
    lock = threading.Lock()
    running = [0, 0]  # now, most seen

    def part(caller, index):
        def run():
            with lock:
                running[0] += 1
                running[1] = max(running[1], running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1
            return [(caller, index)]

        return run

    results = {}
    with SlotCopier(2) as copier:

        def call(caller):
            results[caller] = copier.run([part(caller, i) for i in range(4)], urgent=caller == 0)

        threads = [threading.Thread(target=call, args=(c,)) for c in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert running[1] == 2
    assert results == {c: [(c, i) for i in range(4)] for c in range(4)}


def test_a_size_mismatch_is_a_value_error():
    with SlotCopier(2) as copier, pytest.raises(ValueError, match="copy of 8 bytes into 9"):
        copier.copy_with_checksums([(np.zeros(9, np.uint8), np.zeros(8, np.uint8))])


def test_small_transfers_stay_on_the_calling_thread_and_large_ones_split_by_bytes():
    unit = PARALLEL_MIN_BYTES // 4
    assert _shares([unit] * 3, threads=4) == [range(3)]
    assert _shares([unit] * 8, threads=4) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    assert _shares([4 * unit, unit, unit, unit, unit], threads=2) == [range(1), range(1, 5)]
    assert _shares([2 * unit] * 3, threads=8) == [range(1), range(1, 2), range(2, 3)]
    assert _shares([unit] * 8, threads=1) == [range(8)]


def test_a_copier_needs_at_least_the_calling_thread():
    with pytest.raises(ValueError, match="at least 1"):
        SlotCopier(0)
