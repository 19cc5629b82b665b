"""Semantics of the tiering ledger (docs/design/tiering.md): vLLM's tiering tests and more."""

import pytest

from kvoffload.tiering import (
    JobKind,
    LookupResult,
    MissReason,
    OffloadPolicy,
    ReqContext,
    TieringLedger,
    TransferResult,
)
from kvoffload.tiering.types import (
    JobsInFlight,
    NotReady,
    ProtocolViolation,
    RequestFinishedError,
    UnknownJob,
    UnknownRequest,
    WrongTier,
)
from tests.tiering.conftest import Harness, k

HIT, HIT_PENDING, RETRY, MISS = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)


def put_in_tier(h: Harness, tier: str, keys):
    h.m.apply_index_update(tier, keys, [])


# -- stores and cascades ------------------------------------------------------------------------


def test_basic_store_to_primary(h):
    r = h.new()
    out = h.store(r, [k(1), k(2), k(3)])
    assert out.keys_to_store == [k(1), k(2), k(3)]
    assert out.slots == [0, 1, 2]
    assert h.m.lookup(r, [k(1), k(2), k(3)]).results == [HIT] * 3


def test_cascade_to_all_secondary_tiers(h):
    r = h.new()
    h.store(r, [k(1), k(2), k(3)])
    jobs = h.jobs()
    assert [(h.m.tiers[j.tier].name, j.kind, j.keys) for j in jobs] == [
        ("disk", JobKind.CASCADE, [k(1), k(2), k(3)]),
        ("mem2", JobKind.CASCADE, [k(1), k(2), k(3)]),
    ]
    h.answer(jobs)
    for tier in h.m.tiers:
        assert tier.index == {k(1), k(2), k(3)}


def test_ref_cnt_protection_during_cascade(h):
    r = h.new()
    h.store(r, [k(1)])
    jobs = h.jobs()
    assert h.m.primary.ref_count(k(1)) == 2  # one pin per tier
    h.answer(jobs[:1])
    assert h.m.primary.ref_count(k(1)) == 1
    assert h.m.has_pending_work()
    h.answer(jobs[1:])
    assert h.m.primary.ref_count(k(1)) == 0
    assert not h.m.has_pending_work()


def test_cascade_unpins_on_failure_and_does_not_index(h):
    r = h.new()
    h.store(r, [k(1), k(2)])
    jobs = h.jobs()
    h.answer(jobs, success=False)
    assert h.m.primary.ref_count(k(1)) == 0
    assert h.m.tiers[0].index == set()
    assert h.m.stats.tier(1).cascade_jobs_failed == 1


def test_failed_store_no_cascade(h):
    r = h.new()
    out = h.store(r, [k(1), k(2)], success=False)
    assert out.keys_to_store == [k(1), k(2)]
    assert h.jobs() == []
    assert h.m.lookup(r, [k(1)]).results == [MISS]
    assert h.m.primary.free_slots == 5


def test_partial_store_cascades_only_stored_keys(h):
    r = h.new()
    out = h.m.prepare_store(r, [k(1), k(2), k(3)])
    h.m.complete_store(r, out.keys_to_store, False, [k(1), k(3)])
    assert h.m.lookup(r, [k(1)]).results == [HIT]
    assert h.m.lookup(r, [k(2)]).results == [MISS]
    assert all(j.keys == [k(1), k(3)] for j in h.jobs())


def test_store_result_not_subset_fails_whole_store(h):
    r = h.new()
    out = h.m.prepare_store(r, [k(1), k(2)])
    with pytest.raises(ProtocolViolation):
        h.m.complete_store(r, out.keys_to_store, False, [k(1), k(9)])
    assert h.m.lookup(r, [k(1)]).results == [MISS]
    assert h.m.requests.get(r).pending_primary_stores == 0


def test_prepare_store_skips_present_keys(h):
    r = h.new()
    h.store(r, [k(1)])
    out = h.m.prepare_store(r, [k(1), k(2)])
    assert out.keys_to_store == [k(2)]


def test_complete_store_forwards_request_to_cascade(h):
    r = h.new("req-ctx", kv_load_tiers=[{"medium": "storage"}])
    h.store(r, [k(1)])
    assert {j.req_id for j in h.jobs()} == {"req-ctx"}


def test_cascade_skips_keys_tier_already_holds(h):
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    h.store(r, [k(1), k(2)])
    jobs = {h.m.tiers[j.tier].name: j.keys for j in h.jobs()}
    assert jobs == {"disk": [k(2)], "mem2": [k(1), k(2)]}


def test_cascade_over_the_pin_bound_waits_unpinned_and_uses_no_job_id():
    from kvoffload.tiering import Locality, Medium, TierSpec

    m = TieringLedger(
        5, [TierSpec("disk", Medium.STORAGE, Locality.LOCAL, max_inflight_cascade_keys=2)]
    )
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", [k(1), k(2)])
    m.complete_store("r", out.keys_to_store)
    first = m.take_submissions()
    assert len(first) == 1
    out = m.prepare_store("r", [k(3)])
    m.complete_store("r", out.keys_to_store)
    assert m.take_submissions() == []
    assert m.primary.ref_count(k(3)) == 0
    assert m.stats.tier(1).cascade_keys_deferred == 1
    assert m.next_job_id() == first[0].job_id + 1
    m.end_step()
    assert m.take_submissions() == [], "no room until the first cascade is done"
    m.apply_result("disk", TransferResult(first[0].job_id, True))
    m.end_step()
    (later,) = m.take_submissions()
    assert later.kind is JobKind.CASCADE and later.keys == [k(3)]
    assert m.snapshot().cascade_backlog == 1
    m.apply_result("disk", TransferResult(later.job_id, True))
    assert m.snapshot().cascade_backlog == 0 and m.tiers[0].index == {k(1), k(2), k(3)}


# -- durable cascades ---------------------------------------------------------------------------


def dropped(logs, reason):
    return [
        key
        for e in logs
        if e["event"] == "cascade_dropped" and e["reason"] == reason
        for key in e["keys"]
    ]


