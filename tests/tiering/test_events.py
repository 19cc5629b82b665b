"""The tiers' events (tiering.events): what each tier gained and lost, as a router hears it."""

from kvoffload.tiering import TierSpec, TransferResult
from kvoffload.tiering.tenants import TenantLimits, TenantPolicy
from kvoffload.wire.events import TierEvent
from kvoffload.wire.vocab import PRIMARY, JobKind, Locality, Medium
from tests.tiering.conftest import Harness, k
from tests.tiering.test_tenants import TenantHarness

POOL, DISK, MEM2, OBJECT = PRIMARY, "disk", "mem2", "object"


def changes(h) -> list[tuple[int, bool, list[bytes]]]:
    return [(e.tier, e.removed, e.keys) for e in h.m.take_events()]


def test_nothing_is_recorded_before_start(h):
    r = h.new()
    h.store(r, [k(0)])
    assert h.m.take_events() == []
    h.m.events.start()
    h.store(r, [k(1)])
    assert changes(h) == [(POOL, False, [k(1)])]


def test_a_store_is_told_when_it_lands_and_a_failed_one_never():
    h = Harness()
    h.m.events.start()
    r = h.new()
    out = h.m.prepare_store(r, [k(0), k(1)])
    assert out is not None
    assert changes(h) == [], "a reserved slot is not a stored block"
    h.m.complete_store(r, [k(0), k(1)], False, [k(1)])
    assert changes(h) == [(POOL, False, [k(1)])]


def test_cascades_landing_and_evictions_are_told_per_tier():
    h = Harness(num_slots=2)
    h.m.events.start()
    r = h.new()
    h.store(r, [k(0), k(1)])
    h.drain()
    assert changes(h) == [
        (POOL, False, [k(0), k(1)]),
        (DISK, False, [k(0), k(1)]),
        (MEM2, False, [k(0), k(1)]),
    ]
    h.store(r, [k(2)])
    assert changes(h) == [(POOL, True, [k(0)]), (POOL, False, [k(2)])]
    h.m.apply_index_update("disk", [], [k(1), k(9)])
    assert changes(h) == [(DISK, True, [k(1)])], "only what the tier held"


def test_a_promotion_is_told_when_it_lands():
    h = Harness(num_slots=2)
    r = h.new()
    h.store(r, [k(0), k(1)])
    h.drain()
    h.store(r, [k(2), k(3)])
    h.drain()
    h.m.events.start()
    assert h.m.lookup(r, [k(0)]).results[0].name == "HIT_PENDING"
    assert changes(h) == [(POOL, True, [k(2)])]
    h.drain()
    assert changes(h) == [(POOL, False, [k(0)])]


def test_a_reset_removes_every_ready_block_of_the_pool_only(h):
    r = h.new()
    h.store(r, [k(0), k(1)])
    h.drain()
    h.m.events.start()
    h.m.reset_cache()
    assert changes(h) == [(POOL, True, [k(0), k(1)])]


def test_a_restarted_worker_is_told_as_the_difference_once_its_index_is_complete(h):
    h.m.apply_index_update("disk", [k(0), k(1), k(2)], [])
    h.m.events.start()
    h.m.set_tier_online("disk", False)
    h.m.reset_tier_index("disk")
    h.m.apply_index_update("disk", [k(1), k(2), k(3)], [])
    h.m.apply_index_update("disk", [], [k(2)])
    assert changes(h) == [], "nothing while the index is announced again"
    h.m.set_tier_online("disk", True)
    told = [(tier, removed, set(keys)) for tier, removed, keys in changes(h)]
    assert told == [(DISK, True, {k(0), k(2)}), (DISK, False, {k(3)})]


def test_a_probed_tier_tells_its_cascades_and_what_it_was_found_not_to_hold():
    h = Harness(num_slots=2, probed=True)
    h.m.events.start()
    r = h.new()
    h.store(r, [k(0)])
    h.drain()
    assert (OBJECT, False, [k(0)]) in changes(h)
    h.store(r, [k(1), k(2)])
    h.drain()
    h.m.take_events()
    r2 = h.new("r2")
    h.m.lookup(r2, [k(0)])
    h.m.end_step()
    job = next(j for j in h.jobs() if j.kind is JobKind.PROMOTION and j.tier == 0)
    h.m.apply_result("disk", TransferResult(job.job_id, False, absent_keys=[k(0)]))
    assert (DISK, True, [k(0)]) in changes(h)


def test_each_event_names_the_tenant_of_its_blocks_a_dropped_ones_too():
    policy = TenantPolicy(named={"a": {"primary": TenantLimits(share=1)}})
    disk = TierSpec("disk", capacity_keys=8)
    h = TenantHarness(num_slots=4, specs=[disk], tenant_policy=policy)
    h.m.events.start()
    h.store("a", [k(0)])
    h.store("b", [k(1), k(2)])
    h.drain()
    cpu, storage = (Medium.CPU, Locality.LOCAL), (Medium.STORAGE, Locality.LOCAL)
    assert h.m.take_events() == [
        TierEvent(POOL, *cpu, False, [k(0)], "a"),
        TierEvent(POOL, *cpu, False, [k(1), k(2)], "b"),
        TierEvent(DISK, *storage, False, [k(0)], "a"),
        TierEvent(DISK, *storage, False, [k(1), k(2)], "b"),
    ]
    h.m.drop_tenant("b")
    h.drain()
    events = h.m.take_events()
    assert TierEvent(POOL, *cpu, True, [k(1), k(2)], "b") in events
    assert TierEvent(DISK, *storage, True, [k(1), k(2)], "b") in events
    assert all(e.tenant == "b" for e in events)
