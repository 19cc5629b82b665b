"""``StagedCopier``: copies run in stages on a background thread, each stage awaited on its own,
each block's xxh3 taken as its bytes go by.

A reader that uses a transfer piece by piece (an engine's forward reads a load's KV one layer
after the other) need not wait for the whole copy. ``submit`` queues a ``StagedPlan`` and
returns at once; the copier's thread takes the plan's stages one after the other (a plan may
make each stage only when it is asked for it, so its Python runs beside the submitter's, not
before it), checks each, and spreads its parts over the copier's threads (``SlotCopier``).
``StagedCopy.wait_stage(i)`` returns once stages ``0..i`` ran, ``result`` once every stage ran
and every digest was taken. A thread that waits runs queued parts meanwhile
(``SlotCopier.assist``), so the copy goes faster exactly when someone waits for it.

Digests: a part names, after its copies, the bytes to feed to each digest (``feeds``), which the
part's thread hashes while they are still in its cache; the plan's ``tail_feeds`` are fed once
every stage ran. A digest is the xxh3_64 of everything fed to it in stage order, and within a
stage in the order of the part's feeds. The planner guarantees what makes this well defined: a
digest is fed by at most one part of a stage, so no two threads feed it at once, and its bytes
are fed in the order of the block they describe (``payload_checksum`` of the block then equals
the digest).

Threads: the copier's own thread (the caller of ``SlotCopier.run``) and its helpers run on
``cpus``, so copies in the background stay off the cores of the thread that submitted them
(an engine's forward). Plans run one after the other, in submission order. A plan whose stage
could not be made, or whose check or part raised, stops there: its later stages do not run,
waiters are woken, and ``result`` raises the error.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvoffload.logs import get_logger
from kvoffload.memory.slotcopy import (
    IndexedCopy,
    Segment,
    SlotCopier,
    bind_thread,
    run_segments,
)

log = get_logger()

Feed = tuple[int, memoryview]
"""(digest index, contiguous bytes to feed to that digest)."""


@dataclass(frozen=True)
class StagePart:
    """Segments one thread copies, then the bytes it feeds to digests (see the module)."""

    segments: Sequence[Segment]
    feeds: Sequence[Feed] = ()

    def check(self, digests: int) -> None:
        """ValueError unless every segment pairs buffers of one size and every feed names one
        of ``digests`` digests with contiguous bytes."""
        for segment in self.segments:
            if isinstance(segment, IndexedCopy):
                segment.check()
            elif segment[0].nbytes != segment[1].nbytes:
                raise ValueError(f"copy of {segment[1].nbytes} bytes into {segment[0].nbytes}")
        _check_feeds(self.feeds, digests)


def _no_feeds() -> Sequence[Feed]:
    return ()


@dataclass(frozen=True)
class StagedPlan:
    """``stages`` (iterated once, on the copier's thread) run in order; ``digests`` digests
    are taken, 0 to ``digests - 1``; ``tail_feeds()`` is fed after the last stage."""

    stages: Iterable[Sequence[StagePart]]
    digests: int
    tail_feeds: Callable[[], Sequence[Feed]] = _no_feeds


def _check_feeds(feeds: Sequence[Feed], digests: int) -> None:
    for index, data in feeds:
        if not 0 <= index < digests:
            raise ValueError(f"a feed of digest {index} in a plan of {digests}")
        if not data.c_contiguous:
            raise ValueError("a feed must be contiguous bytes")


class StagedCopy:
    """One submitted plan: its progress, and its digests once it finished."""

    def __init__(self, plan: StagedPlan, copier: SlotCopier) -> None:
        self.plan = plan
        self._copier = copier
        self._stages_done = 0
        self._finished = False
        self._error: BaseException | None = None
        self._digests: list[int] = []

    def wait_stage(self, index: int) -> None:
        """Return once stages ``0..index`` ran, or the copy stopped (``result`` says why),
        running the copier's queued parts meanwhile."""
        self._copier.assist(lambda: self._stages_done > index or self._finished)

    def wait(self) -> None:
        """Return once every stage ran and every digest was taken, or the copy stopped (running
        queued parts meanwhile)."""
        self._copier.assist(lambda: self._finished)

    def result(self) -> list[int]:
        """``wait``, then the digests, by index. Raises the error that stopped the copy."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._digests

    @property
    def finished(self) -> bool:
        return self._finished

    def _stage_done(self) -> None:
        self._stages_done += 1
        self._copier.wake()

    def _finish(self, digests: list[int], error: BaseException | None) -> None:
        self._digests = digests
        self._error = error
        self._finished = True
        self._copier.wake()


class StagedCopier:
    """Runs submitted plans on one thread of its own and ``threads - 1`` helpers, all on
    ``cpus`` (None: wherever the scheduler puts them). ``close`` finishes the plans queued so
    far, then stops the threads."""

    def __init__(self, threads: int = 1, cpus: set[int] | None = None) -> None:
        self._cpus = cpus
        self._copier = SlotCopier(threads, helper_cpus=cpus)
        self._queue: deque[StagedCopy] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvoffload-staged", daemon=True)
        self._thread.start()

    @property
    def threads(self) -> int:
        return self._copier.threads

    def submit(self, plan: StagedPlan) -> StagedCopy:
        """Queue ``plan`` and return its ``StagedCopy`` at once."""
        copy = StagedCopy(plan, self._copier)
        with self._cv:
            if self._closed:
                raise RuntimeError("the staged copier is closed")
            self._queue.append(copy)
            self._cv.notify()
        return copy

    def close(self) -> None:
        """Run what is queued, then stop. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        self._copier.close()

    def _run(self) -> None:
        bind_thread(self._cpus, "staged_copy_affinity_failed")
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                copy = self._queue.popleft()
            self._execute(copy)

    def _execute(self, copy: StagedCopy) -> None:
        plan = copy.plan
        hashers = [xxhash.xxh3_64() for _ in range(plan.digests)]
        try:
            for parts in plan.stages:
                for part in parts:
                    part.check(plan.digests)
                self._copier.run(
                    [functools.partial(_run_part, part, hashers) for part in parts], urgent=True
                )
                copy._stage_done()
            tail = plan.tail_feeds()
            _check_feeds(tail, plan.digests)
            by_digest: dict[int, list[memoryview]] = {}
            for index, data in tail:
                by_digest.setdefault(index, []).append(data)
            groups = list(by_digest.items())
            shares = max(1, min(self._copier.threads, len(groups)))
            self._copier.run(
                [functools.partial(_feed_all, groups[i::shares], hashers) for i in range(shares)]
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters through result()
            copy._finish([], exc)
            return
        copy._finish([h.intdigest() for h in hashers], None)


def _run_part(part: StagePart, hashers: list[xxhash.xxh3_64]) -> list[None]:
    run_segments(part.segments)
    for index, data in part.feeds:
        hashers[index].update(data)
    return []


def _feed_all(
    groups: list[tuple[int, list[memoryview]]], hashers: list[xxhash.xxh3_64]
) -> list[None]:
    for index, buffers in groups:
        for data in buffers:
            hashers[index].update(data)
    return []