def test_cascade_failed_by_a_worker_crash_is_retried_once_the_worker_is_back(h):
    r = h.new()
    h.store(r, [k(1), k(2)])
    jobs = h.jobs()
    h.answer([j for j in jobs if h.m.tiers[j.tier].name == "mem2"])
    h.m.set_tier_online("disk", False)
    h.m.fail_worker_jobs("disk")  # the disk worker died with the cascade in flight
    assert h.m.primary.pinned_count() == 0
    h.clock.now += 60
    h.m.end_step()
    assert h.jobs() == [], "nothing is sent to a worker known to be down"
    h.m.set_tier_online("disk", True)
    h.m.end_step()
    (retry,) = h.jobs()
    assert (h.m.tiers[retry.tier].name, retry.kind, retry.keys, retry.req_id) == (
        "disk",
        JobKind.CASCADE,
        [k(1), k(2)],
        None,
    )
    h.answer([retry])
    assert h.m.tiers[0].index == {k(1), k(2)}
    assert h.m.snapshot().cascade_backlog == 0 and not h.m.has_pending_work()


def test_cascades_for_an_offline_tier_wait_unpinned_and_go_out_when_it_is_back(h):
    h.m.set_tier_online("disk", False)
    r = h.new()
    h.store(r, [k(1), k(2)])
    (mem2,) = h.jobs()
    assert h.m.tiers[mem2.tier].name == "mem2"
    h.answer([mem2])
    assert h.m.primary.pinned_count() == 0, "waiting cascades pin nothing"
    assert h.m.snapshot().tiers["disk"].cascade_backlog == 2
    assert h.m.stats.tier(1).cascade_keys_deferred == 2
    h.m.set_tier_online("disk", True)
    h.m.end_step()
    (disk,) = h.jobs()
    assert disk.keys == [k(1), k(2)] and h.m.primary.ref_count(k(1)) == 1
    h.answer([disk])
    assert h.m.tiers[0].index == {k(1), k(2)}


def test_a_failure_after_the_backlog_emptied_is_still_retried(h):
    r = h.new()
    h.m.set_tier_online("disk", False)
    h.store(r, [k(1)])
    h.answer(h.jobs())
    h.m.set_tier_online("disk", True)
    h.m.end_step()
    h.answer(h.jobs())  # the backlog is empty again
    h.m.end_step()
    h.store(r, [k(2)])
    for job in h.jobs():
        h.m.apply_result(h.m.tiers[job.tier].name, TransferResult(job.job_id, False))
    h.clock.now += 1
    assert h.m.has_pending_work()
    h.m.end_step()
    assert sorted((h.m.tiers[j.tier].name, j.keys[0]) for j in h.jobs()) == [
        ("disk", k(2)),
        ("mem2", k(2)),
    ]


def test_failed_cascades_back_off_and_are_dropped_at_the_retry_bound(captured_logs):
    h = Harness(cascade_max_attempts=3, cascade_backoff_s=1.0)
    r = h.new()
    h.store(r, [k(1)])
    jobs = h.jobs()
    h.answer([j for j in jobs if h.m.tiers[j.tier].name == "mem2"])
    (job,) = [j for j in jobs if h.m.tiers[j.tier].name == "disk"]
    waits = []
    for _ in range(2):
        h.m.apply_result("disk", TransferResult(job.job_id, False))  # an I/O error
        started = h.clock.now
        while True:
            h.m.end_step()
            retried = h.jobs()
            if retried:
                break
            h.clock.now += 0.25
        waits.append(h.clock.now - started)
        (job,) = retried
    assert waits == [1.0, 2.0], "the backoff doubles"
    h.m.apply_result("disk", TransferResult(job.job_id, False))
    assert dropped(captured_logs, "retry_bound") == [k(1).hex()]
    assert h.m.stats.tier(1).cascade_dropped_retry_bound == 1
    assert h.m.snapshot().cascade_backlog == 0
    h.clock.now += 60
    h.m.end_step()
    assert h.jobs() == []


def test_a_full_tier_drops_the_keys_without_retry(h, captured_logs):
    r = h.new()
    h.store(r, [k(1), k(2)])
    for job in h.jobs():
        tier = h.m.tiers[job.tier].name
        full = [k(2)] if tier == "disk" else []
        h.m.apply_result(
            tier, TransferResult(job.job_id, False, [k(1)] if full else None, full_keys=full)
        )
    assert dropped(captured_logs, "tier_full") == [k(2).hex()]
    assert h.m.stats.tier(1).cascade_dropped_tier_full == 1
    h.clock.now += 60
    h.m.end_step()
    (retry,) = h.jobs()  # mem2's transient failure is retried, disk's full key is not
    assert h.m.tiers[retry.tier].name == "mem2" and retry.keys == [k(1), k(2)]


def test_a_key_evicted_before_its_cascade_is_dropped_as_evicted(captured_logs):
    h = Harness(num_slots=2)
    h.m.set_tier_online("disk", False)
    r = h.new()
    h.store(r, [k(1)])
    h.answer(h.jobs())
    h.store(r, [k(2), k(3)])  # evicts k1, still waiting for the disk tier
    assert dropped(captured_logs, "evicted") == [k(1).hex()]
    assert h.m.stats.tier(1).cascade_dropped_evicted == 1
    assert h.m.snapshot().tiers["disk"].cascade_backlog == 2


def test_eviction_prefers_blocks_that_no_longer_wait_for_a_cascade(captured_logs):
    h = Harness(num_slots=3)
    r = h.new()
    h.store(r, [k(2)])
    h.answer(h.jobs())  # k2 reached every tier
    h.m.set_tier_online("disk", False)
    h.store(r, [k(1)])
    h.answer(h.jobs())  # k1 reached mem2 only; it waits for the disk tier
    h.m.touch([k(2)])  # LRU alone would evict k1 next
    h.store(r, [k(3), k(4)])
    assert k(1) in h.m.primary and k(2) not in h.m.primary
    assert dropped(captured_logs, "evicted") == []


def test_reset_gives_up_the_backlog_as_evicted_after_a_flush(h, captured_logs):
    h.m.set_tier_online("disk", False)
    r = h.new()
    h.store(r, [k(1)])
    h.answer(h.jobs())
    h.m.flush_cascade_backlogs()
    h.m.end_step()
    assert (
        h.jobs() == [] and h.m.cascade_backlog(online_only=True) == 0 and h.m.cascade_backlog() == 1
    )
    h.m.reset_cache()
    assert dropped(captured_logs, "evicted") == [k(1).hex()]
    assert h.m.cascade_backlog() == 0


