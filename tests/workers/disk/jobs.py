"""Running a disk backend's jobs in tests, as the worker framework does."""

from __future__ import annotations

import itertools

from kvoffload.wire.protocol import Job
from workers.backend import BackendOutcome
from workers.disk.worker import DiskBackend

_job_ids = itertools.count(1)


def run(backend: DiskBackend, kind: str, keys: list[bytes], slots: list[int]) -> BackendOutcome:
    """Run one job, then release and clean it up as the framework does before publishing."""
    outcome = backend.run_job(Job(job_id=next(_job_ids), kind=kind, keys=keys, slots=slots))
    if outcome.release is not None:
        outcome.release()
    if outcome.cleanup is not None:
        outcome.cleanup()
    return outcome
