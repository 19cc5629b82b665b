"""Primary index and its eviction policies (LRU, ARC)."""

import pytest

from kvoffload.tiering import LookupResult, PrimaryIndex
from kvoffload.tiering.policies import ARCPolicy, make_policy
from kvoffload.tiering.types import NotReady, ProtocolViolation
from tests.tiering.conftest import k


def filled(policy, n=4):
    p = PrimaryIndex(n, policy)
    keys = [k(i) for i in range(n)]
    p.allocate(keys, set(keys))
    p.complete_write(keys, True)
    return p


def test_allocation_order_unused_first_then_freed_lifo():
    p = PrimaryIndex(4)
    assert p.allocate([k(1), k(2)], set()).slots == [0, 1]
    p.complete_write([k(1), k(2)], False)  # frees 0 then 1
    assert p.allocate([k(3), k(4), k(5), k(6)], set()).slots == [2, 3, 1, 0]


def test_states_and_lookup():
    p = PrimaryIndex(2)
    p.allocate([k(1)], set())
    assert p.ref_count(k(1)) == -1 and p.lookup(k(1)) is LookupResult.HIT_PENDING
    with pytest.raises(NotReady):
        p.pin([k(1)])
    p.complete_write([k(1)], True)
    assert p.lookup(k(1)) is LookupResult.HIT and p.evictable_count == 1
    p.pin([k(1)])
    p.pin([k(1)])
    assert p.ref_count(k(1)) == 2 and p.evictable_count == 0
    p.unpin([k(1)])
    p.unpin([k(1)])
    assert p.evictable_count == 1
    with pytest.raises(ProtocolViolation):
        p.unpin([k(1)])
    assert p.lookup(k(9)) is LookupResult.MISS


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_key_not_evicted_by_its_own_store(policy):
    p = filled(policy)
    keys = [k(0), k(10)]
    new_keys, slots, evicted = p.allocate(keys, set(keys))
    assert new_keys == [k(10)]
    assert k(0) not in evicted and k(0) in p


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pinned_and_in_flight_keys_block_eviction(policy):
    p = filled(policy, 3)
    p.pin([k(0), k(1), k(2)])
    assert p.allocate([k(5)], set()) is None
    p.unpin([k(2)])
    assert p.allocate([k(5)], set()).evicted == [k(2)]
    assert p.allocate([k(6)], set()) is None  # k5 in flight, others pinned


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_is_atomic(policy):
    p = filled(policy, 3)
    p.pin([k(0)])
    before = list(p.items())
    assert p.allocate([k(7), k(8), k(9)], set()) is None
    assert list(p.items()) == before


def test_fast_fail_does_not_call_policy():
    p = filled("lru", 3)
    p.pin([k(0), k(1)])
    calls = []
    original = p.policy.evict
    p.policy.evict = lambda n, protected: calls.append(n) or original(n, protected)
    assert p.allocate([k(7), k(8)], set()) is None
    assert calls == []
    assert p.allocate([k(7)], {k(2)}) is None  # protected: policy asked, refuses
    assert calls == [1]


def test_lru_order_and_touch():
    p = filled("lru", 3)
    p.touch([k(0), k(1)])  # k0 becomes most recent
    assert p.policy.order() == [k(2), k(1), k(0)]
    assert p.allocate([k(5)], set()).evicted == [k(2)]


def test_arc_moves_to_t2_on_second_access_and_evicts_t1_first():
    p = filled("arc", 3)
    arc = p.policy
    assert isinstance(arc, ARCPolicy)
    p.touch([k(1)])
    assert k(1) in arc.t2 and k(0) in arc.t1
    evicted = p.allocate([k(5)], set())[2]
    assert evicted == [k(0)] and k(0) in arc.b1


def test_arc_not_ready_touch_stays_in_t1():
    p = PrimaryIndex(3, "arc")
    p.allocate([k(1)], set())
    p.touch([k(1)])
    assert k(1) in p.policy.t1


def test_arc_ghost_hits_adapt_target_and_ghosts_are_bounded():
    p = filled("arc", 2)
    arc = p.policy
    p.allocate([k(5)], set())
    p.complete_write([k(5)], True)  # evicts k0 into B1
    assert k(0) in arc.b1
    p.touch([k(0)])
    assert arc.target_t1 == 1.0
    for i in range(10, 20):
        p.allocate([k(i)], set())
        p.complete_write([k(i)], True)
    assert len(arc.b1) <= 2 and len(arc.b2) <= 2


def test_arc_failed_store_cleanup():
    p = PrimaryIndex(2, "arc")
    p.allocate([k(1)], set())
    p.complete_write([k(1)], False)
    assert k(1) not in p.policy.t1 and k(1) not in p
    assert p.free_slots == 2


def test_policy_by_name():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope", 3, lambda key: 0)
    assert make_policy("ARC", 3, lambda key: 0).name == "arc"


def test_reset_forgets_everything():
    p = filled("lru", 3)
    p.reset()
    assert len(p) == 0 and p.free_slots == 3
    assert p.allocate([k(1)], set())[1] == [0]
