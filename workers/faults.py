"""Fault injection for tier workers (soak and failure tests).

One ``FaultInjector`` per worker process, shared by the framework and the backend and updated in
place by ``Control(action="faults")``; a new spec applies to operations from then on, including
those of jobs that were already queued. Decisions come from a ``random.Random`` seeded with
``FaultSpec.seed``, so a run is reproducible for a given order of operations. Thread-safe.

Hooks, by who calls them:
- backends, per medium operation: ``on_op(op, key)`` (= ``count_op`` + ``maybe_delay`` +
  ``maybe_fail``; its signature fits ``workers.disk.FaultHook``), and ``should_corrupt()`` when
  writing to a medium (corrupt the written bytes after the checksum was computed);
- the framework, per job release: ``take_release_failure()``.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time

from kvoffload.logs import get_logger
from kvoffload.wire.protocol import FaultSpec

log = get_logger()


class InjectedFault(OSError):
    """An operation that failed on purpose."""


class FaultInjector:
    """Draws fault decisions for one worker; all fractions are per operation in [0, 1]."""

    def __init__(self, spec: FaultSpec | None = None) -> None:
        self._lock = threading.Lock()
        self._set(spec if spec is not None else FaultSpec())

    @property
    def spec(self) -> FaultSpec:
        return self._spec

    @property
    def delays(self) -> bool:
        """True when ``maybe_delay`` can sleep (some operations are slowed on purpose)."""
        s = self._spec
        return s.delay_s > 0.0 and s.delay_fraction > 0.0

    @property
    def active(self) -> bool:
        """True when any fault can fire."""
        s = self._spec
        return bool(
            s.fail_fraction
            or s.enospc_fraction
            or self.delays
            or s.corrupt_fraction
            or self._release_failures_left
            or s.crash_after_ops >= 0
        )

    def _set(self, spec: FaultSpec) -> None:
        with self._lock:
            self._spec = spec
            self._rng = random.Random(spec.seed)
            self._release_failures_left = max(0, spec.release_failures)
            self._ops = 0

    def replace(self, spec: FaultSpec) -> None:
        """Use ``spec`` from now on: reseeds, and restarts the release-failure and op counters."""
        self._set(spec)
        log.info(
            "faults_set",
            fail_fraction=spec.fail_fraction,
            delay_s=spec.delay_s,
            delay_fraction=spec.delay_fraction,
            corrupt_fraction=spec.corrupt_fraction,
            release_failures=spec.release_failures,
            crash_after_ops=spec.crash_after_ops,
            seed=spec.seed,
            enospc_fraction=spec.enospc_fraction,
        )

    def _draw(self, fraction: float) -> bool:
        if fraction <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < fraction

    def maybe_fail(self, op: str, key: bytes = b"") -> None:
        """Raise ``InjectedFault`` (EIO) for a ``fail_fraction`` of calls."""
        if self._draw(self._spec.fail_fraction):
            raise InjectedFault(errno.EIO, f"injected {op} failure for key {key.hex()[:16]}")

    def maybe_full(self, op: str, key: bytes = b"") -> None:
        """Raise ``InjectedFault`` (ENOSPC) for an ``enospc_fraction`` of medium writes."""
        if self._draw(self._spec.enospc_fraction):
            raise InjectedFault(
                errno.ENOSPC, f"injected full medium on {op} for key {key.hex()[:16]}"
            )

    def maybe_delay(self) -> float:
        """Sleep ``delay_s`` for a ``delay_fraction`` of calls; returns the seconds slept."""
        spec = self._spec
        if spec.delay_s <= 0.0 or not self._draw(spec.delay_fraction):
            return 0.0
        time.sleep(spec.delay_s)
        return spec.delay_s

    def should_corrupt(self) -> bool:
        """True for a ``corrupt_fraction`` of calls."""
        return self._draw(self._spec.corrupt_fraction)

    def take_release_failure(self) -> bool:
        """True for the first ``release_failures`` calls after the spec was set."""
        with self._lock:
            if self._release_failures_left <= 0:
                return False
            self._release_failures_left -= 1
            return True

    def count_op(self) -> None:
        """Count one operation; with ``crash_after_ops`` = N >= 0 the call after N counted
        operations kills this process with SIGKILL (no cleanup, like a real crash)."""
        limit = self._spec.crash_after_ops
        if limit < 0:
            return
        with self._lock:
            crash = self._ops >= limit
            self._ops += 1
        if crash:
            log.warning("fault_crash", after_ops=limit)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_op(self, op: str, key: bytes = b"") -> None:
        """The per-operation hook: ``count_op``, then ``maybe_delay``, then ``maybe_fail``."""
        self.count_op()
        self.maybe_delay()
        self.maybe_fail(op, key)
