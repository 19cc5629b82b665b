"""Every message of kvoffload's channels, as typed msgspec Structs on msgpack.

Client channel (engine DEALER <-> manager ROUTER): each request carries ``rid`` (the caller's
call id) and gets exactly one reply with the same ``rid``: its typed reply or an ``Error``.
Job channel (worker DEALER <-> manager ROUTER): hello/ack with the protocol version, jobs
carrying keys and slot numbers (never block bytes), results, heartbeats, control.
Landing channel (tier worker -> client, through the client's named pipe, not ZeroMQ:
``kvoffload.wire.landing_pipe``): ``Landed`` notices of a promotion's keys, sent to the client
that waits for them as they land, beside the job's progress to the manager
(docs/design/cold-loads.md).
Peer channel (one node's peer worker DEALERs -> another's ROUTERs, tcp://): a ``PeerFetch`` of
blocks on the fetch endpoint (CURVE), answered by ``PeerRefused`` there, or on the bulk endpoint
by ``PeerBlocks`` and the blocks' bytes, one frame each, sealed with the fetch's AES-256-GCM key
(the only channel that carries block bytes: between nodes there is no shared pool).

Decoding is strict (``decode_client_request``, ``decode_client_reply``,
``decode_worker_message``, ``decode_manager_message``, ``decode_landing``, ``decode_peer_fetch``
and ``decode_peer_reply`` accept only their channel's union) and bounded by ``MAX_MESSAGE_BYTES``. Nothing is ever unpickled. What a status reply and a heartbeat
carry is defined in ``kvoffload.wire.status``.

Each frame is one msgpack map, the ``rid`` among its fields. A request that cannot be decoded is
still answered with its ``rid`` when ``request_id_of`` finds one in the frame's top-level map
(-1 otherwise). Sending the ``rid`` in a ZeroMQ frame of its own would spare that scan, but
costs a frame each way on every call, and measured slower per round trip than this layout.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

import msgspec

from kvoffload.wire.events import TierEvent
from kvoffload.wire.status import ManagerStatus, WorkerStats

# re-exported: part of the protocol
from kvoffload.wire.vocab import ErrorCode as ErrorCode
from kvoffload.wire.vocab import JobKind as JobKind
from kvoffload.wire.vocab import LookupResult as LookupResult
from kvoffload.wire.vocab import MissReason as MissReason
from kvoffload.wire.vocab import must_wait as must_wait

PROTOCOL_VERSION = 8
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class ProtocolError(Exception):
    """A frame that is not a valid message of the expected channel."""


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---- vocabulary ---------------------------------------------------------------------------------


class HandleKind(enum.StrEnum):
    """How the cpu worker reaches an engine's KV cache."""

    SHM = "shm"  # a POSIX shared-memory segment
    CUDA_IPC = "cuda_ipc"  # CUDA memory shared through torch's IPC handles


class ControlAction(enum.StrEnum):
    DRAIN = "drain"  # finish in-flight jobs, accept no more
    SHUTDOWN = "shutdown"
    FAULTS = "faults"  # apply ``Control.faults``
    HELLO = "hello"  # the manager restarted and does not know this worker: send the hello again


# ---- shared pieces ------------------------------------------------------------------------------


class CudaIpcFields(msgspec.Struct, forbid_unknown_fields=True):
    """torch's CUDA IPC sharing fields of one tensor (``torch.multiprocessing.reductions``):
    its shape and element offset in the shared storage, its dtype name, and the handles that
    open the storage, its ref counter and its event."""

    size: list[int]
    stride: list[int]
    tensor_offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One KV tensor of the engine: ``num_blocks`` rows of ``row_bytes`` bytes (block-major).

    For ``shm`` handles ``offset`` is the tensor's byte offset in the segment; ``cuda_ipc``
    handles carry ``ipc``."""

    row_bytes: int
    offset: int = 0
    ipc: CudaIpcFields | None = None


class KVHandle(msgspec.Struct, forbid_unknown_fields=True):
    """How the cpu worker reaches an engine's KV cache. A device block's bytes, in pool order,
    are the concatenation of each tensor's row for that block (sum of row_bytes == block_bytes)."""

    handle_id: str
    kind: HandleKind
    num_blocks: int
    tensors: list[TensorSpec]
    shm_name: str = ""


