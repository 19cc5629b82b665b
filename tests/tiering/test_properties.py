"""Random call sequences against the tiering ledger, with invariants checked after every step."""

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
            self._forget(event.keys)

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
