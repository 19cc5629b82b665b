"""Helpers that play the tier workers for the pure tiering library."""

import pytest
import structlog

from kvoffload.tiering import (
    JobKind,
    Locality,
    Medium,
    ReqContext,
    TieringLedger,
    TierSpec,
    TransferResult,
)


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A TieringLedger with tiers "disk" (indexed, storage/local) and "mem2" (indexed, cpu/remote)
    and an optional probed "object" tier, plus helpers that answer jobs like workers would."""

    def __init__(self, num_slots=5, probed=False, request_level=(), **kw):
        specs = [
            TierSpec("disk", Medium.STORAGE, Locality.LOCAL, request_level="disk" in request_level),
            TierSpec("mem2", Medium.CPU, Locality.REMOTE, request_level="mem2" in request_level),
        ]
        if probed:
            specs.append(TierSpec("object", Medium.STORAGE, Locality.REMOTE, indexed=False))
        self.clock = FakeClock()
        self.m = TieringLedger(num_slots, specs, clock=self.clock, **kw)
        self.sent = []

    def new(self, req_id="r1", **params):
        self.m.on_new_request(ReqContext.from_params(req_id, params))
        return req_id

    def store(self, req_id, keys, success=True):
        out = self.m.prepare_store(req_id, keys)
        assert out is not None
        self.m.complete_store(req_id, out.keys_to_store, success)
        return out

    def jobs(self):
        new = self.m.take_submissions()
        self.sent.extend(new)
        return new

    def answer(self, jobs, success=True, successful_keys=None, found=None):
        """Answer like a worker: probes confirm ``found`` present and every other key absent;
        transfers report ``success``/``successful_keys`` (failed keys failed transiently)."""
        for job in jobs:
            tier = self.m.tiers[job.tier].name
            if job.kind is JobKind.PROBE:
                present = [key for key in job.keys if key in (found or ())]
                absent = [key for key in job.keys if key not in present]
                self.m.apply_result(
                    tier,
                    TransferResult(job.job_id, not absent, present or None, absent_keys=absent),
                )
            else:
                self.m.apply_result(tier, TransferResult(job.job_id, success, successful_keys))

    def drain(self):
        """Answer every job successfully until none is left."""
        while True:
            self.m.end_step()
            jobs = self.jobs()
            if not jobs:
                return
            self.answer(jobs)


@pytest.fixture(autouse=True)
def captured_logs():
    """Keep the library's warnings out of the test output; tests may inspect them."""
    with structlog.testing.capture_logs() as logs:
        yield logs


@pytest.fixture
def h():
    return Harness()
