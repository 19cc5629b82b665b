"""Tier filter parsing (vLLM rules) and the existence verdict cache."""

import pytest

from kvoffload.tiering import Locality, Medium, TierFilter, TierMatcher, parse_tier_filter
from kvoffload.tiering.verdicts import Phase, VerdictCache
from tests.tiering.conftest import k


@pytest.mark.parametrize(
    "value,expected",
    [
        ([{"medium": "storage"}], (TierMatcher(Medium.STORAGE),)),
        ([{"medium": "CPU"}], (TierMatcher(Medium.CPU),)),
        ([{}], (TierMatcher(),)),
        (
            [{"medium": "storage", "locality": "Remote"}],
            (TierMatcher(Medium.STORAGE, Locality.REMOTE),),
        ),
        (
            [{"medium": "cpu"}, {"locality": "local"}],
            (TierMatcher(Medium.CPU), TierMatcher(None, Locality.LOCAL)),
        ),
        ([], ()),
    ],
)
def test_parse_valid(value, expected):
    assert parse_tier_filter(value).matchers == expected


@pytest.mark.parametrize("value", ["storage", [{"medium": "unknown"}], [{"locality": "mars"}], [3]])
def test_parse_invalid_fails_open(value):
    assert parse_tier_filter(value) == TierFilter.ALL


def test_parse_skips_bad_entries():
    f = parse_tier_filter([{"medium": "storage"}, "x", {"medium": "bogus"}, {"medium": "cpu"}])
    assert f.matchers == (TierMatcher(Medium.STORAGE), TierMatcher(Medium.CPU))


def test_filter_allows():
    assert not TierFilter(()).allows(Medium.CPU, Locality.LOCAL)
    assert TierFilter.ALL.allows(Medium.STORAGE, Locality.REMOTE)
    f = TierFilter((TierMatcher(Medium.STORAGE, Locality.LOCAL),))
    assert f.allows(Medium.STORAGE, Locality.LOCAL)
    assert not f.allows(Medium.STORAGE, Locality.REMOTE)
    assert f.allows(Medium.STORAGE, None)  # a tier with dynamic locality is unconstrained


def test_verdict_new_key_unknown_then_resolved():
    v = VerdictCache()
    assert v.lookup(k(1), "a") is None
    assert v.lookup(k(2), "a") is None
    assert v.take_queued() == [k(1), k(2)]
    assert v.take_queued() == []
    assert v.lookup(k(1), "a") is None
    v.resolve([k(1), k(2)], [k(1)])
    assert v.lookup(k(1), "a") is True and v.lookup(k(2), "a") is False


def test_verdict_key_queued_once_across_requests():
    v = VerdictCache()
    v.lookup(k(1), "a")
    v.lookup(k(1), "b")
    assert v.take_queued() == [k(1)]


def test_verdict_release_keeps_shared_and_in_flight_entries():
    v = VerdictCache()
    v.lookup(k(1), "a")
    v.lookup(k(1), "b")
    v.take_queued()
    v.release("a")
    v.release("b")
    assert v.phase(k(1)) is Phase.IN_FLIGHT  # kept until its answer arrives
    v.resolve([k(1)], [])
    assert v.phase(k(1)) is None
    v.lookup(k(2), "a")
    v.lookup(k(2), "b")
    v.take_queued()
    v.resolve([k(2)], [k(2)])
    v.release("a")
    assert v.lookup(k(2), "b") is True
    v.release("b")
    assert len(v) == 0
    v.release("never-seen")


def test_verdict_mark_miss_and_present():
    v = VerdictCache()
    v.lookup(k(1), "a")
    v.take_queued()
    v.resolve([k(1)], [k(1)])
    v.mark_miss([k(1), k(9)])
    assert v.lookup(k(1), "a") is False
    assert v.phase(k(9)) is None
    v.mark_present([k(1)])
    assert v.cached(k(1)) is True


def test_verdict_released_before_flush_is_not_probed():
    v = VerdictCache()
    v.lookup(k(1), "a")
    v.release("a")
    assert v.take_queued() == []
