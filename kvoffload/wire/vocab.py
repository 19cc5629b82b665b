"""Closed vocabularies shared by the wire protocol and the tiering library.

The standard library only: the tiering library imports it without importing the protocol,
and the protocol re-exports it, so clients never import the tiering library.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

PRIMARY = "primary"
"""The host pool's name among the tiers (tier events, tenants' limits and counts, stats)."""


class Medium(enum.Enum):
    """What a tier keeps its blocks in."""

    CPU = "cpu"
    STORAGE = "storage"


class Locality(enum.Enum):
    """Where a tier keeps them, relative to this node: the object store is remote."""

    LOCAL = "local"
    REMOTE = "remote"


class LookupResult(enum.IntEnum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


class JobKind(enum.StrEnum):
    """What a job asks of a worker. The tiering library creates the tier jobs (promotion,
    cascade, probe); the manager adds the cpu worker's (device store and load, verify)."""

    DEVICE_STORE = "device_store"  # engine KV cache -> pool slots (cpu worker)
    DEVICE_LOAD = "device_load"  # pool slots -> engine KV cache (cpu worker)
    PROMOTION = "promotion"  # secondary tier -> pool slots (reserved, written by the job)
    CASCADE = "cascade"  # pool slots (pinned while the job runs) -> secondary tier
    PROBE = "probe"  # does the tier hold these keys (no slots)
    VERIFY = "verify"  # check stamped slots against their bytes (cpu worker, warm restart)
    DELETE = "delete"  # remove keys from the tier (room for a tenant's share, a tenant drop)


TIER_JOB_KINDS = (JobKind.PROMOTION, JobKind.CASCADE, JobKind.PROBE, JobKind.DELETE)
"""The kinds of job the tiering library creates for the secondary tiers."""


class MissReason(enum.IntEnum):
    """Why a key was not a hit (reported next to MISS and RETRY results)."""

    NONE = 0
    ABSENT = 1  # in no tier the request may read
    EVICTED = 2  # was in the primary tier, evicted recently, absent elsewhere
    FILTERED = 3  # only tiers the request's filter excludes could have it
    PRIMARY_FULL = 4  # a secondary tier has it but no primary slot could be reserved
    DEADLINE = 5  # stayed HIT_PENDING past the deadline for this request
    FAILED_LOAD = 6  # an earlier load of it failed for this request
    PROBING = 7  # RETRY: an existence probe is unresolved
    AWAITING_PREFIX = 8  # RETRY: found, promotion deferred until earlier keys resolve
    PROBE_FAILED = 9  # the existence probe this request waited on failed or timed out


_WAIT_RESULTS = frozenset({LookupResult.HIT_PENDING, LookupResult.RETRY})


def must_wait(results: Iterable[int]) -> bool:
    """Some result is HIT_PENDING or RETRY: the caller waits and looks up again instead of
    computing those keys."""
    return any(r in _WAIT_RESULTS for r in results)


class ErrorCode(enum.StrEnum):
    """Every code an ``Error`` reply or a client-side failure carries (str-valued: a code
    compares equal to its plain string)."""

    # the call could not be read or is not allowed now
    BAD_MESSAGE = "bad_message"
    VERSION_MISMATCH = "version_mismatch"
    NOT_CONNECTED = "not_connected"
    DRAINING = "draining"
    INTERNAL = "internal"
    # the call's arguments
    BAD_REQUEST = "bad_request"
    TOO_MANY_KEYS = "too_many_keys"
    BAD_KEY = "bad_key"
    BAD_TENANT = "bad_tenant"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    # requests, handles, pins and prepared stores
    UNKNOWN_REQUEST = "unknown_request"
    DUPLICATE_REQUEST = "duplicate_request"
    REQUEST_FINISHED = "request_finished"
    UNKNOWN_HANDLE = "unknown_handle"
    HANDLE_TAKEN = "handle_taken"
    BAD_HANDLE = "bad_handle"
    HANDLE_UNSUPPORTED = "handle_unsupported"
    NOT_PINNED = "not_pinned"
    NOT_PREPARED = "not_prepared"
    NOT_READY = "not_ready"
    # capacity and workers: retry later
    NO_SPACE = "no_space"
    TENANT_CAP = "tenant_cap"  # the request's tenant is at its cap and its own blocks are busy
    WORKER_UNAVAILABLE = "worker_unavailable"
    RESET_TIMEOUT = "reset_timeout"
    # rejected by the tiering library
    TIERING_ERROR = "tiering_error"
    UNKNOWN_JOB = "unknown_job"
    WRONG_TIER = "wrong_tier"
    PROTOCOL_VIOLATION = "protocol_violation"
    JOBS_IN_FLIGHT = "jobs_in_flight"
    # raised by the client without a reply
    UNAVAILABLE = "unavailable"
    MESSAGE_TOO_LARGE = "message_too_large"
    # a peer node's refusals (peer channel)
    DEPLOYMENT_MISMATCH = "deployment_mismatch"
    TENANT_KEY_MISMATCH = "tenant_key_mismatch"
    BUSY = "busy"
