"""The manager's client API: one handler per request type, the checks they share, long polls,
cache resets and client leases. Transport and the poll loop live in ``loop``.

Each handler takes the client's identity, its session and the request of its own type, and
returns the reply (None: it answers later). ``Handlers.add`` pairs a request type with its
handler, so mypy checks that every handler accepts the message it is registered for.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar, cast

import msgspec
import structlog

from kvoffload.memory.blockformat import MAX_SLICES
from kvoffload.server.handles import KVHandles
from kvoffload.server.jobs import WorkerChannel
from kvoffload.server.sessions import ClientSession, PendingPoll
from kvoffload.server.state import CPU_WORKER, ManagerState, RequestError, WaitingLookup
from kvoffload.tiering import LookupResult, ReqContext
from kvoffload.tiering.types import LandingTag, PrefixResult, TieringError
from kvoffload.wire import protocol as p
from kvoffload.wire.landing_pipe import pipe_path
from kvoffload.wire.protocol import ErrorCode
from kvoffload.wire.tenant_ids import TENANT_ID_CHARS, is_tenant_id

log = structlog.get_logger()

Reply = p.ClientReply | None
"""A handler's reply; None when it answers later (a long poll, a held lookup, a cache reset)."""

_M = TypeVar("_M", bound=p.ClientRequest)
Handler = Callable[[bytes, ClientSession, _M], Reply]
"""(client identity, its session, the request) -> the reply."""


class Handlers:
    """One handler per request type, looked up by the request's exact type."""

    def __init__(self) -> None:
        self._by_type: dict[type[msgspec.Struct], Handler[p.ClientRequest]] = {}

    def add(self, kind: type[_M], handler: Handler[_M]) -> None:
        # a handler only ever receives requests of its own kind (looked up by type below)
        self._by_type[kind] = cast("Handler[p.ClientRequest]", handler)

    def __call__(self, identity: bytes, session: ClientSession, msg: p.ClientRequest) -> Reply:
        return self._by_type[type(msg)](identity, session, msg)


MAX_KEYS_PER_CALL = 65536


def _errors_only(msg: p.ClientRequest) -> bool:
    """The client asked for no Ok reply to ``msg`` (``CompleteStore.errors_only``)."""
    return isinstance(msg, (p.CompleteStore, p.CompleteLoad, p.FinishRequest)) and msg.errors_only


