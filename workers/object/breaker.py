"""Circuit breaker for the object store: stop calling a server that does not answer.

States: ``closed`` (calls pass), ``open`` (calls fail fast with ``BreakerOpen``, no network) and
``half_open`` (one probe call passes; its success closes the breaker, its failure reopens it).
The breaker opens after ``failure_threshold`` consecutive failures. The first cooldown is
``base_cooldown_s``; each reopen from half-open doubles it up to ``max_cooldown_s``; closing
resets it. A probe that never reports (its caller died) is replaced after ``probe_timeout_s``.

Pure and thread-safe: no I/O besides log events, time comes from the injected ``clock``.
Callers pair every admitted ``before_call()`` with one ``record_success()`` (the server answered,
whatever it answered) or ``record_failure()`` (it did not: refused, reset, timeout, 5xx).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from kvoffload.wire.status import BreakerState, BreakerStats
from workers.object.errors import TransientObjectError

log = structlog.get_logger()

CLOSED: BreakerState = "closed"
OPEN: BreakerState = "open"
HALF_OPEN: BreakerState = "half_open"


class BreakerOpen(TransientObjectError):
    """The breaker is open: the call was not attempted."""

    def __init__(self, name: str, retry_in_s: float) -> None:
        super().__init__(f"{name} circuit breaker open; next probe in {retry_in_s:.2f}s")
        self.retry_in_s = retry_in_s


class CircuitBreaker:
    """Consecutive-failure breaker with exponentially growing cooldown and a single probe."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        base_cooldown_s: float = 1.0,
        max_cooldown_s: float = 30.0,
        probe_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "object",
    ) -> None:
        if failure_threshold < 1 or base_cooldown_s <= 0 or max_cooldown_s < base_cooldown_s:
            raise ValueError("invalid circuit breaker settings")
        self.name = name
        self._threshold = failure_threshold
        self._base_cooldown = base_cooldown_s
        self._max_cooldown = max_cooldown_s
        self._probe_timeout = probe_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._cooldown = base_cooldown_s
        self._open_until = 0.0
        self._probe_started: float | None = None
        self._consecutive_failures = 0
        self._failures_total = 0
        self._rejected_total = 0
        self._opened_total = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def before_call(self) -> None:
        """Admit a call or raise ``BreakerOpen``; after the cooldown, admit exactly one probe."""
        with self._lock:
            if self._state == CLOSED:
                return
            now = self._clock()
            if self._state == OPEN:
                if now < self._open_until:
                    self._reject(self._open_until - now)
                self._state = HALF_OPEN
                self._probe_started = now
                log.info("object_breaker_half_open", breaker=self.name, cooldown_s=self._cooldown)
                return
            if self._probe_started is not None and now - self._probe_started < self._probe_timeout:
                self._reject(self._probe_started + self._probe_timeout - now)
            self._probe_started = now

    def _reject(self, retry_in_s: float) -> None:
        self._rejected_total += 1
        raise BreakerOpen(self.name, retry_in_s)

    def record_success(self) -> None:
        """The server answered; close the breaker if it was not closed."""
        with self._lock:
            self._consecutive_failures = 0
            if self._state != CLOSED:
                log.info("object_breaker_closed", breaker=self.name, state_was=self._state)
                self._state = CLOSED
                self._cooldown = self._base_cooldown
                self._probe_started = None

    def record_failure(self) -> None:
        """The server did not answer; open (or reopen with a longer cooldown) when due."""
        with self._lock:
            self._consecutive_failures += 1
            self._failures_total += 1
            now = self._clock()
            if self._state == HALF_OPEN:
                self._cooldown = min(self._max_cooldown, self._cooldown * 2)
                self._open(now)
                log.warning("object_breaker_reopened", breaker=self.name, cooldown_s=self._cooldown)
            elif self._state == CLOSED and self._consecutive_failures >= self._threshold:
                self._open(now)
                log.warning(
                    "object_breaker_opened",
                    breaker=self.name,
                    consecutive_failures=self._consecutive_failures,
                    cooldown_s=self._cooldown,
                )

    def _open(self, now: float) -> None:
        self._state = OPEN
        self._open_until = now + self._cooldown
        self._probe_started = None
        self._opened_total += 1

    def snapshot(self) -> BreakerStats:
        """State and counters for status pages and logs."""
        with self._lock:
            retry_in = max(0.0, self._open_until - self._clock()) if self._state == OPEN else 0.0
            return BreakerStats(
                state=self._state,
                consecutive_failures=self._consecutive_failures,
                failures_total=self._failures_total,
                rejected_total=self._rejected_total,
                opened_total=self._opened_total,
                cooldown_s=self._cooldown,
                retry_in_s=retry_in,
            )
