"""Value types of the tiering library: lookup results, miss reasons, tier filters, jobs, results."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

from kvoffload.logs import get_logger
from kvoffload.wire.vocab import ErrorCode, JobKind, LookupResult, MissReason, must_wait
from kvoffload.wire.vocab import Locality as Locality
from kvoffload.wire.vocab import Medium as Medium

log = get_logger()

Key = bytes
_E = TypeVar("_E", bound=enum.Enum)


class CascadeDrop(enum.Enum):
    """Why a key was never cascaded to a tier (the only reasons one may be given up)."""

    EVICTED = "evicted"  # it left the primary tier before its cascade could run
    TIER_FULL = "tier_full"  # the tier has no room for it
    RETRY_BOUND = "retry_bound"  # its cascade failed too many times
    TENANT_CAP = "tenant_cap"  # its tenant is at its cap on the tier and none of its own can go


class WriteBack(enum.Enum):
    """What a tier's dirty keys (in the host pool, their cascade to it not landed) may suffer
    when the pool needs room (``writeback``): ``HOLD`` never evicts them (stores are refused
    instead), ``BEST_EFFORT`` evicts them last and gives them up for the tier (counted)."""

    HOLD = "hold"
    BEST_EFFORT = "best_effort"


class OffloadPolicy(enum.IntEnum):
    CHUNK_LEVEL = 0  # offload only newly computed blocks
    REQUEST_LEVEL = 1  # offload every block of the request, prefix hits included


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """None on either side matches anything."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True, slots=True)
class TierFilter:
    """Which secondary tiers a request may read from; the primary tier is never filtered.

    An empty matcher tuple denies every secondary tier."""

    matchers: tuple[TierMatcher, ...]
    ALL: ClassVar[TierFilter]  # set below: one unconstrained matcher

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        return any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter((TierMatcher(),))


def parse_tier_filter(value: Any) -> TierFilter:
    """Parse ``kv_load_tiers``: a list of {"medium": ..., "locality": ...} dicts.

    Fail-open rules: not a list -> ALL; bad entries are skipped with a warning; a non-empty list
    with no valid entry -> ALL; ``[]`` -> deny all secondary tiers; ``[{}]`` -> unconstrained."""
    if value is None:
        return TierFilter.ALL
    if not isinstance(value, list):
        log.warning("tier_filter_not_a_list", value=repr(value)[:200])
        return TierFilter.ALL
    if not value:
        return TierFilter(())
    matchers = []
    for entry in value:
        matcher = _parse_matcher(entry)
        if matcher is None:
            log.warning("tier_filter_entry_skipped", entry=repr(entry)[:200])
        else:
            matchers.append(matcher)
    if not matchers:
        return TierFilter.ALL
    return TierFilter(tuple(matchers))


def _parse_matcher(entry: Any) -> TierMatcher | None:
    if not isinstance(entry, Mapping):
        return None
    try:
        medium = _parse_enum(Medium, entry.get("medium"))
        locality = _parse_enum(Locality, entry.get("locality"))
    except ValueError:
        return None
    return TierMatcher(medium, locality)


def _parse_enum(kind: type[_E], raw: Any) -> _E | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError(raw)
    return kind(raw.lower())


@dataclass(slots=True)
class TransferJob:
    """One asynchronous job for one secondary tier (``kind`` is one of ``TIER_JOB_KINDS``).
    ``slots`` is co-indexed with ``keys``."""

    job_id: int
    tier: int
    kind: JobKind
    keys: list[Key]
    slots: list[int]
    req_id: str | None
    submitted_at: float = 0.0
    landed: set[Key] = field(default_factory=set)
    """Keys of a promotion already made ready by ``TieringLedger.apply_progress``."""
    tenants: list[str] = field(default_factory=list)
    """The tenant id of each key (co-indexed with ``keys``; empty when none has a tenant),
    for a tier that names blocks by tenant (the object tier)."""
    purge_tenant: str = ""
    """A ``DELETE`` job of a tenant drop: the tier also removes every block it holds under
    this tenant's name, known to this manager or not (the shared bucket)."""
    landing: LandingTag | None = None
    """A promotion whose keys a client waits for as they land (``TieringLedger.promote_now``);
    the library only carries it to the transport."""


