"""Tiering semantics as a pure library: no sockets, threads or processes (see TIERING contract)."""

from .manager import RequestState, TieringManager
from .primary import PrimaryIndex
from .secondary import SecondaryTier, TierSpec
from .types import (
    JobKind,
    JobResult,
    Locality,
    LookupReply,
    LookupResult,
    Medium,
    MissReason,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    TierFilter,
    TierMatcher,
    TieringError,
    TransferJob,
    parse_tier_filter,
)

__all__ = [
    "JobKind",
    "JobResult",
    "Locality",
    "LookupReply",
    "LookupResult",
    "Medium",
    "MissReason",
    "OffloadPolicy",
    "PrepareStoreOutput",
    "PrimaryIndex",
    "ReqContext",
    "RequestState",
    "SecondaryTier",
    "TierFilter",
    "TierMatcher",
    "TierSpec",
    "TieringError",
    "TieringManager",
    "TransferJob",
    "parse_tier_filter",
]