# ---- client channel: requests ------------------------------------------------------------------


class Connect(_Msg, tag="connect"):
    """``landing_endpoint``: ``fifo://`` and the absolute path of the client's landing pipe
    for ``Landed`` notices (``kvoffload.wire.landing_pipe``; "" for none: its lookups never
    get landing tickets)."""

    rid: int
    version: int
    client_name: str = ""
    landing_endpoint: str = ""


class RegisterKV(_Msg, tag="register_kv"):
    rid: int
    handle: KVHandle


class NewRequest(_Msg, tag="new_request"):
    """``tenant``: the id of the request's tenant (``kvoffload.wire.tenant_ids.tenant_id`` of its
    name; "" for none): the blocks it stores are that tenant's, and it sees no other's."""

    rid: int
    req_id: str
    params: dict[str, Any] = {}
    tenant: str = ""


class Lookup(_Msg, tag="lookup"):
    """Evaluate a request's prefix. With ``pin``, every key answered HIT is pinned for this
    client in the same call (as ``PrepareLoad`` would) and its slot returned, so a later load
    of it cannot fail; the client releases each such pin with ``CompleteLoad``.

    ``wait_ms`` > 0: while no key of the answer is HIT and some key is HIT_PENDING or RETRY,
    the manager holds the reply (up to ``wait_ms``) and evaluates the prefix again each time a
    tier job lands keys; it answers as soon as some key is HIT or none is pending any more, and
    at the deadline with what it then finds. 0 answers at once.

    ``landing`` (with ``pin``, from a client with a landing endpoint): the promotions this
    lookup starts are sent to their tier at once, and their keys are answered HIT_PENDING with
    their reserved slot in ``LookupReply.landing_slots``; the tier's worker tells the client of
    each such key as it lands (``Landed``, ticket = this call's ``rid``), and the key is then
    pinned for the client as if this lookup had found it HIT. The reply is not held for them:
    with ``wait_ms`` it is held only while no key is HIT and some pending key has no landing
    slot."""

    rid: int
    req_id: str
    keys: list[bytes]
    pin: bool = False
    wait_ms: int = 0
    landing: bool = False


class Load(_Msg, tag="load"):
    """Copy ready keys from the pool into device blocks (pins until the job finishes)."""

    rid: int
    req_id: str
    keys: list[bytes]
    device_blocks: list[int]
    handle_id: str


class Store(_Msg, tag="store"):
    """Copy device blocks into the pool, then cascade them to every secondary tier."""

    rid: int
    req_id: str
    keys: list[bytes]
    device_blocks: list[int]
    handle_id: str


class PrepareStore(_Msg, tag="prepare_store"):
    rid: int
    req_id: str
    keys: list[bytes]


class CompleteStore(_Msg, tag="complete_store"):
    """``checksums``: optional, co-indexed with ``keys``: the digests of each written slot's
    slices in rank order: one, the xxh3 of the whole slot (``blockformat.payload_checksum``),
    for a block one writer wrote; one per tensor-parallel rank for a block written in slices
    of ``slice_bytes`` (``blockformat.slice_checksums``). With slot headers on, the manager
    then stamps the slots of the keys that landed, so they survive a manager restart (verified
    like every adopted block). ``errors_only``: the manager answers only an Error, never Ok
    (a client that does not wait for the reply: the manager answers a client's calls in
    order, so any later reply tells that this call succeeded)."""

    rid: int
    req_id: str
    keys: list[bytes]
    success: bool = True
    successful_keys: list[bytes] | None = None
    checksums: list[list[int]] | None = None
    slice_bytes: int = 0
    errors_only: bool = False


class PrepareLoad(_Msg, tag="prepare_load"):
    rid: int
    req_id: str
    keys: list[bytes]


class CompleteLoad(_Msg, tag="complete_load"):
    """Release pins (``errors_only`` as in ``CompleteStore``)."""

    rid: int
    req_id: str
    keys: list[bytes]
    errors_only: bool = False


class Touch(_Msg, tag="touch"):
    rid: int
    keys: list[bytes]


