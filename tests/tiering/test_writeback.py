"""Write-back (docs/design/tiering.md, section 4): a HOLD tier's dirty blocks are never evicted,
a store that finds no clean room is refused at once, best-effort tiers lose blocks only counted."""

from kvoffload.tiering import (
    JobKind,
    Locality,
    LookupResult,
    Medium,
    TieringLedger,
    TierSpec,
    TransferResult,
    WriteBack,
)
from tests.tiering.conftest import FakeClock, Harness, k

DISK = TierSpec("disk", Medium.STORAGE, Locality.LOCAL, writeback=WriteBack.HOLD)
OBJECT = TierSpec("object", Medium.STORAGE, Locality.REMOTE, indexed=False)


class WriteBackHarness(Harness):
    """``Harness``'s helpers over a ledger with the given tiers (default: a HOLD disk tier)."""

    def __init__(self, num_slots=4, specs=(DISK,), **kw):
        self.clock = FakeClock()
        self.m = TieringLedger(num_slots, list(specs), clock=self.clock, **kw)
        self.sent = []


def dropped(logs, tier, reason):
    return [
        key
        for e in logs
        if e["event"] == "cascade_dropped" and e["tier"] == tier and e["reason"] == reason
        for key in e["keys"]
    ]


def test_dirty_blocks_of_a_hold_tier_are_never_evicted_and_the_store_is_refused(captured_logs):
    h = WriteBackHarness(num_slots=4)
    r = h.new()
    h.store(r, [k(1), k(2), k(3), k(4)])
    (cascade,) = h.jobs()  # in flight: every block is dirty for the disk
    assert h.m.prepare_store(r, [k(5)]) is None, "no clean block to evict: refused at once"
    assert h.m.stats.store_allocation_failures == 1 and h.m.stats.stores_refused_dirty == 1
    h.answer([cascade])
    snap = h.m.snapshot()
    assert snap.held_slots == 0 and snap.tiers["disk"].dirty_keys == 0
    out = h.m.prepare_store(r, [k(5)])
    assert out is not None and out.evicted == [k(1)], "blocks on disk go first"
    assert dropped(captured_logs, "disk", "evicted") == []


def test_an_offline_hold_tier_keeps_its_blocks_until_it_is_back(captured_logs):
    h = WriteBackHarness(num_slots=3)
    h.m.set_tier_online("disk", False)
    r = h.new()
    h.store(r, [k(1), k(2), k(3)])
    assert h.jobs() == []
    snap = h.m.snapshot()
    assert snap.held_slots == 3 and snap.tiers["disk"].dirty_keys == 3
    assert snap.pinned_slots == 0, "held, not pinned: loads still read them"
    assert h.m.prepare_store(r, [k(4)]) is None
    h.clock.now += 2.5
    assert h.m.prepare_store(r, [k(4)]) is None
    h.m.set_tier_online("disk", True)
    h.m.end_step()
    h.answer(h.jobs())
    h.clock.now += 0.5
    assert h.m.prepare_store(r, [k(4)]) is not None
    assert h.m.stats.stores_refused_dirty == 2
    assert h.m.stats.store_backpressure_s == 3.0, "from the first refusal to the next store"
    assert h.m.tiers[0].index == {k(1), k(2), k(3)}
    assert dropped(captured_logs, "disk", "evicted") == []


def test_a_worker_crash_keeps_the_blocks_held_and_retried():
    h = WriteBackHarness(num_slots=2)
    r = h.new()
    h.store(r, [k(1), k(2)])
    assert len(h.jobs()) == 1
    h.m.set_tier_online("disk", False)
    h.m.fail_worker_jobs("disk")
    assert h.m.primary.pinned_count() == 0 and h.m.primary.held_count == 2
    assert h.m.prepare_store(r, [k(3)]) is None
    h.clock.now += 1
    h.m.set_tier_online("disk", True)
    h.m.end_step()
    (retry,) = h.jobs()
    assert retry.keys == [k(1), k(2)]
    h.answer([retry])
    assert h.m.primary.held_count == 0 and h.m.prepare_store(r, [k(3)]) is not None


