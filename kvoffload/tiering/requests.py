"""The request table: each request's state by id, from ``start`` to its end.

A request ends in two steps. ``finish`` means no more submit-side calls: its queued promotions
are submitted, its unread-promotion pins released, its deadlines disarmed, and it may start
nothing more (``open`` refuses it). ``finalize`` drops its state once it is finished **and** no
primary store is pending **and** no cascade key is parked; only then do the secondary tiers and
the tenants hear of its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.tiering.cascades import Cascades
from kvoffload.tiering.deadlines import PendingDeadlines
from kvoffload.tiering.promotions import Promotions
from kvoffload.tiering.secondary import SecondaryTier
from kvoffload.tiering.tenants import Tenancy
from kvoffload.tiering.types import (
    OffloadPolicy,
    ReqContext,
    RequestFinishedError,
    RequestState,
    UnknownRequest,
)


class RequestTable:
    def __init__(
        self,
        states: dict[str, RequestState],
        tiers: Sequence[SecondaryTier],
        promotions: Promotions,
        deadlines: PendingDeadlines,
        cascades: Cascades,
        tenancy: Tenancy,
    ) -> None:
        """``states``: the table's own dict, which the deadlines read too."""
        self.states = states
        self.tiers = tiers
        self.promotions = promotions
        self.deadlines = deadlines
        self.cascades = cascades
        self.tenancy = tenancy

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.states

    def get(self, req_id: str) -> RequestState:
        """The request's state, finished or not; UnknownRequest if there is none."""
        try:
            return self.states[req_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {req_id!r}") from None

    def open(self, req_id: str) -> RequestState:
        """The state of a request that may still start work; RequestFinishedError once it is
        finished, UnknownRequest if there is none."""
        state = self.get(req_id)
        if state.is_finished:
            raise RequestFinishedError(f"request {req_id!r} is finished")
        return state

    def active(self, req_id: str | None) -> RequestState | None:
        """The request's state while it has not finished; None otherwise (or for no request)."""
        state = self.states.get(req_id) if req_id is not None else None
        return state if state is not None and not state.is_finished else None

    def start(self, ctx: ReqContext) -> OffloadPolicy:
        """Create (or replace) the request's state; REQUEST_LEVEL if any tier asks for it."""
        state = RequestState(ctx)
        for i, tier in enumerate(self.tiers):
            if tier.on_new_request(ctx.req_id) is OffloadPolicy.REQUEST_LEVEL:
                state.request_level_tiers.add(i)
        self.states[ctx.req_id] = state
        self.tenancy.request_started(ctx)
        if state.request_level_tiers:
            return OffloadPolicy.REQUEST_LEVEL
        return OffloadPolicy.CHUNK_LEVEL

    def finish(self, req_id: str) -> None:
        """No more submit-side calls for the request (module docstring); a second call does
        nothing."""
        state = self.get(req_id)
        if state.is_finished:
            return
        self.promotions.flush(only_req=req_id)
        self.promotions.release_unread(state)
        self.deadlines.disarm_all(state)
        state.is_finished = True
        self.finalize(req_id)

    def finalize(self, req_id: str) -> None:
        """Drop the request's state if it is finished and nothing of it is pending."""
        state = self.states.get(req_id)
        if state is None or not state.is_finished:
            return
        if state.pending_primary_stores or state.parked_cascade_keys:
            return
        for tier in self.tiers:
            tier.on_request_finished(req_id)
        self.tenancy.request_done(state.ctx)
        del self.states[req_id]

    def reset(self) -> None:
        """A ``reset_cache``: every request forgets its stores, parked cascades, unread
        promotions and deadlines; the finished ones are finalized, the others stay usable."""
        for req_id, state in list(self.states.items()):
            state.pending_primary_stores = 0
            state.parked_cascade_keys.clear()
            state.unread.clear()
            self.cascades.unpark(req_id)
            state.pending_deadlines.clear()
            state.expired.clear()
            self.finalize(req_id)