# -- lookups and promotions ---------------------------------------------------------------------


def test_lookup_from_primary(h):
    r = h.new()
    h.store(r, [k(1), k(2), k(3)])
    reply = h.m.lookup(r, [k(1), k(2), k(3)])
    assert reply.results == [HIT] * 3
    assert (reply.hit_prefix, reply.ready_prefix) == (3, 3)


def test_partial_lookup_stops_at_first_miss(h):
    r = h.new()
    h.store(r, [k(1), k(2), k(3)])
    reply = h.m.lookup(r, [k(1), k(2), k(3), k(4), k(5)])
    assert reply.results == [HIT, HIT, HIT, MISS]
    assert reply.reasons[-1] is MissReason.ABSENT
    assert reply.hit_prefix == 3


def test_lookup_starts_no_promotion_past_first_miss(h):
    put_in_tier(h, "disk", [k(1), k(3)])
    r = h.new()
    reply = h.m.lookup(r, [k(1), k(2), k(3)])
    assert reply.results == [HIT_PENDING, MISS]
    h.m.end_step()
    jobs = h.jobs()
    assert [j.keys for j in jobs] == [[k(1)]]
    assert k(3) not in h.m.primary


def test_promotion_from_secondary(h):
    put_in_tier(h, "disk", [k(1), k(2)])
    r = h.new()
    assert h.m.lookup(r, [k(1), k(2)]).results == [HIT_PENDING] * 2
    assert h.jobs() == []  # submitted at step end
    h.m.end_step()
    jobs = h.jobs()
    assert [(j.kind, j.keys, j.req_id) for j in jobs] == [(JobKind.PROMOTION, [k(1), k(2)], r)]
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.answer(jobs)
    reply = h.m.lookup(r, [k(1), k(2)])
    assert reply.results == [HIT, HIT]


@pytest.mark.parametrize(
    "successful", [[1, 3], None, []], ids=["partial", "legacy-none", "legacy-empty"]
)
def test_failed_promotion_keeps_only_successful_blocks(h, successful):
    put_in_tier(h, "disk", [k(1), k(2), k(3)])
    r = h.new()
    h.m.lookup(r, [k(1), k(2), k(3)])
    h.m.end_step()
    keys = None if successful is None else [k(i) for i in successful]
    h.answer(h.jobs(), success=False, successful_keys=keys)
    expected = {1: MISS, 2: MISS, 3: MISS}
    for i in successful or []:
        expected[i] = HIT
    got = {i: h.m.primary.lookup(k(i)) for i in (1, 2, 3)}
    assert got == expected
    assert h.m.primary.free_slots == 5 - len(successful or [])


def test_failed_load_is_not_repromoted_for_same_request(h):
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    h.answer(h.jobs(), success=False)
    reply = h.m.lookup(r, [k(1)])
    assert reply.results == [MISS]
    assert reply.reasons == [MissReason.FAILED_LOAD]
    h.m.end_step()
    assert h.jobs() == []
    other = h.new("r2")
    assert h.m.lookup(other, [k(1)]).results == [HIT_PENDING]  # a fresh request re-probes


def test_promotion_result_not_subset_fails_job_as_whole(h):
    put_in_tier(h, "disk", [k(1), k(2)])
    r = h.new()
    h.m.lookup(r, [k(1), k(2)])
    h.m.end_step()
    (job,) = h.jobs()
    h.m.apply_result("disk", TransferResult(job.job_id, False, [k(1), k(7)]))
    assert h.m.primary.lookup(k(1)) is MISS
    assert h.m.jobs_in_flight() == 0


def test_lookup_batches_promotions_per_request(h):
    put_in_tier(h, "disk", [k(1), k(2), k(3), k(4)])
    a, b = h.new("a"), h.new("b")
    h.m.lookup(a, [k(1), k(2)])
    h.m.lookup(b, [k(3), k(4)])
    assert h.jobs() == []
    h.m.end_step()
    jobs = h.jobs()
    assert sorted((j.req_id, tuple(j.keys)) for j in jobs) == [
        ("a", (k(1), k(2))),
        ("b", (k(3), k(4))),
    ]


def test_shared_block_promoted_once(h):
    put_in_tier(h, "disk", [k(1)])
    a, b = h.new("a"), h.new("b")
    assert h.m.lookup(a, [k(1)]).results == [HIT_PENDING]
    assert h.m.lookup(b, [k(1)]).results == [HIT_PENDING]
    h.m.end_step()
    jobs = h.jobs()
    assert [(j.req_id, j.keys) for j in jobs] == [("a", [k(1)])]


def test_promotion_uses_first_tier_that_hits(h):
    put_in_tier(h, "disk", [k(1)])
    put_in_tier(h, "mem2", [k(1)])
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    assert [h.m.tiers[j.tier].name for j in h.jobs()] == ["disk"]


def test_promotion_primary_full_is_miss(h):
    r = h.new()
    h.m.prepare_store(r, [k(i) for i in range(10, 15)])  # all 5 slots in flight
    put_in_tier(h, "disk", [k(1)])
    reply = h.m.lookup(r, [k(1)])
    assert reply.results == [MISS]
    assert reply.reasons == [MissReason.PRIMARY_FULL]
    assert h.m.stats.promotion_allocation_failures == 1


def test_promotion_never_evicts_keys_of_the_same_lookup():
    h = Harness(num_slots=2)
    r = h.new()
    h.store(r, [k(1), k(2)])
    h.answer(h.jobs())
    put_in_tier(h, "disk", [k(3)])
    h.m.touch([k(2), k(1)])
    reply = h.m.lookup(r, [k(1), k(2), k(3)])
    assert reply.results == [HIT, HIT, MISS]
    assert reply.reasons[-1] is MissReason.PRIMARY_FULL


def test_promotions_start_up_to_the_first_key_that_finds_no_slot(h):
    r = h.new()
    h.m.prepare_store(r, [k(i) for i in range(10, 13)])  # 3 of the 5 slots in flight
    put_in_tier(h, "disk", [k(i) for i in range(1, 6)])
    reply = h.m.lookup(r, [k(i) for i in range(1, 6)])
    assert reply.results == [HIT_PENDING, HIT_PENDING, MISS]
    assert reply.reasons == [MissReason.NONE, MissReason.NONE, MissReason.PRIMARY_FULL]
    assert reply.hit_prefix == 2
    assert h.m.stats.promotion_allocation_failures == 1
    assert h.m.stats.tier(1).lookups_hit == 3  # k4 and k5 were never looked at
    h.m.end_step()
    assert [j.keys for j in h.jobs()] == [[k(1), k(2)]]


