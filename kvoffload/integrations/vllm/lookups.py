"""How one request's queued keys are asked of the service, group by group (pure, no vLLM).

vLLM's scheduler reads a request's prefix per KV cache group and converges on one hit boundary
that every group can serve: a full-attention group hits a prefix of chunks (its first MISS ends
it); a sliding-window group needs its last ``window`` chunks before the boundary, found by a
scan from the end. The service answers a batch of keys in order and stops at the first MISS
(it never promotes past a key that cannot be part of the prefix). ``ask_by_group`` asks in the
order each group is read:

- a full-attention group: its keys in token order, one call; keys past its first MISS are
  MISS without being asked;
- a sliding-window group: its keys from the end down, ``window`` keys per call, until it has
  ``window`` hits in a row, below the first MISS of any full-attention group (keys at or past
  that MISS can never be read for this request, so they are MISS without being asked); when a
  group's window ends above another group's, it searches again below the lower end, as vLLM's
  scheduler will.

Calls are batched into rounds, one round trip each (``Ask`` takes several batches): the first
round asks every full-attention group together with the top window of every sliding-window
group (so a prefix that hits whole costs one round trip); each later round asks the next window
of every sliding group still searching. A window asked in the first round may lie past a full
group's first MISS found in the same round: its keys may then be promoted (they are never
loaded, and their pins go when vLLM picks what it loads).

So the hits of every group arrive in one step, and past the first round no key is asked that the
request could not read at the boundary found so far. Keys left unasked stay unanswered (vLLM asks
them again if it needs them).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from vllm.v1.kv_offload.base import LookupResult

Ask = Callable[[list[list[bytes]]], Sequence[Sequence[LookupResult]]]
"""Ask the service for each batch of keys, in this order, all in one round trip: per batch, the
results of a prefix of it (stopping after its first MISS)."""


def ask_by_group(
    keys: Sequence[bytes],
    group_of: Callable[[bytes], int],
    position_of: Callable[[bytes], int | None],
    windows: Mapping[int, int | None],
    ask: Ask,
    full_miss_position: float = math.inf,
) -> set[bytes]:
    """Ask ``keys`` (one request's, in the order vLLM asked them) group by group; returns the
    keys that are MISS for this request without having been asked. ``windows``: group ->
    sliding window in chunks (None or absent: full attention). ``position_of``: a key's end
    token in the request (None if unknown: the key keeps its place in ``keys``).
    ``full_miss_position``: the lowest position at which a full-attention group already
    missed for this request."""
    by_group = _by_group(keys, group_of)
    found = [position_of(key) for key in keys]
    key_ends = (
        [i if at is None else at for i, at in enumerate(found)]
        if None in found
        else cast("list[int]", found)  # no None among them
    )
    positions: dict[bytes, float] = dict(zip(keys, key_ends, strict=True))
    position = positions.__getitem__

    full = [sorted(ks, key=position) for g, ks in by_group.items() if windows.get(g) is None]
    sliding = {
        g: _WindowSearch(sorted(ks, key=position, reverse=True), max(1, windows[g] or 1), positions)
        for g, ks in by_group.items()
        if windows.get(g) is not None
    }
    answers: dict[bytes, LookupResult] = {}
    # The first round: the full groups, and the top window of each sliding group.
    searching = {g: search.next_keys(full_miss_position, answers) for g, search in sliding.items()}
    searching = {g: batch for g, batch in searching.items() if batch}
    first = full + list(searching.values())
    results = ask(first) if first else []
    not_asked: set[bytes] = set()
    limit = full_miss_position
    for ordered, answered in zip(full, results, strict=False):
        miss = _first_miss(answered[: len(ordered)])
        if miss is not None:  # the group's keys are in token order: its first MISS is lowest
            limit = min(limit, position(ordered[miss]))
        not_asked.update(ordered[len(answered) :])
    _record(searching, results[len(full) :], answers, sliding)
    if not sliding:
        return not_asked

    ends: dict[int, float] = {}
    bound = limit  # a window must end below it
    while True:
        todo = {g for g in sliding if g not in ends or ends[g] >= bound}
        while todo:
            searching = {}
            for group in todo:
                end = sliding[group].end(bound, answers)
                if end is None:
                    searching[group] = sliding[group].next_keys(bound, answers)
                else:
                    ends[group] = end
            todo = set(searching)
            if searching:
                _record(searching, ask(list(searching.values())), answers, sliding)
        lowest = min(ends.values())
        if all(end <= lowest for end in ends.values()) or lowest <= 0:
            break
        bound = lowest + 1e-9  # positions are whole tokens: a window ending at ``lowest`` fits
    for search in sliding.values():
        not_asked.update(k for k in search.descending if position(k) >= limit and k not in answers)
    return not_asked


def _by_group(keys: Sequence[bytes], group_of: Callable[[bytes], int]) -> dict[int, list[bytes]]:
    """``keys`` by group, each group's in their order in ``keys``."""
    groups = [group_of(key) for key in keys]
    if groups and groups.count(groups[0]) == len(groups):
        return {groups[0]: list(keys)}  # one group: a model with one, or one group's lookups
    by_group: dict[int, list[bytes]] = {}
    for group, key in zip(groups, keys, strict=True):
        by_group.setdefault(group, []).append(key)
    return by_group


def _first_miss(answered: Sequence[LookupResult]) -> int | None:
    """The index of the first MISS in ``answered``; None if none is."""
    try:
        return answered.index(LookupResult.MISS)
    except ValueError:
        return None


class _WindowSearch:
    """One sliding-window group's search, from the end down, for ``window`` hits in a row."""

    def __init__(
        self, descending: list[bytes], window: int, positions: Mapping[bytes, float]
    ) -> None:
        self.descending = descending
        self.window = window
        self._positions = positions
        self._descending_positions = [-positions[k] for k in descending]  # ascending
        self.exhausted = False
        """The service answered none of a batch: nothing more to learn now."""

    def _below(self, bound: float) -> list[bytes]:
        return self.descending[bisect.bisect_right(self._descending_positions, -bound) :]

    def end(self, bound: float, answers: Mapping[bytes, LookupResult]) -> float | None:
        """The end position of the highest run of ``window`` hits below ``bound``; 0 if there
        is none (or nothing more can be learnt now), None while keys must be asked first."""
        if self.exhausted:
            return 0
        below = self._below(bound)
        run = 0
        for i, key in enumerate(below):
            result = answers.get(key)
            if result is None:
                return None
            run = run + 1 if result in (LookupResult.HIT, LookupResult.HIT_PENDING) else 0
            if run == self.window:
                return self._positions[below[i - self.window + 1]]
        return 0

    def next_keys(self, bound: float, answers: Mapping[bytes, LookupResult]) -> list[bytes]:
        """The keys to ask next: the unanswered ones among the ``window`` keys below ``bound``
        from the highest unanswered one down (empty when every key is answered)."""
        below = self._below(bound)
        for i, key in enumerate(below):
            if key not in answers:
                return [k for k in below[i : i + self.window] if k not in answers]
        return []


def _record(
    searching: Mapping[int, list[bytes]],
    results: Sequence[Sequence[LookupResult]],
    answers: dict[bytes, LookupResult],
    sliding: Mapping[int, _WindowSearch],
) -> None:
    """Record the answers to the batches of ``searching`` (group -> keys asked)."""
    for i, (group, batch) in enumerate(searching.items()):
        answered = results[i] if i < len(results) else []
        if not answered:
            sliding[group].exhausted = True
        for key, result in zip(batch, answered, strict=False):
            answers[key] = result