class FinishRequest(_Msg, tag="finish_request"):
    """The request is over: no call may start anything for it any more, and its landing waits
    and the pins of its unread promotions go (``errors_only`` as in ``CompleteStore``)."""

    rid: int
    req_id: str
    errors_only: bool = False


class EndStep(_Msg, tag="end_step"):
    rid: int


class ResetCache(_Msg, tag="reset_cache"):
    rid: int


class Poll(_Msg, tag="poll"):
    """Take this client's finished-job events; waits up to ``wait_ms`` for the first one."""

    rid: int
    wait_ms: int = 0


class Status(_Msg, tag="status"):
    rid: int


class Disconnect(_Msg, tag="disconnect"):
    """The client is leaving: its open requests finish and its pins are released now."""

    rid: int


class TenantDrop(_Msg, tag="tenant_drop"):
    """Remove every block of the tenant (its id) from every tier of the service and from the
    shared bucket; answered with ``TenantDropped`` once the tiers removed them."""

    rid: int
    tenant: str


MAX_EVENT_PREFIX_BYTES = 64
MAX_EVENT_KEYS = 65536


class TakeTierEvents(_Msg, tag="take_tier_events"):
    """Take what the service's tiers gained and lost after ``cursor`` (0: nothing taken yet),
    answered at once with ``TierEvents``: at most ``max_keys`` keys, only keys that start with
    ``prefix``, only blocks of no tenant or of a tenant this client named in ``NewRequest``.
    The first call starts the service's event log."""

    rid: int
    cursor: int = 0
    prefix: Annotated[bytes, msgspec.Meta(max_length=MAX_EVENT_PREFIX_BYTES)] = b""
    max_keys: Annotated[int, msgspec.Meta(ge=1, le=MAX_EVENT_KEYS)] = 8192


ClientRequest = (
    Connect
    | RegisterKV
    | NewRequest
    | Lookup
    | Load
    | Store
    | PrepareStore
    | CompleteStore
    | PrepareLoad
    | CompleteLoad
    | Touch
    | FinishRequest
    | EndStep
    | ResetCache
    | Poll
    | Status
    | Disconnect
    | TenantDrop
    | TakeTierEvents
)


# ---- client channel: replies -------------------------------------------------------------------


class Error(_Msg, tag="error"):
    """Typed failure of one call. ``rid`` is -1 when the request could not be decoded."""

    rid: int
    code: ErrorCode
    message: str


class Ok(_Msg, tag="ok"):
    rid: int


class Connected(_Msg, tag="connected"):
    """``manager_pid``: slots this manager hands out stay reserved only while that process
    lives (a restarted manager may give them to other keys), so an engine that copies into or
    out of pool slots itself checks it is alive around each copy."""

    rid: int
    version: int
    client_id: str
    num_slots: int
    block_bytes: int
    key_bytes_min: int
    key_bytes_max: int
    pool_name: str
    tiers: list[str]
    manager_pid: int = 0


class NewRequestReply(_Msg, tag="new_request_reply"):
    rid: int
    request_level: bool


class LookupReply(_Msg, tag="lookup_reply"):
    """``results``/``reasons``: one byte per evaluated key (``LookupResult`` / ``MissReason``
    values), up to and including the first MISS. ``slots``: empty unless the lookup asked to
    ``pin``; then co-indexed with ``results``, the pinned slot of each HIT key and -1 for the
    others. ``checksums``: with ``slots``, the digests of each pinned slot's block as recorded
    when it was written (see ``CompleteStore``; empty: none recorded), so a reader can verify
    what it copies, slice by slice. ``landing_slots``: empty unless the lookup asked for
    ``landing`` and started promotions; then co-indexed with ``results``, the reserved slot of
    each HIT_PENDING key whose landing will be told to the client (``Landed``), -1 for the
    others."""

    rid: int
    results: bytes
    reasons: bytes
    hit_prefix: int
    ready_prefix: int
    slots: list[int] = []
    checksums: list[list[int]] = []
    landing_slots: list[int] = []


class JobAccepted(_Msg, tag="job_accepted"):
    """A device job was submitted; its outcome arrives as a DeviceJobFinished event (exactly once).
    ``job_id`` is None when there was nothing to do (every key already stored)."""

    rid: int
    job_id: int | None
    keys: list[bytes]
    evicted: list[bytes] = []