def test_a_key_asked_twice_in_a_lookup_is_promoted_once(h):
    put_in_tier(h, "disk", [k(1), k(2)])
    r = h.new()
    reply = h.m.lookup(r, [k(1), k(2), k(1)])
    assert reply.results == [HIT_PENDING] * 3
    h.m.end_step()
    assert [j.keys for j in h.jobs()] == [[k(1), k(2)]]


def test_promotions_before_and_after_a_pending_write_start_in_order(h):
    a, b = h.new("a"), h.new("b")
    h.m.prepare_store(b, [k(3)])  # being written for another request
    put_in_tier(h, "disk", [k(1), k(2), k(4)])
    reply = h.m.lookup(a, [k(1), k(2), k(3), k(4)])
    assert reply.results == [HIT_PENDING] * 4
    h.m.end_step()
    assert [j.keys for j in h.jobs()] == [[k(1), k(2), k(4)]]


def test_miss_reasons_evicted_and_filtered():
    h = Harness(num_slots=1)
    r = h.new()
    h.store(r, [k(1)])
    h.answer(h.jobs(), success=False)
    h.store(r, [k(2)])
    h.answer(h.jobs(), success=False)
    assert h.m.lookup(r, [k(1)]).reasons == [MissReason.EVICTED]
    f = h.new("f", kv_load_tiers=[])
    assert h.m.lookup(f, [k(9)]).reasons == [MissReason.FILTERED]


# -- probed tier (object store) -----------------------------------------------------------------


def test_probed_tier_retry_then_hit_pending_then_hit():
    h = Harness(probed=True)
    r = h.new()
    reply = h.m.lookup(r, [k(1), k(2)])
    assert reply.results == [RETRY, RETRY]
    assert reply.reasons == [MissReason.PROBING] * 2
    assert reply.hit_prefix == 0 and reply.must_wait
    h.m.end_step()
    (probe,) = h.jobs()
    assert probe.kind is JobKind.PROBE and probe.keys == [k(1), k(2)]
    assert h.m.lookup(r, [k(1), k(2)]).results == [RETRY, RETRY]  # still unresolved, no new probe
    h.m.end_step()
    assert h.jobs() == []
    h.answer([probe], found={k(1)})
    reply = h.m.lookup(r, [k(1), k(2)])
    assert reply.results == [HIT_PENDING, MISS]
    h.m.end_step()
    (promo,) = h.jobs()
    assert promo.kind is JobKind.PROMOTION and h.m.tiers[promo.tier].name == "object"
    h.answer([promo])
    assert h.m.lookup(r, [k(1), k(2)]).results == [HIT, MISS]


def test_no_promotion_past_an_uncertain_key():
    h = Harness(probed=True)
    put_in_tier(h, "disk", [k(2)])
    r = h.new()
    reply = h.m.lookup(r, [k(1), k(2)])
    assert reply.results == [RETRY, RETRY]
    assert reply.reasons == [MissReason.PROBING, MissReason.AWAITING_PREFIX]
    h.m.end_step()
    assert all(j.kind is JobKind.PROBE for j in h.jobs())
    assert k(2) not in h.m.primary


def test_probe_verdict_shared_across_requests_and_released():
    h = Harness(probed=True)
    a, b = h.new("a"), h.new("b")
    h.m.lookup(a, [k(1)])
    h.m.lookup(b, [k(1)])
    h.m.end_step()
    (probe,) = h.jobs()
    h.answer([probe], found=set())
    assert h.m.lookup(b, [k(1)]).results == [MISS]
    obj = h.m.tiers[2]
    h.m.on_request_finished("a")
    assert len(obj.verdicts) == 1
    h.m.on_request_finished("b")
    assert len(obj.verdicts) == 0


def test_probe_timeout_resolves_to_miss():
    h = Harness(probed=True, probe_timeout_s=5.0)
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    (probe,) = h.jobs()
    h.clock.now += 6
    assert h.m.expire_probes() == [probe.job_id]
    assert h.m.lookup(r, [k(1)]).results == [MISS]
    with pytest.raises(UnknownJob):
        h.m.apply_result("object", TransferResult(probe.job_id, True))


def probed_and_promoting(h, *req_ids):
    """k1 found by a probe, then promoted for the first of ``req_ids`` (all wait on it)."""
    for req_id in req_ids:
        assert h.m.lookup(req_id, [k(1)]).results == [RETRY]
    h.m.end_step()
    h.answer(h.jobs(), found={k(1)})
    for req_id in req_ids:
        assert h.m.lookup(req_id, [k(1)]).results == [HIT_PENDING]
    h.m.end_step()
    (promo,) = h.jobs()
    assert promo.kind is JobKind.PROMOTION and promo.req_id == req_ids[0]
    return promo


def test_transient_object_load_failure_misses_only_for_its_request_and_a_fresh_one_reprobes():
    h = Harness(probed=True)
    a = h.new("a")
    promo = probed_and_promoting(h, a)
    h.m.apply_result("object", TransferResult(promo.job_id, False))  # one GET timed out
    reply = h.m.lookup(a, [k(1)])
    assert reply.results == [MISS] and reply.reasons == [MissReason.FAILED_LOAD]
    fresh = h.new("fresh")
    reply = h.m.lookup(fresh, [k(1)])
    assert reply.results == [RETRY] and reply.reasons == [MissReason.PROBING]
    h.m.end_step()
    (probe,) = h.jobs()
    assert probe.kind is JobKind.PROBE and probe.keys == [k(1)]
    h.answer([probe], found={k(1)})
    assert h.m.lookup(fresh, [k(1)]).results == [HIT_PENDING]


def test_confirmed_absent_or_corrupt_object_is_a_shared_miss():
    h = Harness(probed=True)
    a = h.new("a")
    promo = probed_and_promoting(h, a)
    h.m.apply_result("object", TransferResult(promo.job_id, False, absent_keys=[k(1)]))
    fresh = h.new("fresh")
    reply = h.m.lookup(fresh, [k(1)])
    assert reply.results == [MISS] and reply.reasons == [MissReason.ABSENT]
    h.m.end_step()
    assert h.jobs() == [], "a confirmed absence needs no new probe"


