"""``StagedCopier``: stages run in order on its thread, each awaited on its own, digests fed in
order, errors handed to the waiters, waiting threads help."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.slotcopy import IndexedCopy
from kvoffload.memory.stagedcopy import StagedCopier, StagedPlan, StagePart

PAGE = 64 << 10
NOTHING = np.zeros(1, np.uint8)


class Hook(IndexedCopy):
    """A segment that copies nothing and calls ``hook`` when it runs."""

    def __init__(self, hook) -> None:
        super().__init__(NOTHING, slice(0, 0), NOTHING, slice(0, 0))
        object.__setattr__(self, "hook", hook)

    def run(self) -> None:
        self.hook()


def rows(count: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def layer_plan(src: np.ndarray, dst: list[np.ndarray], per_part: int = 2) -> StagedPlan:
    """Copy ``src`` rows (one block of ``len(dst)`` pages each) into ``dst[layer][block]``,
    one stage per layer, each block's digest fed page after page."""
    layers = len(dst)

    def stages():
        for layer in range(layers):
            parts = []
            for first in range(0, len(src), per_part):
                blocks = range(first, min(len(src), first + per_part))
                pieces = [src[b, layer * PAGE : (layer + 1) * PAGE] for b in blocks]
                segments = [(dst[layer][b], piece) for b, piece in zip(blocks, pieces, strict=True)]
                feeds = [(b, memoryview(piece)) for b, piece in zip(blocks, pieces, strict=True)]
                parts.append(StagePart(segments, feeds))
            yield parts

    return StagedPlan(stages(), len(src))


@pytest.mark.parametrize("threads", [1, 2])
def test_stages_copy_every_byte_and_digests_equal_each_blocks_xxh3(threads):
    src = rows(5, 3 * PAGE, seed=1)
    dst = [np.zeros((5, PAGE), np.uint8) for _ in range(3)]
    copier = StagedCopier(threads)
    try:
        digests = copier.submit(layer_plan(src, dst)).result()
    finally:
        copier.close()
    assert digests == [payload_checksum(block) for block in src]
    for layer in range(3):
        assert np.array_equal(dst[layer], src[:, layer * PAGE : (layer + 1) * PAGE])


def test_a_stage_can_be_awaited_before_the_next_one_runs():
    src = rows(2, 2 * PAGE, seed=2)
    dst = [np.zeros((2, PAGE), np.uint8) for _ in range(2)]
    gate = threading.Event()
    plan = layer_plan(src, dst)

    def gated():
        stages = iter(plan.stages)
        yield next(stages)
        assert gate.wait(10)
        yield from stages

    copier = StagedCopier(1)
    try:
        copy = copier.submit(StagedPlan(gated(), plan.digests))
        copy.wait_stage(0)
        assert np.array_equal(dst[0], src[:, :PAGE])
        assert not dst[1].any() and not copy.finished
        gate.set()
        copy.wait_stage(1)
        assert np.array_equal(dst[1], src[:, PAGE:])
        assert copy.result() == [payload_checksum(block) for block in src]
    finally:
        gate.set()
        copier.close()


def test_tail_feeds_complete_each_digest_after_the_stages():
    src = rows(3, 2 * PAGE, seed=3)
    dst = np.zeros((3, PAGE), np.uint8)
    stage = [
        StagePart(
            [(dst[b], src[b, :PAGE]) for b in range(3)],
            [(b, memoryview(src[b, :PAGE])) for b in range(3)],
        )
    ]
    plan = StagedPlan([stage], 3, lambda: [(b, memoryview(src[b, PAGE:])) for b in range(3)])
    copier = StagedCopier(2)
    try:
        assert copier.submit(plan).result() == [payload_checksum(block) for block in src]
    finally:
        copier.close()


def test_an_error_stops_the_plan_wakes_its_waiters_and_the_next_plan_runs():
    src = rows(2, PAGE, seed=4)
    short = np.zeros(PAGE - 1, np.uint8)
    bad = StagedPlan([[StagePart([(short, src[0])])], [StagePart([(short, src[1])])]], 0)
    dst = [np.zeros((2, PAGE), np.uint8)]
    copier = StagedCopier(1)
    try:
        failed = copier.submit(bad)
        failed.wait_stage(1)
        with pytest.raises(ValueError, match="bytes into"):
            failed.result()
        assert copier.submit(layer_plan(src, dst)).result() == [
            payload_checksum(block) for block in src
        ]
    finally:
        copier.close()


def test_a_feed_of_an_unknown_digest_fails_the_plan():
    src = rows(1, PAGE, seed=5)
    plan = StagedPlan([[StagePart([], [(3, memoryview(src[0]))])]], 1)
    copier = StagedCopier(1)
    try:
        with pytest.raises(ValueError, match="digest 3"):
            copier.submit(plan).result()
    finally:
        copier.close()


def test_a_waiting_thread_runs_parts_of_the_stage_it_waits_for():
    """The copier's own thread takes one part and blocks in it; the waiter runs the others."""
    src = rows(4, PAGE, seed=6)
    dst = np.zeros((4, PAGE), np.uint8)
    started, release = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        assert release.wait(10)

    parts = [StagePart([Hook(block)])] + [StagePart([(dst[b], src[b])]) for b in range(4)]

    def stages():
        yield parts

    copier = StagedCopier(1)
    try:
        copy = copier.submit(StagedPlan(stages(), 0))
        assert started.wait(10)
        waiter = threading.Thread(target=copy.wait_stage, args=(0,))
        waiter.start()
        deadline = 100
        while not np.array_equal(dst, src) and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        assert np.array_equal(dst, src)  # copied by the waiter while the copier's thread blocks
        release.set()
        waiter.join(10)
        assert not waiter.is_alive()
        copy.result()
    finally:
        release.set()
        copier.close()


def test_the_copier_thread_runs_on_the_cpus_it_was_given():
    cpu = min(os.sched_getaffinity(0))
    seen: list[set[int]] = []

    probe = Hook(lambda: seen.append(os.sched_getaffinity(0)))
    copier = StagedCopier(1, cpus={cpu})
    try:
        copier.submit(StagedPlan([[StagePart([probe])]], 0)).result()
    finally:
        copier.close()
    assert seen == [{cpu}]
