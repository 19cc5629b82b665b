"""Loads copied layer by layer beside the forward that reads them (vLLM on CPU).

A pool hit that vLLM loads in the step that schedules its request (``sync_loads``) is read by
that step's forward one attention layer at a time, and vLLM calls the connector's
``wait_for_layer_load(layer)`` just before each layer's attention. So the forward need not wait
for the whole copy: such a load is copied one KV tensor after the other, in the order the
forward reads them, on the cores the forward does not run on (``StagedCopier``), and each layer
waits for its own tensor only. The first layer waits for its share of the bytes; the rest of
the copy runs beside the forward.

``LayerOrder`` learns which KV tensor each layer reads (from the tensors vLLM registers) and the
order the forward reads them in (from the ``wait_for_layer_load`` calls of one step). Layered
loads start only once one step's forward called it for every layer that reads an offloaded
tensor: a model whose attention never asks would read KV before its copy, so it keeps loads
copied whole before the forward.

``LayeredLoad.plan`` cuts a load into those stages. Each key's digest is taken as its slot's
bytes go by: a key's pieces are copied in slot order when the stage order follows the slot
layout (one vLLM block per key, the group's tensors in forward order), and hashed right after
their copy; otherwise the slots are hashed once every stage ran. Either way the digests are
checked before the load is reported, and a mismatch fails the key (vLLM recomputes its blocks
and drops the token the step computed with them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.integrations.vllm.layout import BlockLayout, CopyRow
from kvoffload.integrations.vllm.segments import PageViews, tensor_segments
from kvoffload.memory.stagedcopy import Feed, StagedPlan, StagePart

STAGE_PART_BYTES = 1 << 20
"""Slot bytes of one part of a stage: copied, then hashed by one thread while in its cache."""

Span = tuple[int, int]
"""[start, end) of a tensor's bytes in the address space."""


def layer_tensors(
    layers: Mapping[str, Span], tensors: Sequence[Span]
) -> dict[str, tuple[int, ...]]:
    """For each layer, the indexes of the tensors whose bytes overlap its own (the KV tensors a
    load writes and the layer reads); layers that overlap none are left out."""
    out: dict[str, tuple[int, ...]] = {}
    for name, (start, end) in layers.items():
        hit = tuple(i for i, (t0, t1) in enumerate(tensors) if start < t1 and t0 < end)
        if hit:
            out[name] = hit
    return out


class LayerOrder:
    """Which tensors each layer reads (``layers``: layer name -> tensor indexes), and once
    learned, the order the forward reads the tensors in. ``saw`` is told each
    ``wait_for_layer_load`` and ``step_ended`` the end of each step; ``order`` is None until
    one step saw every layer of ``layers``."""

    def __init__(self, layers: Mapping[str, tuple[int, ...]]) -> None:
        self.layers = dict(layers)
        self.order: tuple[int, ...] | None = None
        self._step: dict[str, None] = {}

    def saw(self, layer: str) -> None:
        if self.order is None and layer in self.layers:
            self._step.setdefault(layer, None)

    def step_ended(self) -> None:
        if self.order is None and self.layers and len(self._step) == len(self.layers):
            order: dict[int, None] = {}
            for layer in self._step:
                for tensor in self.layers[layer]:
                    order.setdefault(tensor, None)
            self.order = tuple(order)
        self._step = {}

    def tensors_of(self, layer: str) -> tuple[int, ...]:
        return self.layers.get(layer, ())


@dataclass(frozen=True)
class LayeredLoad:
    """A load copied one tensor a stage: its copy rows, the slots of its keys, the tensors of
    its stages in order, and the KV tensors and pool they copy between (see
    ``layered_load``). ``keys``: the loaded key indexes (digest ``i`` is ``keys[i]``'s);
    ``moved``: the bytes it copies. ``plan`` makes the ``StagedPlan``."""

    layout: BlockLayout
    group_refs: Sequence[Sequence[tuple[int, int, int]]]
    arrays: Sequence[np.ndarray]
    host: np.ndarray
    rows: Sequence[CopyRow]
    slots: Sequence[int]
    stages: list[int]
    keys: list[int]
    moved: int

    def last_stage(self, tensors: Sequence[int]) -> int:
        """The last stage that copies one of ``tensors``; -1 when none does."""
        return max((self.stages.index(t) for t in tensors if t in self.stages), default=-1)

    def plan(self) -> StagedPlan:
        """The copy of ``rows`` from their keys' slots into the KV tensors, stage after stage
        (each made when the copier asks for it), each key's digest over
        ``layout.checked_bytes`` of its slot (see the module)."""
        planner = _Planner(self)
        return StagedPlan(planner.stages(), len(self.keys), planner.tail)