def test_failed_probe_misses_only_for_the_requests_waiting_on_it():
    h = Harness(probed=True)
    a, b = h.new("a"), h.new("b")
    h.m.lookup(a, [k(1)])
    h.m.lookup(b, [k(1)])
    h.m.end_step()
    (probe,) = h.jobs()
    h.m.apply_result("object", TransferResult(probe.job_id, False))  # store unreachable
    for req in (a, b):
        reply = h.m.lookup(req, [k(1)])
        assert reply.results == [MISS] and reply.reasons == [MissReason.PROBE_FAILED]
    fresh = h.new("fresh")
    assert h.m.lookup(fresh, [k(1)]).results == [RETRY]
    h.m.end_step()
    (again,) = h.jobs()
    h.answer([again], found={k(1)})
    assert h.m.lookup(fresh, [k(1)]).results == [HIT_PENDING]
    h.m.on_request_finished(a)
    h.m.on_request_finished(b)
    assert h.m.snapshot().tiers["object"].tracked_requests == 1


def test_successful_cascade_makes_probed_verdict_present():
    h = Harness(probed=True)
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    h.answer(h.jobs(), found=set())
    h.store(r, [k(1)])
    h.answer(h.jobs())
    assert h.m.tiers[2].verdicts.cached(k(1)) is True


# -- HIT_PENDING deadline and unread promotions -------------------------------------------------


def test_hit_pending_deadline_per_request_key_not_reset_by_failed_rounds():
    h = Harness(hit_pending_deadline_s=10.0)
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    for round_no in range(4):  # each round another request promotes k1 and the load fails
        other = h.new(f"other{round_no}")
        assert h.m.lookup(other, [k(1)]).results == [HIT_PENDING]
        assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
        h.m.end_step()
        for job in h.jobs():
            h.m.apply_result("disk", TransferResult(job.job_id, False))
        h.clock.now += 3
    assert h.clock.now - 100.0 == 12  # past the 10 s armed at the first HIT_PENDING
    other = h.new("late")
    assert h.m.lookup(other, [k(1)]).results == [HIT_PENDING]
    reply = h.m.lookup(r, [k(1)])
    assert reply.results == [MISS] and reply.reasons == [MissReason.DEADLINE]
    assert h.m.stats.hit_pending_expired == 1


def test_landed_promotion_disarms_the_deadline_and_a_new_wait_gets_a_new_window():
    h = Harness(num_slots=3, hit_pending_deadline_s=5.0)
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.m.end_step()
    h.answer(h.jobs())
    assert h.m.lookup(r, [k(1)]).results == [HIT]
    h.m.prepare_load(r, [k(1)])
    h.m.complete_load([k(1)])
    h.clock.now += 60  # long after the first window
    w = h.new("w")
    h.store(w, [k(7), k(8), k(9)])  # evicts k1 (preemption would do the same)
    h.answer(h.jobs())
    assert k(1) not in h.m.primary
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING], "a new wait starts a new window"
    h.clock.now += 4
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.clock.now += 2
    reply = h.m.lookup(r, [k(1)])
    assert reply.results == [MISS] and reply.reasons == [MissReason.DEADLINE]
    assert h.m.stats.hit_pending_expired == 1


def test_a_landed_write_ends_an_expired_wait_too():
    h = Harness(num_slots=3, hit_pending_deadline_s=1.0)
    w, r = h.new("w"), h.new("r")
    out = h.m.prepare_store(w, [k(1)])
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.clock.now += 2
    assert h.m.lookup(r, [k(1)]).reasons == [MissReason.DEADLINE]
    h.m.complete_store(w, out.keys_to_store)
    h.answer(h.jobs())
    assert h.m.lookup(r, [k(1)]).results == [HIT]
    h.store(w, [k(7), k(8), k(9)])  # evicts k1
    h.answer(h.jobs())
    put_in_tier(h, "disk", [k(1)])
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]


def test_deadline_applies_when_the_request_itself_would_promote_again():
    h = Harness(hit_pending_deadline_s=5.0)
    w, r = h.new("w"), h.new("r")
    out = h.m.prepare_store(w, [k(1)])
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.m.complete_store(w, out.keys_to_store, success=False)
    put_in_tier(h, "disk", [k(1)])
    h.clock.now += 6
    reply = h.m.lookup(r, [k(1)])
    assert reply.results == [MISS] and reply.reasons == [MissReason.DEADLINE]
    assert k(1) not in h.m.primary  # no promotion started for an expired key


def test_hit_pending_deadline_on_stuck_store():
    h = Harness(hit_pending_deadline_s=1.0)
    w, r = h.new("writer"), h.new("reader")
    h.m.prepare_store(w, [k(1)])
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.clock.now += 0.5
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.clock.now += 0.6
    assert h.m.lookup(r, [k(1)]).results == [MISS]
    assert h.m.lookup(r, [k(1)]).results == [MISS]
    assert h.m.stats.hit_pending_expired == 1


def test_landed_promotion_pinned_until_loaded():
    h = Harness(num_slots=2)
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    h.answer(h.jobs())
    assert h.m.primary.ref_count(k(1)) == 1  # unread pin
    other = h.new("other")
    assert h.m.prepare_store(other, [k(7), k(8)]) is None  # cannot evict the unread block
    slots = h.m.prepare_load(r, [k(1)])
    assert h.m.primary.ref_count(k(1)) == 1  # load pin replaced the unread pin
    h.m.complete_load([k(1)])
    assert h.m.primary.ref_count(k(1)) == 0
    assert slots == [h.m.primary.slot_of(k(1))]
    assert h.m.stats.promoted_keys_consumed == 1


def test_landed_promotion_pin_released_when_request_finishes(h):
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.end_step()
    h.answer(h.jobs())
    h.m.on_request_finished(r)
    assert h.m.primary.ref_count(k(1)) == 0


