"""``SlotCopier``: engine-side copies between an engine's buffers and host-pool slots, spread
over threads.

An engine that maps the pool moves its blocks itself (``prepare_store``, copy, ``complete_store``;
a pinned lookup, copy, ``complete_load``). One thread copies at memcpy speed and, for a store,
also hashes every byte; numpy's copy and xxhash release the GIL on buffers this large, so the
work of one call is cut into contiguous shares of about equal bytes and run at once, one share on
the calling thread and the others on the copier's threads. A transfer under
``PARALLEL_MIN_BYTES`` runs on the calling thread alone: waking another thread costs more than
copying it.

Every call returns only after every share has finished, also when one raised (its exception is
then raised): no thread writes into a buffer after the call returned.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np

from kvoffload.memory.blockformat import copy_with_checksum, payload_checksum

PARALLEL_MIN_BYTES = 1 << 20
"""Transfers smaller than this are not split (a thread hand-off costs about 100 µs on a busy
2-core VM, the time to copy 0.5-1 MiB)."""
DEFAULT_THREADS = min(4, len(os.sched_getaffinity(0)))
"""Threads per copier, the calling thread included: the cores this process may run on, at most
4 (on the 2-core test machine two threads copied and hashed 1-4 MiB blocks 1.6-1.9x as fast as
one; more cores are untested)."""

CopyPair = tuple[np.ndarray, np.ndarray]
"""``(dst, src)``: byte arrays (uint8 or int8) of one dtype and size (``dst`` contiguous for a
copy with checksum)."""
T = TypeVar("T")
_Item = TypeVar("_Item")


class SlotCopier:
    """Copies and hashes over ``threads`` threads, the calling thread included (``threads=1``:
    everything on the calling thread). Safe to call from several threads at once. ``close``
    stops the threads; the copier is unusable afterwards."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvoffload-copy")
            if threads > 1
            else None
        )

    def copy(self, pairs: Sequence[CopyPair]) -> None:
        """Copy each ``src`` into its ``dst``. Pairs fewer than the threads are cut into parts
        (when they are worth splitting), so one large block is copied by every thread."""
        sizes = [dst.nbytes for dst, _ in pairs]
        if len(pairs) < self.threads and sum(sizes) >= PARALLEL_MIN_BYTES:
            pairs = _cut(pairs, self.threads)
            sizes = [dst.nbytes for dst, _ in pairs]
        self._run(pairs, sizes, _copy_share)

    def copy_with_checksums(self, pairs: Sequence[CopyPair]) -> list[int]:
        """Copy each ``src`` into its ``dst`` and return the xxh3 of each ``dst`` (as
        ``payload_checksum``), in order. Each block is copied and hashed in one pass, by one
        thread (the hash of one block cannot be split)."""
        return self._run(pairs, [dst.nbytes for dst, _ in pairs], _checksum_copy_share)

    def checksums(self, buffers: Sequence[np.ndarray]) -> list[int]:
        """The xxh3 of each buffer (as ``payload_checksum``), in order."""
        return self._run(buffers, [buf.nbytes for buf in buffers], _checksum_share)

    def close(self) -> None:
        """Stop the threads (waits for running shares). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> SlotCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self,
        items: Sequence[_Item],
        sizes: list[int],
        share_fn: Callable[[Sequence[_Item]], list[T]],
    ) -> list[T]:
        """``share_fn`` over contiguous shares of ``items``, results concatenated in order."""
        shares = _shares(sizes, self.threads)
        if len(shares) == 1 or self._pool is None:
            return share_fn(items)
        futures: list[Future[list[T]]] = [
            self._pool.submit(share_fn, items[share.start : share.stop]) for share in shares[1:]
        ]
        try:
            out = share_fn(items[shares[0].start : shares[0].stop])
        finally:
            wait(futures)
        for future in futures:
            out.extend(future.result())
        return out


@functools.cache
def shared_copier() -> SlotCopier:
    """One ``SlotCopier`` of ``DEFAULT_THREADS`` for the whole process, made on first use (its
    threads end with the process)."""
    return SlotCopier()


def _shares(sizes: list[int], threads: int) -> list[range]:
    """Contiguous index ranges of about equal bytes, at most ``threads`` of them; one range when
    the total is under ``PARALLEL_MIN_BYTES``."""
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


def _cut(pairs: Sequence[CopyPair], parts: int) -> list[CopyPair]:
    """Each pair with contiguous buffers cut into up to ``parts`` pieces of consecutive bytes
    (flat views, no copy); other pairs are kept whole."""
    out: list[CopyPair] = []
    for dst, src in pairs:
        _check_sizes(dst, src)
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


def _copy_share(pairs: Sequence[CopyPair]) -> list[None]:
    for dst, src in pairs:
        _check_sizes(dst, src)
        np.copyto(dst, src if src.shape == dst.shape else src.reshape(dst.shape), casting="no")
    return []


def _checksum_copy_share(pairs: Sequence[CopyPair]) -> list[int]:
    out = []
    for dst, src in pairs:
        _check_sizes(dst, src)
        out.append(copy_with_checksum(dst, src))
    return out


def _checksum_share(buffers: Sequence[np.ndarray]) -> list[int]:
    return [payload_checksum(buf) for buf in buffers]
