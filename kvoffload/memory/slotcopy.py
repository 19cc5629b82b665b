"""``SlotCopier``: copies between an engine's buffers and host-pool slots over several threads,
with the xxh3 of each block taken in the same pass.

A *block* is a sequence of *segments* ``(dst, src)``: byte arrays (uint8 or int8) of the same
size, such as one KV tensor's row of a block and its range of the block's pool slot. Its digest
is the xxh3_64 of the hashed side's bytes, segment after segment (``payload_checksum`` of the
slot when the segments cover it in order). Which side is hashed (``Hashed``):

- ``SOURCE`` (stores): each chunk of the source right after it was copied, while the copy's
  reads left it in the cache; the digest then describes the bytes the engine handed over,
  which a store copied. A source that changed during the copy leaves a slot that fails this
  digest when it is read: never wrong bytes that pass;
- ``DESTINATION`` (verified loads): each chunk of the destination right after it was written,
  so the digest describes exactly what the engine will use.

Copies use the process's memcpy (numpy releases the GIL around it). Where glibc was told to
use non-temporal stores for large copies (the service's workers are, see
``kvoffload.runtime.childenv``), a copy does not pull the slot into the cache, which is why
stores hash the source.

Threads: a call's work is cut into *parts* (contiguous runs of blocks of about equal bytes, a
large single copy cut into pieces), as many as there are threads not busy with other calls and
at least enough for parts of ``MAX_PART_BYTES``, that the calling thread and the copier's ``threads - 1`` helper threads take from one queue;
parts of urgent calls (loads) go first. At most ``threads``
parts run at once over all callers, so several callers (the cpu worker's job threads) share the
cores without oversubscribing them. A transfer under ``PARALLEL_MIN_BYTES`` is one part, run by
the calling thread. Every call returns only after each of its parts finished, also when one
raised (the first exception is then raised): no thread writes into a buffer after the call
returned.
"""

from __future__ import annotations

import enum
import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import xxhash

from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import payload_checksum

log = get_logger()

PARALLEL_MIN_BYTES = 8 << 20
"""Transfers smaller than this are not split. Copies from memory into memory share its
bandwidth: two threads copied and hashed 1.35-1.4 times as fast as one on the machines
measured, not twice, while waking a helper and waiting for its part cost about 200 µs
on a 2-core VM. A call of 4 MiB took as long on two threads as on one, 2 MiB longer; one of
16 MiB a quarter less (``docs/benchmarks.md``, "Copies split from 8 MiB")."""
MAX_PART_BYTES = 8 << 20
"""The largest part of a call that other calls keep the threads busy around (see
``SlotCopier._part_count``)."""
CHUNK_BYTES = 512 << 10
"""Bytes copied, then hashed, at a time: the chunk is still in the core's cache when it is
hashed, and large enough for glibc's non-temporal stores (from 256 KiB in the workers) and for
few GIL hand-offs (two a chunk)."""
MAX_COPY_THREADS = 4
"""The most threads a copier gets by default (more did not copy faster on the machines
measured; memory bandwidth is shared)."""
DEFAULT_THREADS = min(MAX_COPY_THREADS, len(os.sched_getaffinity(0)))
"""Threads per copier, the calling thread included: the cores the importing thread may run on,
at most ``MAX_COPY_THREADS``."""

Pair = tuple[np.ndarray, np.ndarray]
"""``(dst, src)``: byte arrays of one dtype and size (contiguous, in a hashed copy)."""
Block = Sequence[Pair]
T = TypeVar("T")


@dataclass(frozen=True)
class IndexedCopy:
    """``dst[dst_index] = src[src_index]`` over pages: 1-D arrays of one whole-page item each
    (``page_items``), so numpy moves each page with one memcpy, outside the GIL, in one call
    for the scattered pages of many blocks. An index is a slice or an array of item numbers,
    the two of one length; with a slice on the source side the pages are copied once, with two
    arrays they are gathered into a temporary first."""

    dst: np.ndarray
    dst_index: slice | np.ndarray
    src: np.ndarray
    src_index: slice | np.ndarray

    def check(self) -> None:
        """ValueError unless both sides hold pages of one size, as many on each side."""
        if self.dst.dtype != self.src.dtype or self.dst.ndim != 1 or self.src.ndim != 1:
            raise ValueError(f"pages of {self.src.dtype} copied into pages of {self.dst.dtype}")
        into = _index_length(self.dst_index, len(self.dst))
        count = _index_length(self.src_index, len(self.src))
        if count != into:
            raise ValueError(f"{count} pages into {into}")

    def run(self) -> None:
        self.dst[self.dst_index] = self.src[self.src_index]