class Slots(_Msg, tag="slots"):
    """Reply to PrepareStore/PrepareLoad: slots co-indexed with ``keys``; for PrepareStore
    ``keys`` are only the keys to write (already-present keys are skipped)."""

    rid: int
    keys: list[bytes]
    slots: list[int]
    evicted: list[bytes] = []


class DeviceJobFinished(msgspec.Struct, forbid_unknown_fields=True):
    job_id: int
    req_id: str
    kind: JobKind
    """``DEVICE_STORE`` or ``DEVICE_LOAD``."""
    success: bool
    successful_keys: list[bytes] | None = None
    error: str = ""


class JobsFinished(_Msg, tag="jobs_finished"):
    """Reply to ``Poll``: this client's device jobs that finished since its last poll."""

    rid: int
    finished: list[DeviceJobFinished]


class StatusReply(_Msg, tag="status_reply"):
    rid: int
    status: ManagerStatus


class TenantDropped(_Msg, tag="tenant_dropped"):
    """What a ``TenantDrop`` removed: blocks per tier (``object``: the objects under the
    tenant's name in the bucket, other nodes' included), and per tier the blocks it could not
    remove (-1: that tier's removal failed as a whole; try again)."""

    rid: int
    removed: dict[str, int]
    failed: dict[str, int] = {}


class TierEvents(_Msg, tag="tier_events"):
    """Reply to ``TakeTierEvents``; pass ``cursor`` to the next call.

    ``resync``: the client's cursor was 0, from an earlier manager, or so old that events it
    never took are gone; these events begin a snapshot (stored events only) of every block
    the tiers named in ``complete`` hold now (the host pool and the indexed tiers; a probed
    tier, the object store, cannot be listed), and the client replaces what it knew of those
    tiers with the snapshot once it ends. ``in_snapshot``: the snapshot goes on in the next
    reply. ``more``: events are waiting beyond ``max_keys``; ask again now."""

    rid: int
    events: list[TierEvent]
    cursor: int
    resync: bool = False
    complete: list[str] = []
    in_snapshot: bool = False
    more: bool = False


ClientReply = (
    Error
    | Ok
    | Connected
    | NewRequestReply
    | LookupReply
    | JobAccepted
    | Slots
    | JobsFinished
    | StatusReply
    | TenantDropped
    | TierEvents
)


# ---- job channel: worker -> manager ------------------------------------------------------------


class WorkerHello(_Msg, tag="hello"):
    version: int
    worker: str
    medium: str
    pid: int
    capabilities: list[str] = []


class IndexUpdate(_Msg, tag="index_update"):
    """Keys the worker's tier now holds / no longer holds; ``complete`` marks the end of the
    start-up announcement."""

    added: list[bytes] = []
    removed: list[bytes] = []
    complete: bool = False


class JobDone(_Msg, tag="job_done"):
    """Exactly one per job, sent only after every resource that could touch the pool for the
    job is released. For probes, ``successful_keys`` are the keys found. ``absent_keys``: failed
    keys the tier confirmed it does not hold (for probes: not found; for promotions: never
    stored, gone, or corrupt and removed); any other failed key failed transiently.
    ``full_keys``: failed cascade keys the tier had no room for (not worth retrying).
    ``removed``: a ``delete`` job with ``purge_tenant``: the blocks removed in all."""

    job_id: int
    success: bool
    successful_keys: list[bytes] | None = None
    transfer_s: float = 0.0
    nbytes: int = 0
    error: str = ""
    absent_keys: list[bytes] = []
    full_keys: list[bytes] = []
    removed: int = 0


class Heartbeat(_Msg, tag="heartbeat"):
    inflight: int = 0
    degraded: bool = False
    stats: WorkerStats = msgspec.field(default_factory=WorkerStats)


class JobProgress(_Msg, tag="job_progress"):
    """Keys of a promotion still running whose slots are complete (bytes verified, slot header
    stamped) and that the job will not touch again: the manager makes them HIT at once. Sent
    before the job's ``JobDone``, which still lists them among its successful keys."""

    job_id: int
    keys: list[bytes]


