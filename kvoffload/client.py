"""Engine-side client of the manager (one DEALER socket; not thread-safe: one per thread).

Every call sends one request and waits for its reply (matched by call id) up to ``timeout_s``;
``begin_lookup`` and ``begin_prepare_store`` send theirs at once and leave the wait to
``PendingCall.result``.
Failures raise ``KVOffloadError`` carrying the manager's ``ErrorCode``; a call that would
exceed ``protocol.MAX_MESSAGE_BYTES`` raises one with ``MESSAGE_TOO_LARGE`` before anything
is sent; a missing reply raises ``ServiceUnavailable`` (also a ``TimeoutError``).
Finished device jobs are delivered once each, by ``poll``/``wait``.

A restarted manager answers ``not_connected``: ``reconnect`` starts a new session with what
this client had set up (KV handles, open requests); with ``auto_reconnect`` that happens by
itself and the call is sent once more.

With ``landing`` (an ipc:// endpoint), the client also creates a landing pipe beside the
manager's socket file (``kvoffload.wire.landing_pipe``), where tier workers tell it of the
keys its ``lookup(..., landing=True)`` calls are promoting as they land (``take_landed``): a
cold load then waits for the disk, not for the manager to hear of the disk and answer
(docs/design/cold-loads.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

import zmq

from kvoffload.wire import protocol as p
from kvoffload.wire.landing_pipe import LandingPipe
from kvoffload.wire.protocol import ErrorCode, LookupResult, MissReason, must_wait
from kvoffload.wire.status import ManagerStatus
from kvoffload.wire.tenant_ids import tenant_id


class KVOffloadError(Exception):
    """A failed call; ``code`` (an ``ErrorCode``, equal to its plain string) says why."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class ServiceUnavailable(KVOffloadError, TimeoutError):
    """The manager did not answer in time: it is down, restarting or unreachable (code
    ``unavailable``). Call ``reconnect`` once it is back."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


R = TypeVar("R")
"""The reply type a call expects."""
T = TypeVar("T")

LOST_JOB_ERROR = "lost: the manager restarted or dropped this client's session"
DEFERRED_ERRORS_KEPT = 64


class LookupOutcome:
    """A lookup reply as ``LookupResult``/``MissReason`` values (results up to the first MISS)."""

    def __init__(self, reply: p.LookupReply) -> None:
        self.raw_results = reply.results
        self.raw_reasons = reply.reasons
        self.hit_prefix = reply.hit_prefix
        self.ready_prefix = reply.ready_prefix
        self.slots = reply.slots
        self.checksums = reply.checksums
        self.landing_slots = reply.landing_slots
        self.ticket = reply.rid if reply.landing_slots else 0
        """The ``Landed.ticket`` of the notices that tell the keys of ``landing_slots``."""

    @property
    def results(self) -> list[LookupResult]:
        return [LookupResult(r) for r in self.raw_results]

    @property
    def reasons(self) -> list[MissReason]:
        return [MissReason(r) for r in self.raw_reasons]

    @property
    def must_wait(self) -> bool:
        """Some key is HIT_PENDING or RETRY: wait, then look up again."""
        return must_wait(self.raw_results)

    def __repr__(self) -> str:
        return f"LookupOutcome(hit_prefix={self.hit_prefix}, ready_prefix={self.ready_prefix}, results={[r.name for r in self.results]})"


def _same(reply: T) -> T:
    return reply


def _checked(kind: type, reply_type: type[R], reply: Any) -> R:
    """``reply`` if it is a ``reply_type``; KVOffloadError for an Error or another type."""
    if isinstance(reply, p.Error):
        raise KVOffloadError(reply.code, reply.message)
    if not isinstance(reply, reply_type):
        raise KVOffloadError(
            ErrorCode.BAD_MESSAGE,
            f"{kind.__name__} was answered by a {type(reply).__name__}, not a {reply_type.__name__}",
        )
    return reply


class PendingCall(Generic[T]):
    """A call a ``begin_*`` method sent, whose reply ``result`` reads: the caller works while
    the manager answers. The manager handles the client's calls in the order they were sent,
    so the calls made before ``result`` are answered as usual, and the begun call sees the
    effect of every call sent before it. ``result`` raises as the blocking call would
    (``ServiceUnavailable`` once ``timeout_s`` has passed since it was sent); it is for the
    thread that owns the client, like every call. The client keeps a begun call's reply until
    ``result`` reads it: read it once for every call begun."""

    __slots__ = (
        "_client",
        "_convert",
        "_outcome",
        "deadline",
        "fields",
        "kind",
        "reply_type",
        "rid",
    )

    def __init__(
        self,
        client: KVOffloadClient,
        rid: int,
        kind: type,
        reply_type: type,
        fields: dict[str, Any],
        convert: Callable[[Any], T],
    ) -> None:
        self._client = client
        self.rid = rid
        self.kind = kind
        self.reply_type = reply_type
        self.fields = fields
        self.deadline = time.monotonic() + client.timeout_s
        self._convert = convert
        self._outcome: T | KVOffloadError | None = None

    def result(self) -> T:
        """The reply, read on the first call (later calls return it, or raise its error)."""
        if self._outcome is None:
            try:
                self._outcome = self._convert(self._client._finish(self))
            except KVOffloadError as exc:
                self._outcome = exc
        if isinstance(self._outcome, KVOffloadError):
            raise self._outcome
        return self._outcome


class KVOffloadClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        name: str = "",
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
        auto_reconnect: bool = False,
        landing: bool = False,
    ) -> None:
        """``curve_keys`` = (client public, client secret, server public) for tcp:// endpoints.
        ``auto_reconnect``: a call answered ``not_connected`` calls ``reconnect`` and is sent
        once more. ``landing``: take ``Landed`` notices (``take_landed``), for an ipc://
        endpoint only (ignored otherwise: ``landing_endpoint`` stays ""). Raises
        ServiceUnavailable when the manager does not answer."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.name = name
        self.auto_reconnect = auto_reconnect
        self._curve_keys = curve_keys
        self._zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._rids = itertools.count(1)
        self._events: deque[p.DeviceJobFinished] = deque()
        self._handles: dict[str, p.KVHandle] = {}
        self._requests: dict[str, tuple[dict[str, Any], str]] = {}
        """Open requests: their params and tenant id (``reconnect`` opens them again)."""
        self._jobs: dict[
            int, tuple[str, p.JobKind]
        ] = {}  # accepted device jobs: id -> (req_id, kind)
        self._unawaited: dict[int, str] = {}  # rid -> call name, sent with wait=False
        self._begun: dict[int, Any] = {}
        """Calls sent by ``begin_*`` whose reply was not taken: rid -> the reply, None until it
        arrives."""
        self.deferred_errors: deque[KVOffloadError] = deque(maxlen=DEFERRED_ERRORS_KEPT)
        """Errors answered to calls sent with ``wait=False``, newest last (the last 64)."""
        self._landing: LandingPipe | None = None
        self.landing_endpoint = ""
        """Where tier workers send this client's ``Landed`` notices ("" for none)."""
        if landing:
            self._open_landing()
        self._sock = self._open_socket()
        try:
            self.info = self._exchange(p.Connect, p.Connected, None, self._connect_fields())
        except BaseException:
            self._sock.close(linger=0)
            self._close_landing()
            raise

    # ---- plumbing -------------------------------------------------------------------------

    def _open_socket(self) -> zmq.Socket[bytes]:
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve_keys is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve_keys
        sock.connect(self.endpoint)
        return sock

    def _open_landing(self) -> None:
        """Create the landing pipe beside an ipc:// endpoint's socket file (the run's
        directory, which only the service's user can enter)."""
        if not self.endpoint.startswith("ipc://"):
            return
        directory = os.path.dirname(self.endpoint.removeprefix("ipc://"))
        path = os.path.join(directory, f"landing-{os.getpid()}-{secrets.token_hex(4)}.fifo")
        try:
            self._landing = LandingPipe(path)
        except OSError:
            return
        self.landing_endpoint = self._landing.endpoint

    def _close_landing(self) -> None:
        if self._landing is None:
            return
        self._landing.close()
        self._landing = None

    def _connect_fields(self) -> dict[str, Any]:
        return {
            "version": p.PROTOCOL_VERSION,
            "client_name": self.name,
            "landing_endpoint": self.landing_endpoint,
        }

    def _call(
        self, kind: type, reply_type: type[R], timeout_s: float | None = None, **fields: Any
    ) -> R:
        """One call answered by a ``reply_type``; reconnects once on ``not_connected``."""
        try:
            return self._exchange(kind, reply_type, timeout_s, fields)
        except KVOffloadError as exc:
            if not (
                self.auto_reconnect
                and exc.code is ErrorCode.NOT_CONNECTED
                and kind is not p.Disconnect
            ):
                raise
        self.reconnect()
        return self._exchange(kind, reply_type, timeout_s, fields)

    def _send_request(self, kind: type, fields: dict[str, Any]) -> int:
        """Encode and send one request; returns its call id."""
        rid = next(self._rids)
        frame = p.encode(kind(rid=rid, **fields))
        if len(frame) > p.MAX_MESSAGE_BYTES:
            raise KVOffloadError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"{kind.__name__} encodes to {len(frame)} bytes, over the "
                f"{p.MAX_MESSAGE_BYTES}-byte message limit; it was not sent",
            )
        self._sock.send(frame)
        return rid

    def _send_unawaited(self, kind: type, fields: dict[str, Any]) -> None:
        """Send a call (a kind with ``errors_only``) without waiting for its reply, which comes
        only when it failed: an Error, read by a later call, goes to ``deferred_errors``. The
        manager handles this client's calls in order, so every later call sees its effect, and
        any reply to a later call tells that it succeeded."""
        self._unawaited[self._send_request(kind, {**fields, "errors_only": True})] = kind.__name__

    def _settle_unawaited(self, reply: Any) -> None:
        """Note ``reply``: the unawaited calls sent before it succeeded (the manager answers in
        order and sends them no Ok); an Error to one of them goes to ``deferred_errors``."""
        unawaited = self._unawaited
        while unawaited:
            first = next(iter(unawaited))
            if first >= reply.rid:
                break
            del unawaited[first]
        name = unawaited.pop(reply.rid, None)
        if name is not None and isinstance(reply, p.Error):
            self.deferred_errors.append(
                KVOffloadError(reply.code, f"{name} (sent without waiting): {reply.message}")
            )

    def _exchange(
        self, kind: type, reply_type: type[R], timeout_s: float | None, fields: dict[str, Any]
    ) -> R:
        """Send one request and return its reply; KVOffloadError for an Error reply or one of
        another type than ``reply_type``, ServiceUnavailable when none comes in time."""
        rid = self._send_request(kind, fields)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        return self._reply_to(rid, kind, reply_type, deadline)

    def _reply_to(self, rid: int, kind: type, reply_type: type[R], deadline: float) -> R:
        """The reply to call ``rid``: one a begun call kept, or read now; replies to other
        begun calls read meanwhile are kept for them."""
        reply = self._begun.pop(rid, None)
        while reply is None:
            got = self._read_reply(kind, 1, deadline)
            if got.rid == rid:
                reply = got
            elif got.rid in self._begun:
                self._begun[got.rid] = got
        return _checked(kind, reply_type, reply)

    def _read_reply(self, kind: type, count: int, deadline: float) -> Any:
        """The next reply, its unawaited calls settled; ServiceUnavailable at ``deadline``."""
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not self._sock.poll(remaining_ms):
            calls = f"{kind.__name__} call" if count == 1 else f"{count} {kind.__name__} calls"
            raise ServiceUnavailable(f"no reply to {calls} from {self.endpoint} in time")
        reply = p.decode_client_reply(self._sock.recv())
        self._settle_unawaited(reply)
        return reply

    def _exchange_many(
        self, kind: type, reply_type: type[R], calls: list[dict[str, Any]]
    ) -> list[R | p.Error]:
        """Send every call of ``calls`` at once and return their replies in order, each a
        ``reply_type`` or an Error; one of another type raises KVOffloadError once all are
        in, ServiceUnavailable when some reply does not come in time."""
        rids = [self._send_request(kind, fields) for fields in calls]
        order = {rid: i for i, rid in enumerate(rids)}
        replies: list[Any] = [None] * len(rids)
        deadline = time.monotonic() + self.timeout_s
        missing = len(rids)
        while missing:
            reply = self._read_reply(kind, missing, deadline)
            if reply.rid in self._begun:
                self._begun[reply.rid] = reply
                continue
            index = order.get(reply.rid)
            if index is None or replies[index] is not None:
                continue  # an unawaited call's error, or a late reply to a call that timed out
            replies[index] = reply
            missing -= 1
        for reply in replies:
            if not isinstance(reply, (reply_type, p.Error)):
                raise KVOffloadError(
                    ErrorCode.BAD_MESSAGE,
                    f"{kind.__name__} was answered by a {type(reply).__name__}, "
                    f"not a {reply_type.__name__}",
                )
        return cast(list[R | p.Error], replies)

    def _begin(
        self, kind: type, reply_type: type, fields: dict[str, Any], convert: Callable[[Any], T]
    ) -> PendingCall[T]:
        rid = self._send_request(kind, fields)
        self._begun[rid] = None
        return PendingCall(self, rid, kind, reply_type, fields, convert)

    def _finish(self, call: PendingCall[Any]) -> Any:
        """The reply to a begun call (``PendingCall.result``), reconnecting as ``_call`` does."""
        this_session = call.rid in self._begun
        if this_session:
            try:
                return self._reply_to(call.rid, call.kind, call.reply_type, call.deadline)
            except KVOffloadError as exc:
                error = exc
        else:
            error = KVOffloadError(
                ErrorCode.NOT_CONNECTED, f"the session {call.kind.__name__} was sent in ended"
            )
        if not (self.auto_reconnect and error.code is ErrorCode.NOT_CONNECTED):
            raise error
        if this_session:
            self.reconnect()
        return self._exchange(call.kind, call.reply_type, None, call.fields)

    def reconnect(self, timeout_s: float | None = None) -> None:
        """Start a new session, for a manager that restarted (calls answered
        ``not_connected``) or was unreachable (``ServiceUnavailable``): a fresh socket (requests
        still queued for the old session are dropped), ``Connect`` (``info`` is renewed), then
        every KV handle registered and every request opened and not yet finished by this
        client are registered and opened again. Device jobs accepted before and not reported
        yet end with one failed ``DeviceJobFinished`` each (error ``lost: ...``); pins and prepared
        stores of the old session are gone. The old session, if its manager still has it, is
        told to end. Raises ServiceUnavailable when the manager does not answer within
        ``timeout_s`` (default: the client's ``timeout_s``)."""
        old, self._sock = self._sock, self._open_socket()
        self._unawaited.clear()
        self._begun.clear()
        with contextlib.suppress(zmq.ZMQError):
            old.send(p.encode(p.Disconnect(rid=next(self._rids))), zmq.NOBLOCK)
        old.close(linger=200)
        self.info = self._exchange(p.Connect, p.Connected, timeout_s, self._connect_fields())
        for handle in list(self._handles.values()):
            self._exchange(p.RegisterKV, p.Ok, None, {"handle": handle})
        for req_id, (params, tenant) in list(self._requests.items()):
            fields = {"req_id": req_id, "params": params, "tenant": tenant}
            self._exchange(p.NewRequest, p.NewRequestReply, None, fields)
        lost, self._jobs = self._jobs, {}
        for job_id, (req_id, kind) in lost.items():
            self._events.append(
                p.DeviceJobFinished(job_id, req_id, kind, False, None, LOST_JOB_ERROR)
            )

    def close(self) -> None:
        """Tell the manager we leave (best effort: it finishes our requests and releases our
        pins at once instead of at lease expiry), then close the socket."""
        if not self._sock.closed:
            with contextlib.suppress(TimeoutError, KVOffloadError, zmq.ZMQError):
                self._call(p.Disconnect, p.Ok, timeout_s=1.0)
            self._sock.close(linger=0)
        self._close_landing()

    def abandon(self, linger_ms: int = 200) -> None:
        """Leave without waiting (for a manager that stopped answering): queue a Disconnect,
        so a manager that resumes releases this client's pins at once instead of at lease
        expiry, and close the socket, giving the queued frame ``linger_ms`` to leave."""
        if self._sock.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(p.encode(p.Disconnect(rid=next(self._rids))), zmq.NOBLOCK)
        self._sock.close(linger=linger_ms)
        self._close_landing()

    def __enter__(self) -> KVOffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine calls ---------------------------------------------------------------------

    def register_kv(self, handle: p.KVHandle) -> None:
        """Register a KV cache (``reconnect`` registers it again)."""
        self._call(p.RegisterKV, p.Ok, handle=handle)
        self._handles[handle.handle_id] = handle

    def new_request(
        self,
        req_id: str,
        params: dict[str, Any] | None = None,
        tenant: str = "",
        *,
        tid: str | None = None,
    ) -> bool:
        """Returns True when some tier wants every block of the request (request level). The
        request stays open (``reconnect`` opens it again) until ``finish_request``.
        ``tenant``: the name of the request's tenant ("" for none; sent as its
        ``tenants.tenant_id`` only): the blocks it stores are that tenant's, and it sees no
        other tenant's. Two tenants' keys for one content should differ (vLLM's ``cache_salt``
        does that): a key another tenant holds is a miss and is not stored again. ``tid``:
        the tenant's id instead of its name, for a caller that knows only the id (a peer
        node's fetch)."""
        if tid is None:
            tid = tenant_id(tenant)
        reply = self._call(
            p.NewRequest, p.NewRequestReply, req_id=req_id, params=params or {}, tenant=tid
        )
        self._requests[req_id] = (params or {}, tid)
        return reply.request_level

    def lookup(
        self,
        req_id: str,
        keys: list[bytes],
        pin: bool = False,
        wait_ms: int = 0,
        landing: bool = False,
    ) -> LookupOutcome:
        """Evaluate the prefix ``keys``. With ``pin``, every HIT key is pinned for this client
        in the same round trip and ``slots`` holds its slot (-1 for the other results); release
        each pin with ``complete_load``. With ``wait_ms`` > 0 the manager holds the reply while
        no key is HIT and some are still pending, up to ``wait_ms`` (``protocol.Lookup``): a
        cold load then takes one call per batch of landed keys instead of polling.

        ``landing`` (with ``pin``, on a client with a ``landing_endpoint``): the promotions the
        lookup starts go to their tiers at once; their keys come back HIT_PENDING with a slot
        in ``landing_slots``, and ``take_landed`` tells each as it lands (``ticket``), pinned
        for this client as a HIT: copy it, verify it against the notice's checksums, release it
        with ``complete_load``. A key given up on is released with ``complete_load`` too."""
        fields = self._lookup_fields(req_id, keys, pin, wait_ms, landing)
        timeout_s = wait_ms / 1000 + self.timeout_s
        return LookupOutcome(self._call(p.Lookup, p.LookupReply, timeout_s=timeout_s, **fields))

    def begin_lookup(
        self, req_id: str, keys: list[bytes], pin: bool = False, landing: bool = False
    ) -> PendingCall[LookupOutcome]:
        """``lookup`` (without a wait) sent now; ``result()`` of what it returns reads its
        outcome. An engine looks the next request up this way while it copies the blocks of
        the one before. The pins it takes are this client's once the manager has handled it,
        whether ``result`` is called or not: release them with ``complete_load``."""
        fields = self._lookup_fields(req_id, keys, pin, 0, landing)
        return self._begin(p.Lookup, p.LookupReply, fields, LookupOutcome)

    def _lookup_fields(
        self, req_id: str, keys: list[bytes], pin: bool, wait_ms: int, landing: bool
    ) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "keys": keys,
            "pin": pin,
            "wait_ms": wait_ms,
            "landing": landing and pin and bool(self.landing_endpoint),
        }

    def lookup_many(
        self, req_id: str, batches: list[list[bytes]], pin: bool = False, landing: bool = False
    ) -> list[LookupOutcome]:
        """``lookup`` of each batch, all in one round trip: the calls are sent together and
        the manager answers them in order, each batch evaluated on its own (each stops after
        its own first MISS), as if looked up one after the other. Raises for the first batch
        answered with an error, once every reply is in, having released the pins the other
        batches took."""
        fields = [self._lookup_fields(req_id, keys, pin, 0, landing) for keys in batches]
        replies = self._exchange_many(p.Lookup, p.LookupReply, fields)
        errors = [reply for reply in replies if isinstance(reply, p.Error)]
        if errors and self.auto_reconnect and errors[0].code is ErrorCode.NOT_CONNECTED:
            self.reconnect()
            replies = self._exchange_many(p.Lookup, p.LookupReply, fields)
            errors = [reply for reply in replies if isinstance(reply, p.Error)]
        outcomes = [LookupOutcome(r) for r in replies if isinstance(r, p.LookupReply)]
        if errors:
            taken = [  # pinned, or waited for as they land
                key
                for batch, reply in zip(batches, replies, strict=True)
                if isinstance(reply, p.LookupReply)
                for i, key in enumerate(batch[: len(reply.results)])
                if (i < len(reply.slots) and reply.slots[i] >= 0)
                or (i < len(reply.landing_slots) and reply.landing_slots[i] >= 0)
            ]
            if taken:
                self.complete_load(req_id, taken, wait=False)
            raise KVOffloadError(errors[0].code, errors[0].message)
        return outcomes

    def take_landed(self, timeout_ms: int = 0) -> list[p.Landed]:
        """The ``Landed`` notices received, waiting up to ``timeout_ms`` for the first (0: none
        waited for). Each notice arrives once; a frame that is not one is dropped."""
        pipe = self._landing
        if pipe is None:
            return []
        out: list[p.Landed] = []
        for frame in pipe.frames(timeout_ms):
            with contextlib.suppress(p.ProtocolError):
                out.append(p.decode_landing(frame))
        return out

    def store(
        self, req_id: str, keys: list[bytes], device_blocks: list[int], handle_id: str
    ) -> p.JobAccepted:
        """Offload device blocks; returns the accepted job (job_id None if nothing was new)."""
        accepted = self._call(
            p.Store,
            p.JobAccepted,
            req_id=req_id,
            keys=keys,
            device_blocks=device_blocks,
            handle_id=handle_id,
        )
        return self._accepted(req_id, p.JobKind.DEVICE_STORE, accepted)

    def load(
        self, req_id: str, keys: list[bytes], device_blocks: list[int], handle_id: str
    ) -> p.JobAccepted:
        """Copy ready (HIT) keys into device blocks; the pins last until the job finishes."""
        accepted = self._call(
            p.Load,
            p.JobAccepted,
            req_id=req_id,
            keys=keys,
            device_blocks=device_blocks,
            handle_id=handle_id,
        )
        return self._accepted(req_id, p.JobKind.DEVICE_LOAD, accepted)

    def _accepted(self, req_id: str, kind: p.JobKind, accepted: p.JobAccepted) -> p.JobAccepted:
        if accepted.job_id is not None:
            self._jobs[accepted.job_id] = (req_id, kind)
        return accepted

    def prepare_store(self, req_id: str, keys: list[bytes]) -> p.Slots:
        return self._call(p.PrepareStore, p.Slots, req_id=req_id, keys=keys)

    def begin_prepare_store(self, req_id: str, keys: list[bytes]) -> PendingCall[p.Slots]:
        """``prepare_store`` sent now; ``result()`` of what it returns reads its slots. The
        slots it reserves are this client's once the manager has handled it, whether
        ``result`` is called or not: end them with ``complete_store``."""
        fields = {"req_id": req_id, "keys": keys}
        return self._begin(p.PrepareStore, p.Slots, fields, _same)

    def complete_store(
        self,
        req_id: str,
        keys: list[bytes],
        success: bool = True,
        successful_keys: list[bytes] | None = None,
        checksums: list[list[int]] | None = None,
        wait: bool = True,
        slice_bytes: int = 0,
    ) -> None:
        """``checksums``: the digests of each written slot, one per slice of ``slice_bytes``
        (one, the whole slot's xxh3, without slices: see ``protocol.CompleteStore``), so the
        blocks survive a manager restart. ``wait=False`` sends the call without waiting for
        its reply (one round trip less; an error lands in ``deferred_errors``)."""
        fields: dict[str, Any] = {
            "req_id": req_id,
            "keys": keys,
            "success": success,
            "successful_keys": successful_keys,
            "checksums": checksums,
            "slice_bytes": slice_bytes,
        }
        if wait:
            self._call(p.CompleteStore, p.Ok, **fields)
        else:
            self._send_unawaited(p.CompleteStore, fields)

    def prepare_load(self, req_id: str, keys: list[bytes]) -> p.Slots:
        return self._call(p.PrepareLoad, p.Slots, req_id=req_id, keys=keys)

    def complete_load(self, req_id: str, keys: list[bytes], wait: bool = True) -> None:
        """Release pins taken by ``prepare_load`` or a pinned ``lookup``. ``wait=False`` sends
        the call without waiting for its reply (an error lands in ``deferred_errors``)."""
        if wait:
            self._call(p.CompleteLoad, p.Ok, req_id=req_id, keys=keys)
        else:
            self._send_unawaited(p.CompleteLoad, {"req_id": req_id, "keys": keys})

    def touch(self, keys: list[bytes]) -> None:
        self._call(p.Touch, p.Ok, keys=keys)

    def finish_request(self, req_id: str, wait: bool = True) -> None:
        """Finish the request; this client forgets it even when the call fails. ``wait=False``
        sends the call without waiting for its reply (an error lands in ``deferred_errors``)."""
        try:
            if wait:
                self._call(p.FinishRequest, p.Ok, req_id=req_id)
            else:
                self._send_unawaited(p.FinishRequest, {"req_id": req_id})
        finally:
            self._requests.pop(req_id, None)

    def end_step(self) -> None:
        self._call(p.EndStep, p.Ok)

    def reset_cache(self, timeout_s: float = 60.0) -> None:
        self._call(p.ResetCache, p.Ok, timeout_s=timeout_s)

    def status(self) -> ManagerStatus:
        return self._call(p.Status, p.StatusReply).status

    def tenant_drop(self, name: str, timeout_s: float = 60.0) -> p.TenantDropped:
        """Remove every block of the tenant ``name`` from every tier of the service and from
        the shared bucket (other nodes' objects included); returns the counts per tier once
        the tiers removed them. Afterwards the tenant's lookups miss everywhere."""
        if not name:
            raise ValueError("name the tenant to drop")
        return self._call(
            p.TenantDrop, p.TenantDropped, timeout_s=timeout_s, tenant=tenant_id(name)
        )

    def take_tier_events(
        self, cursor: int = 0, prefix: bytes = b"", max_keys: int = 8192
    ) -> p.TierEvents:
        """What the service's tiers gained and lost after ``cursor`` (0: begin with a
        snapshot), keys starting with ``prefix`` only (``protocol.TierEvents`` says how to
        apply the reply). Blocks of a tenant are seen once this client named the tenant in a
        request."""
        return self._call(
            p.TakeTierEvents, p.TierEvents, cursor=cursor, prefix=prefix, max_keys=max_keys
        )

    def poll(self, wait_ms: int = 0) -> list[p.DeviceJobFinished]:
        """Finished-job events not yet taken (each is returned exactly once)."""
        events = list(self._events)
        self._events.clear()
        if events:
            return events
        events = self._call(
            p.Poll, p.JobsFinished, timeout_s=wait_ms / 1000 + self.timeout_s, wait_ms=wait_ms
        ).finished
        for event in events:
            self._jobs.pop(event.job_id, None)
        return events

    def wait(
        self, job_ids: Iterable[int], timeout_s: float | None = None
    ) -> dict[int, p.DeviceJobFinished]:
        """Block until every job id has finished; other events stay queued for ``poll``."""
        wanted = {j for j in job_ids if j is not None}
        done: dict[int, p.DeviceJobFinished] = {}
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        others: list[p.DeviceJobFinished] = []
        while wanted - done.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._events.extend(others)
                raise TimeoutError(f"jobs {sorted(wanted - done.keys())} did not finish in time")
            for event in self.poll(wait_ms=int(min(remaining, 1.0) * 1000)):
                if event.job_id in wanted:
                    done[event.job_id] = event
                else:
                    others.append(event)
        self._events.extend(others)
        return done
