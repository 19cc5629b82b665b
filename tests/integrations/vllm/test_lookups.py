"""Group-by-group lookups of one request, at the library level: the order in which keys are
asked, what is left unasked, and the boundary the groups converge on."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from kvoffload.integrations.vllm.lookups import ask_by_group  # noqa: E402

HIT, MISS = LookupResult.HIT, LookupResult.MISS
TPC = 32  # tokens per chunk


def key(group: int, chunk: int) -> bytes:
    return b"k%03d" % chunk + group.to_bytes(4, "big")


def group_of(k: bytes) -> int:
    return int.from_bytes(k[-4:], "big")


def position_of(k: bytes) -> int:
    return int(k[1:4]) * TPC


class StoredKeys:
    """Answers keys in order, stopping after the first MISS, as kvoffload's lookup does."""

    def __init__(self, stored: set[bytes]) -> None:
        self.stored = stored
        self.rounds: list[list[list[bytes]]] = []
        """The batches asked, round trip by round trip."""

    def ask(self, batches: list[list[bytes]]) -> list[list[LookupResult]]:
        self.rounds.append([list(keys) for keys in batches])
        return [self._answer(keys) for keys in batches]

    def _answer(self, keys: list[bytes]) -> list[LookupResult]:
        out = []
        for k in keys:
            out.append(HIT if k in self.stored else MISS)
            if out[-1] is MISS:
                break
        return out

    def asked(self) -> set[bytes]:
        return {k for batches in self.rounds for keys in batches for k in keys}


def run(keys, windows, service, **kw):
    return ask_by_group(keys, group_of, position_of, windows, service.ask, **kw)


def test_a_full_attention_group_is_asked_once_in_token_order():
    keys = [key(0, c) for c in range(1, 10)]
    service = StoredKeys({key(0, c) for c in range(1, 5)})
    not_asked = run(list(reversed(keys)), {}, service)
    assert service.rounds == [[keys]]  # token order, whatever order vLLM asked in
    assert not_asked == set(keys[5:])  # past the first MISS (chunk 5)


def test_a_sliding_window_is_searched_below_the_full_groups_first_miss():
    """A prompt sharing 6 chunks with a stored one: the window must end at chunk 6 at most."""
    full = [key(1, c) for c in range(1, 10)]
    sliding = [key(0, c) for c in range(9, 0, -1)]  # vLLM asks a window's keys from the end
    stored = {key(1, c) for c in range(1, 7)} | {key(0, c) for c in (3, 5, 6, 8, 9)}
    service = StoredKeys(stored)

    not_asked = run(sliding + full, {0: 2}, service)

    asked = service.asked()
    assert {key(0, 6), key(0, 5)} <= asked
    # the first round asked the top window beside the full group; past it, nothing that could
    # never be read (at or past chunk 7) is asked
    assert service.rounds[0] == [full, [key(0, 9), key(0, 8)]]
    assert key(0, 7) not in asked
    assert key(0, 7) in not_asked
    assert not not_asked & {key(0, 8), key(0, 9)}  # answered
    assert not asked & {key(0, c) for c in (1, 2, 3, 4)}  # below the window found
    assert not (not_asked & {key(0, c) for c in (1, 2, 3, 4)})  # left for vLLM to ask


def test_sliding_groups_converge_on_the_lowest_window_end():
    a = [key(0, c) for c in range(9, 0, -1)]
    b = [key(1, c) for c in range(9, 0, -1)]
    stored = {key(0, c) for c in (9, 8, 6, 5)} | {key(1, c) for c in (6, 5)}
    service = StoredKeys(stored)

    run(a + b, {0: 2, 1: 2}, service)

    # group 0 first finds its window at chunk 9, group 1 only at 6: group 0 searches again and
    # learns chunks 6 and 5, so vLLM's second pass is answered in this same step
    assert {key(0, 6), key(0, 5), key(1, 6), key(1, 5)} <= service.asked()


def test_a_known_full_miss_bounds_the_window_search():
    sliding = [key(0, c) for c in range(9, 0, -1)]
    service = StoredKeys({key(0, c) for c in range(1, 10)})
    not_asked = run(sliding, {0: 2}, service, full_miss_position=4 * TPC)
    assert service.rounds == [[[key(0, 3), key(0, 2)]]]
    assert not_asked == {key(0, c) for c in range(4, 10)}


def test_no_window_means_nothing_is_claimed_and_nothing_is_lost():
    sliding = [key(0, c) for c in range(4, 0, -1)]
    service = StoredKeys({key(0, 4), key(0, 2)})
    not_asked = run(sliding, {0: 2}, service)
    assert service.asked() == set(sliding)  # every gap was looked at
    assert not_asked == set()


def test_a_prefix_that_hits_whole_costs_one_round_trip_for_every_group():
    """Gemma 3's shape: one full-attention group and three sliding ones, all stored."""
    full = [key(0, c) for c in range(1, 17)]
    slidings = [[key(g, c) for c in range(16, 0, -1)] for g in (1, 2, 3)]
    stored = set(full).union(*slidings)
    service = StoredKeys(stored)

    not_asked = run(full + [k for keys in slidings for k in keys], {1: 4, 2: 4, 3: 4}, service)

    assert len(service.rounds) == 1
    assert service.rounds[0] == [full] + [keys[:4] for keys in slidings]
    assert not_asked == set()


def test_sliding_groups_search_together_one_round_per_window():
    """Each later round asks the next window of every group still searching."""
    slidings = [[key(g, c) for c in range(8, 0, -1)] for g in (1, 2)]
    stored = {key(g, c) for g in (1, 2) for c in (5, 4)}
    service = StoredKeys(stored)

    run([k for keys in slidings for k in keys], {1: 2, 2: 2}, service)

    # chunks 8-7, 7-6, 6-5 (each MISS ends its batch), then 5-4 hit: both groups in each round
    assert [len(batches) for batches in service.rounds] == [2, 2, 2, 2]
    assert service.rounds[-1] == [[key(1, 5), key(1, 4)], [key(2, 5), key(2, 4)]]
