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

So the hits of every group arrive in one step, and no key is asked that the request could not
read at the boundary found so far. Keys left unasked stay unanswered (vLLM asks them again if it
needs them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from vllm.v1.kv_offload.base import LookupResult

Ask = Callable[[list[bytes]], Sequence[LookupResult]]
"""Ask the service for keys in this order: the results of a prefix of them (stopping after the
first MISS)."""


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
    order = {key: i for i, key in enumerate(keys)}
    by_group: dict[int, list[bytes]] = {}
    for key in keys:
        by_group.setdefault(group_of(key), []).append(key)

    def position(key: bytes) -> float:
        found = position_of(key)
        return order[key] if found is None else found

    not_asked: set[bytes] = set()
    limit = full_miss_position
    for group, group_keys in by_group.items():
        if windows.get(group) is not None:
            continue
        ordered = sorted(group_keys, key=position)
        results = ask(ordered)
        for key, result in zip(ordered, results, strict=False):
            if result is LookupResult.MISS:
                limit = min(limit, position(key))
        not_asked.update(ordered[len(results) :])

    sliding = {g: ks for g, ks in by_group.items() if windows.get(g) is not None}
    if not sliding:
        return not_asked
    answers: dict[bytes, LookupResult] = {}
    ends: dict[int, float] = {}
    bound = limit  # a window must end below it
    while True:
        for group, group_keys in sliding.items():
            window = max(1, windows[group] or 1)
            if group in ends and ends[group] < bound:
                continue
            ends[group] = _window_end(group_keys, window, bound, position, answers, ask)
        lowest = min(ends.values())
        if all(end <= lowest for end in ends.values()) or lowest <= 0:
            break
        bound = lowest + 1e-9  # positions are whole tokens: a window ending at ``lowest`` fits
    for group_keys in sliding.values():
        not_asked.update(k for k in group_keys if position(k) >= limit)
    return not_asked


def _window_end(
    keys: list[bytes],
    window: int,
    bound: float,
    position: Callable[[bytes], float],
    answers: dict[bytes, LookupResult],
    ask: Ask,
) -> float:
    """The end position of the highest run of ``window`` hits below ``bound`` among ``keys``
    (asking the unanswered ones from the end down, ``window`` per call), 0 if there is none."""
    descending = [k for k in sorted(keys, key=position, reverse=True) if position(k) < bound]
    run, i = 0, 0
    while i < len(descending):
        unknown = [k for k in descending[i : i + window] if k not in answers]
        if unknown:
            for key, result in zip(unknown, ask(unknown), strict=False):
                answers[key] = result
        progressed = False
        while i < len(descending) and descending[i] in answers:
            progressed = True
            result = answers[descending[i]]
            run = run + 1 if result in (LookupResult.HIT, LookupResult.HIT_PENDING) else 0
            i += 1
            if run == window:
                return position(descending[i - window])
        if not progressed:
            return 0  # the service answered none of them: nothing more to learn now
    return 0
