"""Warm restart in the pure library: adopting blocks found in the pool, verifying them, and the
hook that reports every slot freed or handed to a new key."""

import pytest

from kvoffload.tiering import LookupResult, PrimaryIndex, TieringLedger
from kvoffload.tiering.types import NotReady
from tests.tiering.conftest import Harness, k

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


def test_adopted_keys_are_pending_at_their_exact_slots_and_other_slots_are_free():
    index = PrimaryIndex(6, track_invalidations=True)
    index.adopt([(k(1), 4), (k(2), 1)])
    assert [index.lookup(k(i)) for i in (1, 2, 3)] == [HIT_PENDING, HIT_PENDING, MISS]
    assert (index.slot_of(k(1)), index.slot_of(k(2))) == (4, 1)
    assert index.free_slots == 4 and index.evictable_count == 0
    new_keys, slots, evicted = index.allocate([k(i) for i in range(3, 7)], ())
    assert sorted(slots) == [0, 2, 3, 5] and evicted == []
    assert index.allocate([k(9)], ()) is None, "adopted in-flight keys are not evictable"
    assert index.take_invalidated_slots() == slots


def test_adopt_refuses_a_used_index_and_bad_entries():
    index = PrimaryIndex(4)
    with pytest.raises(ValueError):
        index.adopt([(k(1), 0), (k(1), 1)])
    with pytest.raises(ValueError):
        index.adopt([(k(1), 0), (k(2), 0)])
    with pytest.raises(ValueError):
        index.adopt([(k(1), 4)])
    assert len(index) == 0
    index.allocate([k(1)], ())
    with pytest.raises(ValueError):
        index.adopt([(k(2), 3)])


def test_verified_keys_become_hits_failed_ones_are_freed_and_reported():
    h = Harness(num_slots=4, track_slot_invalidations=True)
    h.m.adopt([(k(1), 2), (k(2), 0), (k(3), 3)])
    req = h.new()
    reply = h.m.lookup(req, [k(1), k(2), k(3)])
    assert reply.results == [HIT_PENDING] * 3 and reply.ready_prefix == 0
    with pytest.raises(NotReady):
        h.m.prepare_load(req, [k(1)])
    assert h.m.snapshot().unverified_slots == 3
    ready, dropped = h.m.complete_adoption([k(1), k(2), k(3)], [k(1), k(3)])
    assert (ready, dropped) == ([k(1), k(3)], [k(2)])
    assert h.m.take_invalidated_slots() == [0], "the failed key's slot must be reported freed"
    reply = h.m.lookup(req, [k(1), k(3), k(2)])
    assert reply.results[:2] == [HIT, HIT] and reply.results[2] is not HIT
    assert h.m.prepare_load(req, [k(1), k(3)]) == [2, 3]
    h.m.complete_load([k(1), k(3)])
    h.answer(h.jobs())  # verified blocks no tier holds are cascaded
    snap = h.m.snapshot()
    assert (snap.unverified_slots, snap.pinned_slots, snap.writing_slots) == (0, 0, 0)


def test_a_late_verification_after_reset_changes_nothing():
    h = Harness(num_slots=3, track_slot_invalidations=True)
    h.m.adopt([(k(1), 1)])
    h.m.reset_cache()
    assert h.m.take_invalidated_slots() == [1]
    req = h.new()
    out = h.m.prepare_store(req, [k(1)])
    assert out.keys_to_store == [k(1)]
    assert h.m.complete_adoption([k(1)], [k(1)]) == ([], [])
    assert h.m.lookup(req, [k(1)]).results == [HIT_PENDING], "the new write must stay in flight"


def test_every_freed_or_reassigned_slot_is_reported_once_per_event():
    h = Harness(num_slots=2, track_slot_invalidations=True)
    req = h.new()
    h.store(req, [k(1), k(2)])
    assert sorted(h.m.take_invalidated_slots()) == [0, 1]  # allocation
    assert h.m.take_invalidated_slots() == []
    h.drain()
    h.store(req, [k(3)])  # evicts the LRU key (slot freed) and hands its slot to k(3)
    evicted_slot = h.m.primary.slot_of(k(3))
    assert h.m.take_invalidated_slots() == [evicted_slot, evicted_slot]
    out = h.m.prepare_store(req, [k(4)])
    h.m.complete_store(req, out.keys_to_store, success=False)
    assert h.m.take_invalidated_slots() == out.slots * 3  # evict, allocate, failed write frees
    h.drain()
    held = sorted(slot for _, slot, _ in h.m.primary.items())
    h.m.reset_cache()
    assert held and sorted(h.m.take_invalidated_slots()) == held


def test_without_tracking_nothing_is_recorded():
    m = TieringLedger(2)
    m.adopt([(k(1), 0)])
    m.complete_adoption([k(1)], [])
    assert m.take_invalidated_slots() == []


def test_adopted_blocks_are_cascaded_to_each_tier_that_does_not_hold_them():
    h = Harness(num_slots=4, track_slot_invalidations=True)
    h.m.adopt([(k(1), 0), (k(2), 1), (k(3), 2)])
    for tier in ("disk", "mem2"):
        h.m.set_tier_online(tier, False)  # a restarted manager: no worker has said hello yet
    h.m.complete_adoption([k(1), k(2), k(3)], [k(1), k(2)])
    h.m.end_step()
    assert h.jobs() == []
    h.m.apply_index_update("disk", [k(1)], [])  # the disk worker announces what it holds
    h.m.set_tier_online("disk", True)
    h.m.set_tier_online("mem2", True)
    h.m.end_step()
    sent = {h.m.tiers[j.tier].name: j.keys for j in h.jobs()}
    assert sent == {"disk": [k(2)], "mem2": [k(1), k(2)]}