Segment = Pair | IndexedCopy
HashedPart = tuple[Sequence[Segment], Sequence[np.ndarray]]
"""Segments to copy, then regions to hash (``SlotCopier.copy_then_hash``)."""


def page_items(rows: np.ndarray) -> np.ndarray:
    """``rows`` (2-D bytes, each row contiguous: one page) as a 1-D array of one item per row,
    for ``IndexedCopy``."""
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


def _index_length(index: slice | np.ndarray, size: int) -> int:
    return len(range(size)[index]) if isinstance(index, slice) else len(index)


class Hashed(enum.Enum):
    """Which side of each segment a copy hashes (see the module docstring)."""

    SOURCE = "source"
    DESTINATION = "destination"


class _Call(Generic[T]):
    """One call's parts, the next one to take, and their results as they finish."""

    __slots__ = ("error", "left", "next", "parts", "results")

    def __init__(self, parts: list[Callable[[], list[T]]]) -> None:
        self.parts = parts
        self.next = 0
        self.left = len(parts)
        self.results: list[list[T]] = [[] for _ in parts]
        self.error: BaseException | None = None


def bind_thread(cpus: set[int] | None, event: str) -> None:
    """Bind the calling thread to ``cpus`` (nothing when None or empty); a refusal is logged as
    ``event``, and the thread runs where it was."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning(event, cpus=sorted(cpus), error=str(exc))


def process_cpus() -> set[int]:
    """The CPUs a thread of this process may be moved to: its cpuset (cgroup v2, else v1),
    else the online CPUs. Wider than the calling thread's affinity when that thread was bound
    to a core (vLLM's CPU workers bind theirs to their OpenMP cores)."""
    try:
        cgroups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        cgroups = []
    candidates = []
    for line in cgroups:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            candidates.append(Path(f"/sys/fs/cgroup{path}") / "cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):
            candidates.append(Path(f"/sys/fs/cgroup/cpuset{path}") / "cpuset.effective_cpus")
    candidates.append(Path("/sys/devices/system/cpu/online"))
    for candidate in candidates:
        try:
            cpus = _cpu_list(candidate.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def _cpu_list(text: str) -> set[int]:
    """CPU ids of a kernel list such as ``0-3,8``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


class SlotCopier:
    """Copies and hashes over ``threads`` threads, the calling thread included (``threads=1``:
    everything on the calling thread). ``helper_cpus``: the CPUs the helper threads run on
    (None: those of the thread that made the copier). Safe to call from several threads at
    once. ``close`` stops the helper threads; the copier is unusable afterwards."""

    def __init__(self, threads: int = DEFAULT_THREADS, helper_cpus: set[int] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._helper_cpus = helper_cpus
        self._cv = threading.Condition()
        self._queue: deque[_Call[object]] = deque()
        self._running = 0
        self._waiting_callers = 0
        self._idle_helpers = 0
        self._closed = False
        self._helpers = [
            threading.Thread(target=self._help, name=f"kvoffload-copy-{i}", daemon=True)
            for i in range(threads - 1)
        ]
        for helper in self._helpers:
            helper.start()

    # ---- copies ----------------------------------------------------------------------------

    def copy(self, pairs: Sequence[Pair], urgent: bool = False) -> None:
        """Copy each ``src`` into its ``dst`` (any layout). Pairs fewer than the threads are
        cut into pieces when they are worth splitting, so one large block is copied by every
        thread."""
        for dst, src in pairs:
            _check_sizes(dst, src)
        sizes = [dst.nbytes for dst, _ in pairs]
        threads = self._part_count(sum(sizes))
        if len(pairs) < threads and sum(sizes) >= PARALLEL_MIN_BYTES:
            pairs = _cut(pairs, threads)
            sizes = [dst.nbytes for dst, _ in pairs]
        shares = _shares(sizes, threads)
        self.run([functools.partial(_copy_pairs, pairs[s.start : s.stop]) for s in shares], urgent)

    def copy_blocks(
        self, blocks: Sequence[Block], hashed: Hashed, urgent: bool = False
    ) -> list[int]:
        """Copy every segment of every block and return each block's digest (its ``hashed``
        side, segments in order), in order. A block is copied and hashed by one thread (the
        hash of one block cannot be split)."""
        for block in blocks:
            for dst, src in block:
                _check_sizes(dst, src)
                if not (dst.flags.c_contiguous and src.flags.c_contiguous):
                    raise ValueError("a hashed copy needs contiguous segments")
        sizes = [sum(dst.nbytes for dst, _ in block) for block in blocks]
        source = hashed is Hashed.SOURCE
        parts = [
            functools.partial(_copy_hash_blocks, blocks[s.start : s.stop], source)
            for s in _shares(sizes, self._part_count(sum(sizes)))
        ]
        return self.run(parts, urgent)

    def copy_then_hash(self, parts: Sequence[HashedPart], urgent: bool = False) -> list[int]:
        """For each part, copy its segments (pairs of any layout: a 2-D view copies many
        blocks in one call; ``IndexedCopy``: scattered pages), then hash each of its regions
        (the slots its copies wrote or read, still in the cache); the regions' digests, in
        order. Each part runs on one thread, the parts on every thread at once: the caller
        sizes them (a few MiB keeps a part's regions cached between its copies and its
        hashes)."""
        for segments, _ in parts:
            for segment in segments:
                if isinstance(segment, IndexedCopy):
                    segment.check()
                else:
                    _check_sizes(*segment)
        work = [
            functools.partial(_copy_then_hash, segments, regions) for segments, regions in parts
        ]
        return self.run(work, urgent)

    def copy_with_checksums(self, pairs: Sequence[Pair]) -> list[int]:
        """Copy each ``src`` into its ``dst`` (each pair one block) and return the xxh3 of each
        (``payload_checksum``), in order: ``copy_blocks`` hashing the source."""
        return self.copy_blocks([[pair] for pair in pairs], Hashed.SOURCE)

    def checksums(self, buffers: Sequence[np.ndarray]) -> list[int]:
        """The xxh3 of each buffer (as ``payload_checksum``), in order."""
        sizes = [buf.nbytes for buf in buffers]
        parts = [
            functools.partial(_hash_buffers, buffers[s.start : s.stop])
            for s in _shares(sizes, self._part_count(sum(sizes)))
        ]
        return self.run(parts)

    # ---- parts -----------------------------------------------------------------------------

    def _part_count(self, nbytes: int) -> int:
        """How many parts a call of ``nbytes`` is cut into: one per thread not busy with other
        calls' parts (read without the lock: a hint), and at least enough for parts of at most
        ``MAX_PART_BYTES``. When every core already copies for other callers, a small call is
        one part, which keeps the cores busy without hand-offs; a large one is still cut, so
        the last calls of a burst end together on every core."""
        if self.threads == 1:
            return 1
        queued = sum(len(call.parts) - call.next for call in list(self._queue))
        spare = self.threads - self._running - queued
        return max(1, spare, -(-nbytes // MAX_PART_BYTES))

    def run(self, parts: Sequence[Callable[[], list[T]]], urgent: bool = False) -> list[T]:
        """Run ``parts`` (each returns a list) on the calling thread and the helpers, at most
        ``threads`` parts of all callers at once; their results concatenated in order. Raises
        the first part's exception once every part has finished."""
        if not parts:
            return []
        call: _Call[T] = _Call(list(parts))
        cv = self._cv
        with cv:
            if self._closed:
                raise RuntimeError("the copier is closed")
            if len(parts) > 1:
                if urgent:
                    self._queue.appendleft(call)  # type: ignore[arg-type]
                else:
                    self._queue.append(call)  # type: ignore[arg-type]
                cv.notify_all()
            while call.left:
                if call.next < len(call.parts) and self._running < self.threads:
                    self._take_and_run(call)
                else:
                    self._waiting_callers += 1
                    cv.wait()
                    self._waiting_callers -= 1
        if call.error is not None:
            raise call.error
        return [item for result in call.results for item in result]

    def assist(self, done: Callable[[], bool]) -> None:
        """Run the parts other threads' calls queued, on the calling thread, until ``done()``
        holds; whoever makes it hold calls ``wake``. For a thread that would otherwise sleep
        until those calls finish, on a core of its own: it runs parts beside the ``threads``
        threads, over their limit."""
        with self._cv:
            while not done():
                if self._queue:
                    self._take_and_run(self._queue[0], counted=False)
                else:
                    self._waiting_callers += 1
                    self._cv.wait()
                    self._waiting_callers -= 1

    def wake(self) -> None:
        """Wake the threads in ``assist`` to check their condition again."""
        with self._cv:
            self._cv.notify_all()

    def _take_and_run(self, call: _Call[T], counted: bool = True) -> None:
        """Run ``call``'s next part; the caller holds the lock, released while it runs. Wakes
        the waiting threads only when one may go on: a caller waits for its parts or a free
        thread, an idle helper for queued parts (a one-part call with nobody waiting wakes
        nobody). ``counted``: the part counts against ``threads`` (an assisting thread's
        does not)."""
        index = call.next
        call.next += 1
        if call.next == len(call.parts) and call in self._queue:
            self._queue.remove(call)  # type: ignore[arg-type]
        self._running += counted
        self._cv.release()
        try:
            result = call.parts[index]()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the call's own thread
            error: BaseException | None = exc
        else:
            call.results[index] = result
            error = None
        finally:
            self._cv.acquire()
        self._running -= counted
        call.left -= 1
        if error is not None and call.error is None:
            call.error = error
        if self._waiting_callers or (self._queue and self._idle_helpers):
            self._cv.notify_all()

    def _help(self) -> None:
        bind_thread(self._helper_cpus, "copy_thread_affinity_failed")
        cv = self._cv
        with cv:
            while True:
                while not self._closed and not (self._queue and self._running < self.threads):
                    self._idle_helpers += 1
                    cv.wait()
                    self._idle_helpers -= 1
                if self._closed:
                    return
                self._take_and_run(self._queue[0])

    def close(self) -> None:
        """Stop the helper threads (running parts finish first). Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for helper in self._helpers:
            helper.join()

    def __enter__(self) -> SlotCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def shared_copier() -> SlotCopier:
    """One ``SlotCopier`` of ``DEFAULT_THREADS`` for the whole process, made on first use (its
    threads end with the process)."""
    return SlotCopier()


def _shares(sizes: list[int], threads: int) -> list[range]:
    """Contiguous index ranges of about equal bytes, at most ``threads`` of them (a part
    count); one range when the total is under ``PARALLEL_MIN_BYTES``."""
    total = sum(sizes)
    if threads == 1 or len(sizes) < 2 or total < PARALLEL_MIN_BYTES:
        return [range(len(sizes))]
    count = min(threads, len(sizes))
    shares: list[range] = []
    start = 0
    done = 0
    for index, size in enumerate(sizes):
        done += size
        if done * count >= total * (len(shares) + 1) and len(shares) < count - 1:
            shares.append(range(start, index + 1))
            start = index + 1
    shares.append(range(start, len(sizes)))
    return [share for share in shares if share]


def _cut(pairs: Sequence[Pair], parts: int) -> list[Pair]:
    """Each pair with contiguous buffers cut into up to ``parts`` pieces of consecutive bytes
    (flat views, no copy); other pairs are kept whole."""
    out: list[Pair] = []
    for dst, src in pairs:
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            out.append((dst, src))
            continue
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        step = -(-flat_dst.size // parts)
        out.extend(
            (flat_dst[i : i + step], flat_src[i : i + step]) for i in range(0, flat_dst.size, step)
        )
    return out


def _check_sizes(dst: np.ndarray, src: np.ndarray) -> None:
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")


def _copy_pairs(pairs: Sequence[Pair]) -> list[None]:
    for dst, src in pairs:
        np.copyto(dst, src if src.shape == dst.shape else src.reshape(dst.shape), casting="no")
    return []


def _copy_hash_blocks(blocks: Sequence[Block], source: bool) -> list[int]:
    """Copy each block's segments a chunk at a time, hashing each chunk just copied (its source
    or its destination) into the block's digest."""
    out = []
    for block in blocks:
        digest = xxhash.xxh3_64()
        for dst, src in block:
            flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
            size = flat_dst.size
            if size <= CHUNK_BYTES:
                np.copyto(flat_dst, flat_src, casting="no")
                digest.update((flat_src if source else flat_dst).data)
                continue
            for at in range(0, size, CHUNK_BYTES):
                part_src = flat_src[at : at + CHUNK_BYTES]
                part_dst = flat_dst[at : at + CHUNK_BYTES]
                np.copyto(part_dst, part_src, casting="no")
                digest.update((part_src if source else part_dst).data)
        out.append(digest.intdigest())
    return out


def run_segments(segments: Sequence[Segment]) -> None:
    """Copy each segment: a pair (any layout) or an ``IndexedCopy``."""
    for segment in segments:
        if isinstance(segment, IndexedCopy):
            segment.run()
        else:
            _copy_pairs((segment,))


def _copy_then_hash(segments: Sequence[Segment], regions: Sequence[np.ndarray]) -> list[int]:
    run_segments(segments)
    return _hash_buffers(regions)


def _hash_buffers(buffers: Sequence[np.ndarray]) -> list[int]:
    return [payload_checksum(buf) for buf in buffers]