def test_unread_promotion_pins_are_capped():
    h = Harness(num_slots=4, unread_promotion_cap=1)
    put_in_tier(h, "disk", [k(1), k(2)])
    r = h.new()
    h.m.lookup(r, [k(1), k(2)])
    h.m.end_step()
    h.answer(h.jobs())
    assert sorted(h.m.primary.ref_count(x) for x in (k(1), k(2))) == [0, 1]


def test_promotion_landing_for_finished_request_is_not_pinned(h):
    put_in_tier(h, "disk", [k(1)])
    r = h.new()
    h.m.lookup(r, [k(1)])
    h.m.on_request_finished(r)  # flushes its promotion first
    (job,) = h.jobs()
    h.answer([job])
    assert h.m.primary.ref_count(k(1)) == 0


# -- loads --------------------------------------------------------------------------------------


def test_prepare_load_requires_ready_keys_and_pins(h):
    r = h.new()
    h.store(r, [k(1), k(2)])
    h.answer(h.jobs())
    h.m.prepare_store(r, [k(3)])
    with pytest.raises(NotReady):
        h.m.prepare_load(r, [k(1), k(3)])
    assert h.m.primary.ref_count(k(1)) == 0  # nothing pinned on failure
    slots = h.m.prepare_load(r, [k(2), k(1)])
    assert slots == [1, 0]
    assert h.m.primary.ref_count(k(1)) == 1
    h.m.complete_load([k(1), k(2)])
    assert h.m.primary.ref_count(k(2)) == 0
    with pytest.raises(ProtocolViolation):
        h.m.complete_load([k(1)])


def test_eviction_in_primary_tier(h):
    r = h.new()
    h.m.events.start()
    h.store(r, [k(i) for i in range(5)])
    h.answer(h.jobs())
    h.m.take_events()
    out = h.m.prepare_store(r, [k(5), k(6)])
    assert out.keys_to_store == [k(5), k(6)]
    assert out.evicted == [k(0), k(1)]
    assert [(e.tier, e.removed, e.keys) for e in h.m.take_events()] == [
        ("primary", True, [k(0), k(1)])
    ]


def test_touch_propagates_to_all_tiers(h):
    r = h.new()
    h.store(r, [k(1), k(2), k(3)])
    h.answer(h.jobs())
    h.m.touch([k(1), k(2), k(3)])
    assert h.m.primary.policy.order()[-3:] == [k(3), k(2), k(1)]
    assert h.m.take_touched("disk") == [k(1), k(2), k(3)]
    assert h.m.take_touched("mem2") == [k(1), k(2), k(3)]
    assert h.m.take_touched("disk") == []


# -- lifecycle ----------------------------------------------------------------------------------


class RecordingTiers:
    """Records the order of submits and finish notifications seen by the tiers."""

    def __init__(self, h: Harness):
        self.events = []
        for tier in h.m.tiers:
            original = tier.on_request_finished

            def finished(req_id, _name=tier.name, _orig=original):
                self.events.append(("finish", _name))
                _orig(req_id)

            tier.on_request_finished = finished
        self.h = h

    def collect_submits(self):
        for job in self.h.jobs():
            self.events.append(("submit", self.h.m.tiers[job.tier].name))


def test_on_request_finished_delays_secondary_until_store_completes(h):
    rec = RecordingTiers(h)
    r = h.new()
    out = h.m.prepare_store(r, [k(1)])
    h.m.on_request_finished(r)
    assert rec.events == [] and (r in h.m.requests)
    with pytest.raises(RequestFinishedError):
        h.m.prepare_store(r, [k(2)])
    h.m.complete_store(r, out.keys_to_store)
    assert rec.events == [("finish", "disk"), ("finish", "mem2")]
    assert len(h.jobs()) == 2
    assert r not in h.m.requests


def test_finished_request_lookup_is_refused_and_submits_nothing(h):
    """A request still finishing its stores may not start a promotion: its tiers would see a
    submit after their on_request_finished."""
    put_in_tier(h, "disk", [k(2)])
    r = h.new()
    out = h.m.prepare_store(r, [k(1)])
    h.m.on_request_finished(r)
    with pytest.raises(RequestFinishedError):
        h.m.lookup(r, [k(2)])
    assert k(2) not in h.m.primary
    h.m.end_step()
    assert h.jobs() == []
    h.m.complete_store(r, out.keys_to_store)
    h.m.end_step()
    assert [job.kind for job in h.jobs()] == [JobKind.CASCADE, JobKind.CASCADE]
    assert r not in h.m.requests


def test_finish_hooks_follow_cascade_submission(h):
    order = []
    r = h.new()
    out = h.m.prepare_store(r, [k(1)])
    h.m.on_request_finished(r)
    for tier in h.m.tiers:
        tier.on_request_finished = lambda req_id, _n=tier.name: order.append(
            ("finish", _n, len(h.m._outbox))
        )
    h.m.complete_store(r, out.keys_to_store)
    assert order == [("finish", "disk", 2), ("finish", "mem2", 2)]  # both cascades already queued


def test_failed_store_finalizes_finished_request(h):
    rec = RecordingTiers(h)
    r = h.new()
    out = h.m.prepare_store(r, [k(1)])
    h.m.on_request_finished(r)
    h.m.complete_store(r, out.keys_to_store, success=False)
    rec.collect_submits()
    assert rec.events == [("finish", "disk"), ("finish", "mem2")]
    assert r not in h.m.requests


def test_zero_store_request_finalizes_immediately(h):
    rec = RecordingTiers(h)
    r = h.new()
    h.m.on_request_finished(r)
    assert rec.events == [("finish", "disk"), ("finish", "mem2")]
    with pytest.raises(UnknownRequest):
        h.m.requests.get(r)


def test_prepare_store_of_present_keys_does_not_count_pending(h):
    r = h.new()
    h.store(r, [k(1)])
    out = h.m.prepare_store(r, [k(1)])
    assert out.keys_to_store == []
    assert h.m.requests.get(r).pending_primary_stores == 0
    h.m.on_request_finished(r)
    assert r not in h.m.requests


def test_on_request_finished_flushes_only_its_pending_promotions(h):
    put_in_tier(h, "disk", [k(1), k(2)])
    a, b = h.new("a"), h.new("b")
    h.m.lookup(a, [k(1)])
    h.m.lookup(b, [k(2)])
    h.m.on_request_finished(a)
    assert [(j.req_id, j.keys) for j in h.jobs()] == [("a", [k(1)])]
    h.m.end_step()
    assert [(j.req_id, j.keys) for j in h.jobs()] == [("b", [k(2)])]


