"""Random call sequences against the tiering ledger, with invariants checked after every step."""

from collections import Counter

import structlog
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.tiering import (
    JobKind,
    Locality,
    Medium,
    ReqContext,
    TieringLedger,
    TierSpec,
    TransferResult,
    WriteBack,
)
from kvoffload.tiering.primary import WRITING
from kvoffload.tiering.types import RequestFinishedError, UnknownJob
from tests.tiering.conftest import FakeClock, k

KEYS = [k(i) for i in range(12)]
NUM_SLOTS = 6
outcomes = st.sampled_from(["ok", "fail", "partial"])


def split(keys, outcome, data):
    if outcome == "ok":
        return True, None, list(keys)
    if outcome == "fail" or len(keys) < 2:
        return False, None, []
    ok = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
    return False, ok, [x for x in keys if x in ok]


class TieringMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.m = TieringLedger(
            NUM_SLOTS,
            [
                TierSpec("disk", Medium.STORAGE, Locality.LOCAL, request_level=True),
                TierSpec("object", Medium.STORAGE, Locality.REMOTE, indexed=False),
            ],
            policy="arc",
            hit_pending_deadline_s=5.0,
            unread_promotion_cap=2,
            clock=self.clock,
        )
        self.requests: list[str] = []
        self.next_req = 0
        self.jobs = {}  # job_id -> TransferJob, submitted and not yet answered
        self.answered: set[int] = set()
        self.stores = []  # (req_id, keys) prepared, not completed
        self.loads = []  # keys pinned by prepare_load, not completed
        self.ready: set[bytes] = set()  # keys whose last write completed successfully
        self.m.events.start()
        self.announced: dict[str, set[bytes]] = {"primary": set(), "disk": set(), "object": set()}
        """Per tier number, what the events told: applied in order, each change effective."""

    def _collect(self):
        for job in self.m.take_submissions():
            assert job.job_id not in self.jobs and job.job_id not in self.answered
            self.jobs[job.job_id] = job

    def _forget(self, keys):
        self.ready.difference_update(keys)

    @rule()
    def new_request(self):
        req_id = f"r{self.next_req}"
        self.next_req += 1
        self.m.on_new_request(ReqContext(req_id))
        self.requests.append(req_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), n=st.integers(1, 6))
    def lookup(self, data, n):
        req = data.draw(st.sampled_from(self.requests))
        start = data.draw(st.integers(0, len(KEYS) - n))
        keys = KEYS[start : start + n]
        reply = self.m.lookup(req, keys)
        assert len(reply.results) <= len(keys)
        assert all(r.name != "MISS" for r in reply.results[:-1])
        self._collect()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def prepare_store(self, data):
        req = data.draw(st.sampled_from(self.requests))
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
        out = self.m.prepare_store(req, keys)
        if out is not None:
            self._forget(out.evicted)
            if out.keys_to_store:
                self.stores.append((req, out.keys_to_store))
        self._collect()

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), outcome=outcomes)
    def complete_store(self, data, outcome):
        idx = data.draw(st.integers(0, len(self.stores) - 1))
        req, keys = self.stores.pop(idx)
        success, ok_keys, ok = split(keys, outcome, data)
        self.m.complete_store(req, keys, success, ok_keys)
        self.ready.update(ok)
        self._collect()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def load(self, data):
        req = data.draw(st.sampled_from(self.requests))
        ready = [key for key in KEYS if self.m.primary.lookup(key).name == "HIT"]
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        try:
            self.m.prepare_load(req, keys)
        except RequestFinishedError:
            return
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule()
    def complete_load(self):
        self.m.complete_load(self.loads.pop(0))

    @rule(data=st.data())
    def touch(self, data):
        self.m.touch(data.draw(st.lists(st.sampled_from(KEYS), max_size=4)))

    @rule()
    def end_step(self):
        for job_id in self.m.end_step():
            self.jobs.pop(job_id)
            self.answered.add(job_id)
        self._collect()

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), outcome=outcomes)
    def answer_job(self, data, outcome):
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs.pop(job_id)
        success, ok_keys, ok = split(job.keys, outcome, data)
        self.m.apply_result(self.m.tiers[job.tier].name, TransferResult(job_id, success, ok_keys))
        self.answered.add(job_id)
        if job.kind is JobKind.PROMOTION:
            self.ready.update(ok)
        self._collect()

    @precondition(lambda self: self.answered)
    @rule(data=st.data())
    def duplicate_result_rejected(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.answered)))
        try:
            self.m.apply_result("disk", TransferResult(job_id, True))
        except UnknownJob:
            return
        raise AssertionError("a second result was accepted")

    @rule(tier=st.sampled_from(["disk", "object"]))
    def worker_dies(self, tier):
        for job_id in self.m.fail_worker_jobs(tier):
            self.jobs.pop(job_id)
            self.answered.add(job_id)
        self._collect()

    @rule(tier=st.sampled_from(["disk", "object"]), online=st.booleans())
    def worker_connection(self, tier, online):
        self.m.set_tier_online(tier, online)

    @rule(data=st.data())
    def disk_reports(self, data):
        added = data.draw(st.lists(st.sampled_from(KEYS), max_size=3))
        removed = data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
        self.m.apply_index_update("disk", added, removed)

    @rule()
    def disk_worker_restarts(self):
        """The worker comes back and announces its index again (``disk_reports``), complete
        when the tier is online again (``worker_connection``)."""
        self.m.set_tier_online("disk", False)
        for job_id in self.m.fail_worker_jobs("disk"):
            self.jobs.pop(job_id)
            self.answered.add(job_id)
        self.m.reset_tier_index("disk")
        self._collect()

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        req = data.draw(st.sampled_from(self.requests))
        self.requests.remove(req)
        self.m.on_request_finished(req)
        self._collect()

    @rule(seconds=st.floats(0, 3))
    def advance_clock(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: not self.jobs and not self.stores and not self.loads)
    @rule()
    def reset_cache(self):
        self.m.reset_cache()
        self.ready.clear()

    @invariant()
    def primary_is_consistent(self):
        slots = {}
        for key, slot, ref in self.m.primary.items():
            assert ref >= WRITING
            assert 0 <= slot < NUM_SLOTS
            assert slot not in slots, "slot owned by two keys"
            slots[slot] = key
            if ref >= 0:
                assert key in self.ready, "HIT for a key whose write did not complete"
        assert len(slots) + self.m.primary.free_slots == NUM_SLOTS
        for tier in self.m.cascades.per_tier:
            assert tier.inflight_keys >= 0
            for key, entry in tier.backlog.items():
                assert entry.in_flight or self.m.primary.lookup(key).name == "HIT", (
                    "backlog keys are ready"
                )
        for event in self.m.take_events():
            told = self.announced[event.tier]
            if event.removed:
                if event.tier == "primary":
                    self._forget(event.keys)
                assert event.tier == "object" or told.issuperset(event.keys), "never stored"
                told.difference_update(event.keys)
            else:
                assert event.tier == "object" or told.isdisjoint(event.keys), "stored twice"
                told.update(event.keys)
        # the events told what the tiers hold
        ready = {key for key, _, ref in self.m.primary.items() if ref >= 0}
        assert self.announced["primary"] == ready
        disk = self.m.tiers[0]
        if disk.online:
            assert self.announced["disk"] == disk.index

    def teardown(self):
        for req in list(self.requests):
            self.m.on_request_finished(req)
        while self.stores:
            req, keys = self.stores.pop()
            self.m.complete_store(req, keys)
        while self.loads:
            self.m.complete_load(self.loads.pop())
        for tier in self.m.tiers:
            self.m.set_tier_online(tier.name, True)
        for _ in range(12):
            self.clock.now += 10
            self.end_step()
            for job_id in list(self.jobs):
                job = self.jobs.pop(job_id)
                self.m.apply_result(self.m.tiers[job.tier].name, TransferResult(job_id, True))
        assert not self.jobs
        assert self.m.primary.pinned_count() == 0
        assert self.m.primary.writing_count() == 0
        assert not self.m.has_pending_work()
        assert self.m.jobs_in_flight() == 0
        assert self.m.cascade_backlog() == 0, (
            "every waiting cascade went out once its tier was back"
        )


TieringMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestTieringProperties = TieringMachine.TestCase


# ---- write-back: no acknowledged block vanishes without a counted, logged reason -------------


class WriteBackMachine(RuleBasedStateMachine):
    """A HOLD disk tier and a best-effort object tier under random stores, lookups (promotions
    evict too), cascade results, worker crashes, tiers going offline, index reports and resets.
    After every step each acknowledged block is in the pool, or each tier that lacks it has a
    reason: it holds it, the tier reported it gone, or a ``cascade_dropped`` log names it for
    that tier (and the stats count every logged drop). The disk tier's blocks are never dropped
    as ``evicted`` except by a reset."""

    def __init__(self):
        super().__init__()
        self._capture = structlog.testing.capture_logs()
        self.logs = self._capture.__enter__()
        self.seen_logs = 0
        self.clock = FakeClock()
        self.m = TieringLedger(
            NUM_SLOTS,
            [
                TierSpec(
                    "disk",
                    Medium.STORAGE,
                    Locality.LOCAL,
                    writeback=WriteBack.HOLD,
                    max_inflight_cascade_keys=3,
                    max_cascade_job_keys=2,
                ),
                TierSpec(
                    "object",
                    Medium.STORAGE,
                    Locality.REMOTE,
                    indexed=False,
                    max_inflight_cascade_keys=2,
                ),
            ],
            policy="arc",
            hit_pending_deadline_s=5.0,
            unread_promotion_cap=2,
            clock=self.clock,
            cascade_max_attempts=3,
        )
        self.req = "r0"
        self.m.on_new_request(ReqContext(self.req))
        self.next_req = 1
        self.jobs = {}
        self.stores = []
        self.loads = []
        self.acked: set[bytes] = set()
        self.object_has: set[bytes] = set()
        self.excused = {"disk": set(), "object": set()}
        self.dropped = Counter()
        self.resetting = False

    def _collect(self):
        for job in self.m.take_submissions():
            self.jobs[job.job_id] = job

    @rule()
    def new_request(self):
        self.m.on_request_finished(self.req)
        self.req = f"r{self.next_req}"
        self.next_req += 1
        self.m.on_new_request(ReqContext(self.req))
        self._collect()  # the finished request's queued promotions went out

    @rule(data=st.data())
    def prepare_store(self, data):
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
        out = self.m.prepare_store(self.req, keys)
        if out is not None and out.keys_to_store:
            self.stores.append((self.req, out.keys_to_store))
        self._collect()

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), outcome=outcomes)
    def complete_store(self, data, outcome):
        req, keys = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        success, ok_keys, ok = split(keys, outcome, data)
        self.m.complete_store(req, keys, success, ok_keys)
        for key in ok:  # acknowledged: from now on it may only vanish for a reason
            self.acked.add(key)
            for excused in self.excused.values():
                excused.discard(key)
        self._collect()

    @rule(data=st.data(), n=st.integers(1, 3))
    def lookup(self, data, n):
        start = data.draw(st.integers(0, len(KEYS) - n))
        self.m.lookup(self.req, KEYS[start : start + n])
        self._collect()

    @rule(data=st.data())
    def load(self, data):
        ready = [key for key in KEYS if self.m.primary.lookup(key).name == "HIT"]
        if ready:
            keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=2, unique=True))
            self.m.prepare_load(self.req, keys)
            self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule()
    def complete_load(self):
        self.m.complete_load(self.loads.pop(0))

    @rule()
    def end_step(self):
        for job_id in self.m.end_step():
            self.jobs.pop(job_id)
        self._collect()

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), outcome=outcomes, full=st.booleans())
    def answer_job(self, data, outcome, full):
        job = self.jobs.pop(data.draw(st.sampled_from(sorted(self.jobs))))
        success, ok_keys, ok = split(job.keys, outcome, data)
        failed = [key for key in job.keys if key not in ok]
        tier = self.m.tiers[job.tier].name
        result = TransferResult(
            job.job_id,
            success,
            ok_keys,
            full_keys=failed if full and job.kind is JobKind.CASCADE else (),
        )
        self.m.apply_result(tier, result)
        if tier == "object" and job.kind is not JobKind.PROMOTION:
            self.object_has.update(ok)  # stored, or found by a probe
        self._collect()

    @rule(tier=st.sampled_from(["disk", "object"]), online=st.booleans())
    def worker_crash_or_return(self, tier, online):
        self._collect()
        if not online:
            self.m.set_tier_online(tier, False)
            for job_id in self.m.fail_worker_jobs(tier):
                self.jobs.pop(job_id)
        else:
            self.m.set_tier_online(tier, True)
        self._collect()

    @rule(data=st.data())
    def disk_reports(self, data):
        removed = data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
        self.m.apply_index_update("disk", [], removed)
        self.excused["disk"].update(removed)  # the tier says it lost them

    @rule(seconds=st.floats(0, 3))
    def advance_clock(self, seconds):
        self.clock.now += seconds

    @precondition(lambda self: not self.jobs and not self.stores and not self.loads)
    @rule()
    def reset_cache(self):
        self.resetting = True
        self.m.flush_cascade_backlogs()
        self.m.reset_cache()
        self._read_logs()
        self.resetting = False

    def _read_logs(self):
        for event in self.logs[self.seen_logs :]:
            if event["event"] != "cascade_dropped":
                continue
            keys = {bytes.fromhex(key) for key in event["keys"]}
            assert len(keys) == event["count"]
            self.excused[event["tier"]].update(keys)
            self.dropped[(event["tier"], event["reason"])] += event["count"]
            if event["tier"] == "disk" and event["reason"] == "evicted":
                assert self.resetting, "a block held for the disk tier was evicted"
        self.seen_logs = len(self.logs)

    @invariant()
    def no_acknowledged_block_vanishes_without_a_reason(self):
        self._read_logs()
        primary, disk = self.m.primary, self.m.tiers[0]
        for key in self.acked:
            if primary.lookup(key).name == "HIT":
                continue
            assert key in disk.index or key in self.excused["disk"], "lost for the disk tier"
            assert key in self.object_has or key in self.excused["object"], "lost for the object"
        for (tier, reason), count in self.dropped.items():
            counters = self.m.stats.tier(self.m.tier_index(tier) + 1)
            assert getattr(counters, f"cascade_dropped_{reason}") == count

    @invariant()
    def held_blocks_are_the_disk_tiers_dirty_blocks(self):
        dirty = self.m.cascades.per_tier[0].dirty
        assert {key for key, _, _ in self.m.primary.items() if self.m.primary.is_held(key)} == set(
            dirty
        )
        assert all(self.m.primary.lookup(key).name == "HIT" for key in dirty)

    def teardown(self):
        self._capture.__exit__(None, None, None)


WriteBackMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
TestWriteBackProperties = WriteBackMachine.TestCase