class ClientApi:
    def __init__(self, state: ManagerState, handles: KVHandles, workers: WorkerChannel) -> None:
        self.state = state
        self.tiering = state.tiering
        self.handles = handles
        self.workers = workers
        self._next_client = 1
        handlers = self._handlers = Handlers()  # Connect, which may come first, is served apart
        handlers.add(p.RegisterKV, self._on_register_kv)
        handlers.add(p.NewRequest, self._on_new_request)
        handlers.add(p.Lookup, self._on_lookup)
        handlers.add(p.Load, self._on_load)
        handlers.add(p.Store, self._on_store)
        handlers.add(p.PrepareStore, self._on_prepare_store)
        handlers.add(p.CompleteStore, self._on_complete_store)
        handlers.add(p.PrepareLoad, self._on_prepare_load)
        handlers.add(p.CompleteLoad, self._on_complete_load)
        handlers.add(p.Touch, self._on_touch)
        handlers.add(p.FinishRequest, self._on_finish_request)
        handlers.add(p.EndStep, self._on_end_step)
        handlers.add(p.ResetCache, self._on_reset_cache)
        handlers.add(p.Poll, self._on_poll)
        handlers.add(p.Status, self._on_status)
        handlers.add(p.Disconnect, self._on_disconnect)
        handlers.add(p.TenantDrop, self._on_tenant_drop)
        handlers.add(p.TakeTierEvents, self._on_take_tier_events)

    def on_frames(self, frames: list[bytes]) -> None:
        """Decode one client request, run its handler and send the reply (a handler that returns
        None answers later: a long poll, a cache reset)."""
        state = self.state
        identity = frames[0]
        if len(frames) != 2:
            state.reply(
                identity,
                p.Error(-1, ErrorCode.BAD_MESSAGE, f"expected one frame, got {len(frames) - 1}"),
            )
            return
        frame = frames[1]
        try:
            msg = p.decode_client_request(frame)
        except p.ProtocolError as exc:
            log.warning("bad_client_message", error=str(exc)[:200])
            state.reply(
                identity, p.Error(p.request_id_of(frame), ErrorCode.BAD_MESSAGE, str(exc)[:500])
            )
            return
        if identity in state.waiting_lookups:
            # a client sends nothing while it waits: it gave up on its held lookup
            self._serve_waiting(identity, time.monotonic(), force=True)
        session = state.sessions.get(identity)
        if session is None and not isinstance(msg, p.Connect):
            state.reply(identity, p.Error(msg.rid, ErrorCode.NOT_CONNECTED, "send Connect first"))
            return
        if session is not None:
            session.last_seen = time.monotonic()
        started = time.perf_counter()
        reply: Reply
        try:
            reply = self._dispatch(identity, session, msg)
        except (RequestError, TieringError) as exc:
            reply = p.Error(msg.rid, exc.code, str(exc))
        except Exception as exc:
            log.exception("client_request_crashed", kind=type(msg).__name__)
            reply = p.Error(msg.rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        if reply is not None and not (isinstance(reply, p.Ok) and _errors_only(msg)):
            state.reply(identity, reply)
        if state.metrics is not None:
            state.metrics.client_call(msg, time.perf_counter() - started)

    def _dispatch(
        self, identity: bytes, session: ClientSession | None, msg: p.ClientRequest
    ) -> Reply:
        """Connect may come before the client has a session; every other request needs one."""
        if isinstance(msg, p.Connect):
            return self._on_connect(identity, session, msg)
        if session is None:
            raise RequestError(ErrorCode.NOT_CONNECTED, "send Connect first")
        return self._handlers(identity, session, msg)

    def housekeeping(self, now: float) -> None:
        """Expire leases, answer polls that reached their deadline, settle pending resets."""
        lease = self.state.cfg.service.request_lease_s
        for session in list(self.state.sessions.values()):
            if now - session.last_seen > lease:
                self._drop_session(session, "lease_expired")
        for session in self.state.sessions.values():
            if session.pending_poll is not None and now >= session.pending_poll.deadline:
                self.state.answer_poll(session, force=True)
        self.serve_waiting_lookups(now, force=self.state.draining)
        self.state.settle_resets(now)
        self.state.settle_drops()

    # ---- checks ---------------------------------------------------------------------------

    def _check_keys(self, keys: list[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_CALL:
            raise RequestError(ErrorCode.TOO_MANY_KEYS, f"{len(keys)} keys > {MAX_KEYS_PER_CALL}")
        lo, hi = self.state.cfg.pool.key_bytes_min, self.state.cfg.pool.key_bytes_max
        for key in keys:
            if not lo <= len(key) <= hi:
                raise RequestError(ErrorCode.BAD_KEY, f"key of {len(key)} bytes outside {lo}..{hi}")

    def _check_writable(self) -> None:
        if self.state.draining:
            raise RequestError(ErrorCode.DRAINING, "the service is shutting down")

    def _scoped(self, session: ClientSession, req_id: str) -> str:
        scoped = session.scoped(req_id)
        if scoped not in session.requests:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, f"unknown request {req_id!r}")
        return scoped

    # ---- handlers -------------------------------------------------------------------------

    def _on_connect(
        self, identity: bytes, session: ClientSession | None, msg: p.Connect
    ) -> p.Connected | p.Error:
        if msg.version != p.PROTOCOL_VERSION:
            return p.Error(
                msg.rid,
                ErrorCode.VERSION_MISMATCH,
                f"client protocol {msg.version} != manager's {p.PROTOCOL_VERSION}",
            )
        if session is None:
            client_id = f"c{self._next_client}"
            self._next_client += 1
            session = ClientSession(identity, client_id, msg.client_name, time.monotonic())
            self.state.sessions[identity] = session
            log.info("client_connected", client_id=client_id, client_name=msg.client_name)
        session.landing_endpoint = msg.landing_endpoint if is_landing_endpoint(msg) else ""
        pool = self.state.cfg.pool
        return p.Connected(
            msg.rid,
            p.PROTOCOL_VERSION,
            session.client_id,
            pool.num_slots,
            pool.block_bytes,
            pool.key_bytes_min,
            pool.key_bytes_max,
            self.state.spec.pool_name,
            [t.name for t in self.tiering.tiers],
            os.getpid(),
        )

    def _on_register_kv(self, identity: bytes, session: ClientSession, msg: p.RegisterKV) -> p.Ok:
        self.handles.register(identity, msg.handle)
        return p.Ok(msg.rid)

    def _on_new_request(
        self, identity: bytes, session: ClientSession, msg: p.NewRequest
    ) -> p.NewRequestReply:
        scoped = session.scoped(msg.req_id)
        if scoped in self.tiering.requests:
            raise RequestError(
                ErrorCode.DUPLICATE_REQUEST,
                f"request {msg.req_id!r} is active or still finishing its stores",
            )
        check_tenant(msg.tenant)
        session.tenants.add(msg.tenant)
        ctx = ReqContext.from_params(scoped, msg.params, msg.tenant)
        policy = self.tiering.on_new_request(ctx)
        session.requests.add(scoped)
        return p.NewRequestReply(msg.rid, bool(policy))

    def _on_lookup(
        self, identity: bytes, session: ClientSession, msg: p.Lookup
    ) -> p.LookupReply | None:
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        reply = self.tiering.lookup(scoped, msg.keys)
        landing_slots = (
            self._start_landings(identity, session, scoped, msg, reply)
            if msg.landing and msg.pin and session.landing_endpoint
            else []
        )
        if msg.wait_ms > 0 and not landing_slots and _worth_waiting(reply.results):
            deadline = time.monotonic() + msg.wait_ms / 1000
            self.state.waiting_lookups[identity] = WaitingLookup(msg, deadline)
            return None
        out = self._lookup_reply(session, scoped, msg, reply)
        out.landing_slots = landing_slots
        return out

    def _start_landings(
        self,
        identity: bytes,
        session: ClientSession,
        scoped: str,
        msg: p.Lookup,
        reply: PrefixResult,
    ) -> list[int]:
        """Send the promotions this lookup queued for the request to their tiers now, each
        telling the client of its keys as they land; the client waits for the keys of
        ``msg`` among them (``landings``). Returns ``LookupReply.landing_slots`` (empty when
        none)."""
        jobs = self.tiering.promote_now(scoped, LandingTag(session.landing_endpoint, msg.rid))
        if not jobs:
            return []
        pending = {
            k
            for k, r in zip(msg.keys, reply.results, strict=False)
            if r is LookupResult.HIT_PENDING
        }
        for job in jobs:
            mine = [(k, s) for k, s in zip(job.keys, job.slots, strict=True) if k in pending]
            if mine:
                keys, slots = (list(x) for x in zip(*mine, strict=True))
                self.state.landings.expect(job.job_id, identity, scoped, keys, slots)
        self.state.dispatch_tier_jobs()  # a job that cannot be sent fails here: no wait left
        slot_of: dict[bytes, int] = {}
        for job in jobs:
            for key in job.keys:
                slot = self.state.landings.waiting_slot(job.job_id, key)
                if slot >= 0:
                    slot_of[key] = slot
        if not slot_of:
            return []
        return [slot_of.get(k, -1) for k in msg.keys[: len(reply.results)]]

    def serve_waiting_lookups(self, now: float, force: bool = False) -> None:
        """Evaluate the held lookups again; answer those with a HIT, with nothing pending any
        more, past their deadline, or all of them when ``force``."""
        for identity in list(self.state.waiting_lookups):
            self._serve_waiting(identity, now, force)

    def _serve_waiting(self, identity: bytes, now: float, force: bool) -> None:
        state = self.state
        waiting = state.waiting_lookups[identity]
        session = state.sessions.get(identity)
        msg = waiting.msg
        if session is None:
            del state.waiting_lookups[identity]
            return
        try:
            scoped = self._scoped(session, msg.req_id)
            reply = self.tiering.lookup(scoped, msg.keys)
        except (RequestError, TieringError) as exc:
            del state.waiting_lookups[identity]
            state.reply(identity, p.Error(msg.rid, exc.code, str(exc)))
            return
        if not force and now < waiting.deadline and _worth_waiting(reply.results):
            return
        del state.waiting_lookups[identity]
        state.reply(identity, self._lookup_reply(session, scoped, msg, reply))

    def _lookup_reply(
        self, session: ClientSession, scoped: str, msg: p.Lookup, reply: PrefixResult
    ) -> p.LookupReply:
        """The reply to ``msg`` from its evaluation ``reply``, pinning its HITs if asked."""
        slots: list[int] = []
        checksums: list[list[int]] = []
        if msg.pin:
            # results, and so slots, stop after the first MISS: msg.keys may be longer
            evaluated = len(reply.results)
            if reply.ready_prefix == evaluated:  # every key evaluated is HIT
                hit_keys = msg.keys[:evaluated]
                slots = self.tiering.prepare_load(scoped, hit_keys) if hit_keys else []
            else:
                hit_keys = [
                    k
                    for k, r in zip(msg.keys, reply.results, strict=False)
                    if r is LookupResult.HIT
                ]
                pinned = iter(self.tiering.prepare_load(scoped, hit_keys) if hit_keys else [])
                slots = [next(pinned) if r is LookupResult.HIT else -1 for r in reply.results]
            session.add_pins(hit_keys)
            warm = self.state.warm
            checksums = (
                warm.checksums_of(msg.keys, slots) if warm is not None else [[] for _ in slots]
            )
        return p.LookupReply(
            msg.rid,
            bytes(reply.results),
            bytes(reply.reasons),
            reply.hit_prefix,
            reply.ready_prefix,
            slots,
            checksums,
        )

    def _device_request(self, session: ClientSession, msg: p.Store | p.Load) -> str:
        """Checks shared by Store and Load; returns the scoped request id."""
        self._check_writable()
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        self.handles.owned(session.identity, msg.handle_id, msg.keys, msg.device_blocks)
        if self.state.registry.live(CPU_WORKER) is None:
            raise RequestError(ErrorCode.WORKER_UNAVAILABLE, "the cpu worker is not connected")
        return scoped

    def _on_store(self, identity: bytes, session: ClientSession, msg: p.Store) -> p.JobAccepted:
        scoped = self._device_request(session, msg)
        out = self.tiering.prepare_store(scoped, msg.keys)
        if out is None:
            raise RequestError(ErrorCode.NO_SPACE, "no primary slots can be freed for this store")
        if not out.keys_to_store:
            return p.JobAccepted(msg.rid, None, [], out.evicted)
        block_of = dict(zip(reversed(msg.keys), reversed(msg.device_blocks), strict=True))
        blocks = [block_of[k] for k in out.keys_to_store]
        job = p.Job(0, p.JobKind.DEVICE_STORE, out.keys_to_store, out.slots, blocks, msg.handle_id)
        job_id = self.workers.submit_device_job(
            session, scoped, msg.req_id, p.JobKind.DEVICE_STORE, job
        )
        return p.JobAccepted(msg.rid, job_id, out.keys_to_store, out.evicted)

    def _on_load(self, identity: bytes, session: ClientSession, msg: p.Load) -> p.JobAccepted:
        scoped = self._device_request(session, msg)
        slots = self.tiering.prepare_load(scoped, msg.keys)
        job = p.Job(0, p.JobKind.DEVICE_LOAD, msg.keys, slots, msg.device_blocks, msg.handle_id)
        job_id = self.workers.submit_device_job(
            session, scoped, msg.req_id, p.JobKind.DEVICE_LOAD, job
        )
        return p.JobAccepted(msg.rid, job_id, list(msg.keys))

    def _on_prepare_store(
        self, identity: bytes, session: ClientSession, msg: p.PrepareStore
    ) -> p.Slots:
        self._check_writable()
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        out = self.tiering.prepare_store(scoped, msg.keys)
        if out is None:
            raise RequestError(ErrorCode.NO_SPACE, "no primary slots can be freed for this store")
        if out.keys_to_store:
            session.add_open_store(scoped, out.keys_to_store)
        return p.Slots(msg.rid, out.keys_to_store, out.slots, out.evicted)

    def _on_complete_store(
        self, identity: bytes, session: ClientSession, msg: p.CompleteStore
    ) -> p.Ok:
        """Allowed after the request finished: a store prepared before may complete later."""
        self._check_keys(msg.keys)
        scoped = session.scoped(msg.req_id)
        if msg.checksums is not None:
            check_store_checksums(msg, msg.checksums, self.state.cfg.pool.block_bytes)
        if not session.close_open_store(scoped, msg.keys):
            raise RequestError(
                ErrorCode.NOT_PREPARED, "no prepared store with these keys for this request"
            )
        self.tiering.complete_store(scoped, msg.keys, msg.success, msg.successful_keys)
        warm = self.state.warm
        if msg.checksums is not None and warm is not None:
            # stamp the slot headers of the keys that are now ready
            generation = self.tiering.next_job_id()
            for key, digests in zip(msg.keys, msg.checksums, strict=True):
                if self.tiering.primary.lookup(key) is LookupResult.HIT:
                    slot = self.tiering.primary.slot_of(key)
                    warm.stamp(slot, key, digests, msg.slice_bytes, generation)
        self.state.dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _on_prepare_load(
        self, identity: bytes, session: ClientSession, msg: p.PrepareLoad
    ) -> p.Slots:
        self._check_writable()
        self._check_keys(msg.keys)
        slots = self.tiering.prepare_load(self._scoped(session, msg.req_id), msg.keys)
        session.add_pins(msg.keys)
        return p.Slots(msg.rid, msg.keys, slots)

    def _on_complete_load(
        self, identity: bytes, session: ClientSession, msg: p.CompleteLoad
    ) -> p.Ok:
        """Release pins; a key this client still waits for (``Lookup.landing``) releases its
        wait instead, and one whose wait was lost is accepted without effect."""
        self._check_keys(msg.keys)
        keys = msg.keys
        if session.landing_endpoint:
            keys = self._release_landings(identity, session, msg)
        if not session.owns_pins(keys):
            raise RequestError(ErrorCode.NOT_PINNED, "these keys are not pinned by this client")
        self.tiering.complete_load(keys)
        session.drop_pins(keys)
        return p.Ok(msg.rid)

    def _release_landings(
        self, identity: bytes, session: ClientSession, msg: p.CompleteLoad
    ) -> list[bytes]:
        """The keys of ``msg`` left to unpin, once each key took, in this order, a pin the
        client holds, else its open landing wait for the request (released), else a lost
        wait (forgotten). Nothing changes when some key has none of them (NOT_PINNED)."""
        scoped = session.scoped(msg.req_id)
        waits = self.state.landings
        lost = session.landing_lost.get(scoped, set())
        if not lost and not waits.has_waits(identity):
            return msg.keys  # nothing but pins to release
        held = session.pinned
        pins = Counter({key: held[key] for key in set(msg.keys) if key in held})
        lost_left = set(lost)
        opened: Counter[bytes] = Counter()
        unpin: list[bytes] = []
        release: list[bytes] = []
        forget: list[bytes] = []
        for key in msg.keys:
            if pins[key] > 0:
                pins[key] -= 1
                unpin.append(key)
                continue
            if key not in opened:
                opened[key] = waits.open_count(identity, scoped, key)
            if opened[key] > 0:
                opened[key] -= 1
                release.append(key)
            elif key in lost_left:
                lost_left.discard(key)
                forget.append(key)
            else:
                raise RequestError(ErrorCode.NOT_PINNED, "these keys are not pinned by this client")
        waits.release(identity, scoped, release)
        lost.difference_update(forget)
        return unpin

    def _on_touch(self, identity: bytes, session: ClientSession, msg: p.Touch) -> p.Ok:
        self._check_keys(msg.keys)
        self.tiering.touch(msg.keys)
        return p.Ok(msg.rid)

    def _on_finish_request(
        self, identity: bytes, session: ClientSession, msg: p.FinishRequest
    ) -> p.Ok:
        scoped = self._scoped(session, msg.req_id)
        self.state.landings.drop_request(identity, scoped)
        session.landing_lost.pop(scoped, None)
        self.tiering.on_request_finished(scoped)
        session.requests.discard(scoped)
        self.state.dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _on_end_step(self, identity: bytes, session: ClientSession, msg: p.EndStep) -> p.Ok:
        self.tiering.end_step()
        self.state.dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _on_reset_cache(self, identity: bytes, session: ClientSession, msg: p.ResetCache) -> None:
        """Answered once no job is in flight and the online tiers took every waiting cascade
        (their backoff is skipped), or with ``reset_timeout`` after the drain timeout."""
        deadline = time.monotonic() + self.state.cfg.supervisor.drain_timeout_s
        self.state.pending_resets.append((identity, msg.rid, deadline))
        self.tiering.flush_cascade_backlogs()
        self.state.run_tier_step()
        self.state.settle_resets(time.monotonic())
        return None

    def _on_poll(self, identity: bytes, session: ClientSession, msg: p.Poll) -> None:
        if session.pending_poll is not None:
            self.state.reply(identity, p.JobsFinished(session.pending_poll.rid, []))
        session.pending_poll = PendingPoll(msg.rid, time.monotonic() + msg.wait_ms / 1000)
        self.state.answer_poll(session, force=msg.wait_ms <= 0)
        return None

    def _on_disconnect(self, identity: bytes, session: ClientSession, msg: p.Disconnect) -> p.Ok:
        self._drop_session(session, "disconnected")
        return p.Ok(msg.rid)

    def _on_status(self, identity: bytes, session: ClientSession, msg: p.Status) -> p.StatusReply:
        return p.StatusReply(msg.rid, self.state.status(time.monotonic()))

    def _on_tenant_drop(self, identity: bytes, session: ClientSession, msg: p.TenantDrop) -> None:
        """Answered with ``TenantDropped`` once every tier removed the tenant's blocks
        (``tiering.tenants.drops``)."""
        check_tenant(msg.tenant, required=True)
        self._check_writable()
        drop = self.tiering.drop_tenant(msg.tenant)
        self.state.drop_replies.wait(drop, identity, msg.rid)
        self.state.dispatch_tier_jobs()
        return None

    def _on_take_tier_events(
        self, identity: bytes, session: ClientSession, msg: p.TakeTierEvents
    ) -> p.TierEvents:
        return self.state.events.take(session.event_reader, msg, session.tenants)

    def _drop_session(self, session: ClientSession, reason: str) -> None:
        """Finish everything a vanished client left: its prepared stores fail, its pins are
        released, its requests finish; its device jobs still complete but deliver no event."""
        del self.state.sessions[session.identity]
        self.state.waiting_lookups.pop(session.identity, None)
        self.state.landings.drop_client(session.identity)
        for scoped, stores in session.open_stores.items():
            for keys in stores:
                self.tiering.complete_store(scoped, keys, success=False)
        if session.pinned:
            self.tiering.complete_load(session.all_pins())
        for scoped in session.requests:
            if scoped in self.tiering.requests:
                self.tiering.on_request_finished(scoped)
        self.handles.release(session.handles)
        self.state.dispatch_tier_jobs()
        log.log(
            logging.INFO if reason == "disconnected" else logging.WARNING,
            "client_dropped",
            client_id=session.client_id,
            reason=reason,
            requests=len(session.requests),
            pins=sum(session.pinned.values()),
        )


def is_landing_endpoint(msg: p.Connect) -> bool:
    """Only landing pipes (``fifo://`` and an absolute path) take ``Landed`` notices: a client
    that maps the pool runs on this machine, and the workers write to nothing else."""
    return bool(pipe_path(msg.landing_endpoint))


def check_tenant(tenant: str, required: bool = False) -> None:
    """A tenant id as ``kvoffload.wire.tenant_ids.tenant_id`` makes it ("" for none, unless
    ``required``); else ``bad_tenant``."""
    if not is_tenant_id(tenant) or (required and not tenant):
        raise RequestError(
            ErrorCode.BAD_TENANT,
            f"tenant must be {TENANT_ID_CHARS} lower-case hex digits "
            f"(kvoffload.wire.tenant_ids.tenant_id of its name){'' if required else ' or empty'}",
        )


def _worth_waiting(results: list[LookupResult]) -> bool:
    """A held lookup waits while nothing is ready and something may still become ready."""
    return LookupResult.HIT not in results and p.must_wait(results)


def check_store_checksums(
    msg: p.CompleteStore, checksums: list[list[int]], block_bytes: int
) -> None:
    """BAD_REQUEST unless every key of ``msg`` has the digests of one block: one, or one per
    slice of ``msg.slice_bytes`` that fit a block of ``block_bytes``."""
    if len(checksums) != len(msg.keys):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{len(msg.keys)} keys but {len(checksums)} checksums"
        )
    for digests in checksums:
        sliced = len(digests) > 1
        if not 1 <= len(digests) <= MAX_SLICES or (
            sliced and not 0 < msg.slice_bytes * len(digests) <= block_bytes
        ):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{len(digests)} checksums of slices of {msg.slice_bytes} bytes do not "
                f"describe a block of {block_bytes} bytes (1 to {MAX_SLICES} slices)",
            )