@pytest.mark.parametrize("probed", [False, True], ids=["indexed", "probed"])
def test_result_after_finish_creates_no_request_state_and_a_reused_id_starts_fresh(probed):
    h = Harness(probed=probed)
    tier = "object" if probed else "disk"
    if probed:
        other = h.new("keeps-the-verdict")
        h.m.lookup(other, [k(1)])
        h.m.end_step()
        h.answer(h.jobs(), found={k(1)})
    else:
        put_in_tier(h, "disk", [k(1)])
    r = h.new("r")
    assert h.m.lookup(r, [k(1)]).results == [HIT_PENDING]
    h.m.on_request_finished(r)  # submits its promotion, then finalizes
    assert r not in h.m.requests
    assert [j.kind for j in h.jobs()] == [JobKind.PROMOTION]
    h.m.fail_worker_jobs(tier)  # the worker dies with the promotion in flight
    tracked = h.m.snapshot().tiers[tier].tracked_requests
    assert tracked == (1 if probed else 0), "no state may be created for a finished request"
    h.new("r")
    assert h.m.lookup("r", [k(1)]).results == [RETRY if probed else HIT_PENDING], (
        "a reused id starts fresh"
    )


def test_on_new_request_policy():
    h = Harness(request_level=("mem2",))
    assert h.m.on_new_request(ReqContext("x")) is OffloadPolicy.REQUEST_LEVEL
    assert h.m.requests.get("x").request_level_tiers == {1}
    h2 = Harness()
    assert h2.m.on_new_request(ReqContext("x")) is OffloadPolicy.CHUNK_LEVEL


@pytest.mark.parametrize("new_keys", [0, 2], ids=["fully_warm", "mixed"])
def test_prepare_store_cascades_existing_blocks_to_request_level_tiers(new_keys):
    h = Harness(num_slots=6, request_level=("disk",))
    writer = h.new("w")
    h.store(writer, [k(1), k(2), k(3)])
    for job in h.jobs():  # the chunk-level cascades of the writer find the tiers full
        h.m.apply_result(
            h.m.tiers[job.tier].name, TransferResult(job.job_id, False, full_keys=job.keys)
        )
    r = h.new("r")
    fresh = [k(10 + i) for i in range(new_keys)]
    out = h.m.prepare_store(r, [k(1), k(2), k(3), *fresh])
    assert out.keys_to_store == fresh
    jobs = h.jobs()
    assert [(h.m.tiers[j.tier].name, j.keys) for j in jobs] == [("disk", [k(1), k(2), k(3)])]


def test_request_level_parks_pending_keys_until_their_write_lands():
    h = Harness(request_level=("disk",))
    w, r = h.new("w"), h.new("r")
    out = h.m.prepare_store(w, [k(1)])
    h.m.prepare_store(r, [k(1)])
    assert h.m.requests.get(r).parked_cascade_keys
    h.m.on_request_finished(r)
    assert (r in h.m.requests) and h.m.has_pending_work()
    h.m.complete_store(w, out.keys_to_store)
    h.jobs()
    h.m.end_step()
    jobs = h.jobs()
    assert [(j.req_id, j.keys) for j in jobs] == [("r", [k(1)])]
    assert r not in h.m.requests


def test_cascade_drops_parked_keys_whose_primary_write_failed():
    h = Harness(request_level=("disk",))
    w, r = h.new("w"), h.new("r")
    out = h.m.prepare_store(w, [k(1)])
    h.m.prepare_store(r, [k(1)])
    h.m.complete_store(w, out.keys_to_store, success=False)
    h.m.end_step()
    assert h.jobs() == []
    assert not h.m.requests.get(r).parked_cascade_keys


# -- results from workers -----------------------------------------------------------------------


def test_unknown_job_and_wrong_tier_are_rejected_without_change(h):
    r = h.new()
    h.store(r, [k(1)])
    jobs = h.jobs()
    with pytest.raises(UnknownJob):
        h.m.apply_result("disk", TransferResult(9999, True))
    with pytest.raises(WrongTier):
        h.m.apply_result("mem2", TransferResult(jobs[0].job_id, True))
    assert h.m.primary.ref_count(k(1)) == 2
    assert h.m.jobs_in_flight() == 2


def test_each_job_gets_exactly_one_result(h):
    r = h.new()
    h.store(r, [k(1)])
    job = h.jobs()[0]
    h.m.apply_result("disk", TransferResult(job.job_id, True))
    with pytest.raises(UnknownJob):
        h.m.apply_result("disk", TransferResult(job.job_id, True))


def test_crashed_worker_jobs_fail_and_unpin(h):
    put_in_tier(h, "disk", [k(5)])
    r = h.new()
    h.store(r, [k(1)])
    h.m.lookup(r, [k(5)])
    h.m.end_step()
    jobs = h.jobs()
    disk_jobs = [j.job_id for j in jobs if h.m.tiers[j.tier].name == "disk"]
    assert sorted(h.m.fail_worker_jobs("disk")) == sorted(disk_jobs)
    assert h.m.primary.ref_count(k(1)) == 1  # mem2's cascade still holds its pin
    assert k(5) not in h.m.primary  # the promotion's slot was freed
    assert h.m.lookup(r, [k(5)]).results == [MISS]  # marked missed for this request
    h.answer([j for j in jobs if h.m.tiers[j.tier].name == "mem2"])
    assert h.m.primary.pinned_count() == 0
    h.clock.now += 1
    h.m.end_step()
    (retry,) = h.jobs()  # the failed cascade goes out again
    assert (h.m.tiers[retry.tier].name, retry.kind, retry.keys) == ("disk", JobKind.CASCADE, [k(1)])
    h.answer([retry])
    assert h.m.primary.pinned_count() == 0 and not h.m.has_pending_work()


def test_job_ids_increase(h):
    r = h.new()
    h.store(r, [k(1)])
    h.store(r, [k(2)])
    ids = [j.job_id for j in h.jobs()]
    assert ids == sorted(ids) and len(set(ids)) == 4


# -- reset --------------------------------------------------------------------------------------