@dataclass(frozen=True, slots=True)
class LandingTag:
    """Who is told of a promotion's keys as they land: an endpoint and a ticket, opaque to the
    library (the transport's landing channel)."""

    endpoint: str
    ticket: int


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A tier's outcome for one job.

    ``success=True``: every key succeeded (``successful_keys`` ignored).
    ``success=False`` with ``successful_keys`` None or empty: every key failed.
    ``success=False`` with a non-empty collection: exactly those keys succeeded; it must be a
    subset of the job's keys or the whole result is treated as a failure (protocol error).
    For probes, ``successful_keys`` are the keys found.
    ``absent_keys``: failed keys the tier confirmed it does not hold (never stored, gone, or
    corrupt and removed; for probes, not found). Any other failed key failed transiently: the
    tier may still hold it. ``full_keys``: failed cascade keys the tier had no room for.
    Keys that are not failed keys of the job are ignored."""

    job_id: int
    success: bool
    successful_keys: Collection[Key] | None = None
    transfer_time_s: float | None = None
    absent_keys: Collection[Key] = ()
    full_keys: Collection[Key] = ()
    removed: int = 0
    """A ``DELETE`` job with ``purge_tenant``: the blocks the tier removed in all."""


@dataclass(slots=True)
class Admission:
    """What may happen to keys about to be cascaded (``CascadeRoom.admit``): go ``now``,
    ``wait`` for removals under way, or be given up (``full``: no room; ``capped``: their
    tenant is at its cap)."""

    now: list[Key] = field(default_factory=list)
    wait: list[Key] = field(default_factory=list)
    full: list[Key] = field(default_factory=list)
    capped: list[Key] = field(default_factory=list)


class Allocation(NamedTuple):
    """Slots reserved by ``PrimaryIndex.allocate``: the keys that were not present yet, their
    slots (co-indexed), and the keys evicted to make room."""

    new_keys: list[Key]
    slots: list[int]
    evicted: list[Key]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """``keys_to_store``/``slots`` are co-indexed: the caller writes each key into its slot and
    then calls ``complete_store``. ``evicted`` lists keys dropped from the primary tier."""

    keys_to_store: list[Key]
    slots: list[int]
    evicted: list[Key]


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """Per-key results, in order, up to and including the first MISS (later keys unevaluated).

    ``hit_prefix``: leading keys that are HIT or HIT_PENDING (the prefix the engine may count).
    ``ready_prefix``: leading keys that are HIT (loadable now).
    ``reasons``: co-indexed with ``results``; NONE for hits."""

    results: list[LookupResult]
    reasons: list[MissReason]
    hit_prefix: int
    ready_prefix: int

    @property
    def must_wait(self) -> bool:
        return must_wait(self.results)


@dataclass(slots=True)
class ReqContext:
    """``tenant``: the id of the request's tenant ("" for none): its blocks are the tenant's,
    and it sees no other tenant's blocks."""

    req_id: str
    tier_filter: TierFilter = field(default_factory=lambda: TierFilter.ALL)
    params: Mapping[str, Any] = field(default_factory=dict)
    tenant: str = ""

    @classmethod
    def from_params(
        cls, req_id: str, params: Mapping[str, Any] | None = None, tenant: str = ""
    ) -> ReqContext:
        params = dict(params or {})
        return cls(req_id, parse_tier_filter(params.get("kv_load_tiers")), params, tenant)


@dataclass(slots=True)
class RequestState:
    """What the tiering library keeps of one request: its stores still being written, whether
    it finished, the tiers that want all its blocks, the keys parked for their cascade, its
    HIT_PENDING deadlines (and the keys past theirs), and its promoted keys not yet read."""

    ctx: ReqContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] = field(default_factory=set)
    parked_cascade_keys: OrderedDict[Key, None] = field(default_factory=OrderedDict)
    pending_deadlines: dict[Key, float] = field(default_factory=dict)
    expired: set[Key] = field(default_factory=set)
    unread: set[Key] = field(default_factory=set)


class TieringError(Exception):
    """Base of the errors a caller can cause; each maps to a typed error reply."""

    code: ErrorCode = ErrorCode.TIERING_ERROR


class UnknownRequest(TieringError):
    code = ErrorCode.UNKNOWN_REQUEST


class RequestFinishedError(TieringError):
    code = ErrorCode.REQUEST_FINISHED


class NotReady(TieringError):
    code = ErrorCode.NOT_READY


class UnknownJob(TieringError):
    code = ErrorCode.UNKNOWN_JOB


class WrongTier(TieringError):
    code = ErrorCode.WRONG_TIER


class ProtocolViolation(TieringError):
    code = ErrorCode.PROTOCOL_VIOLATION


class JobsInFlight(TieringError):
    code = ErrorCode.JOBS_IN_FLIGHT
