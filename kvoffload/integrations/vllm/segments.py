"""The CPU copies between one vLLM KV tensor's pages and their places in pool slots (numpy
views, no I/O): shared by the whole-load plan (``worker.copy_plan_cpu``) and the layered one
(``layered.layered_load_plan``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.memory.slotcopy import IndexedCopy, Segment, page_items


class PageViews:
    """The page-item views (``page_items``) of the pool and of the KV tensors a plan scatters
    into or gathers from, made once per plan."""

    def __init__(self, arrays: Sequence[np.ndarray], host: np.ndarray) -> None:
        self._arrays = arrays
        self._host = host
        self._pool: dict[tuple[int, int], np.ndarray] = {}
        self._kv: dict[int, np.ndarray] = {}

    def pool(self, start: int, page: int) -> np.ndarray:
        if (start, page) not in self._pool:
            self._pool[start, page] = page_items(self._host[:, start : start + page])
        return self._pool[start, page]

    def kv(self, tensor: int, page: int) -> np.ndarray:
        if tensor not in self._kv:
            self._kv[tensor] = page_items(self._arrays[tensor][:, :page])
        return self._kv[tensor]


def tensor_segments(
    placed: Sequence[tuple[int, int]],
    tensor: int,
    page: int,
    start: int,
    arrays: Sequence[np.ndarray],
    host: np.ndarray,
    to_pool: bool,
    views: PageViews,
) -> list[Segment]:
    """The copies of ``page`` bytes of ``tensor`` for each (slot, vLLM block) of ``placed``,
    at byte ``start`` of each slot: one 2-D copy per run whose slots and blocks both grow by
    one, or, when only the source side is consecutive (a load into scattered vLLM blocks),
    one ``IndexedCopy`` of all the pages."""
    slot_ids = [slot for slot, _ in placed]
    block_ids = [block for _, block in placed]
    src_ids, dst_ids = (block_ids, slot_ids) if to_pool else (slot_ids, block_ids)
    if _consecutive(src_ids) and not _consecutive(dst_ids):
        src_sel = slice(src_ids[0], src_ids[0] + len(src_ids))
        dst_sel = np.asarray(dst_ids, dtype=np.intp)
        on_pool, on_kv = views.pool(start, page), views.kv(tensor, page)
        if to_pool:
            return [IndexedCopy(on_pool, dst_sel, on_kv, src_sel)]
        return [IndexedCopy(on_kv, dst_sel, on_pool, src_sel)]
    segments: list[Segment] = []
    for slot0, block0, count in _runs(placed):
        pool_side = host[slot0 : slot0 + count, start : start + page]
        kv_side = arrays[tensor][block0 : block0 + count, :page]
        segments.append((pool_side, kv_side) if to_pool else (kv_side, pool_side))
    return segments


def _consecutive(ids: list[int]) -> bool:
    """Whether ``ids`` grow by one from each to the next."""
    return all(i == ids[0] + n for n, i in enumerate(ids))


def _runs(placed: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first slot, first block, count) of each run of places whose slot and block both grow
    by one from one place to the next."""
    runs: list[tuple[int, int, int]] = []
    for slot, block in placed:
        if runs:
            slot0, block0, count = runs[-1]
            if slot == slot0 + count and block == block0 + count:
                runs[-1] = (slot0, block0, count + 1)
                continue
        runs.append((slot, block, 1))
    return runs