def test_reset_cache_refuses_with_jobs_in_flight(h):
    r = h.new()
    h.store(r, [k(1)])
    with pytest.raises(JobsInFlight):
        h.m.reset_cache()


def test_reset_cache_finalizes_finished_and_keeps_active_requests(h):
    rec = RecordingTiers(h)
    done, active = h.new("done"), h.new("active")
    h.m.prepare_store(done, [k(1)])
    h.m.on_request_finished(done)
    h.m.prepare_store(active, [k(2)])
    put_in_tier(h, "disk", [k(3)])
    h.m.lookup(active, [k(3)])  # a queued promotion that reset drops
    h.m.reset_cache()
    assert done not in h.m.requests
    assert rec.events == [("finish", "disk"), ("finish", "mem2")]
    assert h.m.requests.get(active).pending_primary_stores == 0
    assert len(h.m.primary) == 0 and h.m.primary.free_slots == 5
    h.m.end_step()
    assert h.jobs() == []
    h.store(active, [k(4)])
    assert len(h.jobs()) == 2
    assert h.m.tiers[0].index == {k(3)}  # secondary tiers keep their data


# -- tier filters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tiers,expected",
    [
        ([{"medium": "storage", "locality": "remote"}], MISS),
        ([], MISS),
        (None, HIT_PENDING),
        ([{"medium": "CPU"}], HIT_PENDING),
        ([{}], HIT_PENDING),
    ],
    ids=["non_matching", "empty_denies_all", "all", "explicit_cpu", "unconstrained"],
)
def test_tier_filter_on_lookup(tiers, expected):
    h = Harness()
    r0 = h.new("w")
    h.store(r0, [k(1)])
    h.answer(h.jobs(), success=False)
    put_in_tier(h, "mem2", [k(2)])  # mem2 is cpu/remote
    params = {} if tiers is None else {"kv_load_tiers": tiers}
    r = h.new("r", **params)
    reply = h.m.lookup(r, [k(1), k(2)])
    assert reply.results == [HIT, expected]


def test_works_without_secondary_tiers():
    m = TieringLedger(3)
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", [k(1), k(2), k(3)])
    m.complete_store("r", out.keys_to_store)
    assert m.take_submissions() == []
    assert m.lookup("r", [k(1), k(2), k(3)]).results == [HIT] * 3
    assert m.lookup("r", [k(4)]).results == [MISS]


def test_unknown_request_is_rejected(h):
    with pytest.raises(UnknownRequest):
        h.m.lookup("nope", [k(1)])
    with pytest.raises(UnknownRequest):
        h.m.prepare_store("nope", [k(1)])


# -- promotions that land key by key (progress before the result) -------------------------------


def promoting(h, keys, req_id="r1"):
    put_in_tier(h, "disk", keys)
    r = h.new(req_id)
    assert h.m.lookup(r, keys).results == [HIT_PENDING] * len(keys)
    h.m.end_step()
    (job,) = h.jobs()
    return r, job


def test_progress_makes_the_landed_keys_hit_before_the_result(h):
    r, job = promoting(h, [k(1), k(2), k(3)])
    assert h.m.apply_progress("disk", job.job_id, [k(1)]) == [k(1)]
    reply = h.m.lookup(r, [k(1), k(2), k(3)])
    assert reply.results == [HIT, HIT_PENDING, HIT_PENDING]
    assert reply.ready_prefix == 1
    assert h.m.primary.ref_count(k(1)) == 1  # protected for its request until read
    assert h.m.jobs_in_flight() == 1  # the job still gets its one result
    h.m.apply_result("disk", TransferResult(job.job_id, True))
    assert h.m.lookup(r, [k(1), k(2), k(3)]).results == [HIT, HIT, HIT]
    assert h.m.stats.promoted_keys == 3
    assert h.m.primary.ref_count(k(1)) == 1  # protected once, not twice


def test_landed_keys_count_as_promoted_by_their_tier_once_before_the_result(h):
    """An engine attributes a load to a tier by its promoted count, which must not lag behind
    the keys it can already load."""
    r, job = promoting(h, [k(1), k(2), k(3)])
    h.m.apply_progress("disk", job.job_id, [k(1), k(2)])
    assert h.m.stats.tier(1).promoted_keys_ok == 2
    h.m.apply_result("disk", TransferResult(job.job_id, True))
    assert h.m.stats.tier(1).promoted_keys_ok == 3


def test_a_failed_result_frees_only_the_keys_that_had_not_landed(h):
    r, job = promoting(h, [k(1), k(2), k(3)])
    h.m.apply_progress("disk", job.job_id, [k(1)])
    h.m.apply_result("disk", TransferResult(job.job_id, False))
    assert [h.m.primary.lookup(k(i)) for i in (1, 2, 3)] == [HIT, MISS, MISS]
    assert h.m.primary.free_slots == 5 - 1
    assert h.m.jobs_in_flight() == 0


def test_a_worker_crash_keeps_the_landed_keys(h):
    r, job = promoting(h, [k(1), k(2)])
    h.m.apply_progress("disk", job.job_id, [k(1)])
    assert h.m.fail_worker_jobs("disk") == [job.job_id]
    assert [h.m.primary.lookup(k(i)) for i in (1, 2)] == [HIT, MISS]


def test_progress_ignores_foreign_repeated_and_late_keys_and_other_jobs(h):
    r, job = promoting(h, [k(1), k(2)])
    assert h.m.apply_progress("disk", job.job_id, [k(9)]) == []
    assert h.m.primary.lookup(k(9)) is MISS
    assert h.m.apply_progress("disk", job.job_id, [k(1), k(1)]) == [k(1)]
    assert h.m.apply_progress("disk", job.job_id, [k(1)]) == []
    with pytest.raises(WrongTier):
        h.m.apply_progress("mem2", job.job_id, [k(2)])
    assert h.m.primary.lookup(k(2)) is HIT_PENDING
    h.m.apply_result("disk", TransferResult(job.job_id, True))
    assert h.m.apply_progress("disk", job.job_id, [k(2)]) == []  # after the result: nothing
    h.store(r, [k(5)])
    (cascade, *_) = h.jobs()
    assert cascade.kind is JobKind.CASCADE
    assert h.m.apply_progress("disk", cascade.job_id, [k(5)]) == []
    assert h.m.primary.ref_count(k(5)) == 2  # pinned by its two cascades, nothing changed