WorkerMessage = WorkerHello | IndexUpdate | JobDone | JobProgress | Heartbeat


# ---- job channel: manager -> worker ------------------------------------------------------------


class HelloAck(_Msg, tag="hello_ack"):
    version: int
    accepted: bool
    reason: str = ""


class LandingTarget(msgspec.Struct, forbid_unknown_fields=True):
    """Where a promotion's keys are told as they land: the client's landing endpoint and the
    ticket (the rid of the lookup that started the promotion)."""

    endpoint: str
    ticket: int


class Job(_Msg, tag="job"):
    """``device_*`` and ``verify`` jobs go to the cpu worker, the others to tier workers.
    ``tenants``: co-indexed with ``keys``, the tenant id each block is named under (a tier
    that names blocks by tenant: the object tier); empty when none has a tenant.
    ``purge_tenant``: a ``delete`` job of a tenant drop: also remove every block the tier
    holds under that tenant's name. ``landing``: a promotion whose keys the worker also tells
    a waiting client as they land (``Landed``); None for none."""

    job_id: int
    kind: JobKind
    keys: list[bytes]
    slots: list[int] = []
    device_blocks: list[int] = []
    handle_id: str = ""
    tenants: list[str] = []
    purge_tenant: str = ""
    landing: LandingTarget | None = None


class TouchKeys(_Msg, tag="touch_keys"):
    keys: list[bytes]


class AttachKV(_Msg, tag="attach_kv"):
    handle: KVHandle


class DetachKV(_Msg, tag="detach_kv"):
    handle_id: str


_Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class FaultSpec(msgspec.Struct, forbid_unknown_fields=True):
    """Fault injection for soak tests: fractions of operations that fail (EIO) / are delayed /
    are corrupted, of medium writes that find the medium full (ENOSPC), release failures to
    inject, or a crash after ``crash_after_ops``."""

    fail_fraction: _Fraction = 0.0
    delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    delay_fraction: _Fraction = 0.0
    corrupt_fraction: _Fraction = 0.0
    release_failures: Annotated[int, msgspec.Meta(ge=0)] = 0
    crash_after_ops: int = -1
    seed: int = 0
    enospc_fraction: _Fraction = 0.0


class Control(_Msg, tag="control"):
    action: ControlAction
    faults: FaultSpec | None = None


ManagerMessage = HelloAck | Job | TouchKeys | AttachKV | DetachKV | Control


# ---- landing channel: tier worker -> client -------------------------------------------------


class Landed(_Msg, tag="landed"):
    """Keys of a promotion with a ``LandingTarget``, told to the waiting client by the worker
    that runs it. ``keys`` landed: their slots (``slots``, co-indexed) hold the verified block,
    whose digests (as ``LookupReply.checksums`` gives them) are ``checksums``; the client may
    copy them at once and releases each with ``CompleteLoad``, as a pinned HIT. ``failed``:
    keys that will not land (a MISS for this request). ``final``: the job is over; every key
    of it not told landed, before or in this notice, has failed (the notice that tells a job's
    last key is final, with ``failed`` empty). A client that stops waiting for a ticket's keys
    sends ``CompleteLoad`` for them, which cancels their pins. The manager hears of the same
    keys from the job's progress: until then their slots stay being written, which nothing
    evicts or reuses, and then they are pinned for the client, so a slot told landed stays
    the key's until the client's ``CompleteLoad``. Only a worker that dies before its progress
    reached the manager lets the manager free such a slot; a client therefore verifies what it
    copied against ``checksums`` (a slot rewritten under the copy fails that check)."""

    ticket: int
    keys: list[bytes] = []
    slots: list[int] = []
    checksums: list[list[int]] = []
    failed: list[bytes] = []
    final: bool = False


LandingMessage = Landed


# ---- peer channel: a node's peer worker DEALER -> another node's peer worker ROUTER ------------