def test_only_a_counted_reason_lets_a_held_block_go(captured_logs):
    h = WriteBackHarness(num_slots=2, cascade_max_attempts=2, cascade_backoff_s=1.0)
    r = h.new()
    h.store(r, [k(1), k(2)])
    (job,) = h.jobs()
    h.m.apply_result(
        "disk", TransferResult(job.job_id, False, [k(2)], full_keys=[k(1)])
    )  # k1: no room on disk
    assert dropped(captured_logs, "disk", "tier_full") == [k(1).hex()]
    assert h.m.primary.held_count == 0
    h.store(r, [k(3)])  # evicts k1 (given up for the disk, counted)
    (job,) = h.jobs()
    for _ in range(2):
        h.m.apply_result("disk", TransferResult(job.job_id, False))
        h.clock.now += 5
        h.m.end_step()
        job = next(iter(h.jobs()), None)
    assert dropped(captured_logs, "disk", "retry_bound") == [k(3).hex()]
    assert h.m.primary.held_count == 0
    assert h.m.prepare_store(r, [k(4)]) is not None
    assert dropped(captured_logs, "disk", "evicted") == []


def test_a_reset_gives_up_what_an_offline_hold_tier_never_got(captured_logs):
    h = WriteBackHarness(num_slots=2)
    h.m.set_tier_online("disk", False)
    r = h.new()
    h.store(r, [k(1)])
    h.m.reset_cache()
    assert dropped(captured_logs, "disk", "evicted") == [k(1).hex()]
    assert h.m.primary.held_count == 0 and len(h.m.primary) == 0
    assert h.m.snapshot().tiers["disk"].dirty_keys == 0


def clean_block_then_object_offline() -> tuple[WriteBackHarness, str]:
    """Three slots over a HOLD disk tier and a best-effort object tier: k1 stored and clean
    everywhere, then the object tier offline (what is stored next stays dirty for it)."""
    h = WriteBackHarness(num_slots=3, specs=(DISK, OBJECT))
    r = h.new()
    h.store(r, [k(1)])
    h.answer(h.jobs())
    h.m.set_tier_online("object", False)
    return h, r


def test_best_effort_blocks_go_last_and_counted_held_ones_never(captured_logs):
    h, r = clean_block_then_object_offline()
    h.store(r, [k(2)])
    h.answer(h.jobs())  # k2: on disk, dirty for the object only
    h.m.set_tier_online("disk", False)
    h.store(r, [k(3)])  # k3: dirty for both, held for the disk
    h.m.touch([k(1)])  # LRU alone would evict k2 first
    out = h.m.prepare_store(r, [k(4)])
    assert out.evicted == [k(1)], "a clean block goes before a best-effort dirty one"
    h.m.complete_store(r, out.keys_to_store)
    out = h.m.prepare_store(r, [k(5)])
    assert out.evicted == [k(2)], "then one dirty for the best-effort tier only"
    assert dropped(captured_logs, "object", "evicted") == [k(2).hex()]
    h.m.complete_store(r, out.keys_to_store)
    assert h.m.prepare_store(r, [k(6)]) is None, "k3, k4, k5 wait for the disk: held"
    assert dropped(captured_logs, "disk", "evicted") == []


def test_promotions_use_clean_room_first_as_one_at_a_time():
    h, r = clean_block_then_object_offline()
    h.store(r, [k(2)])
    h.store(r, [k(3)])
    h.answer(h.jobs())  # k2, k3: on disk, dirty for the object only
    h.m.touch([k(1)])  # LRU alone would evict k2 and k3
    h.m.apply_index_update("disk", [k(10), k(11)], [])
    reply = h.m.lookup(r, [k(10), k(11)])
    assert reply.results == [LookupResult.HIT_PENDING] * 2
    assert [key in h.m.primary for key in (k(1), k(2), k(3))] == [False, False, True]


def test_cascades_go_out_in_jobs_of_bounded_size_within_the_bound_and_in_order():
    spec = TierSpec(
        "disk",
        Medium.STORAGE,
        Locality.LOCAL,
        writeback=WriteBack.HOLD,
        max_inflight_cascade_keys=4,
        max_cascade_job_keys=2,
    )
    h = WriteBackHarness(num_slots=16, specs=(spec,))
    r = h.new()
    h.store(r, [k(i) for i in range(6)])
    first = h.jobs()
    assert [j.keys for j in first] == [[k(0), k(1)], [k(2), k(3)]]
    h.store(r, [k(6)])  # older keys wait: k6 goes behind them
    h.m.end_step()
    assert h.jobs() == []
    h.answer(first[:1])
    h.m.end_step()
    (later,) = h.jobs()
    assert later.keys == [k(4), k(5)] and later.kind is JobKind.CASCADE
    snap = h.m.snapshot().tiers["disk"]
    assert snap.cascade_inflight_keys == 4 and snap.dirty_keys == 5
