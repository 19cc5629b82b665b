"""Tiering semantics as a pure library: no sockets, threads or processes (see TIERING contract)."""

from ..vocab import LookupResult, MissReason
from .manager import RequestState, TieringManager
from .primary import PrimaryIndex
from .secondary import SecondaryTier, TierSpec
from .types import (
    JobKind,
    Locality,
    Medium,
    OffloadPolicy,
    PrefixResult,
    PrepareStoreOutput,
    ReqContext,
    TierFilter,
    TieringError,
    TierMatcher,
    TransferJob,
    TransferResult,
    parse_tier_filter,
)

__all__ = [
    "JobKind",
    "Locality",
    "LookupResult",
    "Medium",
    "MissReason",
    "OffloadPolicy",
    "PrefixResult",
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
    "TransferResult",
    "parse_tier_filter",
]