class PeerFetch(_Msg, tag="peer_fetch"):
    """Ask a holder node for blocks, on its fetch endpoint (tcp:// with CURVE; docs/fleet.md,
    "Peers"). Every fetch carries what the holder checks before it serves anything: the
    protocol ``version``, the ``deployment`` fingerprint (``blockformat.deployment_fingerprint``:
    block format, ``block_bytes``, layout) and the ``tenant_check`` of the requester's tenant
    key (``tenant_ids.key_check``). ``tenant``: the id the blocks are named under ("" for
    none); the holder serves only that tenant's blocks. ``wait_ms``: how long the holder may
    take to bring blocks it holds on its disk into its pool first (0: its pool only).

    The answer goes to the requester's socket on the holder's bulk endpoint whose routing id
    is ``bulk_id``, every frame sealed with AES-256-GCM under ``key`` (fresh for each fetch,
    known to the two ends only: it travels inside CURVE); see ``PEER_SEAL_NONCE``."""

    version: int
    fetch_id: int
    deployment: bytes
    tenant_check: str
    tenant: str
    keys: list[bytes]
    bulk_id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
    key: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    wait_ms: int = 0


def peer_seal_nonce(fetch_id: int, frame: int) -> bytes:
    """The 12-byte AES-GCM nonce of frame ``frame`` (0: the ``PeerBlocks`` header, then each
    block) of fetch ``fetch_id``: never the same twice under one key."""
    return fetch_id.to_bytes(8, "big") + frame.to_bytes(4, "big")