def layered_load(
    layout: BlockLayout,
    group_refs: Sequence[Sequence[tuple[int, int, int]]],
    arrays: Sequence[np.ndarray],
    host: np.ndarray,
    rows: Sequence[CopyRow],
    slots: Sequence[int],
    order: Sequence[int],
) -> LayeredLoad:
    """A load of ``rows`` with one stage per tensor in ``order`` (tensors it writes that
    ``order`` lacks come last). ``group_refs[g]``: (tensor, page bytes, offset in the block
    stride) of each tensor of group ``g``. Cheap: the plan is made by ``LayeredLoad.plan``."""
    used = {tensor for group in {row.group for row in rows} for tensor, _, _ in group_refs[group]}
    stages = [t for t in dict.fromkeys(order) if t in used] + sorted(used - set(order))
    group_bytes = [sum(page for _, page, _ in refs) for refs in group_refs]
    return LayeredLoad(
        layout,
        group_refs,
        arrays,
        host,
        rows,
        slots,
        stages,
        list(dict.fromkeys(row.key_index for row in rows)),
        sum(group_bytes[row.group] for row in rows),
    )


class _Planner:
    """Makes a layered load's stages one at a time, keeping each key's digest cursor: the
    first byte of its checked span not fed yet. Everything is worked out on the copier's
    thread, as its first stage is asked for."""

    def __init__(self, load: LayeredLoad) -> None:
        self.load = load
        self.cursors: dict[int, int] = {}

    def stages(self) -> Iterator[list[StagePart]]:
        self._prepare()
        for tensor in self.load.stages:
            yield self._stage(tensor)

    def _prepare(self) -> None:
        load = self.load
        layout = load.layout
        self.first, self.end = checked_span(layout, load.host.shape[1])
        stage_of = {tensor: i for i, tensor in enumerate(load.stages)}
        # per group: tensor -> [(offset in the block stride, page)], in stage then slot order
        self.pages: list[dict[int, list[tuple[int, int]]]] = []
        streamed = layout.blocks_per_chunk == 1
        for refs in load.group_refs:
            by_tensor: dict[int, list[tuple[int, int]]] = {}
            for tensor, page, offset in refs:
                by_tensor.setdefault(tensor, []).append((offset, page))
            for pages in by_tensor.values():
                pages.sort()
            ordered = sorted(by_tensor.items(), key=lambda item: stage_of.get(item[0], -1))
            cursor = 0
            for _, pages in ordered:
                for offset, page in pages:
                    streamed = streamed and offset >= cursor
                    cursor = offset + page
            self.pages.append(by_tensor)
        self.streamed = streamed
        self.digest_of = {key: i for i, key in enumerate(load.keys)}
        self.views = {key: memoryview(load.host[load.slots[key]]) for key in load.keys}
        self.cursors = dict.fromkeys(load.keys, self.first)
        self.bases = {
            block: layout.offset(block) for block in {row.chunk_block for row in load.rows}
        }

    def _stage(self, tensor: int) -> list[StagePart]:
        load = self.load
        slots, host, arrays = load.slots, load.host, load.arrays
        # per key, in key order: (slot offset, page, vLLM block) of what the stage copies
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for row in load.rows:
            for offset, page in self.pages[row.group].get(tensor, ()):
                pieces.setdefault(row.key_index, []).append(
                    (self.bases[row.chunk_block] + offset, page, row.block_id)
                )
        keys = list(pieces)
        key_bytes = sum(page for _, page, _ in pieces[keys[0]]) if keys else 1
        per_part = max(1, STAGE_PART_BYTES // max(1, key_bytes))
        views = PageViews(arrays, host)
        parts: list[StagePart] = []
        for at in range(0, len(keys), per_part):
            places: dict[tuple[int, int], list[tuple[int, int]]] = {}
            feeds: list[Feed] = []
            for key in keys[at : at + per_part]:
                slot, view, digest = slots[key], self.views[key], self.digest_of[key]
                for offset, page, block in pieces[key]:
                    places.setdefault((offset, page), []).append((slot, block))
                    if self.streamed:
                        feeds.append((digest, view[self.cursors[key] : offset + page]))
                        self.cursors[key] = offset + page
            segments = []
            for (offset, page), placed in places.items():
                segments.extend(
                    tensor_segments(placed, tensor, page, offset, arrays, host, False, views)
                )
            parts.append(StagePart(segments, feeds))
        return parts

    def tail(self) -> list[Feed]:
        """What each key's digest still needs once every stage ran: the rest of its checked
        span (all of it when the stages were not fed)."""
        return [
            (self.digest_of[key], self.views[key][cursor : self.end])
            for key, cursor in self.cursors.items()
            if cursor < self.end
        ]


def checked_span(layout: BlockLayout, block_bytes: int) -> tuple[int, int]:
    """[first, end) of a slot of ``block_bytes`` that ``layout.checked_bytes`` covers."""
    if layout.copies == 1:
        return 0, block_bytes
    first = layout.rank * layout.per_rank_bytes
    return first, first + layout.per_rank_bytes
