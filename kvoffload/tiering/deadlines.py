"""HIT_PENDING deadlines: how long a request may wait for a key that is being written.

A request's deadline for a key is armed at its first wait (a lookup that answers HIT_PENDING, or
a promotion it starts), kept through failed rounds, and disarmed when a write of the key lands,
so a later wait (after an eviction) starts a new window. Past it, the key is a MISS
(``MissReason.DEADLINE``) for that request until a write of it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvoffload.logs import get_logger
from kvoffload.tiering.stats import TieringStats
from kvoffload.tiering.types import Key, RequestState
from kvoffload.wire.vocab import LookupResult, MissReason

log = get_logger()


class PendingDeadlines:
    def __init__(
        self,
        deadline_s: float,
        requests: Mapping[str, RequestState],
        stats: TieringStats,
        clock: Callable[[], float],
    ) -> None:
        """``requests``: the live request states, by id (read only)."""
        self.deadline_s = deadline_s
        self._requests = requests
        self._stats = stats
        self._clock = clock
        self._waiters: dict[Key, set[str]] = {}

    def check(self, state: RequestState, key: Key) -> tuple[LookupResult, MissReason]:
        """HIT_PENDING while the request's deadline for ``key`` (armed now if need be) is
        ahead, MISS past it."""
        if key in state.expired:
            return LookupResult.MISS, MissReason.DEADLINE
        now = self._clock()
        deadline = self.arm(state, key, now)
        if now < deadline:
            return LookupResult.HIT_PENDING, MissReason.NONE
        state.expired.add(key)
        self._stats.hit_pending_expired += 1
        log.warning(
            "hit_pending_deadline_expired",
            req_id=state.ctx.req_id,
            key=key.hex(),
            deadline_s=self.deadline_s,
        )
        return LookupResult.MISS, MissReason.DEADLINE

    def arm(self, state: RequestState, key: Key, now: float) -> float:
        """The deadline of (request, key), armed at ``now`` if it is not yet."""
        deadline = state.pending_deadlines.get(key)
        if deadline is None:
            deadline = state.pending_deadlines[key] = now + self.deadline_s
            self._waiters.setdefault(key, set()).add(state.ctx.req_id)
        return deadline

    def landed(self, keys: Iterable[Key]) -> None:
        """These keys became ready: every wait on them is over."""
        for key in keys:
            for req_id in self._waiters.pop(key, ()):
                state = self._requests.get(req_id)
                if state is not None:
                    state.pending_deadlines.pop(key, None)
                    state.expired.discard(key)

    def disarm_all(self, state: RequestState) -> None:
        """The request finished: it waits for nothing any more."""
        req_id = state.ctx.req_id
        for key in state.pending_deadlines:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(req_id)
                if not waiters:
                    del self._waiters[key]
        state.pending_deadlines.clear()
        state.expired.clear()

    def clear(self) -> None:
        """Forget every wait (the callers clear the requests' own deadlines)."""
        self._waiters.clear()