class PeerChecksum(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A block's checksum as its holder's slot header carries it (``BlockChecksum``): the
    xxh3 of the block, or, for a block written in ``slices`` slices of ``slice_bytes`` (one
    per tensor-parallel rank), the combination of theirs."""

    value: int
    slices: int = 1
    slice_bytes: int = 0


class PeerBlocks(_Msg, tag="peer_blocks"):
    """The holder's answer to a ``PeerFetch``, on the bulk endpoint: the first frame of a
    multipart message, followed by one frame per key of ``keys`` (the block's bytes,
    ``block_bytes`` long), in order, each frame sealed (ciphertext then the 16-byte tag).
    ``checksums``: co-indexed with ``keys``, each block's checksum as its writers took it (the
    holder's slot header; taken when the block is sent where it has none), so the requester
    verifies every block it receives. ``absent``: keys the holder does not hold for this
    tenant (evicted, never held, another tenant's). ``failed``: keys it holds but could not
    send in time (its disk was slow, its pool busy)."""

    fetch_id: int
    keys: list[bytes] = []
    checksums: list[PeerChecksum] = []
    absent: list[bytes] = []
    failed: list[bytes] = []


class PeerRefused(_Msg, tag="peer_refused"):
    """A ``PeerFetch`` the holder did not serve, answered on the fetch endpoint: ``code`` says
    why (``VERSION_MISMATCH``, ``DEPLOYMENT_MISMATCH``, ``TENANT_KEY_MISMATCH``, ``BUSY``,
    ``BAD_MESSAGE``, ...)."""

    fetch_id: int
    code: ErrorCode
    message: str = ""


PeerReply = PeerBlocks | PeerRefused


# ---- encoding ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_client_request_decoder: msgspec.msgpack.Decoder[ClientRequest] = msgspec.msgpack.Decoder(
    ClientRequest
)
_client_reply_decoder: msgspec.msgpack.Decoder[ClientReply] = msgspec.msgpack.Decoder(ClientReply)
_worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(WorkerMessage)
_manager_decoder: msgspec.msgpack.Decoder[ManagerMessage] = msgspec.msgpack.Decoder(ManagerMessage)
_landing_decoder: msgspec.msgpack.Decoder[LandingMessage] = msgspec.msgpack.Decoder(LandingMessage)
_peer_fetch_decoder: msgspec.msgpack.Decoder[PeerFetch] = msgspec.msgpack.Decoder(PeerFetch)
_peer_reply_decoder: msgspec.msgpack.Decoder[PeerReply] = msgspec.msgpack.Decoder(PeerReply)
_M = TypeVar("_M")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder[_M], frame: bytes) -> _M:
    """Any failure to decode, whatever its kind (nesting too deep for the decoder included),
    is a ProtocolError, so every bad frame can be answered."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from None
    except RecursionError:
        raise ProtocolError("message nested too deeply to decode") from None
    except Exception as exc:  # noqa: BLE001 - msgspec raises more than its own errors
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from None


def decode_client_request(frame: bytes) -> ClientRequest:
    return _decode(_client_request_decoder, frame)


def decode_client_reply(frame: bytes) -> ClientReply:
    return _decode(_client_reply_decoder, frame)


def decode_worker_message(frame: bytes) -> WorkerMessage:
    return _decode(_worker_decoder, frame)


def decode_manager_message(frame: bytes) -> ManagerMessage:
    return _decode(_manager_decoder, frame)


def decode_landing(frame: bytes) -> LandingMessage:
    return _decode(_landing_decoder, frame)


def decode_peer_fetch(frame: bytes) -> PeerFetch:
    return _decode(_peer_fetch_decoder, frame)


def decode_peer_reply(frame: bytes) -> PeerReply:
    return _decode(_peer_reply_decoder, frame)


def request_id_of(frame: bytes) -> int:
    """Best-effort ``rid`` of an undecodable client frame (-1 if none can be read).

    Only the top-level map is read: values are skipped without recursion and at most
    ``_RID_SCAN_ITEMS`` msgpack items are looked at, so a frame nested arbitrarily deep, or a
    huge one, costs little and still yields the rid that precedes the bad value."""
    try:
        return _scan_rid(frame[:MAX_MESSAGE_BYTES])
    except Exception:  # noqa: BLE001 - a junk frame gets -1
        return -1


_RID_SCAN_ITEMS = 4096
_RID_KEY = b"\xa3rid"
# msgpack headers with a fixed-size body: first byte -> body bytes
_FIXED_BODY = {
    0xC0: 0,
    0xC2: 0,
    0xC3: 0,
    0xCA: 4,
    0xCB: 8,
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xD4: 2,
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,
}
# msgpack headers followed by a big-endian length: first byte -> (length bytes, extra bytes)
_SIZED_BODY = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
}
# container headers followed by a big-endian count: first byte -> (count bytes, items per count)
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _item_header(frame: bytes, pos: int) -> tuple[int, int]:
    """(position after the msgpack item header at ``pos`` and its inline body, number of
    nested items that follow it). IndexError past the end, ValueError on an invalid byte."""
    b = frame[pos]
    if b <= 0x7F or b >= 0xE0:
        return pos + 1, 0
    if 0x80 <= b <= 0x8F:
        return pos + 1, 2 * (b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return pos + 1, b & 0x0F
    if 0xA0 <= b <= 0xBF:
        return pos + 1 + (b & 0x1F), 0
    if b in _FIXED_BODY:
        return pos + 1 + _FIXED_BODY[b], 0
    if b in _SIZED_BODY:
        width, extra = _SIZED_BODY[b]
        return pos + 1 + width + extra + int.from_bytes(frame[pos + 1 : pos + 1 + width], "big"), 0
    if b in _CONTAINERS:
        width, per = _CONTAINERS[b]
        if pos + 1 + width > len(frame):
            raise IndexError("truncated header")
        return pos + 1 + width, per * int.from_bytes(frame[pos + 1 : pos + 1 + width], "big")
    raise ValueError(f"invalid msgpack byte {b:#x}")


def _skip_item(frame: bytes, pos: int, budget: list[int]) -> int:
    """Position after the item at ``pos`` (its nested items included), without recursion."""
    pending = 1
    while pending:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("rid scan budget exhausted")
        pos, nested = _item_header(frame, pos)
        pending += nested - 1
    if pos > len(frame):
        raise IndexError("truncated item")
    return pos


def _scan_rid(frame: bytes) -> int:
    if not frame or not (0x80 <= frame[0] <= 0x8F or frame[0] in (0xDE, 0xDF)):
        return -1
    pos, nested = _item_header(frame, 0)
    budget = [_RID_SCAN_ITEMS]
    for _ in range(nested // 2):
        key_end = _skip_item(frame, pos, budget)
        is_rid = frame[pos:key_end] == _RID_KEY
        value_end = _skip_item(frame, key_end, budget)
        if is_rid:
            rid = msgspec.msgpack.decode(frame[key_end:value_end])
            return rid if isinstance(rid, int) and not isinstance(rid, bool) else -1
        pos = value_end
    return -1
